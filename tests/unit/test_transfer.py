"""The streaming copy between levels (pitstop.engine.transfer) in one process: byte for byte
through many small pieces, a damaged byte or a failed write stops it (never hangs), a file
already there is replaced and never written through, the memory it takes is bounded."""

from __future__ import annotations

import errno
import filecmp
import os
import resource
import signal
from typing import Any

import pytest
import torch

import pitstop
from conftest import flip_byte
from pitstop.engine.payload import Layout
from pitstop.engine.transfer import copy_budget, copy_files, piece_bytes
from pitstop.format.manifest import Manifest
from pitstop.options import ALIGN_BYTES, MIN_HOST_MEMORY_BYTES, IOOptions
from pitstop.storage.local import LocalStorage
from pitstop.testing import FaultyStorage

STEP = "step-0000000001"
SMALL = IOOptions(read_chunk_bytes=ALIGN_BYTES, read_buffers=4)  # 4 KiB pieces


def _saved(tmp_path: Any) -> tuple[str, Manifest]:
    """A step of odd-sized tensors (several pieces each at 4 KiB) and its manifest."""
    root = str(tmp_path / "src")
    state = {"a": torch.arange(10_001, dtype=torch.float32), "b": torch.ones(3, 7), "n": 5}
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, state)
    with open(os.path.join(root, STEP, "manifest.json"), "rb") as f:
        return root, Manifest.loads(f.read(), path=root)


def test_a_copy_through_many_small_pieces_is_byte_for_byte(tmp_path: Any) -> None:
    root, manifest = _saved(tmp_path)
    source, target = LocalStorage(root, SMALL), LocalStorage(str(tmp_path / "dst"), SMALL)
    os.makedirs(tmp_path / "dst" / STEP)
    assert piece_bytes(SMALL, 0) == ALIGN_BYTES
    nbytes = copy_files(source, target, STEP, manifest, 0, "flush")
    assert nbytes == sum(f.nbytes for f in manifest.files)
    for f in manifest.files:
        assert filecmp.cmp(
            os.path.join(root, STEP, f.name), tmp_path / "dst" / STEP / f.name, shallow=False
        )


def test_a_damaged_byte_stops_the_copy_naming_what_differs(tmp_path: Any) -> None:
    root, manifest = _saved(tmp_path)
    first = min(t.offset for t in manifest.tensors if t.nbytes)
    flip_byte(os.path.join(root, STEP, "rank-00000.bin"), first + 5000)
    os.makedirs(tmp_path / "dst" / STEP)
    with pytest.raises(pitstop.CorruptCheckpointError, match="checksum mismatch"):
        copy_files(
            LocalStorage(root, SMALL), LocalStorage(str(tmp_path / "dst"), SMALL), STEP,
            manifest, 0, "flush",
        )  # fmt: skip


@pytest.mark.parametrize("call", ["write_data", "write_object"])
def test_a_failed_write_fails_the_copy_and_never_hangs(tmp_path: Any, call: str) -> None:
    root, manifest = _saved(tmp_path)
    os.makedirs(tmp_path / "dst" / STEP)
    target: Any = FaultyStorage(
        LocalStorage(str(tmp_path / "dst"), SMALL), fail={call: [1]}, errno=errno.ENOSPC
    )
    with pytest.raises(pitstop.CheckpointIOError, match="injected ENOSPC"):
        copy_files(LocalStorage(root, SMALL), target, STEP, manifest, 0, "flush")


def test_a_file_already_there_is_replaced_never_written_through(tmp_path: Any) -> None:
    root, manifest = _saved(tmp_path)
    os.makedirs(tmp_path / "dst" / STEP)
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 8192)
    os.link(other, tmp_path / "dst" / STEP / "rank-00000.bin")  # as `cp -al` would leave it
    copy_files(
        LocalStorage(root, SMALL), LocalStorage(str(tmp_path / "dst"), SMALL), STEP, manifest,
        0, "restore",
    )  # fmt: skip
    assert other.read_bytes() == b"x" * 8192
    assert filecmp.cmp(
        os.path.join(root, STEP, "rank-00000.bin"), tmp_path / "dst" / STEP / "rank-00000.bin",
        shallow=False,
    )  # fmt: skip
    assert sorted(os.listdir(tmp_path / "dst" / STEP)) == ["objects-00000.json", "rank-00000.bin"]


def test_pieces_never_cross_files_and_the_budget_is_at_most_the_smallest_host_memory() -> None:
    layout = Layout.of([("a", 5000), ("b", 0), ("c", 3 * ALIGN_BYTES)])
    assert [f[2] for f in layout.files] == [0, 2 * ALIGN_BYTES, 2 * ALIGN_BYTES]
    pieces = layout.pieces(2 * ALIGN_BYTES)
    assert [(e.start, e.end) for e in pieces] == [(0, 8192), (8192, 16384), (16384, 20480)]
    assert layout.count(2 * ALIGN_BYTES) == len(pieces)
    io = IOOptions()
    assert copy_budget(io) == MIN_HOST_MEMORY_BYTES  # 6 x 16 MiB read buffers, capped
    units = io.threads + 1 + 5  # the ring and five send / receive buffers
    assert piece_bytes(io, 5) * units <= MIN_HOST_MEMORY_BYTES


def test_a_write_that_fails_half_way_through_a_file_fails_the_copy(tmp_path: Any) -> None:
    """The file system refuses bytes past 16 KiB (RLIMIT_FSIZE: EFBIG) while later pieces
    wait for room in the ring: the copy fails with that error instead of waiting for ever."""
    root, manifest = _saved(tmp_path)
    os.makedirs(tmp_path / "dst" / STEP)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16384, hard))
    try:
        with pytest.raises(pitstop.CheckpointIOError, match="too large"):
            copy_files(
                LocalStorage(root, SMALL), LocalStorage(str(tmp_path / "dst"), SMALL), STEP,
                manifest, 0, "flush",
            )  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
