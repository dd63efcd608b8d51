"""Restore streams into the live state through a few bounded read buffers."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
import pitstop.engine.restore as restore_mod
import pitstop.engine.verify as verify_mod
from conftest import flip_byte
from pitstop.engine.verify import verify_checkpoint
from pitstop.errors import CheckpointIOError, PartialRestoreError, StateMismatchError
from pitstop.io.arena import Arena
from pitstop.options import IOOptions, SaveOptions
from pitstop.storage import LocalStorage
from pitstop.testing import FaultyStorage

KIB = 1 << 10


def _state(seed: int, width: int = 256) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, width)).square().mean().backward()
        opt.step()
    return {"model": model, "opt": opt, "extra": torch.arange(1000.0) + seed}


def _bits(state: dict[str, Any]) -> dict[str, bytes]:
    out = {f"model.{k}": v.numpy().tobytes() for k, v in state["model"].state_dict().items()}
    for i, s in state["opt"].state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.numpy().tobytes() for k, v in s.items()})
    out["extra"] = state["extra"].numpy().tobytes()
    return out


def _small_reads(buffer_bytes: int, count: int = 2) -> SaveOptions:
    io = IOOptions(read_chunk_bytes=buffer_bytes, read_buffers=count)
    return SaveOptions(io=io)


class _Recorder:
    """Records the bytes of every Arena allocated while restore runs, and of those held at
    once (``peak``: a read buffer too small for a request is closed before a larger one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.held = self.peak = 0
        recorder = self

        class Recording(Arena):
            def __init__(self, nbytes: int) -> None:
                super().__init__(nbytes)
                recorder.sizes.append(self.nbytes)
                recorder.held += self.nbytes
                recorder.peak = max(recorder.peak, recorder.held)

            def close(self) -> None:
                recorder.held -= 0 if self.closed else self.nbytes
                super().close()

        for mod in (verify_mod, restore_mod):
            monkeypatch.setattr(mod, "Arena", Recording)


def test_restore_lands_in_the_live_tensors_through_bounded_buffers(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state(0)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, saved)
    live = _state(1)
    params = {k: v.data_ptr() for k, v in live["model"].state_dict().items()}
    moments = {
        (i, k): v.data_ptr() for i, s in live["opt"].state.items() for k, v in s.items()
    }  # fmt: skip
    recorder = _Recorder(monkeypatch)
    with pitstop.CheckpointManager(root, options=_small_reads(64 * KIB)) as ckpt:
        assert ckpt.restore(live) == 1
    assert _bits(live) == _bits(saved)
    state_bytes = sum(len(b) for b in _bits(saved).values())
    # two 64 KiB read buffers, nothing of the checkpoint's size (main allocated a whole arena)
    assert recorder.peak <= 2 * 64 * KIB < state_bytes // 8, recorder.sizes
    # the bytes landed in the tensors the state already had
    assert {k: v.data_ptr() for k, v in live["model"].state_dict().items()} == params
    assert {(i, k): v.data_ptr() for i, s in live["opt"].state.items() for k, v in s.items()} == (
        moments
    )


def test_verify_reads_through_bounded_buffers(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, _state(0))
    entry = pitstop.CheckpointManager(root).entries()[-1]
    assert entry.manifest is not None
    recorder = _Recorder(monkeypatch)
    storage = LocalStorage(root, IOOptions(read_chunk_bytes=32 * KIB, read_buffers=3))
    report = verify_checkpoint(storage, entry.name, entry.manifest)
    assert report.ok and report.nbytes > 10 * 3 * 32 * KIB
    assert recorder.peak <= 3 * 32 * KIB, recorder.sizes


def test_a_fresh_optimizer_takes_the_restored_tensors(root: str) -> None:
    saved = _state(0)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, saved)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    live = {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3)}
    live["extra"] = torch.zeros(1000)
    assert not live["opt"].state  # never stepped: its state comes from the checkpoint
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(live) == 1
    assert _bits(live) == _bits(saved)


@pytest.mark.parametrize("buffer_kib", [64, 4096])
def test_damage_after_bytes_landed_falls_back_and_the_older_one_overwrites_all(
    root: str, buffer_kib: int
) -> None:
    """With 64 KiB buffers the 256 KiB weight segments are read (and land) in pieces before
    their digest is known; with 4 MiB they are verified first. Either way step 1 wins."""
    one, two = _state(0), _state(1)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, one)
        ckpt.save(2, two)
    entry = pitstop.CheckpointManager(root).entries()[-1]
    assert entry.manifest is not None
    last = max(entry.manifest.tensors, key=lambda t: t.offset)  # read last: the rest landed
    flip_byte(os.path.join(root, entry.name, last.file), last.offset + last.nbytes // 2)
    live = _state(7)
    with pitstop.CheckpointManager(root, options=_small_reads(buffer_kib * KIB)) as ckpt:
        assert ckpt.restore(live) == 1
        assert ckpt.last_restore is not None and "damaged" in ckpt.last_restore.skipped[0][1]
    assert _bits(live) == _bits(one)


def test_when_nothing_verifies_the_error_says_the_state_was_overwritten(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, _state(0))
    entry = pitstop.CheckpointManager(root).entries()[-1]
    assert entry.manifest is not None
    last = max(entry.manifest.tensors, key=lambda t: t.offset)
    flip_byte(os.path.join(root, entry.name, last.file), last.offset + 8)
    with (
        pitstop.CheckpointManager(root) as ckpt,
        pytest.raises(PartialRestoreError, match="partly overwritten"),
    ):
        ckpt.restore(_state(7))


def test_an_io_error_part_way_says_the_state_was_overwritten_and_marks_nothing(
    root: str,
) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, _state(0))
    io = IOOptions(read_chunk_bytes=16 * KIB, read_buffers=1)  # a storage brings its own
    faulty = FaultyStorage(LocalStorage(root, io), fail={"read_into": range(4, 100)})
    live = _state(7)
    with (
        pitstop.CheckpointManager(faulty) as ckpt,
        pytest.raises(CheckpointIOError) as info,
    ):
        ckpt.restore(live)
    assert info.value.live_overwritten and "partly overwritten" in str(info.value)
    assert [e.status for e in pitstop.CheckpointManager(root).entries()] == ["committed"]


def test_a_state_that_does_not_fit_is_refused_before_any_data_is_read(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, _state(0))
    live = _state(3, width=128)
    before = _bits(live)
    faulty = FaultyStorage(LocalStorage(root))
    with pitstop.CheckpointManager(faulty) as ckpt, pytest.raises(StateMismatchError):
        ckpt.restore(live)
    assert faulty.by_call["open_data"] == faulty.by_call["read_into"] == 0
    assert _bits(live) == before


def test_live_weights_tied_but_saved_apart_restore_like_load_state_dict(root: str) -> None:
    """Two saved tensors, one live memory: the last one the apply pass copies wins, every
    time (reader threads landing both into it would leave a mix)."""
    torch.manual_seed(0)
    saved = {"a": torch.randn(256, 256), "b": torch.randn(256, 256)}
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, saved)
    for _ in range(5):
        shared = torch.zeros(256, 256)
        live = {"a": shared, "b": shared}
        with pitstop.CheckpointManager(root, options=_small_reads(64 * KIB, count=4)) as ckpt:
            ckpt.restore(live)
        assert torch.equal(shared, saved["b"])


def test_a_partial_restore_reads_only_what_it_loads(root: str) -> None:
    saved = _state(0)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, saved)
    counting = FaultyStorage(LocalStorage(root))  # fails nothing; counts the bytes read
    live = {"model": _state(5)["model"]}
    with pitstop.CheckpointManager(counting) as ckpt:
        assert ckpt.restore(live, strict=False) == 1
    model = [v.numpy().tobytes() for v in saved["model"].state_dict().values()]
    assert [v.numpy().tobytes() for v in live["model"].state_dict().values()] == model
    total = sum(len(b) for b in _bits(saved).values())
    # the model's bytes (and the padding between them), not the optimizer's moments
    read = counting.bytes_read
    assert read < sum(len(b) for b in model) + 64 * KIB < total / 2, (read, total)


def test_after_bytes_landed_a_fallback_that_lacks_keys_says_so(root: str) -> None:
    one = {"w": torch.randn(1000)}
    two = {"w": torch.randn(1000), "ema": torch.randn(1000), "z": torch.randn(1000)}
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, one)
        ckpt.save(2, two)
    entry = pitstop.CheckpointManager(root).entries()[-1]
    assert entry.manifest is not None
    last = max(entry.manifest.tensors, key=lambda t: t.offset)
    flip_byte(os.path.join(root, entry.name, last.file), last.offset + 4)
    live = {"w": torch.zeros(1000), "ema": torch.zeros(1000), "z": torch.zeros(1000)}
    with (
        pitstop.CheckpointManager(root) as ckpt,
        pytest.raises(PartialRestoreError, match="lacks ema"),
    ):
        ckpt.restore(live, strict=False)


def test_after_bytes_landed_an_older_one_that_does_not_fit_says_so(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, {"w": torch.randn(1000), "v": torch.randn(10)})
        ckpt.save(2, {"w": torch.randn(1000), "v": torch.randn(20)})
    entry = pitstop.CheckpointManager(root).entries()[-1]
    assert entry.manifest is not None
    last = max(entry.manifest.tensors, key=lambda t: t.offset)
    flip_byte(os.path.join(root, entry.name, last.file), last.offset + 4)
    live = {"w": torch.zeros(1000), "v": torch.zeros(20)}
    with pitstop.CheckpointManager(root) as ckpt, pytest.raises(StateMismatchError) as info:
        ckpt.restore(live)
    assert info.value.live_overwritten and "already written into the live state" in str(info.value)


def test_a_state_on_the_meta_device_is_refused(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, {"model": nn.Linear(4, 4)})
    with torch.device("meta"):
        ghost = nn.Linear(4, 4)
    with pytest.raises(StateMismatchError, match="meta device"):
        pitstop.load(root, {"model": ghost})
