"""MemorySaver: the saver of a list that starts with ``pitstop.Memory()``.

The same transaction as :class:`~pitstop.engine.saver.Saver` (plan, stage with deferred
copies and the optimizer pre-hook, persist, commit, retain), with the arena taken from the
memory level: a save stages straight into a shared-memory slot, so the slot *is* the
staging arena and the memory snapshot costs training the copy and nothing else.

* A **memory snapshot** (``durable=False``, ``ckpt.step()`` between the policy's saves):
  the persist thread marks the slot ``staged`` (its plan record and objects file after the
  data) and asks the keeper to seal it (hash, manifest, commit). The handle is done then.
* A **durable save** (``durable=True``: the policy's, ``save``, ``async_save``): the same,
  and the keeper also writes the slot to the next level (verifying every checksum) and
  reports it; the commit's bookkeeping (the first level's word on flushes, retention) runs
  when the report arrives, on the ``pitstop-keeper-events`` thread, before the handle is
  done. The slot is kept out of ``begin`` until then.

No keeper (``Memory(keeper=False)``), or a keeper that died (a warning, once): the persist
thread seals and writes in this process. Slots that cannot be made (shared memory too
small or full) or a memory level that is off: the plain saver's arena and commit round,
as without the level.

Call sequence: as :class:`~pitstop.engine.saver.Saver`; ``async_save(..., durable=)``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pitstop._version import __version__
from pitstop.engine.collective import NodeCommit, commit_together, local_items
from pitstop.engine.handle import SaveHandle
from pitstop.engine.persist import PersistResult, encode_objects
from pitstop.engine.plan import SavePlan
from pitstop.engine.saver import Saver, _Meta
from pitstop.engine.stage import (
    Ring,
    StageJob,
    arena_tensor,
    pin_arena,
    stage,
    unpin_arena,
)
from pitstop.errors import CheckpointError, CheckpointExistsError, CheckpointIOError
from pitstop.format.manifest import Lineage
from pitstop.format.names import step_dir_name
from pitstop.io.arena import Arena
from pitstop.levels.keeper import newest_step, write_slot
from pitstop.levels.memory import record_for
from pitstop.levels.memory_level import MemoryLevel
from pitstop.levels.shm import STAGED, Slot, read_meta, seal
from pitstop.log import get_logger
from pitstop.options import SaveOptions
from pitstop.ranks.group import Group
from pitstop.state.tree import Flat, flatten
from pitstop.storage.base import Storage

__all__ = ["MemorySaver", "NoFreeSlotError"]

_log = get_logger("pitstop.levels")
_KEEPER_STALL_SECS = 10.0  # a keeper that answers no command this long (and 5x its slowest
# answer) is taken for hung and killed: this process seals and writes from then on
_SLOW_HASH_BPS = 250e6  # and 1 s more per 250 MB of a slot (a seal of a large state on a
# loaded host: hashing at 1-2 GB/s is usual, 250 MB/s is far below it)
_DURABLE_WAIT_SECS = 120.0  # a durable save waits this long for a slot the keeper frees
_SNAPSHOT_WAIT_SECS = 1.0  # a memory snapshot this long (then it is skipped): the loop waits
# for a keeper that falls behind rather than lose more than the step under way in a crash


class NoFreeSlotError(CheckpointError):
    """A memory snapshot found no free slot (the keeper is still sealing or writing the
    others): this snapshot is skipped; the next one is taken as usual."""


class LayoutChangedError(NoFreeSlotError):
    """Several ranks: this rank's state changed its layout since the last plan every rank
    agreed on, so a memory snapshot (planned alone) cannot be taken: the manager asks every
    rank for a durable save (which plans anew), then the snapshots go on."""


@dataclass
class _Durable:
    handle: SaveHandle
    slot: Slot
    directory: str
    t0: float
    t1: float
    report: bool = True  # its error is raised from the next call that waits


class MemorySaver(Saver):
    """See the module docstring."""

    def __init__(
        self,
        storage: Storage,
        options: SaveOptions,
        *,
        memory: MemoryLevel,
        on_commit: Any = None,
        group: Group | None = None,
        nodes: NodeCommit | None = None,
    ) -> None:
        super().__init__(storage, options, on_commit=on_commit, group=group, nodes=nodes)
        # the persist thread at normal priority: a memory snapshot is committed only once it
        # marks the slot staged (a small write), and a niced thread behind a busy training
        # loop lagged several steps; hashing and writing are the keeper's
        self._persist_pool.shutdown(wait=True)
        self._persist_pool = ThreadPoolExecutor(1, thread_name_prefix="pitstop-persist")
        self.memory = memory
        self._durable_next = True  # the mode of the save being started (training thread)
        self._step_next = 0
        self._slot_next: Slot | None = None  # the slot it stages into
        self._modes: dict[int, bool] = {}  # step -> durable, for the persist thread
        self._writing: dict[int, _Durable] = {}  # slot index -> a durable save being written
        self._here = ThreadPoolExecutor(1, thread_name_prefix="pitstop-memory")
        self._busy: set[int] = set()  # slot indices a commit round writes from (several ranks)
        self._rounds = ThreadPoolExecutor(1, thread_name_prefix="pitstop-persist-round")
        self._listener: threading.Thread | None = None
        self._stopping = False
        self._said_dead = False

    # ------------------------------------------------------------------ training thread
    def async_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        lineage: Lineage | None = None,
        metrics: Mapping[str, float] | None = None,
        durable: bool = True,
    ) -> SaveHandle:
        """As ``Saver.async_save``; ``durable=False``: a memory snapshot only (NoFreeSlotError
        when no slot is free: skipped)."""
        self._durable_next, self._step_next, self._slot_next = durable, step, None
        try:
            return super().async_save(step, state, lineage=lineage, metrics=metrics)
        finally:
            self._durable_next = True  # reserve() and the plain saver's calls plan as ever
            if self.memory.peers is not None:  # every rank's copies take the same rounds
                self.memory.peers.round(step, self._slot_next)

    def skip_snapshot(self, step: int) -> None:
        """Training thread: the memory snapshot of ``step`` is not taken (this rank's level is
        off): the partner copies' round of that step passes with nothing."""
        if self.memory.peers is not None:
            self.memory.peers.round(step, None)

    def _stage(
        self, flat: Flat, plan: SavePlan
    ) -> tuple[StageJob, SavePlan, Arena, Ring | None, float]:
        """Stage into a free slot (the slot is the arena); the plain arena when the memory
        level is off."""
        durable, step = self._durable_next, self._step_next
        t0 = time.perf_counter()
        if self._reserver is not None:
            self._reserver.join()

        def avoid() -> set[int]:  # the slots being written now (asked again while waiting)
            with self._cond:
                return set(self._writing) | self._busy

        if not self.memory.ready(plan.file_bytes, busy=avoid()):
            if not durable:
                raise NoFreeSlotError("the memory level is off", step=step, phase="stage")
            return super()._stage(flat, plan)
        assert self.memory.slots is not None
        if durable and all(s.nbytes < plan.file_bytes for s in self.memory.slots.slots):
            return super()._stage(flat, plan)  # the slots are still being made larger (the
            # only copies of their steps are kept until superseded): the plain arena's turn
        self._listen()
        wait = _DURABLE_WAIT_SECS if durable else 0.0
        need = plan.file_bytes
        slot = self.memory.begin(step, avoid=avoid, wait_secs=wait, nbytes=need)
        if slot is None:  # once the snapshots in flight are staged the older is superseded,
            self._settle_staging()  # and a slot the keeper is sealing is let go
            slot = self.memory.begin(step, avoid=avoid, wait_secs=_SNAPSHOT_WAIT_SECS, nbytes=need)
        if slot is None:
            raise NoFreeSlotError(
                "no memory slot is free (the keeper is still sealing or writing the others)"
                + (f" after {wait:.0f} s" if durable else ""), step=step, phase="stage",
            )  # fmt: skip
        waited = time.perf_counter() - t0
        try:
            buffer = arena_tensor(slot)  # type: ignore[arg-type]
            if any(t.is_cuda for t in flat.tensors.values()):
                pin_arena(slot, buffer)  # type: ignore[arg-type]
            self._hook_optimizers(flat.optimizers)
            job = stage(flat, plan, buffer, overlap=self.options.overlap, copier=self._stage_pool)
        except BaseException:
            assert self.memory.slots is not None
            self.memory.slots.abandon(slot)
            raise
        self._modes[step] = durable
        self._slot_next = slot
        return job, plan, slot, None, waited  # type: ignore[return-value]

    def _settle_staging(self, timeout_secs: float = 2.0) -> None:
        """Training thread: wait until no snapshot of this process is still being staged (the
        persist thread marks them staged right after their copy); True if there were some. A
        fast loop would otherwise find every slot busy (the newest committed, the newest
        staged awaiting its seal, the one in flight) and skip snapshots while the keeper
        seals: a crash then lost more than the step under way."""
        slots = self.memory.slots
        if slots is None or not slots.staging:
            return
        with self._cond:
            self._cond.wait_for(lambda: not slots.staging, timeout_secs)

    # ------------------------------------------------------------------ persist thread
    def _persist(
        self,
        handle: SaveHandle,
        job: StageJob,
        flat: Flat,
        plan: SavePlan,
        arena: Arena,
        directory: str,
        t0: float,
        meta: _Meta,
        ring: Ring | None = None,
    ) -> None:
        if not isinstance(arena, Slot):
            return super()._persist(handle, job, flat, plan, arena, directory, t0, meta, ring)
        slot, durable = arena, self._modes.pop(handle.step, True)
        t1 = time.perf_counter()
        error: BaseException | None = None
        writing = staged = False
        try:
            objects = encode_objects(flat.tree, rank=self.group.rank)
            job.wait_copied()
            handle.stats.stage_secs = (job.copied_at or time.perf_counter()) - t0
            handle._set_staged()
            with self._cond:
                self._staging = [j for j in self._staging if j is not job]
            library = {"pitstop": __version__, "torch": sys.modules["torch"].__version__}
            record = record_for(
                plan, handle.step, rank=self.group.rank, world_size=self.group.size,
                algorithm=self.algorithm, lineage=meta.lineage, metrics=meta.metrics,
                library=library,
            )  # fmt: skip
            assert self.memory.slots is not None
            try:
                self.memory.slots.staged(slot, record, objects, plan.file_bytes)
            except OSError as e:  # shared memory full (ShmSpaceError) or gone
                self.memory.off(f"its slot could not be written ({e})")
                if not durable:
                    raise
                return self._persist_plain(handle, job, flat, plan, slot, directory, t0, meta)
            staged = True
            with self._cond:
                self._cond.notify_all()  # _settle_staging
            if durable and self.group.size > 1:  # every rank's files, one commit round
                self.memory.seal(slot, self._here)
                with self._cond:
                    self._busy.add(slot.index)
                self._rounds.submit(self._persist_round, handle, job, flat, plan, slot,
                                    directory, t0, meta)  # fmt: skip
                return
            if durable:
                with self._cond:
                    self._writing[slot.index] = _Durable(handle, slot, directory, t0, t1)
                writing = True
                if not self.memory.request_persist(slot):
                    self._here.submit(self._write_here, slot.index)
            else:
                self.memory.seal(slot, self._here)
        except BaseException as e:
            error = e
            job.settle()
            if not staged and self.memory.slots is not None:  # the slot is free again
                with contextlib.suppress(Exception):
                    self.memory.slots.abandon(slot)
                with self._cond:
                    self._cond.notify_all()
            if writing:
                with self._cond:
                    self._writing.pop(slot.index, None)
                writing = False
        finally:
            with self._cond:
                self._staging = [j for j in self._staging if j is not job]
        if writing:
            return  # the keeper's report (or the in-process write) finishes it
        handle.stats.persist_secs = time.perf_counter() - t1
        handle.stats.total_secs = time.perf_counter() - t0
        if error is not None and not durable:  # a lost memory snapshot: said, never raised
            _log.warning("memory snapshot of step %d not taken: %r", handle.step, error,
                         phase="stage")  # fmt: skip
        self._finish(handle, error, report=durable)

    def _persist_plain(
        self,
        handle: SaveHandle,
        job: StageJob,
        flat: Flat,
        plan: SavePlan,
        slot: Slot,
        directory: str,
        t0: float,
        meta: _Meta,
    ) -> None:
        """A durable save whose slot could not be marked staged: written from the slot's
        data (complete: the copy is done) by the plain persist and commit round, as
        without the level; the slot is not kept as an arena."""
        assert self.memory.slots is not None
        with contextlib.suppress(Exception):
            self.memory.slots.abandon(slot)
        with self._cond:
            self._cond.notify_all()
        super()._persist(handle, job, flat, plan, slot, directory, t0, meta)  # type: ignore[arg-type]

    def _persist_round(
        self,
        handle: SaveHandle,
        job: StageJob,
        flat: Flat,
        plan: SavePlan,
        slot: Slot,
        directory: str,
        t0: float,
        meta: _Meta,
    ) -> None:
        """Several ranks: a durable save is every rank's part of one step directory, so it
        is written by the save's commit round (this process's writers, from the slot: the
        slot is the arena), not by the keeper, which seals the slot meanwhile. The slot
        stays out of ``begin`` until the round ends. Its own thread: the persist thread
        goes on marking memory snapshots staged."""
        try:
            super()._persist(handle, job, flat, plan, slot, directory, t0, meta)  # type: ignore[arg-type]
        finally:
            with self._cond:
                self._busy.discard(slot.index)
                self._cond.notify_all()

    def _plan(
        self,
        state: Mapping[str, Any],
        check: Any = None,
        step: int | None = None,
    ) -> tuple[Flat, SavePlan]:
        """As ``Saver._plan``; under torch.distributed a memory snapshot plans alone (no rank
        waits for another: a rank whose slots are busy skips its snapshot, the others do
        not): the plan of the last save, if this rank's layout is unchanged since; the
        restart joins only parts of one plan (``plan_id``)."""
        if self._durable_next or self.group.size == 1:
            return super()._plan(state, check, step)
        flat = flatten(state, allow_pickle=self.options.allow_pickle)
        digest = self._digest(local_items(flat, overlap=self.options.overlap))
        plan = self._plans.newest
        if plan is None or plan.signature[self.group.rank] != digest:
            raise LayoutChangedError(
                "the state's layout changed since the last save (a memory snapshot uses the "
                "plan every rank agreed on; the next save makes a new one)", step=step,
                phase="plan",
            )  # fmt: skip
        return flat, plan

    def _in_round(self) -> bool:
        """A memory snapshot takes no commit round: it is not counted (under torch.distributed
        a rank may skip one the others take; the rounds of durable saves stay numbered alike)."""
        return self._durable_next

    def _fail_together(self, directory: str, error: BaseException) -> None:
        """A memory snapshot has no commit round to take part in (no rank waits for it)."""
        if self._durable_next:
            super()._fail_together(directory, error)

    def _release_arena(self, arena: Arena) -> None:
        """A slot is never one of the plain arenas (``_persist_plain`` writes from one)."""
        if not isinstance(arena, Slot):
            super()._release_arena(arena)

    def _written(self, index: int, error: BaseException | None) -> None:
        """A durable save's slot was written to the next level (or failed): the commit's
        bookkeeping (flushes, retention) runs, then its handle is done."""
        with self._cond:
            d = self._writing.pop(index, None)
        if d is None:
            return
        stats = d.handle.stats
        if error is None:
            try:
                manifest = self.storage.read_manifest(d.directory)
                self.nodes.replicate(d.directory, manifest)
                self.nodes.decided(self.nodes.decide())
            except Exception as e:
                error = e
        stats.persist_secs = time.perf_counter() - d.t1
        stats.total_secs = time.perf_counter() - d.t0
        if error is None:
            _log.info("checkpoint step=%d written from memory to %s in %.3f s", d.handle.step,
                      self.storage.url, stats.persist_secs, phase="commit")  # fmt: skip
            if self._on_commit is not None:
                try:
                    self._on_commit(d.handle.step)
                except Exception as e:
                    _log.warning("retention after step %d failed: %r", d.handle.step, e,
                                 phase="gc")  # fmt: skip
        self._finish(d.handle, error, report=d.report)

    def _write_here(self, index: int) -> None:
        """Seal and write a durable save's slot from this process (no keeper, or it died)."""
        with self._cond:
            d = self._writing.get(index)
        if d is None:
            return
        try:
            written = self.memory.persist_here(d.slot, self.io_pool)
            error: BaseException | None = None
            if written is None:
                error = CheckpointExistsError(
                    f"step {d.handle.step} not written to {self.storage.url}: it holds that "
                    "step or a newer one", step=d.handle.step, phase="commit",
                )  # fmt: skip
        except BaseException as e:
            error = e
        self._written(index, error)

    # ------------------------------------------------------------------ keeper events
    def _listen(self) -> None:
        """Start the thread that reads the keeper's reports (once, when it runs)."""
        if self._listener is not None or self.memory.keeper is None:
            return
        self._listener = threading.Thread(
            target=self._events, name="pitstop-keeper-events", daemon=True
        )
        self._listener.start()

    def _events(self) -> None:
        keeper = self.memory.keeper
        assert keeper is not None
        while True:
            try:
                events = keeper.next_events(0.2)
            except (EOFError, OSError, ValueError):
                break
            for e in events:
                self._event(e)
            if self._stopping and not self._writing:
                return
            waited = keeper.stalled(_KEEPER_STALL_SECS + self._slot_bytes() / _SLOW_HASH_BPS)
            if waited is not None:  # stopped or hung: it would hold its slots for ever
                _log.warning(
                    "the memory level's keeper (pid %d) has not answered for %.0f s: it is "
                    "killed", keeper.pid, waited, phase="persist",
                )  # fmt: skip
                keeper.proc.kill()  # its flocks go with it; the EOF follows
        if not self._stopping:
            self._keeper_died()

    def _slot_bytes(self) -> int:
        """The largest slot's data bytes (0: none yet)."""
        slots = self.memory.slots
        return max((s.nbytes for s in slots.slots), default=0) if slots is not None else 0

    def _event(self, e: dict[str, Any]) -> None:
        kind, index, step = e.get("event"), e.get("slot"), e.get("step")
        if not isinstance(index, int):
            return
        with self._cond:
            d = self._writing.get(index)
        if kind == "error" and (d is None or e.get("op") != "persist"):
            _log.warning("memory snapshot in slot %d: the keeper reported %s", index,
                         e.get("message"), phase="commit")  # fmt: skip
        if d is None or kind not in ("persisted", "skipped", "error"):
            return
        if kind != "error" and step != d.handle.step:  # never waited for for ever
            self._written(index, CheckpointError(
                f"slot {index} held step {step}, not step {d.handle.step}, when the keeper "
                "wrote it; not written", step=d.handle.step, phase="persist",
            ))  # fmt: skip
        elif kind == "persisted":
            self._written(index, None)
        elif kind == "skipped":
            self._written(index, CheckpointExistsError(
                f"step {step} not written to {self.storage.url}: {e.get('why')}",
                step=step, phase="commit",
            ))  # fmt: skip
        elif e.get("op") == "persist":
            self._written(index, CheckpointIOError(
                f"the keeper could not write step {d.handle.step} to {self.storage.url}: "
                f"{e.get('message')}", step=d.handle.step, path=self.storage.url, phase="persist",
            ))  # fmt: skip

    def _keeper_died(self) -> None:
        """The keeper is gone: said once; what it was writing is written from here, and from
        now on this process seals and writes."""
        if not self._said_dead:
            self._said_dead = True
            code: Any = None
            if self.memory.keeper is not None:
                with contextlib.suppress(Exception):
                    code = self.memory.keeper.proc.wait(1.0)
            code = "unknown" if code is None else code
            _log.warning(
                "the memory level's keeper ended (exit %s): training goes on, sealing and "
                "writing in the training process", code, phase="persist",
            )  # fmt: skip
        self.memory.keeper_gone()
        with self._cond:
            pending = list(self._writing)
        for index in pending:
            self._here.submit(self._write_here, index)

    # ------------------------------------------------------------------ arenas
    def reserve_async(self, state: Mapping[str, Any]) -> None:
        """The slots are the arenas: made in the background at the first ``step()``."""
        if self._reserver is not None or self._closed:
            return
        if not self.memory.active:  # no memory level: the plain arena, as without it
            return super().reserve_async(state)
        _, plan = self._plan(state)

        def run() -> None:
            with contextlib.suppress(Exception):  # the first save says why, if it fails
                self.memory.ready(plan.file_bytes)

        self._reserver = threading.Thread(target=run, name="pitstop-reserve", daemon=True)
        self._reserver.start()

    def reserve(self, state: Mapping[str, Any]) -> int:
        """Make the slots now; their bytes (the plain arena's when the level is off)."""
        if self._reserver is not None:
            self._reserver.join()  # one maker of the slots at a time
        _, plan = self._plan(state)
        if self.memory.ready(plan.file_bytes):
            assert self.memory.slots is not None
            return sum(s.nbytes for s in self.memory.slots.slots)
        return super().reserve(state)

    # ------------------------------------------------------------------ end
    def write_newest(self, timeout_secs: float = 300.0) -> bool:
        """Training thread, at a clean end: the newest memory snapshot is written to the next
        level unless that level holds it (the memory level's snapshots go with the job).
        False if it could not be: it is nowhere else, its segments must stay."""
        self.wait_all()
        slots = self.memory.slots
        if self.group.size > 1 and self.memory.listed:
            return self._write_newest_together(slots)
        if slots is None or not self.memory.active:
            return True
        self._seal_newest(slots)
        newest = slots.newest()
        if newest is None or newest[1].step is None:
            return True
        slot, step = newest[0], newest[1].step
        directory = step_dir_name(step)
        if self.storage.has_manifest(directory):
            return True
        handle = SaveHandle(step)
        now = time.perf_counter()
        with self._cond:
            self._inflight[step] = handle
            self._writing[slot.index] = _Durable(handle, slot, directory, now, now, False)
        if not self.memory.request_persist(slot):
            self._here.submit(self._write_here, slot.index)
        try:
            handle.wait(timeout_secs)
        except CheckpointExistsError:
            pass  # the next level holds it, or a newer step
        except Exception as e:
            _log.warning("the newest memory snapshot (step %d) was not written to %s: %r",
                         step, self.storage.url, e, phase="persist")  # fmt: skip
            return False
        return True

    @staticmethod
    def _seal_newest(slots: Any) -> None:
        """A staged snapshot newer than every committed one is sealed (here, unless the
        keeper is sealing it: then waited for, up to 10 s)."""
        deadline = time.monotonic() + 10.0
        while (s := slots.newest(STAGED)) is not None and time.monotonic() < deadline:
            c = slots.newest()
            if c is not None and c[1].gen > s[1].gen:
                break
            if seal(s[0]) is None:  # the keeper is sealing it: wait for it
                time.sleep(0.01)

    def _write_newest_together(self, slots: Any) -> bool:
        """Several ranks (collective): the newest step every rank holds in memory is written
        to the next level by a commit round from the slots (each rank writes its part,
        checked against the joined manifest as it goes), unless a node of that level holds
        it already. A failure is said, never raised; False then (the segments stay)."""
        mine: dict[str, tuple[int, bytes]] = {}
        if slots is not None and self.memory.active:
            self._seal_newest(slots)
            mine = self.memory.slot_storage.parts()
        newest = self.memory.joined_steps(mine, "commit", newest_only=True)
        try:
            there = newest_step(self.storage)  # this node's copy of the level
        except CheckpointError:
            there = None
        if not newest:
            if mine and there is not None:
                _log.warning("no memory snapshot newer than step %d (the next level's newest) "
                             "is held by every rank: nothing is written from memory at the "
                             "end", there, phase="persist")  # fmt: skip
            return True
        ((directory, manifest),) = newest.items()
        held = self.group.all_gather(there is not None and there >= manifest.step, "commit")
        if any(held):  # a node holds it, or a newer step
            return True
        self._seq += 1
        rank = self.group.rank

        def write() -> PersistResult:
            t0 = time.perf_counter()
            slot, head = self.memory.slot_storage.slot_of(directory)
            if not slot.try_lock(exclusive=False):
                raise CheckpointError(f"memory slot {slot.index} is being staged into",
                                      step=manifest.step, phase="persist")  # fmt: skip
            try:
                objects = read_meta(slot, head)[1]
                n = write_slot(slot, head, manifest, objects, self.storage, directory,
                               pool=self.io_pool)  # fmt: skip
            finally:
                slot.unlock()
            return PersistResult(
                files=tuple(f for f in manifest.files if f.rank == rank),
                tensors=tuple(t for t in manifest.tensors if t.rank == rank), nbytes=n,
                write_secs=time.perf_counter() - t0, direct=False,
            )  # fmt: skip

        try:
            commit_together(self.group, self.storage, directory, self._seq, write,
                            lambda results, hosts: manifest.dumps(), self.nodes)  # fmt: skip
        except Exception as e:
            self._abort(directory)
            _log.warning("the newest memory snapshot (step %d) was not written to %s: %r",
                         manifest.step, self.storage.url, e, phase="persist")  # fmt: skip
            return False
        _log.info("checkpoint step=%d written from memory to %s at the end", manifest.step,
                  self.storage.url, phase="commit")  # fmt: skip
        if self._on_commit is not None:
            try:
                self._on_commit(manifest.step)
            except Exception as e:
                _log.warning("retention after step %d failed: %r", manifest.step, e, phase="gc")
        return True

    def close(self) -> None:
        """As ``Saver.close``, then the keeper's report thread and the in-process pool."""
        try:
            super().close()
        finally:
            slots = self.memory.slots
            for slot in slots.slots if slots is not None else []:
                if slot.pinned and not slot.closed:  # page-locked for CUDA copies
                    unpin_arena(slot, arena_tensor(slot))  # type: ignore[arg-type]
            self._stopping = True
            if self._listener is not None:
                self._listener.join(timeout=5.0)
            self._here.shutdown(wait=True)
            self._rounds.shutdown(wait=True)
