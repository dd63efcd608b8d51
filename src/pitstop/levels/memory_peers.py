"""PeerCopies: partner copies of the memory level's snapshots in another node's memory
(``pitstop.Memory(redundancy="partner")``, Gemini's checkpoints in peer CPU memory), so that
a restart after one node is lost still restores from memory.

Rank r's snapshots are copied, in the background, to ``placement.partner_holder(r)`` (the
rank of the same local index on the next node of its ring), which keeps the newest copies
as a slot set of its own under the *peer token* of the job (``<job>_p``, rank r): the same
slots, header and metadata as r's own, its part of the manifest as r's keeper sealed it.
Nothing is hashed on the way (every checksum is verified when the copy is read).

Rounds: every rank calls :meth:`PeerCopies.round` for the same memory steps in the same order
(each memory step of the manager: a snapshot, a durable save, or a snapshot it skipped); the
peer thread takes them in order and, per round, exchanges with its holder and its source
on a gloo group of its own (three short messages and the bytes): a header (what it has: the
committed snapshot of that step, pinned, or nothing), the holder's word that it has a slot
for it, then the data and the metadata. A rank whose snapshot of a round was skipped or is
already reused sends nothing that round, so a thread that falls behind catches up. A
failed exchange (a peer gone: the group's timeout) ends the copies for the rest of the run,
with a warning; training never waits for them.

At a restart (training thread, collective, :meth:`rebuild`): a rank that lacks its part of
a step its holder keeps a copy of (its node was lost and replaced) receives the copy into a
slot of its own, sealed with the copied part; the restart then joins the step as any.

Call sequence::

    peers = PeerCopies(level, placement)   # training thread, collective (two gloo groups)
    peers.held_parts()                     # the restart's survey: the copies this rank keeps
    peers.rebuild(name, lost, holder_of)   # collective: copies sent back to the ranks in lost
    peers.round(step, slot)                # after every memory step (slot: None if skipped)
    peers.close(unlink=...)                # the rounds drained, the thread and groups ended
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from pitstop.errors import CheckpointError
from pitstop.levels.memory import SlotStorage
from pitstop.levels.shm import (
    COMMITTED,
    Slot,
    SlotHeader,
    SlotSet,
    commit_copy,
    read_meta,
)
from pitstop.levels.spec import Placement
from pitstop.log import get_logger
from pitstop.ranks.peers import PeerLink, make_link

if TYPE_CHECKING:
    from pitstop.levels.memory_level import MemoryLevel

__all__ = ["PeerCopies", "peer_token"]

_log = get_logger("pitstop.levels")
_SEAL_WAIT_SECS = 10.0  # a round waits this long for the keeper to seal its snapshot
_HEAD = 8  # int64 words: ok, step, gen, file_bytes, record, objects, manifest, 0


def peer_token(job: str) -> str:
    """The token of the partner copies a node keeps for the job's ranks on another node."""
    return job[:62] + "_p"


def _tensor(view: memoryview, n: int) -> torch.Tensor:
    return (
        torch.frombuffer(view, dtype=torch.uint8, count=n)
        if n
        else torch.empty(0, dtype=torch.uint8)
    )


class PeerCopies:
    """See the module docstring."""

    def __init__(self, level: MemoryLevel, placement: Placement) -> None:
        rank = level.group.rank
        self.level, self.rank = level, rank
        self.holder = placement.partner_holder(rank)  # keeps this rank's copies
        self.source = placement.partner_source(rank)  # whose copies this rank keeps
        self.node_of = placement.nodes
        self.job = peer_token(level.job)
        self.directory = level.directory
        self.link: PeerLink = make_link(level.group)  # the peer thread's
        self.restart_link: PeerLink = make_link(level.group)  # the training thread's
        self.held: SlotSet | None = None
        with contextlib.suppress(OSError, ValueError, CheckpointError):
            self.held = SlotSet.attach(self.job, rank=self.source, directory=self.directory)
        self.failed: BaseException | None = None
        self.sent = self.received = 0  # copies, this run
        self._rounds: queue.Queue[tuple[int, Slot | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ save side
    def round(self, step: int, slot: Slot | None) -> None:
        """Training thread: the memory step ``step`` happened (``slot``: its snapshot's, None if
        this rank skipped it); the peer thread copies it when its turn comes."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="pitstop-memory-peer", daemon=True
            )
            self._thread.start()
        self._rounds.put((step, slot))

    def _run(self) -> None:
        while (item := self._rounds.get()) is not None:
            if self.failed is not None:
                continue
            try:
                self._round(*item)
            except Exception as e:
                self.failed = e
                _log.warning(
                    "partner copies of the memory snapshots stop for this run (rank %d -> %d): "
                    "%s", self.rank, self.holder, e, phase="replicate",
                )  # fmt: skip

    def _round(self, step: int, slot: Slot | None) -> None:
        mine = self._pin(step, slot)
        try:
            head = torch.zeros(_HEAD, dtype=torch.int64)
            if mine is not None:
                h, record, objects, manifest = mine[1], mine[2], mine[3], mine[4]
                head[:7] = torch.tensor(
                    [1, step, h.gen, h.file_bytes, len(record), len(objects), len(manifest)]
                )
            theirs = torch.zeros(_HEAD, dtype=torch.int64)
            self.link.exchange([(self.holder, head)], [(self.source, theirs)], "replicate")
            target = self._target(theirs) if theirs[0] else None
            ready, go = torch.tensor([int(target is not None)]), torch.zeros(1, dtype=torch.int64)
            self.link.exchange([(self.source, ready)], [(self.holder, go)], "replicate")
            sends = []
            if mine is not None and go[0]:
                s, h = mine[0], mine[1]
                meta = mine[2] + mine[3] + mine[4]
                sends = [(self.holder, _tensor(s.view, h.file_bytes))]
                sends_meta = [(self.holder, torch.frombuffer(bytearray(meta), dtype=torch.uint8))]
            else:
                sends_meta = []
            recvs, recvs_meta = [], []
            meta_in = None
            if target is not None:
                n, lens = int(theirs[3]), [int(x) for x in theirs[4:7]]
                recvs = [(self.source, _tensor(target.view, n))]
                meta_in = torch.empty(sum(lens), dtype=torch.uint8)
                recvs_meta = [(self.source, meta_in)]
            try:
                self.link.exchange(sends, recvs, "replicate")
                self.link.exchange(sends_meta, recvs_meta, "replicate")
            except BaseException:
                if target is not None and self.held is not None:
                    self.held.abandon(target)
                raise
            if sends:
                self.sent += 1
            if target is not None and meta_in is not None:
                self._install(target, int(theirs[3]), [int(x) for x in theirs[4:7]], meta_in)
        finally:
            if mine is not None:
                mine[0].unlock()

    def _pin(
        self, step: int, slot: Slot | None
    ) -> tuple[Slot, SlotHeader, bytes, bytes, bytes] | None:
        """This rank's committed snapshot of ``step`` in ``slot``, pinned (flock shared) with
        its metadata; None if there is none (skipped, not sealed in time, or reused)."""
        if slot is None or slot.closed:
            return None
        deadline = time.monotonic() + _SEAL_WAIT_SECS
        while True:
            h = slot.header()
            if h is None or h.step != step:
                return None  # reused for a newer step (this thread fell behind)
            if h.state == COMMITTED:
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(0.002)
        if not slot.try_lock(exclusive=False):
            return None
        try:
            h = slot.header()
            if h is None or h.step != step or h.state != COMMITTED:
                raise LookupError
            record, objects, manifest = read_meta(slot, h)
        except (LookupError, CheckpointError):
            slot.unlock()
            return None
        return slot, h, record, objects, manifest

    def _target(self, theirs: torch.Tensor) -> Slot | None:
        """A slot of the held set for the source's snapshot ``theirs`` describes (made, or
        made anew larger); None if shared memory cannot hold it (said once)."""
        n, step = int(theirs[3]), int(theirs[1])
        try:
            if self.held is None or any(s.nbytes < n for s in self.held.slots):
                old, self.held = self.held, None
                if old is not None:
                    old.close(unlink=True)
                self.held = SlotSet.create(
                    self.job, data_bytes=n, count=2, rank=self.source, directory=self.directory,
                    limit_bytes=self.level.spec.limit_bytes,
                )  # fmt: skip
            return self.held.begin(step)
        except (OSError, ValueError, CheckpointError) as e:
            if self.held is None or self.received == 0:
                _log.warning("no room for rank %d's partner copies in %s: %s", self.source,
                             self.directory, e, phase="replicate")  # fmt: skip
            return None

    def _install(self, slot: Slot, n: int, lens: list[int], meta: torch.Tensor) -> None:
        """The copy is complete: its record and objects after the data, then its part of the
        manifest as the source's keeper sealed it."""
        assert self.held is not None
        raw = meta.numpy().tobytes()
        record, objects = raw[: lens[0]], raw[lens[0] : lens[0] + lens[1]]
        self.held.staged(slot, record, objects, n)
        commit_copy(slot, raw[lens[0] + lens[1] :])
        self.received += 1

    # ------------------------------------------------------------------ restart
    def held_parts(self) -> dict[str, bytes]:
        """The steps of the source's snapshots this rank keeps copies of: their parts."""
        storage = SlotStorage(self.directory, self.job, rank=self.source)
        try:
            return {name: part for name, (_, part) in storage.parts().items()}
        finally:
            storage.close()

    def rebuild(self, name: str, lost: list[int]) -> None:
        """Collective (training thread): the holder of each rank in ``lost`` sends it its copy
        of step ``name``; that rank makes it a committed slot of its own (its slot set made
        if it has none). A rank that cannot take it says so; the step then does not join."""
        me, level = self.rank, self.level
        serve = self.source in lost  # I hold the source's copy, and it lost its own
        take = me in lost
        copy: tuple[Slot, SlotHeader, bytes] | None = None
        storage = SlotStorage(self.directory, self.job, rank=self.source) if serve else None
        try:
            head = torch.zeros(_HEAD, dtype=torch.int64)
            if storage is not None:
                with contextlib.suppress(CheckpointError):
                    slot, h = storage.slot_of(name)
                    if slot.try_lock(exclusive=False):
                        record, objects, manifest = read_meta(slot, h)
                        copy = (slot, h, record + objects + manifest)
                        head[:7] = torch.tensor([
                            1, h.step or 0, h.gen, h.file_bytes, len(record), len(objects),
                            len(manifest),
                        ])  # fmt: skip
            theirs = torch.zeros(_HEAD, dtype=torch.int64)
            sends = [(self.source, head)] if serve else []
            recvs = [(self.holder, theirs)] if take else []
            self.restart_link.exchange(sends, recvs, "restore")
            target = self._own_slot(theirs) if take and theirs[0] else None
            ready, go = torch.tensor([int(target is not None)]), torch.zeros(1, dtype=torch.int64)
            self.restart_link.exchange(
                [(self.holder, ready)] if take else [], [(self.source, go)] if serve else [],
                "restore",
            )  # fmt: skip
            data_sends, meta_sends, data_recvs, meta_recvs = [], [], [], []
            meta_in = None
            if copy is not None and go[0]:
                data_sends = [(self.source, _tensor(copy[0].view, copy[1].file_bytes))]
                meta_sends = [
                    (self.source, torch.frombuffer(bytearray(copy[2]), dtype=torch.uint8))
                ]
            if target is not None:
                lens = [int(x) for x in theirs[4:7]]
                data_recvs = [(self.holder, _tensor(target.view, int(theirs[3])))]
                meta_in = torch.empty(sum(lens), dtype=torch.uint8)
                meta_recvs = [(self.holder, meta_in)]
            self.restart_link.exchange(data_sends, data_recvs, "restore")
            self.restart_link.exchange(meta_sends, meta_recvs, "restore")
            if target is not None and meta_in is not None and level.slots is not None:
                raw = meta_in.numpy().tobytes()
                lens = [int(x) for x in theirs[4:7]]
                level.slots.staged(
                    target, raw[: lens[0]], raw[lens[0] : lens[0] + lens[1]], int(theirs[3])
                )
                commit_copy(target, raw[lens[0] + lens[1] :])
                _log.info("memory %s of rank %d rebuilt from its partner copy on node %s",
                          name, me, self.node_of[self.holder], phase="restore")  # fmt: skip
        finally:
            if copy is not None:
                copy[0].unlock()
            if storage is not None:
                storage.close()

    def _own_slot(self, theirs: torch.Tensor) -> Slot | None:
        """A slot of this rank's own set for a copy coming back (the set made if there is
        none or it is too small)."""
        level, n, step = self.level, int(theirs[3]), int(theirs[1])
        try:
            if level.slots is None or any(s.nbytes < n for s in level.slots.slots):
                if level.slots is not None:
                    level.slots.close(unlink=True)
                    level.slots = None
                level.slots = SlotSet.create(
                    level.job, data_bytes=n, count=level.spec.slots, rank=self.rank,
                    directory=self.directory, limit_bytes=level.spec.limit_bytes,
                )  # fmt: skip
            return level.slots.begin(step)
        except (OSError, ValueError, CheckpointError) as e:
            _log.warning("memory: no room to rebuild this rank's snapshot of step %d from its "
                         "partner copy: %s", step, e, phase="restore")  # fmt: skip
            return None

    # ------------------------------------------------------------------ end
    def close(self, *, unlink: bool = True, timeout_secs: float = 60.0) -> None:
        """Drain the rounds (every rank takes the same ones), end the thread and the groups;
        ``unlink``: the copies this node keeps go too."""
        if self._thread is not None:
            self._rounds.put(None)
            self._thread.join(timeout_secs)
        self.link.close()
        self.restart_link.close()
        if self.held is not None:
            self.held.close(unlink=unlink)
            self.held = None

    def describe(self) -> dict[str, Any]:
        return {"holder": self.holder, "source": self.source, "sent": self.sent,
                "received": self.received, "failed": repr(self.failed) if self.failed else None}  # fmt: skip
