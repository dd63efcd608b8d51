"""Several ranks on gloo (spawned, per-test FileStore, short timeouts): ranks split the
bytes, sharded DTensor state, restore on another world size, failures on one rank."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pitstop
import pitstop.errors
from conftest import assert_same_tensors, flip_byte, make_state, tensors_of
from pitstop.cli.main import main as cli
from pitstop.testing.distributed import run_ranks

pytestmark = pytest.mark.dist
TIMEOUT = 60.0


def _state(rank: int, seed: int = 1) -> dict[str, Any]:
    """A DDP-like state: the model and optimizer equal on every rank, per-rank values apart."""
    state = make_state(seed=seed, steps=2)
    torch.manual_seed(seed)
    state["big"] = torch.nn.Linear(512, 300)  # large enough to be cut between ranks
    state["local"] = {"t": torch.full((3,), float(rank)), "rank": rank}
    return state


def _digest(state: dict[str, Any]) -> dict[str, list[float]]:
    return {k: v.double().flatten().tolist() for k, v in tensors_of(state).items()}


def _save(rank: int, world: int, root: str, mode: str, step: int = 5) -> dict[str, Any]:
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(replicated=mode, dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        ckpt.save(step, _state(rank))
    return _digest(_state(rank))


def _restore(rank: int, world: int, root: str) -> tuple[int | None, dict[str, Any]]:
    fresh = _state(rank, seed=99)
    fresh["local"]["t"] = torch.zeros(3)
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
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


def _restore_world(rank: int, world: int, root: str) -> dict[str, Any]:
    return _restore(rank, world, root)[1]


def _jobs(rank: int, world: int, jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> Any:
    """Several saves and restores in one set of rank processes, in order: each job's
    ``("ok", result)`` or ``("error", traceback)``."""
    out: list[tuple[str, Any]] = []
    for fn, args in jobs:
        try:
            out.append(("ok", fn(rank, world, *args)))
        except Exception:
            out.append(("error", traceback.format_exc()))
    return out


def _dtensor_save(rank: int, world: int, root: str) -> None:
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        ckpt.save(1, {"sharded": _dtensor_state(world, seed=3)["sharded"]})


def _dtensor_restore(rank: int, world: int, root: str) -> dict[str, list[float]]:
    fresh = _dtensor_state(world, seed=4)["sharded"]
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        assert ckpt.restore({"sharded": fresh}) == 1
    return {k: v.full_tensor().flatten().tolist() for k, v in fresh.items()}


T_SPLIT = "test_split_and_root_restore_the_same_bytes_on_any_world_size"
T_FOUR = "test_four_ranks_save_and_two_restore"
T_DTENSOR = "test_dtensor_state_round_trips_and_reshards"
T_DTENSOR4 = "test_dtensor_state_of_four_ranks_restores_on_two"
# the rank runs of the tests below, by key: (test, phase, world, job, its directory, its
# arguments after that). The jobs of one phase run in one set of rank processes (spawning
# ranks is what these tests wait for), the phases one after the other: a directory is
# restored in a later phase than its save, in processes that did not write it.
RUNS: dict[str, tuple[str, int, int, Callable[..., Any], str, tuple[Any, ...]]] = {
    "split saved": (T_SPLIT, 0, 2, _save, "split", ("split",)),
    "root saved": (T_SPLIT, 0, 2, _save, "root", ("root",)),
    "split on 4": (T_SPLIT, 1, 4, _restore_world, "split", ()),
    "four saved": (T_FOUR, 1, 4, _save, "four", ("split",)),
    "four on 2": (T_FOUR, 3, 2, _restore_world, "four", ()),
    "dtensor saved": (T_DTENSOR, 0, 2, _dtensor_save, "dtensor", ()),
    "dtensor on 4": (T_DTENSOR, 1, 4, _dtensor_restore, "dtensor", ()),
    "dtensor on 3": (T_DTENSOR, 2, 3, _dtensor_restore, "dtensor", ()),
    "dtensor on 2": (T_DTENSOR, 3, 2, _dtensor_restore, "dtensor", ()),
    "dtensor4 saved": (T_DTENSOR4, 1, 4, _dtensor_save, "dtensor4", ()),
    "dtensor4 on 2": (T_DTENSOR4, 3, 2, _dtensor_restore, "dtensor4", ()),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """The ``RUNS`` of the selected tests, phase by phase: each key's per-rank outcomes, and
    ``dir <name>`` the directories."""
    selected = {
        item.originalname for item in request.session.items if item.module is request.module
    }
    base = tmp_path_factory.mktemp("runs")
    out: dict[str, Any] = {}
    for phase in sorted({p for _, p, _, _, _, _ in RUNS.values()}):
        keys = [k for k, (t, p, *_) in RUNS.items() if p == phase and t in selected]
        if not keys:
            continue
        world = RUNS[keys[0]][2]
        assert all(RUNS[k][2] == world for k in keys)
        jobs = [(RUNS[k][3], (str(base / RUNS[k][4]), *RUNS[k][5])) for k in keys]
        results = run_ranks(_jobs, world, jobs, timeout_secs=TIMEOUT * len(jobs))
        for i, key in enumerate(keys):
            out[key] = [r[i] for r in results]
    out.update({f"dir {name}": str(base / name) for *_, name, _ in RUNS.values()})
    return out


def _outcome(runs: dict[str, Any], key: str) -> list[Any]:
    """Each rank's result of the run ``key``; a rank's error fails the test with it."""
    for rank, (kind, value) in enumerate(runs[key]):
        assert kind == "ok", f"{key}, rank {rank}:\n{value}"
    return [value for _, value in runs[key]]


def test_split_and_root_restore_the_same_bytes_on_any_world_size(runs: dict[str, Any]) -> None:
    split, root_mode = runs["dir split"], runs["dir root"]
    saved = _outcome(runs, "split saved")
    _outcome(runs, "root saved")
    # 2 -> 1: one process, no process group at all, takes rank 0's own values
    for where in (split, root_mode):
        fresh = _state(0, seed=99)
        with pitstop.CheckpointManager(where) as ckpt:
            assert ckpt.restore(fresh) == 5
        assert _digest(fresh) == saved[0]
    # 2 -> 4: ranks 2 and 3 take the own values of saved ranks 0 and 1
    four = _outcome(runs, "split on 4")
    assert [four[r] for r in range(4)] == [saved[0], saved[1], saved[0], saved[1]]


def test_four_ranks_save_and_two_restore(runs: dict[str, Any], capsys: Any) -> None:
    root = runs["dir four"]
    saved = _outcome(runs, "four saved")
    manifest = pitstop.CheckpointManager(root).entries()[0].manifest
    assert manifest is not None and manifest.world_size == 4
    assert sum(1 for t in manifest.tensors if t.global_shape is not None) > 0  # cut tensors
    two = _outcome(runs, "four on 2")
    assert two == [saved[0], saved[1]]
    assert cli(["verify", root]) == 0
    capsys.readouterr()
    assert cli(["inspect", root]) == 0
    shown = capsys.readouterr().out
    assert "world    4 rank(s)" in shown and "rank 3's own" in shown and "of [300, 512]" in shown


def _fail_on_rank1(rank: int, world: int, root: str) -> str:
    from pitstop.storage.local import LocalStorage
    from pitstop.testing import FaultyStorage

    storage: Any = LocalStorage(root)
    if rank == 1:
        storage = FaultyStorage(storage, fail={"persist": range(1, 100)})
    with pitstop.CheckpointManager(
        storage, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        try:
            ckpt.save(2, _state(rank))
        except pitstop.errors.DistributedCheckpointError as e:
            return f"{e.phase}|{e.ranks}|{e}"
        except pitstop.errors.CheckpointIOError as e:
            return f"own|{e.phase}|{e}"
    return "saved"


def test_a_failure_on_rank_1_reaches_rank_0_with_phase_and_rank(tmp_path: Any) -> None:
    root = str(tmp_path / "ck")
    out = run_ranks(_fail_on_rank1, 2, root, timeout_secs=TIMEOUT)
    phase, ranks, _text = out[0].split("|", 2)
    assert phase == "persist" and ranks == "[1]", out[0]
    assert out[1].startswith("own|persist"), out[1]
    assert not pitstop.CheckpointManager(root).steps()  # nothing committed


def _save_two(rank: int, world: int, root: str) -> None:
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=8.0)
    ) as ckpt:
        ckpt.save(1, _state(rank))
        ckpt.save(2, _state(rank, seed=2))


def test_a_rank_killed_mid_persist_commits_nothing_and_restore_takes_the_previous(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "ck")
    out = run_ranks(
        _save_two, 2, root, timeout_secs=TIMEOUT, allow_failures=True,
        env={1: {"PITSTOP_KILL_AT": "persist.after_data:2"}},
    )  # fmt: skip
    assert "exit code -9" in out[1], out[1]
    assert "DistributedCheckpointError" in out[0] and "rank(s) [1]" in out[0], out[0]
    assert pitstop.CheckpointManager(root).steps() == [1]
    fresh = _state(0, seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh) == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks trained it (bitwise the same arithmetic)
    try:
        assert _digest(fresh) == _digest(_state(0))
    finally:
        torch.set_num_threads(threads)


def _dtensor_state(world: int, seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    full = {"rows": torch.randn(10, 7), "cols": torch.randn(6, 9), "rep": torch.randn(5)}
    return {
        "sharded": {
            "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
            "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
            "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        },
        "full": full,
    }


def test_dtensor_state_round_trips_and_reshards(runs: dict[str, Any]) -> None:
    root = runs["dir dtensor"]
    _outcome(runs, "dtensor saved")
    torch.manual_seed(3)
    expected = {"rows": torch.randn(10, 7), "cols": torch.randn(6, 9), "rep": torch.randn(5)}
    want = {k: v.flatten().tolist() for k, v in expected.items()}
    manifest = pitstop.CheckpointManager(root).entries()[0].manifest
    assert manifest is not None
    chunks = [t for t in manifest.tensors if t.key.startswith("sharded/")]
    assert sorted((t.key, t.start) for t in chunks) == [
        ("sharded/cols", (0, 0)), ("sharded/cols", (0, 5)), ("sharded/rep", (0,)),
        ("sharded/rows", (0, 0)), ("sharded/rows", (5, 0)),
    ]  # fmt: skip
    for world in (2, 3, 4):  # the same mesh size, and others (2 -> 4)
        out = _outcome(runs, f"dtensor on {world}")
        assert len(out) == world and all(o == want for o in out)
    plain = {k: torch.zeros_like(v) for k, v in expected.items()}  # one process, plain tensors
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore({"sharded": plain}) == 1
    assert_same_tensors(plain, expected)


def test_dtensor_state_of_four_ranks_restores_on_two(runs: dict[str, Any]) -> None:
    root = runs["dir dtensor4"]
    _outcome(runs, "dtensor4 saved")
    manifest = pitstop.CheckpointManager(root).entries()[0].manifest
    assert manifest is not None and manifest.world_size == 4
    rows = sorted(t.start for t in manifest.tensors if t.key == "sharded/rows")
    assert rows == [(0, 0), (3, 0), (6, 0), (9, 0)]  # 10 rows over 4 ranks: 3, 3, 3, 1
    torch.manual_seed(3)
    expected = {"rows": torch.randn(10, 7), "cols": torch.randn(6, 9), "rep": torch.randn(5)}
    out = _outcome(runs, "dtensor4 on 2")
    assert out == [{k: v.flatten().tolist() for k, v in expected.items()}] * 2


def _save_other_steps(rank: int, world: int, root: str) -> str:
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        try:
            ckpt.save(2 + rank, _state(rank))
        except pitstop.errors.DistributedCheckpointError as e:
            return f"{e.phase}|{e}"
    return "saved"


def test_ranks_saving_different_steps_all_get_one_clear_error(tmp_path: Any) -> None:
    root = str(tmp_path / "ck")
    out = run_ranks(_save_other_steps, 2, root, timeout_secs=TIMEOUT)
    for text in out:
        assert text.startswith("plan|ranks disagree on the step to save: [2, 3]"), text
    assert not os.path.exists(root) or not pitstop.CheckpointManager(root).steps()


def _stage_fails_on_rank1(rank: int, world: int, root: str) -> list[str]:
    import pitstop.engine.saver as saver

    out = []
    # the timeout is longer than run_ranks': a rank left waiting for rank 1 would hang the test
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=3 * TIMEOUT)
    ) as ckpt:
        for step in (1, 2, 3):
            real = saver.stage
            if step == 2 and rank == 1:

                def boom(*args: Any, **kwargs: Any) -> Any:
                    raise MemoryError("no memory for the arena")

                saver.stage = boom  # type: ignore[assignment]
            try:
                ckpt.save(step, _state(rank, seed=step))
                out.append(f"{step}|saved")
            except pitstop.errors.DistributedCheckpointError as e:
                out.append(f"{step}|{e.phase}|{e.ranks}|{e}")
            except MemoryError as e:
                out.append(f"{step}|own|{e}")
            finally:
                saver.stage = real  # type: ignore[assignment]
    return out


def test_a_rank_failing_to_stage_fails_the_save_at_once_and_the_next_save_works(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "ck")
    out = run_ranks(_stage_fails_on_rank1, 2, root, timeout_secs=TIMEOUT)
    assert out[1] == ["1|saved", "2|own|no memory for the arena", "3|saved"], out[1]
    assert out[0][0] == "1|saved" and out[0][2] == "3|saved", out[0]
    phase, ranks, text = out[0][1].split("|", 3)[1:]
    assert (phase, ranks) == ("stage", "[1]") and "no memory for the arena" in text, out[0][1]
    ckpt = pitstop.CheckpointManager(root)
    assert ckpt.steps() == [1, 3] and not os.path.exists(os.path.join(root, "step-0000000002"))


def _save_steps(rank: int, world: int, root: str, steps: list[int]) -> dict[str, Any]:
    """:func:`_save` (split) of each step, one after the other; what the last saved."""
    return [_save(rank, world, root, "split", step) for step in steps][-1]


def _restore_counting(rank: int, world: int, root: str) -> tuple[int | None, int, dict[str, Any]]:
    from pitstop.storage.local import LocalStorage
    from pitstop.testing import FaultyStorage

    counting = FaultyStorage(LocalStorage(root))  # fails nothing; counts the bytes read
    fresh = _state(rank, seed=99)
    with pitstop.CheckpointManager(
        counting, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ck:
        step = ck.restore(fresh)
    return step, counting.bytes_read, _digest(fresh)


def test_each_rank_reads_its_part_of_the_replicated_bytes_and_damage_fails_all_back(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "ck")
    saved = run_ranks(_save_steps, 2, root, [1, 2], timeout_secs=TIMEOUT)  # step 2's values
    manifest = pitstop.CheckpointManager(root).entries()[-1].manifest
    assert manifest is not None
    stream = sum(f.stream_nbytes or 0 for f in manifest.files)
    out = run_ranks(_restore_counting, 2, root, timeout_secs=TIMEOUT)
    for rank, (step, nread, digest) in enumerate(out):
        assert step == 2 and digest == saved[rank]
        assert nread < 0.75 * stream, (rank, nread, stream)  # its slice, not the whole stream
    # damage in rank 1's slice: only rank 1 reads it, both ranks go back to step 1 together
    path = os.path.join(root, "step-0000000002", "rank-00001.bin")
    flip_byte(path, 100)
    out = run_ranks(_restore_counting, 2, root, timeout_secs=TIMEOUT)
    assert [o[0] for o in out] == [1, 1]
    assert [o[2] for o in out] == saved  # (both steps saved the same bytes)
    statuses = {e.step: e.status for e in pitstop.CheckpointManager(root).entries()}
    assert statuses == {1: "committed", 2: "damaged"}, statuses


def _restore_mismatched(rank: int, world: int, root: str, steps: list[int | None]) -> str:
    fresh = _state(rank, seed=99)
    if rank == 1 and steps == [None, None]:
        fresh["big"] = torch.nn.Linear(512, 301)  # fits on rank 0 only
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        try:
            return f"restored {ckpt.restore(fresh, step=steps[rank])}"
        except pitstop.errors.DistributedCheckpointError as e:
            return f"dist|{e.phase}|{e.ranks}|{e}"
        except pitstop.errors.CheckpointError as e:
            return f"own|{type(e).__name__}|{e}"


def _restores_mismatched(
    rank: int, world: int, root: str, cases: list[list[int | None]]
) -> list[str]:
    """:func:`_restore_mismatched` of each case, one after the other (a fresh manager each)."""
    return [_restore_mismatched(rank, world, root, steps) for steps in cases]


def test_a_restore_failing_on_one_rank_or_asked_for_other_steps_fails_on_every_rank(
    tmp_path: Any,
) -> None:
    root = str(tmp_path / "ck")
    run_ranks(_save_steps, 2, root, [3, 5], timeout_secs=TIMEOUT)
    # the cases one after the other in one set of ranks (each with a fresh manager): a failed
    # restore leaves the ranks able to go on
    cases: list[list[int | None]] = [[None, None], [None, 3], [3, None], [3, 5]]
    out = run_ranks(_restores_mismatched, 2, root, cases, timeout_secs=TIMEOUT * len(cases))
    # the live state of rank 1 does not fit: rank 0 must not report success
    assert out[0][0].startswith("dist|restore|[1]|"), out[0][0]
    assert out[1][0].startswith("own|StateMismatchError|"), out[1][0]
    # ranks asking for different steps: one clear error everywhere, nothing set aside
    for i, steps in enumerate(cases[1:], 1):
        for text in (out[0][i], out[1][i]):
            assert text.startswith("dist|restore|") and "ranks disagree on the step" in text, (
                steps,
                text,
            )
    assert pitstop.CheckpointManager(root).steps() == [3, 5]


def _save_empty_own(rank: int, world: int, root: str) -> str:
    state = _state(rank)
    state["extra"] = torch.empty(0)  # a per-rank tensor with no bytes
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        try:
            ckpt.save(1, state)
        except pitstop.errors.DistributedCheckpointError as e:
            return f"dist|{e.phase}|{e.ranks}|{e}"
        fresh = _state(rank, seed=99)
        fresh["extra"] = torch.ones(0)
        return f"restored {ckpt.restore(fresh)}"


def test_an_empty_per_rank_tensor_saves_and_ranks_with_other_settings_are_refused(
    tmp_path: Any,
) -> None:
    out = run_ranks(_save_empty_own, 2, str(tmp_path / "a"), timeout_secs=TIMEOUT)
    assert out == ["restored 1", "restored 1"]
    env = {1: {"PITSTOP_REPLICATED": "root", "PITSTOP_CHUNK_BYTES": str(8 << 20)}}
    out = run_ranks(_save_empty_own, 2, str(tmp_path / "b"), env=env, timeout_secs=TIMEOUT)
    for text in out:
        assert text.startswith("dist|plan|[1]|ranks save with different settings"), text


def _save_own(rank: int, world: int, root: str, value: float) -> None:
    state = {"model": torch.nn.Linear(2, 2), "own": torch.full((2,), value if rank else 0.0)}
    torch.manual_seed(0)
    state["model"] = torch.nn.Linear(2, 2)
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT)
    ) as ckpt:
        ckpt.save(1, state)


def test_diff_and_load_see_every_rank_of_a_job(tmp_path: Any, capsys: Any) -> None:
    from pitstop.cli.main import main

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_ranks(_save_own, 2, a, 1.0, timeout_secs=TIMEOUT)
    run_ranks(_save_own, 2, b, 2.0, timeout_secs=TIMEOUT)  # differs in rank 1's own value only
    assert torch.equal(pitstop.load(a, rank=1)["own"], torch.full((2,), 1.0))
    assert torch.equal(pitstop.load(a)["own"], torch.zeros(2))  # rank 0's, by default
    assert main(["diff", a, b]) == 1
    assert "rank1/own" in capsys.readouterr().out
    assert main(["diff", a, a]) == 0


def _stall_state(rank: int) -> dict[str, Any]:
    """About 192 MiB: weights, momentum, a BatchNorm's buffers (eager, replicated, last in
    the module) and the RNG streams (eager, each rank's own)."""
    torch.manual_seed(3)
    layers: list[torch.nn.Module] = [torch.nn.Linear(2048, 2048) for _ in range(6)]
    model = torch.nn.Sequential(*layers, torch.nn.BatchNorm1d(2048))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 2048)).square().mean().backward()
    opt.step()
    return {"model": model, "opt": opt, "rng": pitstop.RNGState()}


def _model_digest(state: dict[str, Any]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors_of(state["model"]).values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _staged_before_any_write(rank: int, world: int, root: str) -> tuple[bool, str]:
    """Under host_memory_bytes smaller than a rank's part, with every write held at the gate:
    async_save must return once the eager tensors are staged, before any byte is written."""
    import threading

    from pitstop.storage import LocalStorage
    from pitstop.testing import GateStorage

    gate = GateStorage(LocalStorage(root), hold=["write_data"], timeout=TIMEOUT)
    options = pitstop.SaveOptions(host_memory_bytes=64 << 20, dist_timeout_secs=TIMEOUT)
    state = _stall_state(rank)
    returned = threading.Event()
    with pitstop.CheckpointManager(gate, options=options) as ckpt:

        def save() -> None:
            ckpt.async_save(1, state)
            returned.set()

        saver = threading.Thread(target=save, daemon=True)
        saver.start()
        early = returned.wait(10.0)  # a stall for the whole write waits for the gate
        gate.open("write_data")
        saver.join(TIMEOUT)
        ckpt.wait()
    return early, _model_digest(state)


@pytest.mark.parametrize("world", [1, 2])
def test_a_ring_save_stalls_only_for_the_eager_part_on_every_rank(
    tmp_path: Any, world: int
) -> None:
    root = str(tmp_path / "ck")
    out = run_ranks(_staged_before_any_write, world, root, timeout_secs=TIMEOUT)
    early = [e for e, _ in out]
    assert early == [True] * world, early  # main: rank 1's eager RNG state lies past its slice
    fresh = _stall_state(0)
    for p in fresh["model"].parameters():
        p.data.zero_()
    pitstop.load(root, fresh)
    assert _model_digest(fresh) == out[0][1]
