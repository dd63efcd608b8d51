"""Multi-level checkpoints on emulated nodes (one directory per node id, gloo, spawned ranks):
the fault matrix of PRIOR-ART.md's SCR section. Every case asserts the step resumed from,
the level that served it and bit-identical state."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

import pitstop
from conftest import flip_byte, make_state, tensors_of
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
    rank: int,
    world: int,
    base: str,
    scheme: str,
    nodes: list[str],
    steps: int,
    every: int,
    crash: tuple[int, int] | None = None,
    timeout: float = TIMEOUT,
) -> dict[str, Any]:
    """Resume (if anything is there) and train to ``steps``, saving every step; ``crash``
    (rank, step): that rank dies before saving that step."""
    state = _state(rank)
    ckpt = pitstop.CheckpointManager(
        levels=_levels(base, scheme, every), topology=nodes, dist_timeout_secs=timeout
    )
    with ckpt:
        start = ckpt.restore(state) or 0
        for step in range(start + 1, steps + 1):
            _advance(state, rank, step)
            if crash == (rank, step):
                os._exit(9)
            ckpt.save(step, state)
        ckpt.wait()
    assert ckpt.levels is not None and ckpt.levels.flusher is not None
    return {"start": start, "flushes": [(r.step, r.ok) for r in ckpt.levels.flusher.records]}


def _resume(
    rank: int, world: int, base: str, scheme: str, nodes: list[str], train_to: int = 0
) -> dict[str, Any]:
    state = _state(rank, seed=99)
    state["local"]["t"] = torch.zeros(3)
    with pitstop.CheckpointManager(
        levels=_levels(base, scheme, 10), topology=nodes, dist_timeout_secs=TIMEOUT
    ) as ckpt:
        step = ckpt.restore(state)
        info = ckpt.last_restore
        for s in range((step or 0) + 1, train_to + 1):  # the run goes on from there
            _advance(state, rank, s)
            ckpt.save(s, state)
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


_TRAINED: dict[str, str] = {}


def _trained(tmp_path: Any, scheme: str, steps: int = 4, every: int = 2) -> str:
    """A copy of a job of 4 ranks on 4 nodes trained to ``steps`` (local keeps the last two;
    every second step flushed); trained once per scheme and size for the whole module."""
    key = f"{scheme}-{steps}-{every}"
    if key not in _TRAINED:
        base = tempfile.mkdtemp(prefix=f"pitstop-ml-{key}-")
        out = run_ranks(_train, 4, base, scheme, NODES4, steps, every, timeout_secs=TIMEOUT * 3)
        flushed = [s for s in range(every, steps + 1, every)]
        assert out[0]["flushes"] == [(s, True) for s in flushed]
        _TRAINED[key] = base
    base = str(tmp_path / "job")
    shutil.copytree(_TRAINED[key], base)
    return base


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Any:
    yield
    for base in _TRAINED.values():
        shutil.rmtree(base, ignore_errors=True)


def _resumed(base: str, scheme: str, nodes: list[str] = NODES4, **kw: Any) -> list[Any]:
    return run_ranks(_resume, len(nodes), base, scheme, nodes, timeout_secs=TIMEOUT * 3, **kw)


def _node(base: str, node: str, step: int | None = None) -> str:
    path = os.path.join(base, "local", node)
    return path if step is None else os.path.join(path, f"step-{step:010d}")


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_clean_restart_is_served_by_the_local_level(tmp_path: Any, scheme: str) -> None:
    base = _trained(tmp_path, scheme)
    sources = _check(_resumed(base, scheme), 4, "local")
    assert sources["own"] > 0 and not sources.get("partner") and not sources.get("parity")


def test_a_rank_that_crashes_between_checkpoints_resumes_locally(tmp_path: Any) -> None:
    base = str(tmp_path)
    out = run_ranks(
        _train, 4, base, "partner", NODES4, 6, 2, (2, 5), 3.0,
        timeout_secs=TIMEOUT * 3, allow_failures=True,
    )  # fmt: skip
    assert isinstance(out[2], str)  # rank 2 died before step 5; the others then failed
    _check(_resumed(base, "partner"), 4, "local")


def test_a_kill_mid_write_resumes_from_the_previous_local_step(tmp_path: Any) -> None:
    base = str(tmp_path)
    run_ranks(
        _train, 4, base, "xor", NODES4, 6, 2, None, 3.0, timeout_secs=TIMEOUT * 3,
        env={1: {"PITSTOP_KILL_AT": "replicate.mid:5"}}, allow_failures=True,
    )  # fmt: skip
    assert not any(os.path.exists(_node(base, n, 5) + "/manifest.json") for n in NODES4)
    _check(_resumed(base, "xor"), 4, "local")


def test_a_kill_during_a_flush_keeps_the_local_step_and_the_older_shared_one(
    tmp_path: Any,
) -> None:
    base = str(tmp_path)
    run_ranks(
        _train, 4, base, "partner", NODES4, 4, 2, None, 3.0, timeout_secs=TIMEOUT * 3,
        env={1: {"PITSTOP_KILL_AT": "flush.mid:2"}}, allow_failures=True,
    )  # fmt: skip
    shared = sorted(os.listdir(os.path.join(base, "shared")))
    assert "step-0000000002" in shared
    assert not os.path.exists(os.path.join(base, "shared", "step-0000000004", "manifest.json"))
    _check(_resumed(base, "partner"), 4, "local")


@pytest.mark.parametrize("scheme", ["single", "partner", "xor"])
def test_a_lost_node_then_a_spare_then_a_second_loss(tmp_path: Any, scheme: str) -> None:
    """single: the shared level serves; partner/xor: the local level, rebuilt onto the
    spare, which is protected again: a second node lost afterwards is rebuilt too."""
    base = _trained(tmp_path, scheme)
    shutil.rmtree(_node(base, "n1"))
    spare = ["n0", "spare", "n2", "n3"]
    results = _resumed(base, scheme, spare)
    if scheme == "single":
        assert _check(results, 4, "shared") == {"shared": results[0]["sources"]["shared"]}
        return
    sources = _check(results, 4, "local")
    assert sources["partner" if scheme == "partner" else "parity"] > 0
    assert "rank 1" in results[0]["repaired"]
    shutil.rmtree(_node(base, "n0"))  # its partner copy / parity now lives on the spare
    results = _resumed(base, scheme, spare)
    _check(results, 4, "local")
    assert "rank 0" in results[0]["repaired"]


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_two_ring_adjacent_nodes_lost_fall_back_to_shared(tmp_path: Any, scheme: str) -> None:
    base = _trained(tmp_path, scheme)
    shutil.rmtree(_node(base, "n1"))
    shutil.rmtree(_node(base, "n2"))
    _check(_resumed(base, scheme), 4, "shared")


def test_two_non_adjacent_nodes_lost_partner_still_local(tmp_path: Any) -> None:
    base = _trained(tmp_path, "partner")
    shutil.rmtree(_node(base, "n0"))
    shutil.rmtree(_node(base, "n2"))
    results = _resumed(base, "partner")
    _check(results, 4, "local")
    assert {"rank 0", "rank 2"} <= set(results[0]["repaired"])


@pytest.mark.parametrize("scheme", ["single", "partner", "xor"])
def test_a_flipped_byte_in_a_member_file(tmp_path: Any, scheme: str) -> None:
    base = _trained(tmp_path, scheme)
    flip_byte(os.path.join(_node(base, "n2", 4), "rank-00002.bin"), 100)
    results = _resumed(base, scheme)
    if scheme == "single":  # nothing to repair from: the shared level has step 4
        _check(results, 4, "shared")
        return
    _check(results, 4, "local")
    assert "rank 2" in results[0]["repaired"]
    assert _resumed(base, scheme)[0]["repaired"] == []  # repaired for good


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_a_corrupt_copy_or_parity_is_repaired(tmp_path: Any, scheme: str) -> None:
    base = _trained(tmp_path, scheme)
    name = "partner-rank-00000.bin" if scheme == "partner" else "xor-00001.bin"
    flip_byte(os.path.join(_node(base, "n1", 4), name), 10)
    results = _resumed(base, scheme)
    _check(results, 4, "local")
    assert results[0]["sources"].get("partner", 0) == results[0]["sources"].get("parity", 0) == 0
    assert results[0]["repaired"] == [
        "partner copy on rank 1" if scheme == "partner" else "parity on rank 1"
    ]
    assert _resumed(base, scheme)[0]["repaired"] == []


def test_newest_shared_corrupt_and_caches_empty_gives_the_older_shared(tmp_path: Any) -> None:
    base = _trained(tmp_path, "partner")
    shutil.rmtree(os.path.join(base, "local"))
    flip_byte(os.path.join(base, "shared", "step-0000000004", "rank-00003.bin"), 50)
    results = _resumed(base, "partner")
    _check(results, 2, "shared")
    entries = {
        e.name: e.status for e in pitstop.CheckpointManager(os.path.join(base, "shared")).entries()
    }
    assert entries["step-0000000004"] == "damaged"


def test_a_different_world_size_restores_from_shared(tmp_path: Any) -> None:
    base = _trained(tmp_path, "partner")
    results = _resumed(base, "partner", ["n0", "n1"])
    _check(results, 4, "shared")
