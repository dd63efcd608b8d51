"""MemoryLevel: the memory level of a list (``pitstop.Memory()``), first and fastest.

Its snapshots are the job's slots in shared memory (:mod:`pitstop.levels.shm`): the saver
stages straight into a slot (the slot *is* the staging arena), the keeper process
(:mod:`pitstop.levels.keeper`) hashes and commits it, and writes every durable snapshot to
the next level. For the restart it is a plain level over a read-only
:class:`~pitstop.levels.memory.SlotStorage` (the walk loads a committed slot in place).

Call sequence (training thread unless said; one process)::

    memory = MemoryLevel(spec, group, io, next_storage)  # attaches the slots a dead
                                                         #   incarnation left (adopted)
    memory.lists(group); memory.held(words)   # the restart's survey
    memory.serve(walk, load, s, window, ...)  # recover over the window, in place
    memory.ready(nbytes, busy)  # at a save: slots of the state's size (made, or made
                                #   larger one by one), the keeper started; False: off
    slot = memory.begin(step, avoid=..., wait=...)   # a slot to stage into
    memory.seal(slot); memory.persist(slot)   # persist thread: ask the keeper (or do it here
                                              #   when it is gone: ``in_process``)
    memory.close(persist_newest=...)          # the keeper stopped, the segments removed

Under torch.distributed every rank has its slots (its part of each step: its data file, its
objects, its part of the manifest, sealed by its keeper), and the level is on for every rank or
for none. A memory snapshot plans alone (no rank waits for another); a durable save is written
by the save's commit round from the slots. A restart joins the parts of the steps every rank
holds (``prepare_survey``); each rank then reads its own slot.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from pitstop.engine.catalog import Entry
from pitstop.engine.recovery import RestoreResult
from pitstop.errors import CheckpointError, ShmSpaceError
from pitstop.format.manifest import Manifest, join_parts
from pitstop.format.names import step_dir_name
from pitstop.io.locks import pid_alive
from pitstop.levels.keeper import KeeperHandle, persist_slot, start_keeper
from pitstop.levels.keeper_watch import external_keeper
from pitstop.levels.memory import SlotStorage
from pitstop.levels.memory_peers import PeerCopies, peer_token
from pitstop.levels.root import RootLevel
from pitstop.levels.shm import (
    EMPTY,
    STAGED,
    Slot,
    SlotSet,
    boot_id,
    hold_job_lock,
    iter_slots,
    job_token,
    lock_name,
    read_header,
    remove_stale,
    seal,
)
from pitstop.levels.shm_clean import job_slots
from pitstop.levels.shm_header import slot_name
from pitstop.levels.spec import Memory, Placement, memory_dir, node_ids
from pitstop.levels.walk import Walk
from pitstop.log import get_logger
from pitstop.options import IOOptions
from pitstop.ranks.group import Group
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage

__all__ = ["MemoryLevel", "job_token"]  # job_token: shm_header's, re-exported

_log = get_logger("pitstop.levels")


def local_dir(storage: Storage) -> str | None:
    """The directory of ``storage`` if it is a local directory (the keeper writes there)."""
    inner: Any = storage
    while not isinstance(inner, LocalStorage) and hasattr(inner, "inner"):
        inner = inner.inner
    return inner.root if isinstance(inner, LocalStorage) else None


class MemoryLevel(RootLevel):
    """See the module docstring."""

    quiet_when_empty = True  # nothing in memory (a clean start): a slower level serving is normal

    def __init__(
        self,
        spec: Memory,
        group: Group,
        io: IOOptions,
        next_storage: Storage,
        *,
        topology: Mapping[int, str] | Sequence[str] | None = None,
    ) -> None:
        self.spec, self.io = spec, io
        nodes = node_ids(topology, group.rank, lambda o: group.all_gather(o, "plan"))
        self.placement = Placement(nodes, spec.redundancy)
        self.directory = memory_dir(spec, nodes[group.rank])
        if "{node}" in os.fspath(spec.directory):
            with contextlib.suppress(OSError):  # a bad one is said below
                os.makedirs(self.directory, exist_ok=True)
        self.job = spec.job or job_token(next_storage.url)
        self.peers: PeerCopies | None = None
        self.next_storage = next_storage
        self.next_dir = local_dir(next_storage)
        self.slots: SlotSet | None = None
        self.keeper: KeeperHandle | None = None
        self.external = False  # an external keeper (pitstop keeper) seals the snapshots
        self.active = os.path.isdir(self.directory)
        if not self.active:
            _log.warning("pitstop.Memory(directory=%r): no such directory; saves go to the "
                         "next level only", self.directory, phase="plan")  # fmt: skip
        self._claim = -1  # the job's lock file, held and naming this process from the start
        self._leave: str | None = None  # why close() leaves the segments (as a crash would)
        self._refused: list[tuple[str, str]] = []  # the restart's steps whose parts disagree
        self._stuck: float | None = None  # since when no slot was free (an external keeper)
        self._said_stuck = False
        other = _live_owner(self.directory, self.job, group.rank) if self.active else None
        if other is not None:
            self.active = False
            _log.warning(
                "the memory level is off: its segments (job %s in %s) %s (the same script "
                "twice on one checkpoint directory? give each its own pitstop.Memory(job=...)); "
                "saves go to the next level only", self.job, self.directory,
                f"belong to process {other}, which is running" if other > 0
                else "have a lock file that is not a regular file", phase="plan",
            )  # fmt: skip
        world = _saved_world(self.directory, self.job) if self.active and other is None else None
        if world is not None and world != group.size:
            self.active = False
            _log.warning(
                "the memory level is off: the memory snapshots of job %s in %s were taken by %d "
                "rank(s), and this run has %d: restart with %d to restore from them (they are "
                "left as they are; `pitstop gc` removes them once their keeper is gone); saves "
                "go to the next level only", self.job, self.directory, world, group.size, world,
                phase="plan",
            )  # fmt: skip
        if self.active:
            with contextlib.suppress(OSError):  # dead jobs' segments, never a live one's
                for name in remove_stale(self.directory, keep={self.job, peer_token(self.job)}):
                    _log.info("removed a dead job's memory segment %s", name, phase="gc")
            with contextlib.suppress(OSError, ValueError, CheckpointError):
                self.slots = SlotSet.attach(self.job, rank=group.rank, directory=self.directory)
            self._claim_job(group.rank)
        self._slot_storage = SlotStorage(self.directory, self.job, rank=group.rank, io=io)
        super().__init__(self._slot_storage, group, None, name="memory")
        self._agreed = self._agree()
        if self._agreed and self.placement.scheme == "partner":  # collective (the groups)
            self.peers = PeerCopies(self, self.placement)

    @property
    def listed(self) -> bool:
        """A level of the restart's walk: on every rank or none (several ranks: as agreed when
        the level was made, whatever happened since, for the walk to stay collective)."""
        return self._agreed and (self.active or self.group.size > 1)

    def _agree(self) -> bool:
        """Collective under torch.distributed: the level is used on every rank or on none (a
        step in memory is every rank's part of it); said once, naming the ranks without it."""
        if self.group.size == 1:
            return self.active
        flags = self.group.all_gather(self.active, "plan")
        if all(flags):
            return True
        if self.active:
            self.active = False
        if self.group.coordinator:
            _log.warning(
                "the memory level is off on every rank: rank(s) %s cannot use it (see their "
                "warnings); saves go to the next level (%s) as without it",
                ", ".join(str(r) for r, f in enumerate(flags) if not f), self.next_storage.url,
                phase="plan",
            )  # fmt: skip
        return False

    def _claim_job(self, rank: int) -> None:
        """Name this process in the job's lock file now, not at the first save: a second
        process of the same job started meanwhile sees a living owner and stays off."""
        try:
            self._claim = hold_job_lock(self.directory, self.job, rank)
            owner = {"job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                     "boot": boot_id()}  # fmt: skip
            os.pwrite(self._claim, json.dumps(owner).encode().ljust(512), 0)
        except (OSError, CheckpointError) as e:
            self.off(f"its lock file cannot be held ({e})")

    def off(self, why: str) -> None:
        """Turn the memory level off for the rest of the run (said once): saves go to the
        next level as without it."""
        if self.active:
            self.active = False
            _log.warning("the memory level is off: %s; saves go to the next level (%s) as "
                         "without it", why, self.next_storage.url, phase="stage")  # fmt: skip

    def drop_after(self, step: int) -> list[str]:
        """A rollback to ``step``: every snapshot of a newer step (committed, staged or
        being staged; of the abandoned timeline) is removed, so that no later restart
        resumes it; its slot is made anew at the next save. Unlinked, not rewritten: a
        keeper may hold it."""
        dropped = []
        try:
            paths = list(iter_slots(self.directory, self.job, self.group.rank))
            if self.peers is not None:  # and the partner copies of them this rank keeps
                paths += iter_slots(self.directory, self.peers.job, self.peers.source)
        except OSError:
            return []
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    head = read_header(fd)
                finally:
                    os.close(fd)
            except (OSError, CheckpointError):
                continue
            if head is not None and head.step is not None and head.step > step \
                    and head.state != EMPTY:  # fmt: skip
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    if head.rank == self.group.rank and head.job == self.job:
                        dropped.append(f"memory:{step_dir_name(head.step)}")
        if dropped and self.slots is not None:
            self.slots.close(unlink=False)  # made anew (all of them) at the next save
            self.slots = None
        if self.peers is not None and self.peers.held is not None:
            self.peers.held.close()  # made anew at the next copy
            self.peers.held = None
        return dropped

    # ------------------------------------------------------------------ save side
    def ready(self, nbytes: int, busy: Collection[int] = ()) -> bool:
        """A slot of at least ``nbytes`` exists (or will, once the snapshots that are the
        only copies of their steps are superseded) and the keeper runs (when asked for);
        False if the memory level cannot be used (said once: saves go to the next level).
        ``busy``: slot indices being written to the next level (not made anew)."""
        if not self.active:
            return False
        if self.slots is None:  # after a rollback dropped newer slots: the others are kept
            with contextlib.suppress(OSError, ValueError, CheckpointError):  # (the step restored
                found = SlotSet.attach(self.job, rank=self.group.rank, directory=self.directory)
                if found is not None and len(found.slots) >= 2:
                    self.slots = found  # may be the only copy of that step)
                elif found is not None:
                    found.close(unlink=False)
        if self.slots is not None and len(self.slots.slots) >= 2:
            if any(s.nbytes < nbytes for s in self.slots.slots):  # the state grew: the slots
                try:  # are made larger one by one, never the only copy of a step at once
                    self.slots.grow(nbytes, busy=busy, limit_bytes=self.spec.limit_bytes)
                except (ShmSpaceError, OSError, ValueError, CheckpointError) as e:
                    self.off(str(e))
                    return False
            self._start_keeper()
            return True
        old = self.slots  # torn (fewer than 2 slots left): made anew, then swapped in
        try:
            self.slots = SlotSet.create(  # (it replaces the files of the same names)
                self.job, data_bytes=nbytes, count=self.spec.slots, rank=self.group.rank,
                directory=self.directory, limit_bytes=self.spec.limit_bytes,
            )  # fmt: skip
        except (ShmSpaceError, OSError, ValueError, CheckpointError) as e:
            self.slots = None
            self.off(str(e))
            return False
        finally:
            if old is not None:
                old.close(unlink=False)
        self._start_keeper()
        return True

    def _start_keeper(self) -> None:
        if self.spec.keeper == "external":
            if not self.external:
                self.external = external_keeper(self.directory, self.job)
                if not self.external:
                    self.spec = _no_keeper(self.spec)
                    _log.warning(
                        "Memory(keeper='external'): no keeper watches job %s in %s (start "
                        "`pitstop keeper %s` on the node first); sealing in the training "
                        "process", self.job, self.directory, self.next_storage.url,
                        phase="stage",
                    )  # fmt: skip
            return
        if self.keeper is not None or not self.spec.keeper:
            return
        try:
            self.keeper = start_keeper(  # several ranks: a slot is a part, never written
                # alone; rank 0's keeper writes the job's newest whole step when every
                # trainer died (all on this node: levels.keeper_join)
                self.job, rank=self.group.rank, shm_dir=self.directory, next_dir=self.next_dir,
                linger_secs=float(self.spec.linger_secs), world=self.group.size,
                also=[(self.peers.job, self.peers.source)] if self.peers is not None else None,
            )  # fmt: skip
        except Exception as e:
            self.spec = _no_keeper(self.spec)
            _log.warning("could not start the memory level's keeper (%r): sealing and writing "
                         "in the training process", e, phase="stage")  # fmt: skip

    def keeper_gone(self) -> None:
        """The keeper died: from now on this process seals and writes (no new keeper: one
        that keeps dying would cost more than it saves)."""
        self.keeper = None
        self.spec = _no_keeper(self.spec)

    def begin(
        self,
        step: int,
        *,
        avoid: Callable[[], set[int]],
        wait_secs: float = 0.0,
        nbytes: int = 0,
    ) -> Slot | None:
        """A slot of at least ``nbytes`` to stage ``step`` into (see ``SlotSet.begin``;
        ``avoid()``: the slots the keeper is writing); with ``wait_secs``, wait that long for
        one to be freed (the keeper sealing or writing), else None at once."""
        assert self.slots is not None
        deadline = time.monotonic() + wait_secs
        while True:
            slot = self.slots.begin(step, avoid=avoid(), nbytes=nbytes)
            now = time.monotonic()
            if slot is not None:
                self._stuck = None
                return slot
            self._unstick(now)
            if now >= deadline:
                return None
            time.sleep(0.002)

    def _unstick(self, now: float) -> None:
        """No slot was free: if that has lasted ``_EXTERNAL_STALL_SECS`` while a launcher's
        keeper runs (hung or stopped: it is not this process's to kill, as its own keeper
        is), the newest staged snapshot is sealed here, which frees the older slots."""
        if not self.external or self.slots is None:
            return
        if self._stuck is None:
            self._stuck = now  # (once said, it is not waited for again)
        stuck = self._said_stuck or now - self._stuck >= _EXTERNAL_STALL_SECS
        if stuck and self.slots.seal_pending(0.0) and not self._said_stuck:
            self._said_stuck = True
            _log.warning(
                "the external keeper of job %s has sealed nothing for %.0f s: sealing in "
                "the training process when no slot is free", self.job, now - self._stuck,
                phase="stage",
            )  # fmt: skip

    def seal(self, slot: Slot, pool: Executor) -> None:
        """Persist thread: commit staged ``slot`` (the keeper hashes it, or the external
        keeper as it watches; without one, a thread of ``pool`` does)."""
        if self.keeper is not None and self.keeper.request_seal(slot.index):
            return
        if self.external:
            if external_keeper(self.directory, self.job):
                return
            self.external = False
            self.spec = _no_keeper(self.spec)
            _log.warning("the external keeper of job %s ended: sealing in the training "
                         "process", self.job, phase="persist")  # fmt: skip
        pool.submit(self._seal_here, slot)

    def _seal_here(self, slot: Slot) -> None:
        try:
            seal(slot)
        except Exception as e:  # this memory snapshot is lost; the older one stays
            _log.warning("memory snapshot in slot %d not committed: %r", slot.index, e,
                         phase="commit")  # fmt: skip

    def request_persist(self, slot: Slot) -> bool:
        """Persist thread: ask the keeper to seal ``slot`` and write it to the next level;
        False if it cannot (gone, none, or the next level is not a local directory)."""
        if self.keeper is None or self.next_dir is None or self.group.size > 1:
            return False  # (several ranks: a part is written by the commit round only)
        return self.keeper.request_persist(slot.index)

    def persist_here(self, slot: Slot, pool: Executor) -> str | None:
        """Seal ``slot`` if needed and write it to the next level from this process (no
        keeper): the step directory's name, or None if the next level holds it already."""
        deadline = time.monotonic() + 30.0  # an external keeper may be sealing it
        while seal(slot) is None and (h := slot.header()) is not None and h.state == STAGED \
                and time.monotonic() < deadline:  # fmt: skip
            time.sleep(0.005)
        head = persist_slot(slot, self.next_storage, pool=pool)
        if head is None or head.step is None:
            return None
        return step_dir_name(head.step)

    # ------------------------------------------------------------------ restart
    def lists(self, group: Group) -> bool:
        """Every rank lists its own slots (one process: the coordinator, itself)."""
        return True

    def prepare_survey(self) -> None:
        """Collective under torch.distributed, before the restart's survey: each rank's slot
        of a step holds its part of the manifest (sealed alone, no rank waiting for another);
        the steps every rank holds a part of, of one plan, are joined into their manifest
        (``join_parts``: checked like any) and listed. A step some rank lacks (it skipped
        that snapshot, or its slot was reused) or whose parts disagree is not one."""
        if self.group.size == 1:
            return
        mine = self._slot_storage.parts()
        if self.peers is not None and self._rebuild(mine):
            mine = self._slot_storage.parts()
        refused: list[tuple[str, str]] = []
        joined = {
            name: (mine[name][0], manifest.dumps())
            for name, manifest in self.joined_steps(mine, "restore", refused=refused).items()
        }  # fmt: skip
        self._slot_storage.joined = joined
        newest = max(joined, default="")  # (zero-padded names: their order is the steps')
        self._refused = [(name, why) for name, why in refused if name > newest]

    def serve(
        self,
        walk: Walk,
        load: Callable[[Storage, Entry], Any],
        s: int,
        window: tuple[int | None, int] | None,
        view: Any,
        rollback: bool,
    ) -> RestoreResult | None:
        """As a plain level's; the steps newer than every joined one whose parts were refused
        are in ``skipped`` (the same on every rank), as a step refused at load time is."""
        refused, self._refused = self._refused, []
        walk.skipped += [
            (walk.label(self.name, n), f"not a checkpoint: {why}") for n, why in refused
        ]
        return super().serve(walk, load, s, window, view, rollback)

    def _rebuild(self, mine: dict[str, tuple[int, bytes]]) -> bool:
        """Partner copies (collective): the newest step every rank holds a part of, its own or
        a copy its holder keeps, when some rank lacks its own (its node was lost): the copies
        are sent back (``PeerCopies.rebuild``). True if any was."""
        assert self.peers is not None
        held = self.peers.held_parts()
        words = self.group.all_gather(
            ({n: p for n, (_, p) in mine.items()}, held, self.peers.source), "restore"
        )
        holder_of = {w[2]: r for r, w in enumerate(words)}  # rank -> who keeps its copies
        names = sorted({n for w in words for n in (*w[0], *w[1])}, reverse=True)
        for name in names:
            parts, lost = [], []
            for q, w in enumerate(words):
                if name in w[0]:
                    parts.append(w[0][name])
                elif q in holder_of and name in words[holder_of[q]][1]:
                    parts.append(words[holder_of[q]][1][name])
                    lost.append(q)
                else:
                    break
            else:
                try:
                    join_parts(parts, path=f"memory {name}")
                except CheckpointError:
                    continue
                if not lost:
                    return False  # the newest step is whole without copies
                self.peers.rebuild(name, lost)
                return True
        return False

    @property
    def slot_storage(self) -> SlotStorage:
        return self._slot_storage

    def joined_steps(
        self,
        mine: dict[str, tuple[int, bytes]],
        phase: str,
        *,
        newest_only: bool = False,
        refused: list[tuple[str, str]] | None = None,
    ) -> dict[str, Manifest]:
        """Collective (several ranks): every rank's parts (``SlotStorage.parts``) gathered;
        the manifests of the steps every rank holds a part of that join (newest first;
        ``newest_only``: the newest that joins). A step whose parts disagree is said,
        passed over and added to ``refused`` (name, why)."""
        words = self.group.all_gather({name: part for name, (_, part) in mine.items()}, phase)
        out: dict[str, Manifest] = {}
        for name in sorted(set.intersection(*(set(w) for w in words)), reverse=True):
            try:
                out[name] = join_parts([w[name] for w in words], path=f"memory {name}")
            except CheckpointError as e:
                if self.group.coordinator:
                    _log.warning("memory %s is not a checkpoint: %s", name, e, phase=phase)
                if refused is not None:
                    refused.append((name, str(e)))
                continue
            if newest_only:
                break
        return out

    def restarted(self, holds: bool) -> None:
        """Nothing to count: every save is a memory snapshot."""

    # ------------------------------------------------------------------ end
    def leave(self, why: str) -> None:
        """``close()`` leaves the segments as a crash of the training process would: their
        newest step is nowhere else (``why``). The keeper writes it to the next level where
        it can (one process), keeps the segments ``linger_secs`` for a restart, then removes
        them; without a keeper they stay for the restart or ``pitstop gc``."""
        self._leave = why

    def close(self, *, unlink: bool = True) -> None:
        """Stop the keeper and remove the job's segments (``unlink``): memory snapshots do
        not outlive a job that ended, unless :meth:`leave` was called."""
        if self._leave is not None and (self.slots is not None or self.keeper is not None):
            unlink = False
            _log.warning(
                "the memory level's segments (job %s, rank %d) are left in %s for a restart: "
                "%s; %s", self.job, self.group.rank, self.directory, self._leave,
                f"its keeper removes them after linger_secs={self.spec.linger_secs:g} unless "
                "a restart takes them over" if self.keeper is not None
                else "`pitstop gc` removes them once no process of the job runs",
                phase="persist",
            )  # fmt: skip
        try:
            if self.peers is not None:
                self.peers.close(unlink=unlink)
            if self.keeper is not None:
                if unlink:
                    self.keeper.stop(unlink=True, persist=False)
                else:  # as at a crash: it writes what it can, lingers, then removes them
                    self.keeper.detach()
                self.keeper = None
        finally:
            if self.slots is not None:
                self.slots.close(unlink=unlink)
                self.slots = None
            elif unlink and self._claim >= 0:  # no slots were made: the claimed lock file
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, lock_name(self.job, self.group.rank)))
            if self._claim >= 0:
                os.close(self._claim)
                self._claim = -1
            super().close()
            self._slot_storage.close()


_EXTERNAL_STALL_SECS = 10.0
"""No slot free this long while a launcher's keeper runs: the training process seals what
is staged (``MemoryLevel._unstick``)."""


def _live_owner(directory: str, job: str, rank: int) -> int | None:
    """The pid of another living training process that owns the job's segments on this
    host (its lock file names it), -1 for a lock file that is not a regular file, else None
    (no segments, a dead owner: ours to adopt)."""
    path = os.path.join(directory, lock_name(job, rank))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        return -1 if e.errno == errno.ELOOP else None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return -1  # a FIFO, a device...: never read (a FIFO would hang the read)
        owner = json.loads(os.pread(fd, 512, 0).strip() or b"{}")
        with contextlib.suppress(BlockingIOError):  # nobody holds the lock: every process
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # of the job is dead, whatever
            return None  # pid it names (pids are reused: a container's pid 1)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    pid = owner.get("pid") if isinstance(owner, dict) else None
    if not isinstance(pid, int) or pid in (0, os.getpid()):
        return None
    if owner.get("host") != socket.gethostname() or owner.get("boot") != boot_id():
        return None
    return pid if pid_alive(pid) else None


def _saved_world(directory: str, job: str) -> int | None:
    """How many ranks took the job's memory snapshots under ``directory`` (the world size
    their records name, at least one more than the highest rank with segments); None if
    there are none."""
    heads = job_slots(directory, job)
    if not heads:
        return None
    world = max(h.rank for h in heads) + 1
    for h in heads:
        if h.state not in ("staged", "committed") or not h.record_bytes:
            continue
        path = os.path.join(directory, slot_name(job, h.rank, h.index))
        with contextlib.suppress(OSError, ValueError, AttributeError):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                record = json.loads(os.pread(fd, h.record_bytes, h.meta_offset))
            finally:
                os.close(fd)
            world = max(world, int(record.get("world_size", 1)))
    return world


def _no_keeper(spec: Memory) -> Memory:
    return replace(spec, keeper=False)
