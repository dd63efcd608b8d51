"""Flush: copy a committed node-local checkpoint to the shared level, in the background.

Call sequence::

    flusher = Flusher(local, shared, group, on_done=...)   # every rank
    flusher.submit(member)       # persist thread, after step t committed on the local level,
                                 #   when rank 0 decided that t is flushed (every rank the same);
                                 #   or the training thread (``flush()``, ``close()``)
    flusher.pending              # rank 0's decide(): how many flushes are queued or running
    flusher.drain()              # any thread: wait until none is
    flusher.close()              # waits for the flushes in flight

One ``pitstop-flush`` thread per rank runs the flushes in order. Each holds a pin on its
local step (retention skips it), streams the rank's member files from its node to the
shared level through a few bounded buffers (:func:`pitstop.engine.transfer.copy_files`:
every checksum checked on the way, host memory within ``copy_budget`` whatever their
size) and takes part in a commit round through the store (``commit_together``: rank 0
creates the directory and writes the manifest last, after every rank's files are durable).
A failure (ENOSPC on the shared file system, a damaged local file, a rank that is gone) is
logged and recorded in ``records``; it never reaches training, and the local checkpoint
stays as it was.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pitstop.engine.catalog import Catalog
from pitstop.engine.collective import NodeCommit, commit_together
from pitstop.engine.persist import PersistResult
from pitstop.engine.transfer import copy_files
from pitstop.errors import CheckpointNotFoundError, CorruptCheckpointError
from pitstop.faults import killpoint
from pitstop.format.manifest import Manifest
from pitstop.levels.root import RootLevel
from pitstop.levels.spec import Shared
from pitstop.log import get_logger
from pitstop.policy import CheckpointPolicy, PolicyContext, RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.storage.base import Storage

__all__ = ["FlushJob", "FlushRecord", "FlushTarget", "Flusher"]

_log = get_logger("pitstop.levels")


@dataclass
class FlushRecord:
    """The outcome of one flush: ``ok``, or the ``error`` that failed it."""

    step: int
    level: str = "shared"
    ok: bool = False
    error: str | None = None
    nbytes: int = 0
    secs: float = 0.0


@dataclass(frozen=True)
class FlushJob:
    """One rank's part of a flush: its files of ``directory`` (``manifest``) on ``storage``."""

    storage: Storage
    directory: str
    manifest: Manifest
    rank: int


class Flusher:
    """See the module docstring."""

    def __init__(
        self,
        local: Catalog,
        shared: Storage,
        group: Group,
        on_done: Callable[[FlushRecord], None] | None = None,
        *,
        name: str = "shared",
    ) -> None:
        self.local, self.shared, self.group, self.name = local, shared, group, name
        self.on_done = on_done
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pitstop-flush")
        self._lock = threading.Condition()
        self._pending = 0
        self._seq = 0  # flushes submitted: every rank submits the same ones in the same order
        self.records: deque[FlushRecord] = deque(maxlen=256)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def drain(self, timeout_secs: float | None = None) -> bool:
        """Wait until no flush is queued or running; False if ``timeout_secs`` passed first."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout_secs)

    def submit(self, member: FlushJob) -> None:
        """Pin the step now (retention must not take it while the flush waits its turn). A
        pin that fails makes this rank's part of the flush fail (the others learn it in the
        flush's commit round, not after a timeout)."""
        pin = contextlib.ExitStack()
        error: BaseException | None = None
        try:
            if not pin.enter_context(self.local.pin(member.directory)):
                raise CheckpointNotFoundError(
                    f"{member.directory} is no longer committed on {self.local.storage.url}",
                    step=member.manifest.step, phase="flush",
                )  # fmt: skip
        except BaseException as e:
            pin.close()
            error = e
        with self._lock:
            self._pending += 1
            self._seq += 1
            seq = self._seq
        self._pool.submit(self._run, member, pin, seq, error)

    def _report(self, record: FlushRecord, e: BaseException) -> None:
        record.error = f"{type(e).__name__}: {e}"
        _log.warning(
            "flush of step %d to the %s level (%s) failed (training goes on; the local "
            "checkpoint is kept): %s", record.step, self.name, self.shared.url, record.error,
            phase="flush",
        )  # fmt: skip
        self.records.append(record)
        if self.on_done is not None:
            self.on_done(record)

    def _run(
        self, m: FlushJob, pin: contextlib.ExitStack, seq: int, error: BaseException | None
    ) -> None:
        record = FlushRecord(m.manifest.step, self.name)
        t0 = time.perf_counter()
        try:
            with pin:
                record.nbytes = self._copy(m, seq, error)
            record.ok = True
            _log.info("flushed step %d to %s", m.manifest.step, self.shared.url, phase="flush")
            record.secs = time.perf_counter() - t0
            self.records.append(record)
            if self.on_done is not None:
                self.on_done(record)
        except BaseException as e:  # reported, never raised into training
            record.secs = time.perf_counter() - t0
            self._report(record, e)
        finally:
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def _copy(self, m: FlushJob, seq: int, error: BaseException | None) -> int:
        data = m.manifest.dumps()

        def write() -> PersistResult:  # read, verify and write inside the round: a failure
            if error is not None:  # of any rank is every rank's at once
                raise error
            try:  # streamed: read, checked and written piece by piece
                total = copy_files(m.storage, self.shared, m.directory, m.manifest, m.rank, "flush")
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(
                    f"rank {m.rank}'s files of step {m.manifest.step} on {m.storage.url} are "
                    f"damaged ({e.message}); not flushed", step=m.manifest.step, phase="flush",
                ) from e  # fmt: skip
            killpoint("flush.mid")
            return PersistResult((), (), total, 0.0, False)

        try:  # one process: on the null group, in-process
            result = commit_together(
                self.group, self.shared, m.directory, f"flush-{self.name}-{seq}", write,
                lambda results, hosts: data, NodeCommit.single(self.group.size),
            )  # fmt: skip
        except BaseException:
            self.shared.abort(m.directory)
            raise
        return result.nbytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class FlushTarget(RootLevel):
    """A level after the first one: a plain level (its storage, catalog and retention; the
    restart walks it like a root) with the flusher that copies to it, its schedule, and
    what rank 0 counts for its schedule."""

    def __init__(
        self,
        name: str,
        spec: Shared,
        storage: Storage,
        group: Group,
        flusher: Flusher,
        schedule: CheckpointPolicy,
        retention: RetentionPolicy | None,
    ) -> None:
        super().__init__(storage, group, retention, name)
        self.spec, self.flusher, self.schedule = spec, flusher, schedule
        self.since = 0  # rank 0: commits since this level's last flush
        self.last_secs = time.monotonic()  # rank 0: when it last flushed
        self.due = False  # rank 0: flush the next commit (a restart from a step it lacks)
        self.flushed = -1  # the newest step this process submitted to its flusher

    def context(self, step: int) -> PolicyContext:
        """What the schedule decides on after a commit of ``step`` on the first level."""
        secs = time.monotonic() - self.last_secs
        return PolicyContext(
            step=step, elapsed_secs=secs, steps_since_checkpoint=self.since,
            secs_since_checkpoint=secs, in_flight=self.flusher.pending, max_in_flight=2,
        )  # fmt: skip

    def restarted(self, holds: bool) -> None:
        """After a restart: count from now; a level that lacks the restored step gets the
        next commit."""
        self.since, self.last_secs, self.due = 0, time.monotonic(), not holds

    def close(self) -> None:
        try:
            self.flusher.close()
        finally:
            super().close()
