"""Multi-level checkpoints on emulated nodes (one directory per node id, gloo, spawned ranks):
the fault matrix of PRIOR-ART.md's SCR section. Every case asserts the step resumed from,
the level that served it and bit-identical state."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import pitstop
from conftest import make_state, tensors_of
from pitstop.testing.distributed import run_ranks

pytestmark = pytest.mark.dist
TIMEOUT = 20.0
NODES4 = ["n0", "n1", "n2", "n3"]


def _state(rank: int, seed: int = 1) -> dict[str, Any]:
    state = make_state(seed=seed, steps=1)
    state["local"] = {"t": torch.full((3,), float(rank)), "rank": rank}
    return state


def _advance(state: dict[str, Any], rank: int, step: int) -> None:
    """One deterministic training step: equal on every rank but for the per-rank values."""
    torch.manual_seed(1000 + step)
    model, opt = state["model"], state["optimizer"]
    x = torch.randint(0, 10, (8,))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    state["local"]["t"] += step * (rank + 1)


def _expected(rank: int, world: int, steps: int) -> list[dict[str, list[float]]]:
    """The state after each step, computed in a rank process (one thread, as training)."""
    state = _state(rank)
    out = [_digest(state)]
    for s in range(1, steps + 1):
        _advance(state, rank, s)
        out.append(_digest(state))
    return out


def _digest(state: dict[str, Any]) -> dict[str, list[float]]:
    return {k: v.double().flatten().tolist() for k, v in tensors_of(state).items()}


def _levels(base: str, scheme: str, every: int) -> list[Any]:
    return [
        pitstop.Local(os.path.join(base, "local", "{node}"), redundancy=scheme),
        pitstop.Shared(os.path.join(base, "shared"), every=every),
    ]


def _train(
    rank: int, world: int, base: str, scheme: str, nodes: list[str], steps: int, every: int
) -> dict[str, Any]:
    """Resume (if anything is there) and train to ``steps``, saving every step."""
    state = _state(rank)
    with pitstop.CheckpointManager(
        levels=_levels(base, scheme, every), topology=nodes, dist_timeout_secs=TIMEOUT
    ) as ckpt:
        start = ckpt.restore(state) or 0
        for step in range(start + 1, steps + 1):
            _advance(state, rank, step)
            ckpt.save(step, state)
        ckpt.wait()
        flushes = [(r.step, r.ok, r.error) for r in ckpt.levels.flusher.records]
    return {"start": start, "flushes": flushes}


def _resume(rank: int, world: int, base: str, scheme: str, nodes: list[str]) -> dict[str, Any]:
    state = _state(rank, seed=99)
    state["local"]["t"] = torch.zeros(3)
    with pitstop.CheckpointManager(
        levels=_levels(base, scheme, 10), topology=nodes, dist_timeout_secs=TIMEOUT
    ) as ckpt:
        step = ckpt.restore(state)
        info = ckpt.last_restore
    return {
        "step": step,
        "level": info.level if info else None,
        "sources": info.sources if info else None,
        "repaired": info.repaired if info else None,
        "digest": _digest(state),
    }


_EXPECTED: dict[int, list[Any]] = {}


def _check(results: list[dict[str, Any]], step: int, level: str) -> dict[str, int]:
    world = len(results)
    if world not in _EXPECTED:
        _EXPECTED[world] = run_ranks(_expected, world, 12, timeout_secs=TIMEOUT)
    for rank, r in enumerate(results):
        assert (r["step"], r["level"]) == (step, level), r
        assert r["digest"] == _EXPECTED[world][rank][step], f"rank {rank} state differs"
    return results[0]["sources"]


def test_partner_clean_restart_is_served_by_the_local_level(tmp_path: Any) -> None:
    base = str(tmp_path)
    out = run_ranks(_train, 4, base, "partner", NODES4, 5, 2, timeout_secs=TIMEOUT * 3)
    assert [f[:2] for f in out[0]["flushes"]] == [(2, True), (4, True)]
    results = run_ranks(_resume, 4, base, "partner", NODES4, timeout_secs=TIMEOUT * 3)
    sources = _check(results, 5, "local")
    assert sources["own"] > 0 and not sources.get("partner")
