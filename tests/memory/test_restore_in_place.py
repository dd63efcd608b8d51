"""A restore from memory verifies each segment where it lies in the slot and copies it
straight into the live tensors (the reader's ``data_view`` hook); a reader without the hook
is read through the engine's read buffers, as every other storage is."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pitstop.engine.catalog import Catalog
from pitstop.engine.restore import load_entry
from pitstop.engine.verify import data_view_of, verify_checkpoint
from pitstop.errors import CheckpointIOError, CorruptCheckpointError
from pitstop.format.names import step_dir_name
from pitstop.levels.memory import (
    SlotStorage,
    _NullSaver,
    plan_state,
    restore_from_memory,
    stage_into,
)
from pitstop.levels.shm import DATA_OFFSET, SHM_DIR, SlotSet, seal
from pitstop.options import IOOptions, SaveOptions
from pitstop.storage.retry import RetryingStorage
from pitstop.testing import FaultyStorage, GateStorage

from .conftest import assert_same, small_state, tensors_of

KIB = 1 << 10
SMALL_SEGMENTS = SaveOptions(io=IOOptions(chunk_bytes=8 * KIB))  # several segments a tensor


def _state(seed: int) -> dict[str, Any]:
    state = small_state(seed)
    state["extra"] = torch.arange(40_000, dtype=torch.int64) * (seed + 1)  # 320 KiB
    return state


class _Reader:
    """A slot's reader that counts its calls; ``keep``: the view it offers ends there."""

    def __init__(self, inner: Any, counts: dict[str, int], keep: int | None) -> None:
        self.inner, self.counts, self.keep, self.direct = inner, counts, keep, False

    def read_into(self, offset: int, out: memoryview) -> int:
        self.counts["read_into"] += 1
        return int(self.inner.read_into(offset, out))

    def data_view(self) -> memoryview | None:
        self.counts["data_view"] += 1
        view = self.inner.data_view()
        return view if self.keep is None else view[: self.keep]

    def close(self) -> None:
        self.inner.close()


class _CountingSlotStorage(SlotStorage):
    def __init__(self, *args: Any, keep: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = {"read_into": 0, "data_view": 0}
        self.keep = keep

    def open_data(self, directory: str, name: str) -> Any:
        return _Reader(super().open_data(directory, name), self.counts, self.keep)


@pytest.fixture
def slots(job: str) -> Iterator[SlotSet]:
    _, plan = plan_state(_state(0), SMALL_SEGMENTS)
    slots = SlotSet.create(job, data_bytes=plan.file_bytes)
    yield slots
    slots.close(unlink=True)


def _commit(slots: SlotSet, step: int, state: dict[str, Any]) -> str:
    slot = stage_into(slots, step, state, options=SMALL_SEGMENTS)
    assert slot is not None and seal(slot) is not None
    return slot.path


def _restore(storage: Any, into: dict[str, Any]) -> tuple[int | None, list[tuple[str, str]]]:
    result = restore_from_memory(typing.cast(SlotStorage, storage), into)
    return result.step, result.skipped


def _offset_of(job: str, step: int, key_end: str) -> int:
    """Where in the slot file the bytes of the tensor whose key ends with ``key_end`` are."""
    with SlotStorage(SHM_DIR, job) as storage:
        entry = next(e for e in Catalog(storage).committed() if e.step == step)
        assert entry.manifest is not None
        t = next(t for t in entry.manifest.tensors if t.key.endswith(key_end))
        return DATA_OFFSET + t.offset + t.nbytes // 2


@pytest.mark.parametrize("read_chunk_bytes", [16 << 20, 4 * KIB])
def test_a_restore_through_the_slots_own_bytes_is_bit_identical(
    job: str, slots: SlotSet, read_chunk_bytes: int
) -> None:
    saved = _state(1)
    _commit(slots, 1, saved)
    into = _state(7)
    params = {k: v.data_ptr() for k, v in into["model"].state_dict().items()}
    io = IOOptions(read_chunk_bytes=read_chunk_bytes)  # 4 KiB: segments longer than a task
    with _CountingSlotStorage(SHM_DIR, job, io=io) as storage:
        assert _restore(storage, into) == (1, [])
        assert storage.counts == {"read_into": 0, "data_view": 1}  # in place, nothing read
    assert_same(saved, into)
    assert torch.equal(into["extra"], saved["extra"])
    assert {k: v.data_ptr() for k, v in into["model"].state_dict().items()} == params


def test_verify_checks_a_slot_in_place(job: str, slots: SlotSet) -> None:
    _commit(slots, 1, _state(1))
    with _CountingSlotStorage(SHM_DIR, job) as storage:
        (entry,) = Catalog(storage).committed()
        assert entry.manifest is not None
        report = verify_checkpoint(storage, entry.name, entry.manifest)
        assert report.ok, report.problems
        assert report.nbytes == sum(t.nbytes for t in entry.manifest.tensors)
        assert storage.counts["read_into"] == 0


def test_a_flipped_byte_is_damage_naming_file_and_tensor_and_is_never_landed(
    job: str, slots: SlotSet
) -> None:
    _commit(slots, 1, _state(1))
    path = _commit(slots, 2, _state(2))
    at = _offset_of(job, 2, "extra")
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    into = _state(9)
    before = into["extra"].clone()
    with SlotStorage(SHM_DIR, job) as storage:
        entry = next(e for e in Catalog(storage).committed() if e.step == 2)
        with pytest.raises(CorruptCheckpointError) as raised:
            load_entry(storage, entry, into, saver=typing.cast(Any, _NullSaver), allow_pickle=False)
    message = str(raised.value)
    assert "rank-00000.bin" in message and "'extra'" in message and "checksum mismatch" in message
    # the damaged segment was hashed before anything of it was copied: it never landed
    assert not torch.equal(into["extra"], _state(2)["extra"])
    damaged = (at - DATA_OFFSET) // 8  # the int64 element holding the flipped byte
    assert into["extra"][damaged] == before[damaged]
    with SlotStorage(SHM_DIR, job) as storage:
        step, skipped = _restore(storage, into)
    assert step == 1 and skipped and skipped[0][0] == step_dir_name(2)
    assert_same(_state(1), into)  # the older slot serves, every byte of it


def test_a_view_shorter_than_the_file_is_damage(job: str, slots: SlotSet) -> None:
    _commit(slots, 1, _state(1))
    last = _offset_of(job, 1, "extra") - DATA_OFFSET  # the middle of the last tensor
    with _CountingSlotStorage(SHM_DIR, job, keep=last) as storage:
        (entry,) = Catalog(storage).committed()
        with pytest.raises(CorruptCheckpointError, match="ends at byte"):
            load_entry(
                storage, entry, _state(5), saver=typing.cast(Any, _NullSaver), allow_pickle=False
            )
        assert storage.counts["read_into"] == 0


def test_a_storage_without_the_hook_is_read_through_the_buffers(job: str, slots: SlotSet) -> None:
    saved = _state(3)
    _commit(slots, 1, saved)
    into = _state(8)
    with SlotStorage(SHM_DIR, job) as inner:
        # a read fault configured (never reached): the wrapper hides the hook
        wrapped = FaultyStorage(inner, fail={"read_into": [1_000_000]})
        reader = wrapped.open_data(step_dir_name(1), "rank-00000.bin")
        assert data_view_of(reader) is None
        reader.close()
        assert _restore(wrapped, into) == (1, [])
        file_bytes = inner.file_size(step_dir_name(1), "rank-00000.bin")
    assert_same(saved, into)
    assert wrapped.by_call["read_into"] > 0
    assert (
        wrapped.bytes_read >= sum(t.numel() * t.element_size() for t in tensors_of(saved).values())
        and file_bytes > 0
    )


def test_a_reader_that_declines_is_read_through_the_buffers(job: str, slots: SlotSet) -> None:
    saved = _state(4)
    _commit(slots, 1, saved)
    into = _state(8)

    class Declining(_CountingSlotStorage):
        def open_data(self, directory: str, name: str) -> Any:
            reader = super().open_data(directory, name)
            reader.data_view = lambda: None  # "read me"
            return reader

    with Declining(SHM_DIR, job) as storage:
        assert _restore(storage, into) == (1, [])
        assert storage.counts["read_into"] > 0
    assert_same(saved, into)


class _Unreadable(_CountingSlotStorage):
    """A slot storage whose readers refuse ``read_into``: only the in-place view serves."""

    def open_data(self, directory: str, name: str) -> Any:
        reader = super().open_data(directory, name)

        def refuse(offset: int, out: memoryview) -> int:
            raise AssertionError("read_into called: the in-place view was hidden")

        reader.read_into = refuse
        return reader


def test_a_slot_storage_wrapped_in_retrying_storage_restores_in_place(
    job: str, slots: SlotSet
) -> None:
    saved = _state(5)
    _commit(slots, 1, saved)
    into = _state(9)
    with _Unreadable(SHM_DIR, job) as inner:
        # main: the retrying wrapper's reader hid data_view, so read_into was called
        assert _restore(RetryingStorage(inner), into) == (1, [])
        assert inner.counts == {"read_into": 0, "data_view": 1}
    assert_same(saved, into)
    assert torch.equal(into["extra"], saved["extra"])


def test_faulty_storage_passes_the_view_on_only_without_read_faults(
    job: str, slots: SlotSet
) -> None:
    saved = _state(6)
    _commit(slots, 1, saved)
    into = _state(9)
    with _Unreadable(SHM_DIR, job) as inner:
        counting = FaultyStorage(inner, fail={"write_data": [1]})  # no fault for reads
        assert _restore(counting, into) == (1, [])
        assert counting.by_call["read_into"] == 0 and counting.bytes_read == 0
        assert counting.by_call["open_data"] == 1
    assert_same(saved, into)
    with SlotStorage(SHM_DIR, job) as plain:
        for fail in ({"read_into": [1]}, {"restore": [1_000_000]}):
            faulty = FaultyStorage(plain, fail=fail)
            reader = faulty.open_data(step_dir_name(1), "rank-00000.bin")
            assert data_view_of(reader) is None  # a read fault must be able to land
            reader.close()
        faulty = FaultyStorage(plain, fail={"read_into": [1]})
        with pytest.raises(CheckpointIOError, match="injected EIO in read_into"):
            _restore(faulty, _state(9))


def test_gate_storage_passes_the_view_on_unless_read_into_is_held(job: str, slots: SlotSet) -> None:
    _commit(slots, 1, _state(1))
    with SlotStorage(SHM_DIR, job) as plain:
        for hold, offered in (({"lock"}, True), ({"read_into"}, False)):
            reader = GateStorage(plain, hold=hold).open_data(step_dir_name(1), "rank-00000.bin")
            assert (data_view_of(reader) is not None) is offered, hold
            reader.close()
