"""The keeper as a launcher starts it: one process per node that watches a job's memory
slots (every rank of the job on this node) for the job's whole life, across restarts.
No torch.

    pitstop keeper CKPT_DIR [--job TOKEN] [--shm-dir /dev/shm] [--linger-secs 30]

with the training processes made by ``pitstop.Memory(keeper="external")`` (they then start
no keeper of their own). What it does, every few milliseconds:

* **Seal**: a staged snapshot newer than its rank's newest committed one (and not already
  superseded by a newer one) is hashed and committed (:func:`pitstop.levels.shm.seal`), as
  the per-process keeper does on request.
* **Watch the trainers**: each rank's lock file names its training process. When it is
  gone (SIGKILL included), the newest snapshot of a one-process job (its slot is a whole
  checkpoint) is written to ``CKPT_DIR`` if that holds no newer step (checked as written);
  a part of several ranks' step never is alone, but once every rank of a job that runs
  wholly on this node has died, the newest step every rank holds is joined and written
  (:mod:`pitstop.levels.keeper_join`). A
  restarted trainer adopts the slots (its pid in the lock file); if none does within
  ``--linger-secs``, the dead rank's segments are removed.
* **End**: when the job's segments are all gone (a clean ``close()`` removes them) after it
  has seen some, or on SIGTERM/SIGINT (a dead trainer's newest snapshot written first), it
  exits 0. It holds ``pitstop-mem-<job>.keeper`` (flock) while it runs: that is how a
  training process knows an external keeper watches its job.

The job token is the one the trainers use: ``Memory(job=)``, else derived from the next
level's path as :func:`pitstop.levels.shm.job_token` says (``CKPT_DIR`` for a plain
directory; a node's directory for ``Local("/path/{node}")``).

Call sequence: ``run_watch(job, shm_dir, next_dir, ...)`` (the CLI's thread);
``external_keeper(shm_dir, job)`` (a training process: does one run?).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pitstop.io.locks import pid_alive
from pitstop.levels.keeper_join import (
    owner_pid,
    persist_newest,
    seal_newest_staged,
    slot_world,
    trainers_dead,
)
from pitstop.levels.shm import (
    COMMITTED,
    PREFIX,
    STAGED,
    Slot,
    SlotHeader,
    iter_slots,
    lock_name,
    open_slot,
    read_header,
    segment_names,
)
from pitstop.levels.shm_header import parse_segment_name
from pitstop.log import get_logger
from pitstop.options import IOOptions
from pitstop.storage.local import LocalStorage

__all__ = ["external_keeper", "keeper_file", "run_watch"]

_log = get_logger("pitstop.levels")


def keeper_file(directory: str, job: str) -> str:
    """The file an external keeper of ``job`` holds (flock, exclusive) while it runs."""
    return os.path.join(directory, f"{PREFIX}{job}.keeper")


def external_keeper(directory: str, job: str) -> bool:
    """Whether an external keeper watches ``job`` under ``directory`` now."""
    try:
        fd = os.open(keeper_file(directory, job), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True  # held exclusively: it runs
    finally:
        os.close(fd)
    return False


class _Watch:
    def __init__(self, job: str, directory: str, next_dir: str | None, linger_secs: float):
        self.job, self.directory, self.linger = job, directory, linger_secs
        self.storage = LocalStorage(next_dir, IOOptions.from_env()) if next_dir else None
        self.slots: dict[str, Slot] = {}  # path -> mapped slot
        self.hashers = ThreadPoolExecutor(2, thread_name_prefix="pitstop-keeper-hash")
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="pitstop-keeper-io")
        self.dead: dict[int, tuple[int, float]] = {}  # rank -> (dead pid, since)
        self.seen = False
        self.stop = False
        self.joined: set[frozenset[int]] = (
            set()
        )  # the dead pids of a job of several ranks looked at

    def ranks(self) -> list[int]:
        out = set()
        for name in segment_names(self.directory, self.job):
            parsed = parse_segment_name(name)
            if parsed is not None:
                out.add(parsed[1])
        return sorted(out)

    def mapped(self, rank: int) -> list[tuple[Slot, SlotHeader]]:
        """The rank's slots (mapped once, again if replaced) with their headers."""
        out = []
        for path in iter_slots(self.directory, self.job, rank):
            slot = self.slots.get(path)
            try:
                if slot is not None and os.stat(path).st_ino != os.fstat(slot.fd).st_ino:
                    slot.close()
                    slot = None
                if slot is None:
                    slot = open_slot(path, job=self.job, rank=rank, populate=False)
                    self.slots[path] = slot
                head = read_header(slot.fd)
            except (OSError, ValueError, Exception):  # removed, torn, not ours: not a slot
                self.slots.pop(path, None)
                continue
            if head is not None:
                out.append((slot, head))
        return out

    def seal_staged(self, rank: int) -> None:
        """The rank's newest staged snapshot, if newer than its committed ones, sealed."""
        seal_newest_staged(self.mapped(rank), self.hashers, 0.0)

    def persist_dead_job(self, ranks: list[int]) -> None:
        """Every trainer of the job dead, every rank on this node: the job's newest step (one
        process: its newest snapshot; several ranks: their parts joined) to the next level
        unless it holds it (:func:`pitstop.levels.keeper_join.persist_newest`), once per set
        of dead trainers."""
        world = self.world(ranks[0]) if ranks else 0
        if self.storage is None or world < 1 or ranks != list(range(world)):
            return
        pids = frozenset(owner_pid(self.directory, self.job, r) or 0 for r in ranks)
        if pids in self.joined or not trainers_dead(self.directory, self.job, world):
            return
        self.joined.add(pids)
        try:
            step, what = persist_newest(self.directory, self.job, self.storage, pool=self.pool,
                                        hashers=self.hashers)  # fmt: skip
        except Exception as e:
            _log.warning("keeper: the newest memory step of job %s not written to %s: %r",
                         self.job, self.storage.url, e)  # fmt: skip
            return
        _log.info("keeper: job %s (%d rank(s)), newest memory step %s: %s", self.job, world,
                  step, what)  # fmt: skip

    def world(self, rank: int) -> int:
        """The world size the rank's newest snapshot was staged by (0: unknown; a slot being
        staged into has no record yet)."""
        found = [(s, h) for s, h in self.mapped(rank) if h.state in (STAGED, COMMITTED)]
        if not found:
            return 0
        slot, head = max(found, key=lambda sh: sh[1].gen)
        return slot_world(slot, head)

    def remove(self, rank: int) -> None:
        for path in list(iter_slots(self.directory, self.job, rank)):
            slot = self.slots.pop(path, None)
            if slot is not None:
                slot.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, lock_name(self.job, rank)))

    def tick(self, now: float) -> bool:
        """One look at the job; False once it is over (its segments gone)."""
        ranks = self.ranks()
        if not ranks:
            return not self.seen
        self.seen = True
        for rank in ranks:
            self.seal_staged(rank)
            pid = owner_pid(self.directory, self.job, rank)
            alive = pid is not None and pid_alive(pid)
            if alive:
                self.dead.pop(rank, None)
                continue
            if rank not in self.dead:  # it just died: the job's newest step to the disk
                self.dead[rank] = (pid or 0, now)  # (once every trainer of it is dead)
                self.persist_dead_job(ranks)
            elif now - self.dead[rank][1] > self.linger:
                _log.info("keeper: rank %d of job %s was not restarted within %.0f s: its "
                          "memory snapshots are removed", rank, self.job, self.linger)  # fmt: skip
                self.remove(rank)
                self.dead.pop(rank, None)
        return True

    def close(self) -> None:
        for slot in self.slots.values():
            slot.close()
        self.slots.clear()
        self.hashers.shutdown(wait=True)
        self.pool.shutdown(wait=True)


def run_watch(
    job: str,
    shm_dir: str,
    next_dir: str | None,
    *,
    linger_secs: float = 30.0,
    poll_secs: float = 0.005,
    max_secs: float | None = None,
) -> int:
    """Watch ``job``'s slots under ``shm_dir`` until the job is over (see the module
    docstring); ``max_secs``: give up after that long (tests). Exit code 0; 1 if another
    external keeper watches the job already."""
    path = keeper_file(shm_dir, job)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return 1
    os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode().ljust(64), 0)
    watch = _Watch(job, shm_dir, next_dir, linger_secs)

    def on_signal(*_: Any) -> None:
        watch.stop = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    start = time.monotonic()
    try:
        while not watch.stop:
            now = time.monotonic()
            if not watch.tick(now) or (max_secs is not None and now - start > max_secs):
                break
            time.sleep(poll_secs)
        if watch.stop:  # stopped: a dead job's newest step first
            watch.persist_dead_job(watch.ranks())
    finally:
        watch.close()
        for s, h in old.items():
            signal.signal(s, h)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
    return 0
