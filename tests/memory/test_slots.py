"""Shared-memory slots in one process: commit, torn headers, two slots in turn, damage,
two jobs, stale segments, too little shared memory."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
import torch

from pitstop.engine.catalog import Catalog
from pitstop.engine.verify import verify_checkpoint
from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.names import step_dir_name
from pitstop.levels.memory import SlotStorage, plan_state, restore_from_memory, stage_into
from pitstop.levels.shm import (
    COMMITTED,
    DATA_OFFSET,
    HEADER_PAGE,
    META_RESERVE,
    SHM_DIR,
    STAGED,
    STAGING,
    ShmSpaceError,
    SlotSet,
    lock_name,
    new_job_token,
    open_slot,
    remove_stale,
    seal,
    segment_names,
)

from .conftest import assert_same, dead_job, small_state


def _slots(job: str, count: int = 2) -> SlotSet:
    _, plan = plan_state(small_state())
    return SlotSet.create(job, data_bytes=plan.file_bytes, count=count)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _restore(
    job: str, seed: int = 99
) -> tuple[int | None, dict[str, object], list[tuple[str, str]]]:
    into = small_state(seed)
    with SlotStorage(SHM_DIR, job) as storage:
        result = restore_from_memory(storage, into)
    return result.step, into, result.skipped


def test_staged_is_not_committed_until_sealed(job: str) -> None:
    slots = _slots(job)
    try:
        state = small_state(1)
        slot = stage_into(slots, 7, state)
        assert slot is not None
        head = slot.header()
        assert head is not None and head.state == STAGED and head.step == 7
        assert _restore(job)[0] is None  # staged: no checkpoint yet
        committed = seal(slot)
        assert committed is not None and committed.state == COMMITTED
        step, into, _ = _restore(job)
        assert step == 7
        assert_same(state, into)
        assert seal(slot) is None  # already committed: nothing to do
    finally:
        slots.close(unlink=True)


def test_two_slots_in_turn_keep_the_newest_committed_intact(job: str) -> None:
    slots = _slots(job)
    try:
        states = {s: small_state(s) for s in (1, 2, 3)}
        first = stage_into(slots, 1, states[1])
        assert first is not None and seal(first) is not None
        second = slots.begin(2)  # staging: the committed slot is not the one
        assert second is not None and second.index != first.index
        h = second.header()
        assert h is not None and h.state == STAGING
        step, into, _ = _restore(job)  # step 1 still loads while 2 is being staged
        assert step == 1
        assert_same(states[1], into)
        slots.abandon(second)
        second = stage_into(slots, 2, states[2])
        assert second is not None and second.index != first.index and seal(second)
        third = stage_into(slots, 3, states[3])
        assert third is not None and third.index == first.index  # the older one is reused
        assert _restore(job)[0] == 2  # step 3 staged, not sealed: 2 is the newest
        assert seal(third) is not None
        step, into, _ = _restore(job)
        assert step == 3
        assert_same(states[3], into)
        newest = slots.newest()
        assert newest is not None and newest[1].step == 3
    finally:
        slots.close(unlink=True)


def test_a_torn_header_reads_as_not_committed(job: str) -> None:
    slots = _slots(job)
    try:
        slot = stage_into(slots, 4, small_state(4))
        assert slot is not None
        committed = seal(slot)
        assert committed is not None
        # tear the page the commit was written to: the one before it (staged) is current
        _flip(slot.path, (committed.seq % 2) * HEADER_PAGE + 40)
        head = slot.header()
        assert head is not None and head.state == STAGED and head.step == 4
        assert _restore(job)[0] is None
        _flip(slot.path, ((committed.seq + 1) % 2) * HEADER_PAGE + 40)  # both torn: no header
        assert slot.header() is None
        assert slots.begin(5) is not None  # a slot without a header is free to reuse
    finally:
        slots.close(unlink=True)


def test_a_flipped_data_byte_is_damage_and_the_older_slot_serves(job: str) -> None:
    slots = _slots(job)
    try:
        old, new = small_state(1), small_state(2)
        a = stage_into(slots, 1, old)
        assert a is not None and seal(a)
        b = stage_into(slots, 2, new)
        assert b is not None and seal(b)
        _flip(b.path, DATA_OFFSET + 100)
        with SlotStorage(SHM_DIR, job) as storage:
            entry = next(e for e in Catalog(storage).committed() if e.step == 2)
            assert entry.manifest is not None
            report = verify_checkpoint(storage, entry.name, entry.manifest)
            assert not report.ok and "checksum" in report.problems[0]
        step, into, skipped = _restore(job)
        assert step == 1  # the damaged newer slot was skipped, the older one loaded
        assert_same(old, into)
        assert skipped and skipped[0][0] == step_dir_name(2) and "damaged" in skipped[0][1]
    finally:
        slots.close(unlink=True)


def test_a_damaged_slot_alone_raises_corrupt_through_load_entry(job: str) -> None:
    from pitstop.engine.restore import load_entry
    from pitstop.levels.memory import _NullSaver

    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None and seal(a)
        _flip(a.path, DATA_OFFSET + 5)
        with SlotStorage(SHM_DIR, job) as storage:
            (entry,) = Catalog(storage).committed()
            with pytest.raises(CorruptCheckpointError):
                load_entry(storage, entry, small_state(9), saver=_NullSaver, allow_pickle=False)  # type: ignore[arg-type]
        step, _, skipped = _restore(job)
        assert step is None and skipped  # the caller goes on to the next level
    finally:
        slots.close(unlink=True)


def test_damaged_slot_metadata_is_damage(job: str) -> None:
    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None
        committed = seal(a)
        assert committed is not None
        _flip(a.path, committed.meta_offset + committed.record_bytes + 3)  # the objects file
        with SlotStorage(SHM_DIR, job) as storage:
            (entry,) = Catalog(storage).scan()
            assert entry.status == "damaged"
        assert _restore(job)[0] is None
    finally:
        slots.close(unlink=True)


def test_two_jobs_never_open_each_others_segments(job: str, shm_dir: str) -> None:
    other = "t" + new_job_token()
    _, plan = plan_state(small_state())
    mine = SlotSet.create(job, data_bytes=plan.file_bytes, directory=shm_dir)
    theirs = SlotSet.create(other, data_bytes=plan.file_bytes, directory=shm_dir)
    try:
        a = stage_into(mine, 1, small_state(1))
        b = stage_into(theirs, 2, small_state(2))
        assert a is not None and b is not None and seal(a) and seal(b)
        with SlotStorage(shm_dir, job) as storage:
            assert storage.entries() == [step_dir_name(1)]
        with pytest.raises(CheckpointError, match="not a slot of job"):
            open_slot(b.path, job=job, rank=0)
        assert remove_stale(shm_dir) == []  # both alive
        assert all(other not in n for n in segment_names(shm_dir, job))
    finally:
        mine.close(unlink=True)
        theirs.close(unlink=True)


@pytest.mark.fault
def test_stale_segments_of_a_dead_process_are_removed(job: str, shm_dir: str) -> None:
    dead, left = dead_job(shm_dir)
    alive = SlotSet.create(job, data_bytes=8192, directory=shm_dir)
    try:
        assert sorted(remove_stale(shm_dir)) == left
        assert not segment_names(shm_dir, dead)
        assert len(segment_names(shm_dir, job)) == 3  # this living job's are kept
    finally:
        alive.close(unlink=True)


def test_without_a_lock_file_the_owner_pid_and_boot_decide(job: str, shm_dir: str) -> None:
    from dataclasses import replace

    from pitstop.levels.shm import write_header

    slots = SlotSet.create(job, data_bytes=8192, directory=shm_dir)
    try:
        os.unlink(os.path.join(shm_dir, lock_name(job, 0)))  # (removed by hand)
        assert remove_stale(shm_dir) == []  # its owner (this process) is alive, this boot
        for slot in slots.slots:
            head = slot.header()
            assert head is not None
            write_header(slot.fd, replace(head, boot="another-boot", seq=head.seq + 1))
        assert len(remove_stale(shm_dir)) == 2  # a live pid of another boot is no owner
        assert not segment_names(shm_dir, job)
    finally:
        slots.close(unlink=True)


def test_a_held_lock_is_never_stale_whatever_it_says(job: str, shm_dir: str) -> None:
    slots = SlotSet.create(job, data_bytes=8192, directory=shm_dir)
    try:
        path = os.path.join(shm_dir, lock_name(job, 0))
        with open(path, "r+b") as f:
            f.write(b'{"job": "x", "host": "h", "pid": 1, "boot": "another-boot"}'.ljust(512))
        assert remove_stale(shm_dir) == []
    finally:
        slots.close(unlink=True)


def test_too_little_shared_memory_is_said_at_allocation(job: str) -> None:
    with pytest.raises(ShmSpaceError, match="exceeds the limit") as info:
        SlotSet.create(job, data_bytes=1 << 20, limit_bytes=(DATA_OFFSET + (1 << 20)) * 2 - 1)
    assert info.value.path is not None and job in info.value.path
    assert not segment_names(SHM_DIR, job)


@pytest.fixture
def tiny_tmpfs() -> Iterator[str]:
    """A 4 MiB tmpfs (needs root and mount; else the test is skipped)."""
    where = tempfile.mkdtemp(prefix="pitstop-tiny-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", where], capture_output=True
    )
    if mounted.returncode != 0:
        os.rmdir(where)
        pytest.skip("cannot mount a tmpfs here")
    yield where
    subprocess.run(["umount", where], check=True)
    os.rmdir(where)


def test_a_full_tmpfs_is_said_at_allocation_not_a_sigbus(tiny_tmpfs: str) -> None:
    job = "t" + new_job_token()
    with pytest.raises(ShmSpaceError, match="cannot reserve") as info:
        SlotSet.create(job, data_bytes=2 << 20, directory=tiny_tmpfs)  # 2 x 4 MiB > 4 MiB
    whole = DATA_OFFSET + (2 << 20) + META_RESERVE  # data and room for the metadata
    assert str(whole) in str(info.value) and tiny_tmpfs in str(info.value)
    assert os.listdir(tiny_tmpfs) == []


def test_a_pinned_slot_is_not_staged_into(job: str) -> None:
    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None and seal(a)
        b = stage_into(slots, 2, small_state(2))
        assert b is not None and seal(b)
        with SlotStorage(SHM_DIR, job) as storage:
            pin = storage.lock(step_dir_name(1), exclusive=False)  # a reader holds step 1
            assert pin is not None
            assert slots.begin(3) is None  # step 2 is the newest, step 1 is pinned
            pin.release()
            c = slots.begin(3)
            assert c is not None and c.index == a.index
            slots.abandon(c)
    finally:
        slots.close(unlink=True)


def test_a_slot_is_arena_like_and_the_view_is_the_data_file(job: str) -> None:
    state = small_state(5)
    slots = _slots(job)
    try:
        slot = stage_into(slots, 1, state)
        assert slot is not None and seal(slot)
        with SlotStorage(SHM_DIR, job) as storage:
            (entry,) = Catalog(storage).committed()
            assert entry.manifest is not None
            view = storage.data_view(entry.name)
            extra = next(t for t in entry.manifest.tensors if t.key.endswith("extra"))
            raw = bytearray(view[extra.offset : extra.offset + extra.nbytes])
            got = torch.frombuffer(raw, dtype=torch.int64)
            assert torch.equal(got, state["extra"])  # type: ignore[arg-type]
            assert storage.file_size(entry.name, "rank-00000.bin") == entry.manifest.files[0].nbytes
    finally:
        slots.close(unlink=True)


def test_a_slot_torn_twice_is_skipped_and_the_other_serves(job: str) -> None:
    slots = _slots(job)
    try:
        state = small_state(1)
        a = stage_into(slots, 1, state)
        assert a is not None and seal(a)
        b = stage_into(slots, 2, small_state(2))
        assert b is not None and seal(b)
        for page in (0, 1):
            _flip(b.path, page * HEADER_PAGE + 40)
        step, into, _ = _restore(job)
        assert step == 1
        assert_same(state, into)
        again = SlotSet.attach(job)  # a restarted process: the torn slot is left out
        assert again is not None and [s.index for s in again.slots] == [a.index]
        again.close()
    finally:
        slots.close(unlink=True)


def test_a_damaged_record_is_never_sealed(job: str) -> None:
    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None
        head = a.header()
        assert head is not None
        _flip(a.path, head.meta_offset + 10)
        with pytest.raises(CorruptCheckpointError, match="metadata of slot"):
            seal(a)
        h = a.header()
        assert h is not None and h.state == STAGED  # not committed
        assert a.try_lock(exclusive=True)  # and seal let go of it
        a.unlock()
    finally:
        slots.close(unlink=True)


def test_a_state_larger_than_the_slots_is_refused_and_the_slot_freed(job: str) -> None:
    slots = SlotSet.create(job, data_bytes=4096)
    try:
        with pytest.raises(CheckpointError, match="memory slots hold 4096"):
            stage_into(slots, 1, small_state(1))
        assert all(h is not None and h.state == "empty" for h in slots.headers())
        assert slots.begin(1) is not None  # nothing left held
    finally:
        slots.close(unlink=True)


def test_a_staged_snapshot_awaiting_its_seal_is_not_overwritten(job: str) -> None:
    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None and seal(a)
        b = stage_into(slots, 2, small_state(2))  # staged, the keeper has not sealed it yet
        assert b is not None
        assert slots.begin(3) is None  # step 1 is the newest committed, step 2 awaits: skip
        assert seal(b) is not None
        c = slots.begin(3)
        assert c is not None and c.index == a.index
        slots.abandon(c)
        assert _restore(job)[0] == 2
    finally:
        slots.close(unlink=True)


def test_attach_seals_a_staged_snapshot_left_unsealed(job: str) -> None:
    state = small_state(2)
    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None and seal(a)
        assert stage_into(slots, 2, state) is not None  # then the trainer died: no seal
        again = SlotSet.attach(job)  # its restart
        assert again is not None
        newest = again.newest()
        assert newest is not None and newest[1].step == 2
        step, into, _ = _restore(job)
        assert step == 2
        assert_same(state, into)
        again.close()
    finally:
        slots.close(unlink=True)


def test_attach_waits_for_a_keeper_still_sealing_the_newest_snapshot(job: str) -> None:
    """A restart that attaches while the dead trainer's keeper is still hashing its last
    staged snapshot waits for that seal instead of serving the older committed one (CI
    flake: a restart resumed two steps behind under load)."""
    import threading
    import time

    slots = _slots(job)
    try:
        a = stage_into(slots, 1, small_state(1))
        assert a is not None and seal(a)
        b = stage_into(slots, 2, small_state(2))
        assert b is not None
        keeper = open_slot(b.path, job=job, rank=0)  # the keeper's own open of the slot
        assert keeper.try_lock(exclusive=True)  # hashing it

        def finish() -> None:
            time.sleep(0.3)
            assert seal(keeper, hold=True) is not None
            keeper.unlock()

        t = threading.Thread(target=finish)
        t.start()
        again = SlotSet.attach(job)  # the restart
        newest = again.newest() if again is not None else None  # what its restore serves
        t.join()
        keeper.close()
        assert again is not None
        again.close()
        assert newest is not None and newest[1].step == 2, newest
    finally:
        slots.close(unlink=True)
