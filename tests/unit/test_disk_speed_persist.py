"""The save path's speed changes keep what is written: extents that ramp up, hashing beside
the writes, the objects file written beside the data file."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from pitstop.engine.verify import verify_checkpoint
from pitstop.errors import CheckpointIOError
from pitstop.format.checksum import get_checksum
from pitstop.format.manifest import Manifest
from pitstop.format.names import MANIFEST
from pitstop.io.parallel import RAMP, plan_extents
from pitstop.options import ALIGN_BYTES, IOOptions, SaveOptions
from pitstop.storage import LocalStorage
from pitstop.testing import FaultyStorage

MIB = 1 << 20


def _state(seed: int, width: int = 256) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    opt.step()
    return {"model": model, "opt": opt, "extra": torch.arange(5000.0) + seed}


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].state_dict().values())
    for s in state["opt"].state_dict()["state"].values():
        out += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return [*out, state["extra"]]


def _check_tiling(segs: list[tuple[int, int, object]], file_bytes: int, chunk: int) -> list[int]:
    extents = plan_extents(segs, file_bytes, chunk)
    assert extents[0].start == 0 and extents[-1].end == file_bytes
    for a, b in itertools.pairwise(extents):
        assert a.end == b.start and a.end % ALIGN_BYTES == 0
    placed = [s for e in extents for s in e.segments]
    assert sorted(placed, key=lambda s: s[0]) == sorted(segs, key=lambda s: s[0])
    for e in extents:  # a segment lies inside its extent: never cut
        assert all(e.start <= s <= s + n <= e.end or n == 0 for s, n, _ in e.segments)
    return [e.nbytes for e in extents]


@pytest.mark.parametrize("seg_mib", [1, 16])
def test_extents_ramp_up_then_stay_at_chunk_size(seg_mib: int) -> None:
    seg = seg_mib * MIB
    count = 640 // seg_mib
    segs: list[tuple[int, int, object]] = [(i * seg, seg, i) for i in range(count)]
    sizes = _check_tiling(segs, count * seg, 64 * MIB)
    full = 64 * MIB + 8 * MIB
    for k, n in enumerate(sizes[:RAMP]):  # smaller first, never below one segment
        ramp = (64 * MIB) >> (RAMP - k)
        assert n <= max(seg, ramp + ramp // 8)
    assert sizes[0] < sizes[RAMP]
    assert all(n <= max(seg, full) for n in sizes)


def test_extents_of_a_small_file_and_of_gaps_still_tile() -> None:
    segs: list[tuple[int, int, object]] = [(0, 100, 0), (4096, 5000, 1), (12288, 0, 2)]
    assert _check_tiling(segs, 16384, 4096)
    assert _check_tiling([(0, 3 * MIB, 0)], 3 * MIB, 64 * MIB) == [3 * MIB]


def _manifest(root: str, step: int) -> Manifest:
    path = os.path.join(root, f"step-{step:010d}", MANIFEST)
    with open(path, "rb") as f:
        return Manifest.loads(f.read(), path=path)


@pytest.mark.parametrize("ring", [False, True])
def test_every_segment_is_hashed_from_the_bytes_written(root: str, ring: bool) -> None:
    """Hashing beside the writes, whole arena or a ring smaller than the state (whose places
    are reused only once written and hashed): every checksum is that of the file's bytes."""
    width = 2048 if ring else 512  # ~100 MB with Adam's state: larger than the ring
    io = IOOptions(chunk_bytes=(4 * MIB) if ring else 64 * 1024)
    options = SaveOptions(io=io, host_memory_bytes=(64 * MIB) if ring else None)
    state = _state(1, width=width)
    with pitstop.CheckpointManager(root, options=options) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state)
    manifest = _manifest(root, 2)
    hasher = get_checksum(manifest.checksum_algorithm)
    with open(os.path.join(root, "step-0000000002", "rank-00000.bin"), "rb") as f:
        data = f.read()
    seg = manifest.segment_bytes
    for t in manifest.tensors:
        want = [
            hasher(data[o : o + min(seg, t.offset + t.nbytes - o)])
            for o in range(t.offset, t.offset + t.nbytes, seg)
        ] or [hasher(b"")]
        assert list(t.checksum) == want, t.key
    assert verify_checkpoint(LocalStorage(root), "step-0000000002", manifest).ok
    fresh = _state(7, width=width)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh) == 2
    for a, b in zip(_tensors(fresh), _tensors(state), strict=True):
        assert torch.equal(a, b)


class _Order(LocalStorage):
    calls: list[str]

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append("write_data")
        return super().write_data(*args, **kwargs)

    def write_object(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("write_object")
        super().write_object(*args, **kwargs)


def test_the_objects_file_is_written_after_the_data_file_is_begun(root: str) -> None:
    storage = _Order(root)
    storage.calls = []
    with pitstop.CheckpointManager(storage) as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, {"values": {"a": 1, "b": [2, 3]}})  # no data bytes: no extent at all
    assert storage.calls == ["write_data", "write_object"] * 2
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.load(2)["values"] == {"a": 1, "b": [2, 3]}


@pytest.mark.parametrize("call", ["write_object", "write_data"])
def test_a_failed_objects_or_data_write_fails_the_save_and_leaves_nothing(
    root: str, call: str
) -> None:
    storage = FaultyStorage(LocalStorage(root), fail={call: range(1, 100)})
    with pitstop.CheckpointManager(storage) as ckpt:
        with pytest.raises(CheckpointIOError):
            ckpt.save(1, _state(1))
        assert ckpt.steps() == []
    assert not [n for n in os.listdir(root) if n.startswith("step-")]
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(2, _state(2))
        assert ckpt.steps() == [2]
