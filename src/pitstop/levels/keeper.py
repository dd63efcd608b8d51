"""The keeper: a process beside the training process that seals and persists memory slots.

The training process pays for the copy into a slot and nothing else: the keeper hashes a
staged slot and commits it (:func:`pitstop.levels.shm.seal`), and writes a committed slot
to the next level in pitstop's exact on-disk format (:func:`persist_slot`, through the
level's :class:`pitstop.storage.local.LocalStorage`: prepare, write_data, write_object,
commit), verifying every checksum as it writes. It imports no torch.

It watches its parent: a socket pair carries the commands, and its EOF, like the parent's
pidfd becoming readable or the keeper being re-parented, says the training process died
(SIGKILL included). Then the keeper commits the newest consistent snapshot (a staged slot
newer than every committed one is sealed first), persists it if its step is newer than what
the next level holds, removes the job's segments and exits: it never outlives its job for
long. ``linger_secs``: after persisting, keep the segments that long for a restarted
training process of the same job, which adopts them (it holds the job's lock file and its
slots name it as owner); the keeper then exits without removing them. SIGTERM (the job torn
down) ends the linger at once: the segments go if the next level holds their newest step,
else they stay for ``pitstop gc``. Under several ranks (``--world`` > 1) a slot is one
rank's part of a step and is never written alone: once every trainer of the job is dead,
rank 0's keeper writes the newest step every rank holds on this node
(:mod:`pitstop.levels.keeper_join`), at the trainer's death or while it lingers.

Call sequence (training thread)::

    keeper = start_keeper(job, next_dir=...)   # returns once the keeper is ready
    keeper.request_seal(slot.index)            # after slots.staged(...): hash and commit
    keeper.request_persist(slot.index)         # every Nth: seal if needed, write to next_dir
    keeper.alive()                             # False: it died; persist in-process instead
    keeper.events()                            # what it did: sealed, persisted, skipped, error
    keeper.stop(unlink=True)                   # end of the job

The process form (what ``start_keeper`` runs)::

    python -m pitstop.levels.keeper --job TOKEN --parent PID --fd FD [--next DIR] ...

A launcher that starts the node's keeper itself runs ``pitstop keeper DIR`` instead, with the
trainers made by ``Memory(keeper="external")`` (:mod:`pitstop.levels.keeper_watch`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from pitstop.engine.catalog import Catalog
from pitstop.errors import CheckpointExistsError, CorruptCheckpointError
from pitstop.faults import killpoint
from pitstop.format.checksum import get_checksum, segments
from pitstop.format.manifest import Manifest, TensorEntry
from pitstop.format.names import data_file_name, objects_file_name, step_dir_name
from pitstop.io.locks import pid_alive
from pitstop.io.parallel import Extent, plan_extents
from pitstop.levels.shm import (
    COMMITTED,
    SHM_DIR,
    STAGED,
    Slot,
    SlotHeader,
    hold_job_lock,
    iter_slots,
    lock_name,
    open_slot,
    read_header,
    read_meta,
    seal,
)
from pitstop.log import get_logger
from pitstop.options import IOOptions
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage

__all__ = [
    "KeeperHandle", "empty_logs", "keeper_log", "main", "newest_step", "persist_slot",
    "start_keeper", "write_slot",
]  # fmt: skip

_log = get_logger("pitstop.levels")


# ---------------------------------------------------------------------- persist
def newest_step(storage: Storage) -> int | None:
    """The newest committed step ``storage`` holds (None: none)."""
    catalog = Catalog(storage)
    try:
        committed = catalog.committed()
    finally:
        catalog.close()
    return committed[-1].step if committed else None


def persist_slot(
    slot: Slot, storage: Storage, *, pool: Executor, chunk_bytes: int | None = None
) -> SlotHeader | None:
    """Write the committed ``slot`` to ``storage`` as a step directory, verifying every
    checksum segment as it is written (a mismatch aborts the write: CorruptCheckpointError).
    The slot is pinned (flock shared) meanwhile, so it is not staged into. Returns its header,
    or None if it is not committed, is being staged into, or ``storage`` already holds the
    step (CheckpointExistsError is not raised: a step is written once)."""
    if not slot.try_lock(exclusive=False):
        return None
    try:
        head = slot.header()
        if head is None or head.state != COMMITTED or head.step is None:
            return None
        _, objects, raw = read_meta(slot, head)
        manifest = Manifest.loads(raw, path=slot.path)
        directory = step_dir_name(head.step)
        try:
            storage.prepare(directory)
        except CheckpointExistsError:
            return None
        try:
            write_slot(slot, head, manifest, objects, storage, directory, pool=pool,
                       chunk_bytes=chunk_bytes)  # fmt: skip
            killpoint("keeper.persist")  # data and objects written, not committed
            storage.commit(directory, raw)
        except BaseException:
            storage.abort(directory)
            raise
        return head
    finally:
        slot.unlock()


def write_slot(
    slot: Slot,
    head: SlotHeader,
    manifest: Manifest,
    objects: bytes,
    storage: Storage,
    directory: str,
    *,
    pool: Executor,
    chunk_bytes: int | None = None,
) -> int:
    """Write the rank's files of the pinned, committed ``slot`` (its data file and objects)
    into ``directory`` of ``storage``, checking every segment against ``manifest`` (the
    step's; its entries of the slot's rank) as it is written; the bytes written."""
    rank, view = head.rank, slot.view[: head.file_bytes]
    extents = plan_extents(
        _segments(manifest, data_file_name(rank)),
        head.file_bytes,
        chunk_bytes or storage.io.chunk_bytes,
    )
    check = _checker(manifest, view, slot.path)
    storage.write_data(directory, data_file_name(rank), view, extents, pool=pool, on_extent=check)
    storage.write_object(directory, objects_file_name(rank), objects)
    return head.file_bytes + len(objects)


def _segments(manifest: Manifest, name: str) -> list[tuple[int, int, object]]:
    return [
        (start, length, (t, j))
        for t in manifest.tensors
        if t.file == name
        for j, (start, length) in enumerate(segments(t.offset, t.nbytes, manifest.segment_bytes))
        if length
    ]


def _checker(manifest: Manifest, view: memoryview, path: str) -> Any:
    fn = get_checksum(manifest.checksum_algorithm)

    def check(extent: Extent) -> None:  # a writer thread, after the extent is written
        for start, length, tag in extent.segments:
            entry, j = typing.cast(tuple[TensorEntry, int], tag)
            if fn(view[start : start + length]) != entry.checksum[j]:
                raise CorruptCheckpointError(
                    f"memory slot: tensor {entry.key!r} segment {j} does not match its "
                    "checksum; not persisted", step=manifest.step, path=path, phase="persist",
                )  # fmt: skip

    return check


# ---------------------------------------------------------------------- the process
class Keeper:
    """The keeper process's state (``main`` builds it)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.job, self.rank, self.shm = args.job, args.rank, args.shm_dir
        self.parent, self.linger = args.parent, args.linger_secs
        self.world = args.world  # > 1: a slot is a part; rank 0's keeper writes whole steps
        self._joined = False  # (several ranks) the job's newest whole step was looked at
        self.sock = socket.socket(fileno=args.fd)
        self.lock_fd = hold_job_lock(self.shm, self.job, self.rank)  # the segments are alive
        self.also: list[tuple[str, int, int]] = []  # other segments of the job's: partner
        for word in args.also or []:  # copies this node holds (job, rank, their lock)
            job, rank = word.rsplit(":", 1)
            self.also.append((job, int(rank), hold_job_lock(self.shm, job, int(rank))))
        io = IOOptions.from_env()
        self.storage: Storage | None = LocalStorage(args.next, io) if args.next else None
        self.pool = ThreadPoolExecutor(io.threads, thread_name_prefix="pitstop-keeper-io")
        self.hashers = ThreadPoolExecutor(2, thread_name_prefix="pitstop-keeper-hash")
        self.persister = ThreadPoolExecutor(1, thread_name_prefix="pitstop-keeper-persist")
        self.send_lock = threading.Lock()
        self.main_slots: dict[int, Slot] = {}  # mapped once: the main thread's
        self.persist_slots: dict[int, Slot] = {}  # the persist thread's
        self.pidfd = -1
        with contextlib.suppress(AttributeError, OSError):  # Linux >= 5.3
            self.pidfd = os.pidfd_open(self.parent)
        self.term = False
        self._named: int | None = None  # the lock file's mtime when the parent let go
        self.buf = b""
        self.watch_ppid = os.getppid() == self.parent  # started by the training process

    def send(self, **event: Any) -> None:
        with self.send_lock, contextlib.suppress(OSError):  # the main and the persist thread
            self.sock.sendall(json.dumps(event).encode() + b"\n")

    def _slot(self, index: int, cache: dict[int, Slot]) -> Slot | None:
        """Slot ``index``, mapped once per thread (flocks belong to an open file: the main
        thread's and the persist thread's must not be one) and again if it was replaced."""
        for path in iter_slots(self.shm, self.job, self.rank):
            if not path.endswith(f"-s{index}"):
                continue
            slot = cache.get(index)
            with contextlib.suppress(FileNotFoundError):
                if slot is not None and os.stat(path).st_ino == os.fstat(slot.fd).st_ino:
                    return slot
                if slot is not None:
                    slot.close()
                cache[index] = open_slot(path, job=self.job, rank=self.rank, populate=False)
                return cache[index]
        return None

    def run(self) -> int:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "sock")
        if self.pidfd >= 0:
            sel.register(self.pidfd, selectors.EVENT_READ, "pid")
        self.send(event="ready", pid=os.getpid())
        while True:
            for key, _ in sel.select(timeout=0.5):
                if key.data == "pid":  # what it asked before it died comes first
                    self.sock.setblocking(False)
                    stop = self.commands()
                    return stop if stop is not None else self.finish(died=True)
                stop = self.commands()
                if stop is not None:
                    return stop
            if self.watch_ppid and os.getppid() != self.parent:
                return self.finish(died=True)
            if self.term:  # persist, but leave a living trainer's segments alone
                return self.finish(died=True, unlink=not pid_alive(self.parent))

    def commands(self) -> int | None:
        """Read and run what the socket holds; an exit code once the keeper has finished
        (``stop``, or EOF: the parent is gone), else None."""
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return None
            except OSError:
                data = b""
            if not data:
                return self.finish(died=True)
            self.buf += data
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                try:
                    cmd = json.loads(line)
                    op = cmd.get("op")
                except (ValueError, AttributeError):
                    self.send(event="error", op=None, message=f"not a command: {line[:80]!r}")
                    continue
                if op == "stop":
                    return self.finish(died=False, **cmd.get("args", {}))
                self.handle(cmd)
                self.send(event="seen")  # every command answered: a hung keeper shows
            if self.sock.getblocking():
                return None  # one read per wake-up; the selector says when there is more

    def handle(self, cmd: dict[str, Any]) -> None:
        op, index = cmd.get("op"), int(cmd.get("slot", -1))
        slot = self._slot(index, self.main_slots)
        if slot is None:
            self.send(event="error", op=op, slot=index, message="no such slot")
            return
        try:
            if op == "seal" and self._superseded(slot):
                self.send(event="superseded", slot=index)  # a newer snapshot is staged: the
                return  # trainer may take this slot again; hashing it would be wasted
            killpoint("keeper.seal")  # a staged slot not yet flipped (hashing writes nothing)
            head = seal(slot, pool=self.hashers)
            if head is not None:
                self.send(event="sealed", slot=index, step=head.step)
            if op == "persist":  # on the persist thread: seals go on meanwhile
                self.persister.submit(self._persist_index, index)
        except Exception as e:
            self.send(event="error", op=op, slot=index, message=f"{type(e).__name__}: {e}")

    def _superseded(self, slot: Slot) -> bool:
        """Whether staged ``slot`` has a newer staged or committed snapshot beside it."""
        head = slot.header()
        if head is None or head.state != STAGED:
            return False
        for path in iter_slots(self.shm, self.job, self.rank):
            if path == slot.path:
                continue
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    other = read_header(fd)
                finally:
                    os.close(fd)
                if (
                    other is not None
                    and other.state in (STAGED, COMMITTED)
                    and other.gen > head.gen
                ):
                    return True
        return False

    def _persist_index(self, index: int) -> None:
        """The persist thread: slot ``index`` as it is now, to the next level."""
        slot = self._slot(index, self.persist_slots)
        if slot is None:
            self.send(event="error", op="persist", slot=index, message="no such slot")
            return
        try:
            self.persist(slot)
        except Exception as e:
            self.send(event="error", op="persist", slot=index, message=f"{type(e).__name__}: {e}")

    def persist(self, slot: Slot) -> bool:
        """Write the slot's step to the next level unless it holds it (or a newer one);
        whether it holds it now."""
        head = slot.header()
        step = head.step if head is not None else None
        if self.storage is None or step is None or self.world > 1:
            why = "a part of a step of several ranks" if self.world > 1 else "no next level"
            self.send(event="skipped", slot=slot.index, step=step, why=why)
            return False
        held = newest_step(self.storage)
        if held is not None and held >= step:
            self.send(event="skipped", slot=slot.index, step=step, why=f"next level has {held}")
            return True
        t0 = time.perf_counter()
        done = persist_slot(slot, self.storage, pool=self.pool)
        if done is None:
            self.send(event="skipped", slot=slot.index, step=step, why="busy or not committed")
            return False
        # (the step pinned: the slot may have been staged into since the look above)
        secs = time.perf_counter() - t0
        self.send(event="persisted", slot=slot.index, step=done.step, secs=secs)
        return True

    def finish(self, *, died: bool, unlink: bool = True, persist: bool = False) -> int:
        """The training process died (or asked to stop): persist the newest snapshot if the
        next level lacks it, then remove the job's segments (unless adopted) and exit."""
        with contextlib.suppress(OSError):  # the lock file as the parent left it
            self._named = os.stat(
                os.path.join(self.shm, lock_name(self.job, self.rank))
            ).st_mtime_ns
        self.persister.shutdown(wait=True)  # a persist under way ends first
        for cached in [*self.main_slots.values(), *self.persist_slots.values()]:
            cached.close()
        newest = self._newest(seal_staged=died) if died or persist else None
        held = True  # the next level holds the newest snapshot's step (or there is none)
        step = None  # (several ranks) the newest snapshot's step
        if newest is not None and self.world > 1:  # a part: never written alone
            head = newest.header()
            newest.close()
            step = head.step if head is not None else None
            if died and self.rank == 0:
                self._persist_job()
        elif newest is not None:
            try:
                held = self.persist(newest)
            except Exception as e:
                held = False
                _log.warning("keeper: persisting the memory checkpoint failed: %r", e)
            finally:
                newest.close()
        if died and self.linger > 0 and self._adopted(time.monotonic() + self.linger):
            unlink = False
        elif self.term and unlink and not (held if self.world == 1 else self._holds(step)):
            # told to go before a restart took them over (several ranks: rank 0's keeper may
            # have written the job's newest step meanwhile):
            unlink = False  # the newest snapshot is nowhere else; pitstop gc removes them
            _log.warning(
                "keeper: SIGTERM; the newest memory snapshot of job %s rank %d is not on the "
                "next level: its segments are left in %s (pitstop gc removes them)",
                self.job, self.rank, self.shm,
            )  # fmt: skip
        if unlink:
            with contextlib.suppress(OSError):  # a log with nothing in it goes too
                if os.path.getsize(keeper_log(self.job, self.rank)) == 0:
                    os.unlink(keeper_log(self.job, self.rank))
            if self.world > 1 and self.rank == 0 and self._joined and self.storage is not None:
                from pitstop.levels.keeper_join import remove_dead_parts

                with contextlib.suppress(OSError):  # the others' keepers may have gone first
                    remove_dead_parts(self.shm, self.job, self.world, self.storage)
            for job, rank in [(self.job, self.rank), *((j, r) for j, r, _ in self.also)]:
                for path in iter_slots(self.shm, job, rank):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.shm, lock_name(job, rank)))
        os.close(self.lock_fd)
        for _, _, fd in self.also:
            os.close(fd)
        self.pool.shutdown(wait=True)
        self.hashers.shutdown(wait=True)
        return 0

    def _newest(self, *, seal_staged: bool) -> Slot | None:
        """The slot with the newest snapshot (a staged one newer than every committed one is
        sealed first); None if there is none."""
        found: list[tuple[SlotHeader, Slot]] = []
        for path in iter_slots(self.shm, self.job, self.rank):
            with contextlib.suppress(FileNotFoundError, CorruptCheckpointError):
                slot = open_slot(path, job=self.job, rank=self.rank, populate=False)
                head = read_header(slot.fd)
                if head is not None and head.state in (STAGED, COMMITTED):
                    found.append((head, slot))
                else:
                    slot.close()
        found.sort(key=lambda hs: hs[0].gen, reverse=True)
        chosen = None
        for head, slot in found:
            if chosen is None and head.state == STAGED and seal_staged:
                with contextlib.suppress(Exception):
                    if seal(slot, pool=self.hashers) is not None:
                        chosen = slot
                        continue
            if chosen is None and head.state == COMMITTED:
                chosen = slot
                continue
            slot.close()
        return chosen

    def _adopted(self, deadline: float) -> bool:
        """Whether a new training process of the job took the segments over before
        ``deadline`` (its pid in the lock file, alive, not the dead parent; or the parent
        itself, having named itself again since the keeper was let go)."""
        path = os.path.join(self.shm, lock_name(self.job, self.rank))
        named = self._named
        while time.monotonic() < deadline and not self.term:  # SIGTERM: go now
            if self.world > 1 and self.rank == 0 and not self._joined:
                self._persist_job()  # once the job's last trainer is gone too
            with contextlib.suppress(OSError, ValueError):
                with open(path, "rb") as f:
                    owner = json.loads(f.read(512).strip() or b"{}")
                    again = os.fstat(f.fileno()).st_mtime_ns != named
                pid = int(owner.get("pid", 0))
                # a new process, or the parent itself after a close() that left them (its
                # next manager names it in the lock file again)
                if pid and pid != os.getpid() and (pid != self.parent or again):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 0)
                        return True
            time.sleep(0.05)
        return False

    def _persist_job(self) -> None:
        """Rank 0's keeper of a job of several ranks, once every trainer of the job is dead:
        the newest step every rank holds on this node, to the next level
        (:mod:`pitstop.levels.keeper_join`; a job across nodes: nothing)."""
        from pitstop.levels.keeper_join import persist_joined, trainers_dead

        if self.storage is None or not trainers_dead(self.shm, self.job, self.world):
            return
        self._joined = True
        try:
            step, what = persist_joined(self.shm, self.job, self.world, self.storage,
                                        pool=self.pool, hashers=self.hashers)  # fmt: skip
        except Exception as e:
            _log.warning("keeper: the newest memory step of job %s (%d ranks) not written to "
                         "%s: %r", self.job, self.world, self.storage.url, e)  # fmt: skip
            return
        _log.info("keeper: job %s (%d ranks), newest whole memory step %s: %s", self.job,
                  self.world, step, what)  # fmt: skip

    def _holds(self, step: int | None) -> bool:
        """Whether the next level holds ``step`` or a newer one (None: nothing to hold)."""
        if step is None:
            return True
        with contextlib.suppress(Exception):
            held = newest_step(self.storage) if self.storage is not None else None
            return held is not None and held >= step
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m pitstop.levels.keeper``: see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m pitstop.levels.keeper")
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--shm-dir", default=SHM_DIR)
    p.add_argument("--next", default=None, help="the next level's directory")
    p.add_argument("--parent", type=int, required=True, help="the training process's pid")
    p.add_argument("--fd", type=int, required=True, help="the command socket's fd")
    p.add_argument("--linger-secs", type=float, default=0.0)
    p.add_argument("--world", type=int, default=1, help="the job's world size")
    p.add_argument(
        "--also",
        action="append",
        metavar="JOB:RANK",
        help="other segments to keep alive and remove with the job's (partner copies)",
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of the job: the parent decides
    keeper = Keeper(args)

    def on_term(*_: object) -> None:
        keeper.term = True

    signal.signal(signal.SIGTERM, on_term)
    return keeper.run()


# ---------------------------------------------------------------------- the training side
class KeeperHandle:
    """The training process's end of a keeper (see the module docstring). Training thread."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc, self.sock = proc, sock
        self.pid = proc.pid
        self._buf = b""
        self._events: list[dict[str, Any]] = []
        self._asked: collections.deque[float] = collections.deque()  # commands not answered
        self._slowest = 0.0  # the longest a command took to be answered (seconds)

    def alive(self) -> bool:
        """Whether the keeper still runs (False: it crashed or was killed; persist in-process)."""
        return self.proc.poll() is None

    def _send(self, op: str, **kw: Any) -> bool:
        try:
            if op != "stop":
                self._asked.append(time.monotonic())
            self.sock.sendall(json.dumps({"op": op, **kw}).encode() + b"\n")
        except OSError:
            return False
        return True

    def stalled(self, floor_secs: float = 10.0) -> float | None:
        """How long the oldest command has waited for its answer, if longer than
        ``floor_secs`` and 5 times the longest any took so far (a keeper that stopped:
        SIGSTOP, a hung hash), else None. Read by the thread that reads the events."""
        try:
            waited = time.monotonic() - self._asked[0]
        except IndexError:  # none waits (or the last was answered meanwhile)
            return None
        return waited if waited > max(floor_secs, 5 * self._slowest) else None

    def detach(self) -> None:
        """Let the keeper go on alone, as if this process had died: it seals and writes the
        newest snapshot where it can, lingers for a restart, then removes the segments."""
        self.sock.close()

    def request_seal(self, slot: int) -> bool:
        """Hash and commit staged ``slot``; False if the keeper is gone."""
        return self._send("seal", slot=slot)

    def request_persist(self, slot: int) -> bool:
        """Seal ``slot`` if needed and write it to the next level; False if the keeper is gone."""
        return self._send("persist", slot=slot)

    def _pump(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            data = b""
        finally:
            self.sock.settimeout(None)
        if not data:
            raise EOFError
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            event = json.loads(line)
            if event.get("event") != "seen":
                self._events.append(event)
            elif self._asked:
                self._slowest = max(self._slowest, time.monotonic() - self._asked.popleft())

    def events(self) -> list[dict[str, Any]]:
        """What the keeper reported since the last call (never waits)."""
        with contextlib.suppress(EOFError):
            while True:
                before = len(self._events) + len(self._buf)
                self._pump(0.0)
                if len(self._events) + len(self._buf) == before:
                    break
        out, self._events = self._events, []
        return out

    def next_events(self, timeout: float) -> list[dict[str, Any]]:
        """Wait up to ``timeout`` seconds for what the keeper reports (one reader thread);
        [] if nothing came; EOFError once the keeper is gone."""
        if not self._events:
            self._pump(timeout)
        out, self._events = self._events, []
        return out

    def wait_for(self, event: str, *, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """Wait for the next ``event`` whose fields equal ``match`` (tests, ``stop``); an
        ``error`` event or the keeper's end raise."""
        deadline = time.monotonic() + timeout
        while True:
            for i, e in enumerate(self._events):
                if e.get("event") == "error":
                    del self._events[i]
                    raise RuntimeError(f"keeper: {e}")
                if e.get("event") == event and all(e.get(k) == v for k, v in match.items()):
                    del self._events[: i + 1]
                    return e
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"keeper reported no {event} {match} in {timeout} s")
            try:
                self._pump(min(left, 0.5))
            except EOFError:
                raise RuntimeError(f"the keeper ended (exit {self.proc.poll()})") from None

    def stop(self, *, unlink: bool = True, persist: bool = False, timeout: float = 30.0) -> int:
        """Ask the keeper to end (``persist``: the newest committed slot first; ``unlink``:
        remove the job's segments) and wait for it; returns its exit code."""
        self._send("stop", args={"unlink": unlink, "persist": persist})
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.sock.close()
        return code


def keeper_log(job: str, rank: int = 0) -> str:
    """Where the keeper of (``job``, ``rank``) writes its warnings (appended)."""
    return os.path.join(tempfile.gettempdir(), f"pitstop-keeper-{job}-r{rank:05d}.log")


def empty_logs(jobs: typing.Iterable[str]) -> list[str]:
    """The empty logs of the keepers of ``jobs`` (every rank): a killed keeper leaves its log
    behind; ``pitstop gc`` removes those of the jobs whose segments it removed."""
    directory, out = tempfile.gettempdir(), []
    for job in set(jobs):
        prefix = os.path.basename(keeper_log(job, 0)).rsplit("-r", 1)[0] + "-r"
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                path = os.path.join(directory, name)
                if name.startswith(prefix) and name.endswith(".log"):
                    with contextlib.suppress(OSError):
                        if os.lstat(path).st_size == 0:
                            out.append(path)
    return sorted(out)


def start_keeper(
    job: str,
    *,
    rank: int = 0,
    shm_dir: str = SHM_DIR,
    next_dir: str | None = None,
    linger_secs: float = 0.0,
    world: int = 1,
    timeout: float = 30.0,
    kill_at: str | None = None,
    also: list[tuple[str, int]] | None = None,
) -> KeeperHandle:
    """Start the keeper of (``job``, ``rank``) and wait until it is ready. Its environment
    is the caller's without ``PITSTOP_KILL_AT`` (a training process's kill point is not
    the keeper's); ``kill_at`` gives the keeper its own."""
    ours, theirs = socket.socketpair()
    env = {k: v for k, v in os.environ.items() if k != "PITSTOP_KILL_AT"}
    if kill_at is not None:
        env["PITSTOP_KILL_AT"] = kill_at
    cmd = [
        sys.executable, "-m", "pitstop.levels.keeper", "--job", job, "--rank", str(rank),
        "--shm-dir", shm_dir, "--parent", str(os.getpid()), "--fd", str(theirs.fileno()),
        "--linger-secs", str(linger_secs), "--world", str(world),
    ]  # fmt: skip
    if next_dir is not None:
        cmd += ["--next", os.path.abspath(next_dir)]
    for other, other_rank in also or []:
        cmd += ["--also", f"{other}:{other_rank}"]
    log = open(keeper_log(job, rank), "ab")  # noqa: SIM115 (the child's stderr)
    try:
        proc = subprocess.Popen(  # neither the trainer's stdout nor its stderr: a launcher
            # that reads them until EOF (subprocess.run(capture_output=True), a pipe to tee)
            # would wait for the keeper, which outlives a crashed trainer by linger_secs,
            # and not restart the trainer meanwhile; its warnings go to keeper_log()
            cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    finally:
        theirs.close()
        log.close()
    handle = KeeperHandle(proc, ours)
    try:
        handle.wait_for("ready", timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        ours.close()
        raise
    return handle


if __name__ == "__main__":
    sys.exit(main())
