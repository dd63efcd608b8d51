"""SaveHandle: one checkpoint on its way from the arena to committed storage."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from pitstop.errors import CheckpointError

__all__ = ["SaveHandle", "SaveStats"]


@dataclass
class SaveStats:
    """Timings of one save, in seconds, and its size.

    ``stall_secs``: how long ``async_save`` blocked the training loop;
    ``alloc_secs``: the part of it spent allocating (or waiting for) the host arena, a
    one-time cost the profiler leaves out of the checkpoint's cost;
    ``stage_secs``: until every byte was in the arena; ``persist_secs``: from
    the end of staging to the commit; ``total_secs``: from the call to the commit.
    """

    step: int
    nbytes: int = 0
    stall_secs: float = 0.0
    alloc_secs: float = 0.0
    stage_secs: float = 0.0
    persist_secs: float = 0.0
    total_secs: float = 0.0
    direct_io: bool = False

    @property
    def write_gbps(self) -> float:
        return self.nbytes / self.persist_secs / 1e9 if self.persist_secs > 0 else 0.0


class SaveHandle:
    """Returned by ``async_save``. The training thread polls or waits on it.

    ``staged``: every byte is in the host arena (the state may change freely);
    ``committed``: the checkpoint exists durably; ``wait()`` blocks until the
    save ended and raises its error, if any (an error is raised once: by
    ``wait`` or else by the manager's next call).
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.stats = SaveStats(step=step)
        self._staged = threading.Event()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._lock = threading.Lock()
        self._job: Any = None  # the StageJob, set by the saver

    def __repr__(self) -> str:
        state = (
            "committed"
            if self.committed
            else "failed"
            if self._error
            else "staged"
            if self.staged
            else "staging"
        )
        return f"SaveHandle(step={self.step}, {state})"

    @property
    def staged(self) -> bool:
        """Every byte is in the host arena: the live state may change freely."""
        job = self._job
        return self._staged.is_set() or (job is not None and job.copied)

    @property
    def committed(self) -> bool:
        return self._finished.is_set() and self._error is None

    def done(self) -> bool:
        """True when the save ended, committed or failed."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save ends; raise its error; TimeoutError after ``timeout`` seconds."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint of step {self.step} not committed after {timeout} s")
        err = self.take_error()
        if err is not None:
            raise err

    def take_error(self) -> BaseException | None:
        """The error, the first time it is asked for; None afterwards or without one."""
        with self._lock:
            if self._error is None or self._reported:
                return None
            self._reported = True
            return self._error

    # called by the saver's threads
    def _set_staged(self) -> None:
        self._staged.set()

    def _finish(self, error: BaseException | None) -> None:
        if error is not None and not isinstance(error, CheckpointError):
            wrapped = CheckpointError(
                f"checkpoint failed: {error!r}", step=self.step, phase="persist"
            )
            wrapped.__cause__ = error
            error = wrapped
        if isinstance(error, CheckpointError) and error.step is None:
            error.step = self.step
        self._error = error
        self._staged.set()
        self._finished.set()
