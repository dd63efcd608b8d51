"""The memory level's GPU path: CUDA tensors staged into page-locked slots (skipped here:
this machine has no GPU)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import pitstop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_state_snapshots_into_pinned_slots_and_restores(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": opt}
    levels = [
        pitstop.Memory(job=job, directory=shm_dir),
        pitstop.Local(os.path.join(str(tmp_path), "ck")),
    ]
    ckpt = pitstop.CheckpointManager(levels, policy=pitstop.EveryN(10**9))
    for step in range(1, 4):
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        opt.step()
        ckpt.step(step, state)
    ckpt.wait()
    memory = ckpt.hooks.levels.memory
    assert memory is not None and memory.slots is not None
    assert any(s.pinned for s in memory.slots.slots)  # device copies were asynchronous
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ckpt.close()  # writes the newest snapshot (step 3) to the next level
    fresh = torch.nn.Linear(256, 256).cuda()
    again = pitstop.CheckpointManager(levels)
    assert again.restore({"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters())}) == 3
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.cpu(), expected[k]), k
    again.close()
