"""Corruption is detected by verify and skipped by restore; retention and debris are safe."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import pitstop
from conftest import assert_same_tensors, flip_byte, make_state, tensors_of
from pitstop.cli.main import main
from pitstop.errors import CorruptCheckpointError, PartialRestoreError


def _dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:010d}")


def _save_steps(root: str, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    saved = {}
    with pitstop.CheckpointManager(root) as ckpt:
        for step in steps:
            state = make_state(seed=step, steps=2)
            ckpt.save(step, state)
            saved[step] = tensors_of(state)
    return saved


def _corruptions() -> list[tuple[str, Any]]:
    def flip_data(d: str) -> None:
        flip_byte(os.path.join(d, "rank-00000.bin"), 5)

    def truncate_data(d: str) -> None:
        path = os.path.join(d, "rank-00000.bin")
        os.truncate(path, os.path.getsize(path) - 4096)

    def flip_objects(d: str) -> None:
        flip_byte(os.path.join(d, "objects-00000.json"), 20)

    def delete_data(d: str) -> None:
        os.unlink(os.path.join(d, "rank-00000.bin"))

    def garbage_manifest(d: str) -> None:
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write('{"format": "pitstop-checkpoint", "format_')

    return [
        ("flipped data byte", flip_data),
        ("truncated data file", truncate_data),
        ("flipped objects byte", flip_objects),
        ("missing data file", delete_data),
        ("unparseable manifest", garbage_manifest),
    ]


@pytest.mark.parametrize("name, corrupt", _corruptions(), ids=[n for n, _ in _corruptions()])
def test_corruption_detected_by_verify_and_skipped_by_restore(
    root: str, name: str, corrupt: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = _save_steps(root, [1, 2])
    assert main(["verify", root]) == 0
    corrupt(_dir(root, 2))
    capsys.readouterr()
    assert main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert "step-0000000001: ok" in out and "step-0000000002: CORRUPT" in out
    fresh = make_state(seed=50, steps=0)
    assert pitstop.CheckpointManager(root).restore(fresh) == 1
    assert_same_tensors(saved[1], tensors_of(fresh))
    # the damaged one was set aside (a new timeline starts at 1), so the step can be saved again
    assert not os.path.exists(_dir(root, 2))
    assert any(n.startswith(".damaged-step-0000000002-") for n in os.listdir(root))
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(2, fresh)
        assert ckpt.steps() == [1, 2]


def test_flipped_byte_named_in_verify_output(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    _save_steps(root, [1])
    manifest = pitstop.CheckpointManager(root).entries()[0].manifest
    assert manifest is not None
    target = manifest.tensors[3]
    flip_byte(os.path.join(_dir(root, 1), "rank-00000.bin"), target.offset + target.nbytes - 1)
    assert main(["verify", root, "--step", "1"]) == 1
    assert f"tensor {target.key!r} segment 0" in capsys.readouterr().out


def test_every_checkpoint_corrupt_raises_instead_of_starting_over(root: str) -> None:
    _save_steps(root, [1])
    manifest = pitstop.CheckpointManager(root).entries()[-1].manifest
    assert manifest is not None
    first = min((t for t in manifest.tensors if t.nbytes), key=lambda t: t.offset)
    last = max(manifest.tensors, key=lambda t: t.offset)
    data = os.path.join(_dir(root, 1), "rank-00000.bin")
    flip_byte(data, first.offset)  # found before anything landed: nothing was overwritten
    with pytest.raises(
        CorruptCheckpointError, match="no checkpoint passed verification.*checksum mismatch"
    ):
        pitstop.CheckpointManager(root).restore(make_state())
    other = root + "-2"
    _save_steps(other, [1])
    data = os.path.join(_dir(other, 1), "rank-00000.bin")
    flip_byte(data, last.offset + last.nbytes - 1)  # the rest landed before: the error says so
    with pytest.raises(
        PartialRestoreError, match="no checkpoint could be restored.*overwritten.*checksum mismatch"
    ):
        pitstop.CheckpointManager(other).restore(make_state())
    with pytest.raises(  # nothing to overwrite in a fresh load
        CorruptCheckpointError, match="no checkpoint passed verification.*checksum mismatch"
    ):
        pitstop.load(other)


def test_segments_cover_large_tensors(root: str) -> None:
    big = {"w": torch.randn(3, 5000)}  # 60 KB in 16 KiB segments: several per tensor
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(io=pitstop.IOOptions.from_env(chunk_bytes=16384))
    ) as ckpt:
        ckpt.save(1, big)
        entry = ckpt.entries()[0].manifest.tensors[0]  # type: ignore[union-attr]
        assert len(entry.checksum) == 4
    flip_byte(os.path.join(_dir(root, 1), "rank-00000.bin"), 16384 * 2 + 7)
    assert main(["verify", root]) == 1


def test_retention_keeps_newest(root: str) -> None:
    with pitstop.CheckpointManager(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, {"x": torch.tensor([step])})
            ckpt.wait()  # retention runs after save() returns
            assert ckpt.steps()[-1] == step
            assert len(ckpt.steps()) == min(step, 2)
    assert sorted(os.listdir(root)) == ["step-0000000004", "step-0000000005"]


def test_retention_with_async_saves_in_flight(root: str) -> None:
    with pitstop.CheckpointManager(
        root, keep_last=1, options=pitstop.SaveOptions.from_env(max_in_flight=2)
    ) as ckpt:
        handles = [
            ckpt.async_save(step, {"x": torch.full((1000,), float(step))}) for step in range(1, 8)
        ]
        ckpt.wait()
        assert all(h.committed for h in handles)
        assert ckpt.steps() == [7]
    assert pitstop.load(root)["x"][0].item() == 7.0


def test_debris_is_ignored_and_collected(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    _save_steps(root, [1])
    os.makedirs(_dir(root, 2))
    with open(os.path.join(_dir(root, 2), "rank-00000.bin"), "wb") as f:
        f.write(b"\0" * 8192)
    ckpt = pitstop.CheckpointManager(root)
    assert ckpt.steps() == [1]
    assert ckpt.restore(make_state()) == 1
    assert main(["ls", root]) == 0
    assert "partial" in capsys.readouterr().out
    assert main(["gc", root, "--dry-run", "--min-age", "0"]) == 0
    assert os.path.exists(_dir(root, 2))
    assert ckpt.gc() == ["step-0000000002"]
    assert not os.path.exists(_dir(root, 2))
    # a save of the debris' step clears it first
    os.makedirs(_dir(root, 3))
    ckpt.save(3, {"x": torch.ones(1)})
    assert ckpt.steps() == [1, 3]
    ckpt.close()
