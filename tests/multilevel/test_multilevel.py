"""Multi-level checkpoints on emulated nodes (one directory per node id, gloo, spawned ranks):
the fault matrix of PRIOR-ART.md's SCR section. Every case asserts the step resumed from,
the level that served it and bit-identical state."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any

import pytest
import torch

import pitstop
from conftest import flip_byte, make_state, tensors_of
from pitstop.format.manifest import seal
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
        _levels(base, scheme, every),
        topology=nodes,
        options=pitstop.SaveOptions.from_env(dist_timeout_secs=timeout),
    )
    with ckpt:
        start = ckpt.restore(state) or 0
        for step in range(start + 1, steps + 1):
            _advance(state, rank, step)
            if crash == (rank, step):
                os._exit(9)
            ckpt.save(step, state)
        ckpt.wait()
    assert ckpt.hooks.levels is not None and ckpt.hooks.levels.flusher is not None
    return {"start": start, "flushes": [(r.step, r.ok) for r in ckpt.flush_records]}


def _resume(
    rank: int, world: int, base: str, scheme: str, nodes: list[str], train_to: int = 0
) -> dict[str, Any]:
    state = _state(rank, seed=99)
    state["local"]["t"] = torch.zeros(3)
    with pitstop.CheckpointManager(
        _levels(base, scheme, 10),
        topology=nodes,
        options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT),
    ) as ckpt:
        step = ckpt.restore(state)
        info = ckpt.last_restore
        restored = _digest(state)
        for s in range((step or 0) + 1, train_to + 1):  # the run goes on from there
            _advance(state, rank, s)
            ckpt.save(s, state)
            assert ckpt.latest_step() == s  # committed on this rank's node when save returns
    return {
        "step": step,
        "level": info.level if info else None,
        "sources": info.sources if info else None,
        "repaired": info.repaired if info else None,
        "digest": restored,
        "final": _digest(state),
    }


_EXPECTED: dict[int, list[Any]] = {}  # world -> per rank, the state after each step to 12


def _check(results: list[dict[str, Any]], step: int, level: str) -> dict[str, int]:
    world = len(results)
    if world == 4 and world not in _EXPECTED:
        _train_schemes()  # computes them too
    if world not in _EXPECTED and world < 4 and 4 in _EXPECTED:
        _EXPECTED[world] = _EXPECTED[4][:world]  # a rank's states do not depend on the world
    if world not in _EXPECTED:
        _EXPECTED[world] = run_ranks(_expected, world, 12, timeout_secs=TIMEOUT)
    for rank, r in enumerate(results):
        assert (r["step"], r["level"]) == (step, level), r
        assert r["digest"] == _EXPECTED[world][rank][step], f"rank {rank} state differs"
    return results[0]["sources"]


_TRAINED: dict[str, str] = {}
SCHEMES = ["single", "partner", "xor"]


def _train_all(rank: int, world: int, bases: list[str], steps: int, every: int) -> dict[str, Any]:
    """A job of each scheme trained (the flushes of each), and the expected states: one set
    of rank processes for all (spawning ranks is what tests wait for)."""
    flushes = [
        _train(rank, world, base, scheme, NODES4, steps, every)["flushes"]
        for base, scheme in zip(bases, SCHEMES)
    ]
    return {"flushes": flushes, "expected": _expected(rank, world, 12)}


def _train_schemes(steps: int = 4, every: int = 2) -> None:
    bases = [tempfile.mkdtemp(prefix=f"pitstop-ml-{s}-{steps}-{every}-") for s in SCHEMES]
    out = run_ranks(_train_all, 4, bases, steps, every, timeout_secs=TIMEOUT * 6)
    flushed = [s for s in range(every, steps + 1, every)]
    for scheme, base, flushes in zip(SCHEMES, bases, out[0]["flushes"]):
        assert flushes == [(s, True) for s in flushed], scheme
        _TRAINED[f"{scheme}-{steps}-{every}"] = base
    _EXPECTED.setdefault(4, [r["expected"] for r in out])


def _trained(tmp_path: Any, scheme: str, steps: int = 4, every: int = 2) -> str:
    """A copy of a job of 4 ranks on 4 nodes trained to ``steps`` (local keeps the last two;
    every second step flushed); trained once per scheme and size for the whole module (the
    three schemes in one set of rank processes)."""
    key = f"{scheme}-{steps}-{every}"
    if key not in _TRAINED:
        _train_schemes(steps, every)
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


# the crashed runs, by test: (scheme, steps, crash, env of the ranks); each dies in its own
# set of rank processes (a kill ends them), their restarts share one with the fault
# matrix's (see `restarts`)
CRASHES: dict[str, tuple[str, int, tuple[int, int] | None, dict[int, dict[str, str]]]] = {
    "between checkpoints": ("partner", 6, (2, 5), {}),  # rank 2 dies before saving step 5
    "mid write": ("xor", 6, None, {1: {"PITSTOP_KILL_AT": "replicate.mid:5"}}),
    "mid flush": ("partner", 4, None, {1: {"PITSTOP_KILL_AT": "flush.mid:2"}}),
}
CRASH_TESTS = {  # test -> the crash it reads
    "test_a_rank_that_crashes_between_checkpoints_resumes_locally": "between checkpoints",
    "test_a_kill_mid_write_resumes_from_the_previous_local_step": "mid write",
    "test_a_kill_during_a_flush_keeps_the_local_step_and_the_older_shared_one": "mid flush",
}


@pytest.fixture(scope="module")
def crashed(request: Any, tmp_path_factory: Any) -> dict[str, dict[str, Any]]:
    """The crashes of the selected tests of ``CRASH_TESTS``: each job trained until its rank
    dies (what the ranks returned, and what its directories held then); `restarts` restarts
    them."""
    names = [
        CRASH_TESTS[item.originalname] for item in request.session.items
        if item.module is request.module and item.originalname in CRASH_TESTS
    ]  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        scheme, steps, crash, env = CRASHES[name]
        base = str(tmp_path_factory.mktemp("crash"))
        trained = run_ranks(
            _train, 4, base, scheme, NODES4, steps, 2, crash, 3.0, timeout_secs=TIMEOUT * 3,
            env=env, allow_failures=True,
        )  # fmt: skip
        shared = os.path.join(base, "shared")
        out[name] = {
            "trained": trained,
            "base": base,
            "manifests": sorted(
                os.path.relpath(os.path.join(d, "manifest.json"), base)
                for d, _, files in os.walk(base)
                if "manifest.json" in files
            ),
            "shared": sorted(os.listdir(shared)) if os.path.isdir(shared) else [],
        }
    return out


def _manifest_of(node: str, step: int) -> str:
    return os.path.join("local", node, f"step-{step:010d}", "manifest.json")


def test_a_rank_that_crashes_between_checkpoints_resumes_locally(restarts: Any) -> None:
    crash = restarts["crashes"]["between checkpoints"]
    assert isinstance(crash["trained"][2], str)  # rank 2 died before step 5; the others failed
    _check(crash["resumed"], 4, "local")


def test_a_kill_mid_write_resumes_from_the_previous_local_step(restarts: Any) -> None:
    crash = restarts["crashes"]["mid write"]
    assert not any(_manifest_of(n, 5) in crash["manifests"] for n in NODES4)
    assert all(_manifest_of(n, 4) in crash["manifests"] for n in NODES4)
    _check(crash["resumed"], 4, "local")


def test_a_kill_during_a_flush_keeps_the_local_step_and_the_older_shared_one(
    restarts: Any,
) -> None:
    crash = restarts["crashes"]["mid flush"]
    assert "step-0000000002" in crash["shared"]
    assert os.path.join("shared", "step-0000000002", "manifest.json") in crash["manifests"]
    assert os.path.join("shared", "step-0000000004", "manifest.json") not in crash["manifests"]
    _check(crash["resumed"], 4, "local")


def _resume_all(rank: int, world: int, jobs: list[tuple[str, str, list[str], int]]) -> list[Any]:
    """Several restarts in one set of processes (spawning ranks is what tests wait for)."""
    return [_resume(rank, world, *job) for job in jobs]


def _first_data_offset(base: str, step: int, name: str) -> int:
    manifest = pitstop.CheckpointManager(os.path.join(base, "shared")).entries()
    entry = next(e for e in manifest if e.step == step)
    assert entry.manifest is not None
    return min(t.offset for t in entry.manifest.tensors if t.file == name and t.nbytes)


def _lose(*nodes: str) -> Any:
    return lambda base: [shutil.rmtree(_node(base, n)) for n in nodes]


def _flip(node: str, name: str) -> Any:
    def damage(base: str) -> None:
        path = os.path.join(_node(base, node, 4), name)
        offset = _first_data_offset(base, 4, name) if name.startswith("rank-") else 10
        flip_byte(path, offset)

    return damage


def _lose_step(step: int, *nodes: str) -> Any:
    return lambda base: [shutil.rmtree(_node(base, n, step)) for n in nodes]


def _and(*damages: Any) -> Any:
    return lambda base: [d(base) for d in damages]


def _corrupt_shared(base: str) -> None:
    name = "rank-00003.bin"
    flip_byte(
        os.path.join(base, "shared", "step-0000000004", name), _first_data_offset(base, 4, name)
    )


def _corrupt_shared_and_empty_caches(base: str) -> None:
    _corrupt_shared(base)
    shutil.rmtree(os.path.join(base, "local"))


def _other_manifest(node: str) -> Any:
    """A manifest of step 4 that parses but is not the one the other nodes hold."""

    def damage(base: str) -> None:
        path = os.path.join(_node(base, node, 4), "manifest.json")
        with open(path) as f:
            body = json.load(f)
        body["created_unix_secs"] += 1.0
        with open(path, "w") as f:
            json.dump(seal(body), f)

    return damage


def _write(node: str, name: str, data: bytes) -> Any:
    def damage(base: str) -> None:
        with open(os.path.join(_node(base, node, 4), name), "wb") as f:
            f.write(data)

    return damage


def _mark_damaged(node: str, reason: str) -> Any:
    """Step 4 of ``node`` marked DAMAGED as pitstop marks it (naming its checkpoint)."""

    def damage(base: str) -> None:
        from pitstop.format.manifest import Manifest, manifest_digest
        from pitstop.format.markers import marker_text

        d = _node(base, node, 4)
        with open(os.path.join(d, "manifest.json"), "rb") as f:
            m = Manifest.loads(f.read())
        text = marker_text("damaged", 4, reason=reason, manifest_digest=manifest_digest(m))
        with open(os.path.join(d, "DAMAGED"), "w") as f:
            f.write(text)

    return damage


def _parity_of_step_3(base: str) -> None:
    """Rank 1's parity of step 3, relabelled as step 4's: whole, consistent, wrong."""
    old, new = _node(base, "n1", 3), _node(base, "n1", 4)
    shutil.copy(os.path.join(old, "xor-00001.bin"), os.path.join(new, "xor-00001.bin"))
    with open(os.path.join(old, "xor-00001.json")) as f:
        meta = json.load(f)
    meta["step"] = 4
    with open(os.path.join(new, "xor-00001.json"), "w") as f:
        json.dump(meta, f)


def _shared_is_a_file(base: str) -> None:
    shutil.rmtree(os.path.join(base, "shared"))
    with open(os.path.join(base, "shared"), "w") as f:
        f.write("not a directory")


SPARE = ["n0", "spare", "n2", "n3"]
# case: (damage, topology at restart, {scheme: (step, level, repaired)}[, train on to]);
# repaired None: any
CASES: dict[str, tuple[Any, ...]] = {
    "clean restart": (
        lambda base: None, NODES4,
        {"single": (4, "local", []), "partner": (4, "local", []), "xor": (4, "local", [])},
    ),
    "lost node, spare in its place": (
        _lose("n1"), SPARE,
        {"single": (4, "shared", None),
         "partner": (4, "local", ["rank 1", "partner copy on rank 1", "manifest on node spare"]),
         "xor": (4, "local", ["rank 1", "parity on rank 1", "manifest on node spare"])},
    ),
    "two ring-adjacent nodes lost": (
        _lose("n1", "n2"), NODES4, {"partner": (4, "shared", None), "xor": (4, "shared", None)},
    ),
    "two non-adjacent nodes lost": (
        _lose("n0", "n2"), NODES4,
        {"partner": (4, "local", ["rank 0", "rank 2", "partner copy on rank 0",
                                  "partner copy on rank 2", "manifest on node n0",
                                  "manifest on node n2"])},
    ),
    "flipped byte in a member file": (
        _flip("n2", "rank-00002.bin"), NODES4,
        {"single": (4, "shared", None), "partner": (4, "local", ["rank 2"]),
         "xor": (4, "local", ["rank 2"])},
    ),
    "corrupt partner copy": (
        _flip("n1", "partner-rank-00000.bin"), NODES4,
        {"partner": (4, "local", ["partner copy on rank 1"])},
    ),
    "corrupt parity": (
        _flip("n1", "xor-00001.bin"), NODES4, {"xor": (4, "local", ["parity on rank 1"])},
    ),
    "newest shared corrupt, caches empty": (
        _corrupt_shared_and_empty_caches, NODES4,
        {"single": (2, "shared", None), "partner": (2, "shared", None)},
    ),
    # hostile: each of these failed on the first multi-level code
    "newest local lost, newest shared corrupt, older local intact; then train on": (
        _and(_lose_step(4, "n1", "n2"), _corrupt_shared), NODES4,
        {"single": (3, "local", []), "partner": (3, "local", []), "xor": (3, "local", [])}, 6,
    ),
    "another manifest of the step on the lowest node": (
        _other_manifest("n0"), NODES4,
        {"single": (4, "local", ["manifest on node n0"]),
         "partner": (4, "local", ["manifest on node n0"])},
    ),
    "garbage manifest on one node": (
        _write("n2", "manifest.json", b"garbage"), NODES4,
        {"single": (4, "local", ["manifest on node n2"]),
         "xor": (4, "local", ["manifest on node n2"])},
    ),
    "step marked damaged on one node": (
        _mark_damaged("n3", "a tool said so"), NODES4,
        {"partner": (4, "local", ["manifest on node n3"])},
    ),
    "parity of another step": (
        _parity_of_step_3, NODES4, {"xor": (4, "local", ["parity on rank 1"])},
    ),
    "shared level unusable (a file); then train on": (
        _shared_is_a_file, NODES4, {"single": (4, "local", []), "xor": (4, "local", [])}, 5,
    ),
}  # fmt: skip


def _cases(scheme: str) -> dict[str, tuple[Any, ...]]:
    return {name: c for name, c in CASES.items() if scheme in c[2]}


@pytest.fixture(scope="module")
def restarts(request: Any, tmp_path_factory: Any, crashed: dict[str, Any]) -> dict[str, Any]:
    """The restarts of the fault matrix of each scheme selected, per rank and case: after
    the damage, then (partner and xor) once more after a second node is lost; and those of
    the jobs ``crashed`` (``"crashes"``: the crash, its ``"resumed"`` per rank). One set of
    rank processes restarts the crashed jobs and every scheme's cases (spawning ranks is
    what tests wait for); each test asserts its own."""
    schemes = [
        item.callspec.params["scheme"] for item in request.session.items
        if item.module is request.module and item.originalname == "test_the_fault_matrix"
    ]  # fmt: skip
    jobs: dict[str, list[tuple[str, str, list[str], int]]] = {}
    for scheme in schemes:
        tmp = tmp_path_factory.mktemp(f"matrix-{scheme}")
        jobs[scheme] = []
        for i, (damage, nodes, *rest) in enumerate(_cases(scheme).values()):
            base = _trained(tmp / str(i), scheme)
            damage(base)
            jobs[scheme].append((base, scheme, nodes, rest[1] if len(rest) > 1 else 0))
    crash_jobs = [(crash["base"], CRASHES[name][0], NODES4, 0) for name, crash in crashed.items()]
    timeout = TIMEOUT * (8 * len(schemes) + 3 * len(crash_jobs))
    results = run_ranks(
        _resume_all, 4, crash_jobs + [j for s in schemes for j in jobs[s]], timeout_secs=timeout
    )
    for i, crash in enumerate(crashed.values()):
        crash["resumed"] = [r[i] for r in results]
    results = [r[len(crash_jobs) :] for r in results]
    again_schemes = [s for s in schemes if s != "single"]
    for scheme in again_schemes:
        spare = list(_cases(scheme)).index("lost node, spare in its place")
        shutil.rmtree(_node(jobs[scheme][spare][0], "n0"))  # its copy / parity was rebuilt there
    again = run_ranks(
        _resume_all, 4, [job[:3] for s in again_schemes for job in jobs[s]], timeout_secs=timeout
    ) if again_schemes else [[]] * 4  # fmt: skip
    out: dict[str, Any] = {"crashes": crashed}
    first = second = 0
    for scheme in schemes:
        n = len(jobs[scheme])
        out[scheme] = ([r[first : first + n] for r in results], [])
        first += n
        if scheme != "single":
            out[scheme] = (out[scheme][0], [r[second : second + n] for r in again])
            second += n
    return out


@pytest.mark.parametrize("scheme", ["single", "partner", "xor"])
def test_the_fault_matrix(restarts: dict[str, Any], scheme: str) -> None:
    """Each case: the step resumed from, the level that served it, bit-identical state, what
    was repaired; then every case restarts once more with nothing repaired (redundancy was
    re-established), and a second node lost after the spare came in is rebuilt too."""
    cases = _cases(scheme)
    results, again = restarts[scheme]
    for j, (name, (_, _, expect, *on)) in enumerate(cases.items()):
        per_rank = [r[j] for r in results]
        step, level, repaired = expect[scheme]
        sources = _check(per_rank, step, level)
        for rank, r in enumerate(per_rank):  # the run went on from there, saving each step
            assert r["final"] == _EXPECTED[4][rank][on[0] if on else step], name
        if repaired is not None:
            assert per_rank[0]["repaired"] == repaired, name
        if level == "shared":
            assert sources == {"shared": sources["shared"]} and sources["shared"] > 0, name
        elif "rank 1" in (repaired or []):
            assert sources["partner" if scheme == "partner" else "parity"] > 0, name
    if scheme == "single":
        return
    spare = list(cases).index("lost node, spare in its place")
    for j, (name, (_, _, expect, *on)) in enumerate(cases.items()):
        per_rank = [r[j] for r in again]
        if j == spare:  # a second loss after the spare came in: rebuilt again
            _check(per_rank, 4, "local")
            what = "partner copy" if scheme == "partner" else "parity"
            assert per_rank[0]["repaired"] == ["rank 0", f"{what} on rank 0", "manifest on node n0"]
        elif expect[scheme][1] == "local":
            assert per_rank[0]["repaired"] == [], name
            assert per_rank[0]["step"] == (on[0] if on else expect[scheme][0]), name


def test_a_different_world_size_restores_from_shared(tmp_path: Any) -> None:
    base = _trained(tmp_path, "partner")
    _check(_resumed(base, "partner", ["n0", "n1"]), 4, "shared")


def _save_slow_commits(rank: int, world: int, base: str) -> list[int | None]:
    """Two ranks per node; each node's leader takes half a second to commit."""
    from pitstop.storage.local import LocalStorage

    commit = LocalStorage.commit

    def slow(self: LocalStorage, directory: str, manifest: bytes) -> None:
        time.sleep(0.5)
        commit(self, directory, manifest)

    LocalStorage.commit = slow  # type: ignore[method-assign]
    seen = []
    with pitstop.CheckpointManager(_levels(base, "partner", 10), topology=["a", "a", "b", "b"], options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)) as ckpt:  # fmt: skip
        for step in (1, 2):
            ckpt.save(step, _state(rank))
            seen.append(ckpt.latest_step())
    return seen


def test_save_returns_once_the_step_is_committed_on_the_callers_node(tmp_path: Any) -> None:
    assert run_ranks(_save_slow_commits, 4, str(tmp_path), timeout_secs=TIMEOUT * 3) == [[1, 2]] * 4


def _two_nodes_one_directory(rank: int, world: int, path: str) -> str:
    try:
        pitstop.CheckpointManager(
            [pitstop.Local(path)],
            topology=["a", "b"],
            options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT),
        )
    except pitstop.UnsupportedSetupError as e:
        return str(e)
    return "accepted"


def test_two_nodes_on_one_local_directory_are_refused(tmp_path: Any) -> None:
    out = run_ranks(_two_nodes_one_directory, 2, str(tmp_path / "local"), timeout_secs=TIMEOUT * 3)
    assert all("nodes 'a' and 'b' share one local directory" in e for e in out), out
