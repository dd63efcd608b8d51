"""A job of several ranks on one node whose trainers are all dead: its newest whole memory
step, written to the next level by a keeper. No torch.

Under several ranks a slot holds one rank's part of a step (its files and its part of the
manifest), never written alone: a step of several ranks is whole only with every rank's
part. When every rank of the job runs on one node, that node's shared memory holds every
part; once every rank's training process has died (SIGKILL included), a keeper that sees
it seals what the trainers left staged, joins the parts of the newest step every rank
holds (:func:`pitstop.format.manifest.join_parts`: checked like any manifest), writes each
rank's files from its slot, verifying every checksum segment as it is written, and commits
the joined manifest last: the step a restart would have taken from memory, now on the
next level too. A job across nodes has no process that sees every part: its snapshots wait
in memory (``Memory(linger_secs=)``) for a restart, as before.

Call sequence: the per-rank keeper of rank 0 (:mod:`pitstop.levels.keeper`: when its trainer
dies and while it lingers) or the launcher's keeper (:mod:`pitstop.levels.keeper_watch`:
when it has seen every rank die) calls :func:`trainers_dead`, then :func:`persist_joined`;
``pitstop gc`` calls :func:`persist_newest` for a dead job before it removes the job's
segments (one process or several ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Executor

from pitstop.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from pitstop.faults import killpoint
from pitstop.format.manifest import Manifest, join_parts
from pitstop.format.names import step_dir_name
from pitstop.io.locks import pid_alive
from pitstop.levels.keeper import newest_step, persist_slot, write_slot
from pitstop.levels.shm import (
    COMMITTED,
    STAGED,
    Slot,
    SlotHeader,
    iter_slots,
    lock_name,
    open_slot,
    read_meta,
    seal,
)
from pitstop.levels.shm_clean import job_slots, remove_rank_if_dead
from pitstop.storage.base import Storage

__all__ = [
    "owner_pid", "persist_joined", "persist_newest", "remove_dead_parts", "seal_newest_staged",
    "slot_world", "trainers_dead",
]  # fmt: skip


def owner_pid(directory: str, job: str, rank: int) -> int | None:
    """The pid the rank's lock file names (the training process that owns its slots)."""
    try:
        with open(os.path.join(directory, lock_name(job, rank)), "rb") as f:
            owner = json.loads(f.read(512).strip() or b"{}")
    except (OSError, ValueError):
        return None
    pid = owner.get("pid") if isinstance(owner, dict) else None
    return pid if isinstance(pid, int) and pid > 0 else None


def slot_world(slot: Slot, head: SlotHeader) -> int:
    """The world size of the job that staged ``slot`` (its record's); 0 if unreadable."""
    try:
        record = json.loads(read_meta(slot, head)[0])
        return int(record.get("world_size", 1))
    except Exception:
        return 0


def trainers_dead(directory: str, job: str, world: int) -> bool:
    """Whether no rank of ``job`` (a world of ``world``) has a living training process:
    each rank's lock file names none, or one that is gone."""
    for rank in range(world):
        pid = owner_pid(directory, job, rank)
        if pid is not None and pid_alive(pid):
            return False
    return True


def persist_joined(
    directory: str,
    job: str,
    world: int,
    storage: Storage,
    *,
    pool: Executor,
    hashers: Executor,
    seal_wait_secs: float = 30.0,
) -> tuple[int | None, str]:
    """Write the newest step every rank of ``job`` holds in ``directory`` to ``storage``
    unless it holds that step or a newer one. Call it once every trainer is dead
    (:func:`trainers_dead`). Returns (the newest whole step, or None; what was done)."""
    ranks: list[list[tuple[Slot, SlotHeader]]] = []
    try:
        for rank in range(world):
            mapped = _mapped(directory, job, rank)
            ranks.append(mapped)
            if not mapped:
                return None, f"rank {rank}'s memory snapshots are not on this node"
            seal_newest_staged(mapped, hashers, seal_wait_secs)
        held = newest_step(storage)
        damaged: list[str] = []
        for step, manifest, chosen in _whole_steps(ranks):  # newest first
            if held is not None and held >= step:
                return step, f"the next level holds step {held}" + _said(damaged)
            try:
                wrote, what = _write(step, manifest, chosen, storage, pool)
                return wrote, what + _said(damaged)
            except CorruptCheckpointError as e:  # a damaged part: the next older step
                damaged.append(f"step {step}: {e}")
        return None, "no step every rank holds" + _said(damaged)
    finally:
        for mapped in ranks:
            for slot, _ in mapped:
                slot.close()


def persist_newest(
    directory: str,
    job: str,
    storage: Storage,
    *,
    pool: Executor,
    hashers: Executor,
    seal_wait_secs: float = 5.0,
) -> tuple[int | None, str]:
    """A dead job's newest memory step to ``storage`` unless it holds that step or a newer
    one: a one-process job's newest snapshot (a staged one sealed first), or the newest
    step every rank of a job of several ranks holds in ``directory``
    (:func:`persist_joined`). Returns (that step, or None; what was done)."""
    mapped = _mapped(directory, job, 0)
    try:
        live = [(h.gen, slot_world(s, h)) for s, h in mapped if h.state in (STAGED, COMMITTED)]
        if not live:
            return None, "no memory snapshot"
        world = max(live)[1]
        if world > 1:
            return persist_joined(directory, job, world, storage, pool=pool, hashers=hashers,
                                  seal_wait_secs=seal_wait_secs)  # fmt: skip
        seal_newest_staged(mapped, hashers, seal_wait_secs)
        held, damaged = newest_step(storage), list[str]()
        for _, i in sorted(((h.gen, i) for i, (_, h) in enumerate(mapped)
                            if h.state == COMMITTED and h.step is not None), reverse=True):  # fmt: skip
            slot, head = mapped[i]
            assert head.step is not None
            if held is not None and held >= head.step:
                return head.step, f"the next level holds step {held}" + _said(damaged)
            try:
                done = persist_slot(slot, storage, pool=pool)
            except CorruptCheckpointError as e:  # damaged: the next older snapshot
                damaged.append(f"step {head.step}: {e}")
                continue
            return head.step, ("written" if done is not None else "in use") + _said(damaged)
        return None, "no committed memory snapshot" + _said(damaged)
    finally:
        for slot, _ in mapped:
            slot.close()


def remove_dead_parts(directory: str, job: str, world: int, storage: Storage) -> list[str]:
    """Rank 0's keeper at its end: the segments of the job's other ranks whose processes are
    all gone (their keepers left them: the newest step was not on the next level yet when
    they were told to go) and whose newest snapshot the next level now holds; the names
    removed."""
    held = newest_step(storage)
    if held is None:
        return []
    newest: dict[int, int] = {}
    for h in job_slots(directory, job):
        if h.rank and h.step is not None and h.state in (STAGED, COMMITTED):
            newest[h.rank] = max(newest.get(h.rank, -1), h.step)
    out = []
    for rank in range(1, world):
        if rank in newest and newest[rank] <= held:
            out += remove_rank_if_dead(directory, job, rank)
    return out


def _mapped(directory: str, job: str, rank: int) -> list[tuple[Slot, SlotHeader]]:
    out = []
    for path in iter_slots(directory, job, rank):
        try:
            slot = open_slot(path, job=job, rank=rank, populate=False)
        except (OSError, ValueError, CheckpointError):
            continue  # removed, torn or not this job's: not a slot of it
        head = slot.header()
        if head is None:
            slot.close()
            continue
        out.append((slot, head))
    return out


def seal_newest_staged(
    mapped: list[tuple[Slot, SlotHeader]], hashers: Executor, wait: float
) -> None:
    """Seal the rank's newest staged snapshot if it is newer than its committed ones (the
    trainer died before its keeper sealed it); one that another process holds (that rank's
    keeper, sealing it) is waited for, up to ``wait`` seconds."""
    top = max((h.gen for _, h in mapped if h.state == COMMITTED), default=-1)
    staged = [(h.gen, i) for i, (_, h) in enumerate(mapped) if h.state == STAGED and h.gen > top]
    if not staged:
        return
    i = max(staged)[1]
    slot = mapped[i][0]
    deadline = time.monotonic() + wait
    while True:
        with contextlib.suppress(Exception):  # damaged: its older committed step serves
            seal(slot, pool=hashers)
        head = slot.header()
        if head is None or head.state != STAGED or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if head is not None:
        mapped[i] = (slot, head)


def _said(damaged: list[str]) -> str:
    return f" (passed over, damaged: {'; '.join(damaged)})" if damaged else ""


def _whole_steps(
    ranks: list[list[tuple[Slot, SlotHeader]]],
) -> Iterator[tuple[int, Manifest, list[tuple[Slot, SlotHeader, bytes]]]]:
    """The steps whose committed parts every rank holds and that join, newest first: (step,
    the joined manifest, each rank's slot, header and objects)."""
    parts: list[dict[int, tuple[Slot, SlotHeader, bytes, bytes]]] = []
    for mapped in ranks:
        mine: dict[int, tuple[Slot, SlotHeader, bytes, bytes]] = {}
        for slot, head in mapped:
            if head.state != COMMITTED or head.step is None:
                continue
            with contextlib.suppress(CheckpointError):  # damaged metadata: not a part
                _, objects, part = read_meta(slot, head)
                if head.step not in mine or head.gen > mine[head.step][1].gen:
                    mine[head.step] = (slot, head, objects, part)
        parts.append(mine)
    common = set.intersection(*(set(p) for p in parts))
    for step in sorted(common, reverse=True):
        try:
            manifest = join_parts([p[step][3] for p in parts], path=f"memory step {step}")
        except CheckpointError:
            continue  # parts of different timelines or plans: not one step
        yield step, manifest, [p[step][:3] for p in parts]


def _write(
    step: int,
    manifest: Manifest,
    chosen: list[tuple[Slot, SlotHeader, bytes]],
    storage: Storage,
    pool: Executor,
) -> tuple[int | None, str]:
    pinned: list[Slot] = []
    try:
        for slot, head, _ in chosen:  # pinned (flock shared): a restart does not stage into it
            if not slot.try_lock(exclusive=False):
                return None, f"the slot of step {step} is in use"
            pinned.append(slot)
            now = slot.header()
            if now is None or now.state != COMMITTED or now.gen != head.gen:
                return None, f"the slot of step {step} was reused"
        name = step_dir_name(step)
        try:
            storage.prepare(name)
        except CheckpointExistsError:
            return step, "written already"
        try:
            for slot, head, objects in chosen:
                write_slot(slot, head, manifest, objects, storage, name, pool=pool)
            killpoint("keeper.persist")  # every rank's files written, not committed
            storage.commit(name, manifest.dumps())
        except BaseException:
            storage.abort(name)
            raise
        return step, "written"
    finally:
        for slot in pinned:
            slot.unlock()
