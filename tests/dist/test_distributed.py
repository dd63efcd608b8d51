"""Several ranks on gloo (spawned, per-test FileStore, short timeouts): ranks split the
bytes, sharded DTensor state, restore on another world size, failures on one rank."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import pitstop
from conftest import assert_same_tensors, make_state, tensors_of
from pitstop.testing.distributed import run_ranks

pytestmark = pytest.mark.dist
TIMEOUT = 60.0


def _state(rank: int, seed: int = 1) -> dict[str, Any]:
    """A DDP-like state: the model and optimizer equal on every rank, per-rank values apart."""
    state = make_state(seed=seed, steps=2)
    state["local"] = {"t": torch.full((3,), float(rank)), "rank": rank}
    return state


def _digest(state: dict[str, Any]) -> dict[str, list[float]]:
    return {k: v.double().flatten().tolist() for k, v in tensors_of(state).items()}


def _save(rank: int, world: int, root: str, mode: str, step: int = 5) -> dict[str, Any]:
    with pitstop.CheckpointManager(root, replicated=mode, dist_timeout_secs=TIMEOUT) as ckpt:
        ckpt.save(step, _state(rank))
    return _digest(_state(rank))


def _restore(rank: int, world: int, root: str) -> tuple[int | None, dict[str, Any]]:
    fresh = _state(rank, seed=99)
    fresh["local"]["t"] = torch.zeros(3)
    with pitstop.CheckpointManager(root, dist_timeout_secs=TIMEOUT) as ckpt:
        step = ckpt.restore(fresh)
    return step, _digest(fresh)


@pytest.mark.parametrize("mode", ["split", "root"])
def test_two_ranks_save_one_checkpoint_and_restore_it(tmp_path: Any, mode: str) -> None:
    root = str(tmp_path / "ck")
    saved = run_ranks(_save, 2, root, mode, timeout_secs=TIMEOUT)
    assert sorted(os.listdir(root)) == ["step-0000000005"]
    manifest = pitstop.CheckpointManager(root).entries()[0].manifest
    assert manifest is not None and manifest.world_size == 2
    sizes = {f.name: f.nbytes for f in manifest.files}
    if mode == "split":
        assert sizes["rank-00000.bin"] and sizes["rank-00001.bin"]
    restored = run_ranks(_restore, 2, root, timeout_secs=TIMEOUT)
    for rank in (0, 1):
        step, digest = restored[rank]
        assert step == 5
        assert digest == saved[rank]
