"""CheckpointManager: the object a training loop holds.

Call sequence (training thread)::

    ckpt = CheckpointManager("ckpts", keep_last=3)
    start = ckpt.restore(state)            # newest valid step, loaded in place; None if none
    for step in range(start or 0, ...):
        ...                                # forward, backward, optimizer.step()
        ckpt.async_save(step, state)       # or ckpt.save(step, state): durable on return
    ckpt.close()                           # waits for saves in flight

or let a policy choose when, from what it measures::

    for step in ...:
        ...
        ckpt.step(step, state, loss=loss.item())   # True when it started a save

Retention runs on the persist thread right after a commit: older checkpoints
beyond ``keep_last`` are un-committed (manifest removed first) and deleted;
the newest committed one and any save in flight are never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Mapping
from types import FrameType
from typing import Any

from pitstop.engine.catalog import Entry, committed, read_manifest, scan
from pitstop.engine.handle import SaveHandle
from pitstop.engine.restore import load_checkpoint
from pitstop.engine.saver import Saver
from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from pitstop.faults import killpoint
from pitstop.format.names import data_file_name, quarantine_dir_name, step_dir_name
from pitstop.log import get_logger
from pitstop.options import IOOptions, SaveOptions
from pitstop.policy import CheckFreq, CheckpointPolicy, PolicyContext
from pitstop.profiler import Profiler, ProfileStats
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage

__all__ = ["CheckpointManager"]

_log = get_logger("pitstop")


class CheckpointManager:
    """Saves, restores and retires the checkpoints of one training job.

    ``root`` is a directory (or a :class:`~pitstop.storage.Storage`). ``keep_last``
    keeps that many committed checkpoints (None: all). ``allow_pickle`` lets
    values that JSON cannot hold be stored, and loaded, as pickles. Other knobs
    live in :class:`~pitstop.options.SaveOptions` (``options=``) or in their
    keyword shortcuts.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        keep_last: int | None = None,
        *,
        options: SaveOptions | None = None,
        allow_pickle: bool | None = None,
        max_in_flight: int | None = None,
        overlap: bool | None = None,
        io_threads: int | None = None,
        chunk_bytes: int | None = None,
        direct_io: str | None = None,
        policy: CheckpointPolicy | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        io = (options.io if options else None) or IOOptions.from_env(
            threads=io_threads, chunk_bytes=chunk_bytes, direct=direct_io
        )
        base = options or SaveOptions.from_env(io=io)
        self.options = base.replace(
            io=io,
            **{
                k: v
                for k, v in {
                    "allow_pickle": allow_pickle,
                    "max_in_flight": max_in_flight,
                    "overlap": overlap,
                }.items()
                if v is not None
            },
        )
        self.storage: Storage = root if isinstance(root, Storage) else LocalStorage(root, io)
        self.keep_last = keep_last
        self._saver = Saver(self.storage, self.options, on_commit=self._retain)
        self.policy: CheckpointPolicy = policy if policy is not None else CheckFreq()
        self.profiler = Profiler()
        self._loop = _LoopClock()
        self._preempted: int | None = None
        self._signals: dict[int, Any] = {}
        self._exit_code: int | None = 0

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage.url!r}, keep_last={self.keep_last})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ save
    def async_save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background.

        The call stalls the loop only for copying the tensors that the next
        forward pass may change; parameters and optimizer state finish copying
        while training goes on (``optimizer.step()`` waits for them).
        """
        return self._saver.async_save(step, state)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Save ``state`` as ``step``; durable and committed when it returns."""
        return self._saver.save(step, state)

    def reserve(self, state: Mapping[str, Any]) -> int:
        """Allocate the staging arena for ``state`` now, not at the first save.

        An arena is memory touched for the first time, which is slow (0.3-0.8 GB/s here):
        call this at start-up so that the first ``async_save`` stalls only for its copy.
        ``restore`` does it implicitly. Returns the bytes reserved.
        """
        return self._saver.reserve(state)

    def wait(self) -> None:
        """Wait for every save in flight; raise the error of a failed one."""
        self._saver.wait_all()

    def close(self) -> None:
        """Wait for saves in flight and release memory and threads."""
        for sig, previous in self._signals.items():
            signal.signal(sig, previous)
        self._signals.clear()
        self._saver.close()

    @property
    def host_bytes(self) -> int:
        """Host memory held by staging arenas."""
        return self._saver.host_bytes

    @property
    def history(self) -> list[SaveHandle]:
        """Handles of the most recent saves (their ``stats`` hold the timings)."""
        return list(self._saver.history)

    # ------------------------------------------------------------------ policy-driven
    def step(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        loss: float | None = None,
        epoch: int | None = None,
        epoch_end: bool = False,
    ) -> bool:
        """Call once per iteration, after ``optimizer.step()``: measures, asks the policy,
        and starts an ``async_save`` when it says so. Returns whether it did.

        After ``save_on_signal``, the first call after the signal saves synchronously and
        raises SystemExit (a clean exit: ``with`` blocks and ``finally`` clauses run).
        """
        loop = self._loop
        now = time.perf_counter()
        waited = self._saver.hook_wait_secs - loop.hook_wait_seen  # optimizer.step() waited
        loop.hook_wait_seen += waited
        if loop.last is not None:
            self.profiler.iteration(now - loop.last - waited, persisting=loop.persisting)
            if waited > 0:
                self.profiler.stall(waited, add_to_last=True)
        elif not loop.started:
            loop.start, loop.started = now, True
        self._collect()
        if self._preempted is not None:
            self._save_and_exit(step, state)
        measured = self.profiler.snapshot()
        ctx = PolicyContext(
            step=step,
            elapsed_secs=now - loop.start,
            steps_since_checkpoint=step - loop.ckpt_step if loop.ckpt_step is not None else step,
            secs_since_checkpoint=now
            - (loop.ckpt_time if loop.ckpt_time is not None else loop.start),
            iter_secs=measured.iter_secs,
            stall_secs=measured.stall_secs,
            persist_secs=measured.persist_secs,
            slowdown_secs=measured.slowdown_secs,
            observed_overhead=measured.recent_overhead,
            in_flight=len(loop.pending),
            max_in_flight=self.options.max_in_flight,
            checkpoints=self.profiler.checkpoints + len(loop.pending),
            epoch=epoch,
            epoch_end=epoch_end,
            loss=loss,
        )
        started = False
        if self.policy.decide(ctx):
            t0 = time.perf_counter()
            try:
                loop.pending.append(self.async_save(step, state))
                started = True
            except CheckpointExistsError:
                pass  # resumed at a step that is already committed
            stall = time.perf_counter() - t0
            self.profiler.stall(stall)
            if started:
                loop.ckpt_step, loop.ckpt_time = step, time.perf_counter()
        loop.persisting = bool(loop.pending)
        loop.last = time.perf_counter()
        return started

    def pause(self) -> None:
        """The loop is about to do other work (evaluation, a long log flush): the time until the
        next ``step()`` is not an iteration and is not measured."""
        self._loop.last = None

    def _collect(self) -> None:
        """Feed committed saves to the profiler."""
        loop = self._loop
        done = [h for h in loop.pending if h.done()]
        loop.pending = [h for h in loop.pending if not h.done()]
        for h in done:
            if h.committed:
                self.profiler.checkpoint(h.stats)
        self._saver.raise_pending()

    def stats(self) -> ProfileStats:
        """Robust running estimates: iteration time, stall, persist time, slowdown, bandwidth, overhead."""
        self._collect()
        interval = getattr(self.policy, "interval", None) or getattr(
            self.policy, "interval_secs", None
        )
        return self.profiler.snapshot(interval=interval)

    def save_on_signal(self, *signals: int, exit_code: int | None = 0) -> None:
        """On any of ``signals`` (default SIGTERM and SIGUSR1, as schedulers send before a
        kill), the next ``step()`` saves a final checkpoint and, unless ``exit_code`` is
        None, exits cleanly with it. Call from the main thread."""
        self._exit_code = exit_code
        for sig in signals or (signal.SIGTERM, signal.SIGUSR1):
            self._signals[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._preempted = signum

    @property
    def preempted(self) -> bool:
        """True once a signal of ``save_on_signal`` arrived."""
        return self._preempted is not None

    def _save_and_exit(self, step: int, state: Mapping[str, Any]) -> None:
        _log.warning(
            "signal %s: saving a final checkpoint at step %d",
            self._preempted,
            step,
            phase="persist",
        )
        self.wait()
        with contextlib.suppress(CheckpointExistsError):  # already saved at this step
            self.save(step, state)
        code = self._exit_code
        self._preempted = None
        if code is not None:
            raise SystemExit(code)

    # ------------------------------------------------------------------ query
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [e.step for e in committed(self.storage) if e.step is not None]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def entries(self) -> list[Entry]:
        return scan(self.storage)

    # ------------------------------------------------------------------ restore
    def restore(
        self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the step loaded, or None when there is no checkpoint. A
        checkpoint that fails verification is logged, set aside and the next
        older one is tried; if every checkpoint fails, CorruptCheckpointError
        lists why. A checkpoint that does not fit the state raises
        StateMismatchError naming the keys (no fallback: an older one would not fit either).
        """
        self._saver.raise_pending()
        self._saver.wait_staged()  # a save in flight must not copy what restore writes
        entries = scan(self.storage)
        candidates = [e for e in entries if e.status == "committed"]
        if step is not None:
            candidates = [e for e in candidates if e.step == step]
            if not candidates:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step}", step=step, path=self.storage.url
                )
        if not candidates:
            return None
        failures: list[tuple[Entry, CheckpointError]] = []
        for entry in reversed(candidates):
            try:
                self._load(entry, state, strict)
            except CorruptCheckpointError as e:
                _log.warning(
                    "checkpoint %s failed verification, trying an older one: %s",
                    entry.name,
                    e,
                    phase="verify",
                )
                failures.append((entry, e))
                continue
            unreadable = [
                e
                for e in entries
                if e.status == "corrupt" and e.step is not None and e.step > (entry.step or 0)
            ]
            self._set_aside([f for f, _ in failures] + unreadable)
            self._loop.ckpt_step = entry.step  # the policy counts from the restored checkpoint
            _log.info("restored step %d from %s", entry.step, self.storage.url, phase="restore")
            return entry.step
        reasons = "; ".join(f"{e.name}: {err.message}" for e, err in failures)
        raise CorruptCheckpointError(
            f"no checkpoint passed verification ({reasons})", path=self.storage.url, phase="restore"
        )

    def _load(self, entry: Entry, state: Mapping[str, Any] | None, strict: bool) -> Any:
        manifest = entry.manifest or read_manifest(self.storage, entry.name)
        path = f"{self.storage.url}/{entry.name}"
        name = data_file_name(0)
        try:
            claimed = manifest.file(name).nbytes
        except KeyError:
            raise CorruptCheckpointError(
                f"manifest lists no {name}", step=entry.step, path=path
            ) from None
        try:
            actual = self.storage.file_size(entry.name, name)
        except CheckpointError as e:
            raise CorruptCheckpointError(f"{name}: {e.message}", step=entry.step, path=path) from e
        if actual != claimed:  # checked before a buffer of that size is allocated
            raise CorruptCheckpointError(
                f"{name}: {actual} bytes on storage, manifest says {claimed}",
                step=entry.step,
                path=path,
            )
        try:
            with self._saver.borrow_buffer(claimed) as (view, buffer):
                return load_checkpoint(
                    self.storage, entry.name, manifest, state, view, buffer,
                    pool=self._saver.io_pool, allow_pickle=self.options.allow_pickle, strict=strict,
                )  # fmt: skip
        except CheckpointError:
            raise
        except (OSError, KeyError, IndexError) as e:
            raise CorruptCheckpointError(f"cannot load: {e!r}", step=entry.step, path=path) from e

    def load(self, step: int | None = None) -> Any:
        """The saved state as fresh objects (tensors on CPU; Statefuls as their state dicts)."""
        self._saver.wait_staged()
        candidates = committed(self.storage)
        if step is not None:
            candidates = [e for e in candidates if e.step == step]
        if not candidates:
            raise CheckpointNotFoundError(
                "no committed checkpoint" + (f" of step {step}" if step is not None else ""),
                path=self.storage.url,
            )
        return self._load(candidates[-1], None, True)

    def _set_aside(self, entries: list[Entry]) -> None:
        """Rename checkpoints that failed verification so that a new save of their step can commit."""
        for entry in entries:
            if entry.step is None:
                continue
            target = quarantine_dir_name(entry.step, uuid.uuid4().hex[:8])
            try:
                self.storage.rename(entry.name, target)
                _log.warning(
                    "set aside corrupt checkpoint %s as %s", entry.name, target, phase="restore"
                )
            except CheckpointError as e:
                _log.warning("could not set aside %s: %s", entry.name, e, phase="restore")

    # ------------------------------------------------------------------ retention and gc
    def _retain(self, newest: int) -> None:
        """Persist thread, after ``newest`` committed: keep the newest ``keep_last``."""
        if self.keep_last is None:
            return
        steps = [s for s in self.steps() if s <= newest]
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            if step == newest:
                continue
            directory = step_dir_name(step)
            self.storage.uncommit(directory)
            killpoint("retention.mid")
            self.storage.remove(directory)

    def gc(self, *, dry_run: bool = False) -> list[str]:
        """Remove debris of interrupted saves (directories without a manifest). Returns the names."""
        with self._saver._cond:
            busy = {step_dir_name(s) for s in self._saver._inflight}
        names = [e.name for e in scan(self.storage) if e.status == "partial" and e.name not in busy]
        if not dry_run:
            for name in names:
                self.storage.remove(name)
        return names


class _LoopClock:
    """Timing state of ``CheckpointManager.step`` (training thread only)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.started = False
        self.hook_wait_seen = 0.0
        self.last: float | None = None
        self.persisting = False
        self.ckpt_step: int | None = None
        self.ckpt_time: float | None = None
        self.pending: list[SaveHandle] = []
