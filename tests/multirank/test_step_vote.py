"""``ckpt.step`` on two gloo ranks (spawned, per-test stores, short timeouts): the ranks vote
on rank 0's decision a step ahead, every rank takes the same decision at the same step,
checkpoints come at the policy's interval, an epoch's end is saved at that step, and a
signal on one rank makes both save at the same step."""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any

import pytest
import torch

import pitstop
from pitstop.testing.distributed import run_ranks

pytestmark = pytest.mark.dist
TIMEOUT = 60.0


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01)}


def _train(state: dict[str, Any]) -> None:
    model, opt = state["model"], state["opt"]
    model(torch.randn(32, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _options() -> pitstop.SaveOptions:
    return pitstop.SaveOptions(dist_timeout_secs=TIMEOUT)


def _rank_policies(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 0 asks for every 3rd step, rank 1 for every 2nd (and ends epochs at 10 and 16):
    rank 0's policy decides for both, and an epoch's end is saved at that very step."""
    policy = pitstop.EveryN(3 if rank == 0 else 2) | pitstop.EveryEpoch()
    state = _state()
    results = []
    with pitstop.CheckpointManager(root, policy=policy, options=_options()) as ckpt:
        for step in range(1, 21):
            _train(state)
            results.append(int(ckpt.step(step, state, epoch_end=step in (10, 16))))
        ckpt.wait()
        return {"results": results, "steps": ckpt.steps(), "step_secs": ckpt.stats().step_secs}


def test_rank_zero_decides_at_its_interval_on_every_rank(tmp_path: Any) -> None:
    out = run_ranks(_rank_policies, 2, str(tmp_path), timeout_secs=TIMEOUT)
    assert out[0]["results"] == out[1]["results"]
    # every 3rd step counted from the newest checkpoint, and the epochs' ends at 10 and 16
    expected = [3, 6, 9, 10, 13, 16, 19]
    saved = [s for s, r in zip(range(1, 21), out[0]["results"], strict=True) if r]
    assert saved == expected
    assert out[0]["steps"] == out[1]["steps"] == expected
    assert all(o["step_secs"] is not None and o["step_secs"] > 0 for o in out)  # counted


def _checkfreq(rank: int, world: int, root: str) -> dict[str, Any]:
    """CheckFreq on both ranks, a small state and a few ms per step: rank 0's intervals as it
    chose them after each step, and what each step did."""
    policy = pitstop.CheckFreq(max_overhead=0.02, warmup=2, profile=4)
    state = _state()
    results, intervals = [], []
    with pitstop.CheckpointManager(root, keep_last=2, policy=policy, options=_options()) as ckpt:
        for step in range(1, 81):
            _train(state)
            time.sleep(0.004 if rank == 0 else 0.002)  # the ranks run at different speeds
            results.append(int(ckpt.step(step, state)))
            intervals.append(policy.interval)
    return {"results": results, "intervals": intervals}


def test_checkfreq_checkpoints_at_rank_zeros_interval_on_every_rank(tmp_path: Any) -> None:
    out = run_ranks(_checkfreq, 2, str(tmp_path), timeout_secs=TIMEOUT)
    results, intervals = out[0]["results"], out[0]["intervals"]
    assert results == out[1]["results"]
    saved = [s for s, r in zip(range(1, 81), results, strict=True) if r]
    assert len(saved) >= 3, saved  # the probe, then checkpoints at the measured interval
    for a, b in itertools.pairwise(saved):
        # the interval rank 0 chose at step t-1 (the vote for step t) held back every step
        # before b, and b is the first step it allowed
        for t in range(a + 1, b):
            k = intervals[t - 2]
            assert k is None or t - a < k, (a, b, t, k)
        k = intervals[b - 2]
        assert k is not None and b - a >= k, (a, b, k)


def _signalled(rank: int, world: int, root: str) -> list[int]:
    """Rank 1 gets SIGUSR1 after step 7: both ranks save the same step and go on."""
    state = _state()
    first_seen = []
    with pitstop.CheckpointManager(root, policy=pitstop.EveryN(100), options=_options()) as ckpt:
        ckpt.save_on_signal(signal.SIGUSR1, exit_code=None)
        for step in range(1, 13):
            _train(state)
            ckpt.step(step, state)
            if rank == 1 and step == 7:
                os.kill(os.getpid(), signal.SIGUSR1)
            if ckpt.steps() and not first_seen:
                first_seen.append(step)
        return first_seen + ckpt.steps()


def test_a_signal_on_one_rank_saves_the_same_step_on_both(tmp_path: Any) -> None:
    out = run_ranks(_signalled, 2, str(tmp_path), timeout_secs=TIMEOUT)
    assert out[0] == out[1]
    first, *steps = out[0]
    assert steps == [first] and first == 9, out  # seen at step 8's vote, saved at 9
