"""A root is a list of levels of any length: every save to the first (node-local) level,
each further level flushed on its own schedule (a schedule policy) with its own retention;
a restart takes the newest step any level can deliver, the faster level first."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

import pitstop


def _steps(path: Any) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(path) if n.startswith("step-"))


def _three(tmp_path: Any, **near: Any) -> list[Any]:
    return [
        pitstop.Local(tmp_path / "local" / "{node}", keep_last=2),
        pitstop.Shared(tmp_path / "near", every=1, name="near", **near),
        pitstop.Shared(tmp_path / "far", every=3, name="far"),
    ]


def _train(ckpt: pitstop.CheckpointManager, model: torch.nn.Module, steps: range) -> None:
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(float(step))
        ckpt.save(step, {"model": model})
        _drain(ckpt)  # (a level with two flushes queued would put the next one off)


def _drain(ckpt: pitstop.CheckpointManager) -> None:
    levels = ckpt.hooks.levels
    assert levels is not None
    for flusher in levels.flushers:
        flusher.drain()


def test_three_levels_each_flushed_on_its_schedule_with_its_retention(tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 4)
    levels = _three(tmp_path, keep_last=3)
    with pitstop.CheckpointManager(levels, topology=["n0"], keep_last=1) as ckpt:
        _train(ckpt, model, range(1, 8))
        _drain(ckpt)
        assert sorted(r.level for r in ckpt.flush_records if r.step == 6) == ["far", "near"]
        assert _steps(tmp_path / "local" / "n0") == [6, 7]
        assert _steps(tmp_path / "near") == [5, 6, 7]  # Shared(keep_last=3)
        assert _steps(tmp_path / "far") == [6]  # every 3rd commit; the manager's keep_last=1
    assert _steps(tmp_path / "far") == [7]  # close() flushes the newest to every level


def test_a_restart_takes_the_fastest_level_that_still_holds_the_newest_step(
    tmp_path: Any,
) -> None:
    model = torch.nn.Linear(4, 4)
    levels = _three(tmp_path)
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        _train(ckpt, model, range(1, 7))
    served = []
    for gone in (["local"], ["local", "near"]):  # a restart fetches the step into local
        for name in gone:
            shutil.rmtree(tmp_path / name)
        fresh = torch.nn.Linear(4, 4)
        with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
            assert ckpt.restore({"model": fresh}) == 6
            assert ckpt.last_restore is not None
            served.append(ckpt.last_restore.level)
        assert torch.equal(fresh.weight, model.weight)
    assert served == ["near", "far"]
    assert 6 in _steps(tmp_path / "local" / "n0")  # fetched back into the local level


def test_a_damaged_step_on_the_fast_level_falls_back_to_the_slower_one(tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 4)
    levels = _three(tmp_path)
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        _train(ckpt, model, range(1, 7))
    shutil.rmtree(tmp_path / "local")
    data = tmp_path / "near" / "step-0000000006" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    fresh = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": fresh}) == 6
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "far"
    assert torch.equal(fresh.weight, model.weight)


def test_a_level_schedule_is_any_schedule_policy(tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 4)
    levels = [
        pitstop.Local(tmp_path / "local" / "{node}"),
        pitstop.Shared(tmp_path / "shared", schedule=pitstop.EveryN(2) | pitstop.Every(secs=3600)),
    ]
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        _train(ckpt, model, range(1, 6))
        _drain(ckpt)
    assert _steps(tmp_path / "shared") == [2, 4, 5]  # close() flushed 5, the newest


def test_level_lists_that_cannot_work_are_refused(tmp_path: Any) -> None:
    local = pitstop.Local(tmp_path / "local" / "{node}")
    with pytest.raises(ValueError, match="first"):
        pitstop.CheckpointManager([pitstop.Shared(tmp_path / "s"), local])
    with pytest.raises(ValueError, match="the same or one holds the other"):
        pitstop.CheckpointManager(
            [local, pitstop.Shared(tmp_path / "s"), pitstop.Shared(tmp_path / "s")]
        )
    with pytest.raises(ValueError, match="names"):
        pitstop.CheckpointManager(
            [
                local,
                pitstop.Shared(tmp_path / "s", name="x"),
                pitstop.Shared(tmp_path / "t", name="x"),
            ]
        )
    with pytest.raises(ValueError, match="every= or schedule="):
        pitstop.Shared(tmp_path / "s", every=2, schedule=pitstop.EveryN(2))
    with pytest.raises(TypeError, match="schedule"):
        pitstop.Shared(tmp_path / "s", schedule=3)  # type: ignore[arg-type]
    for name in ("LOCAL", "../x", "a b", ""):
        with pytest.raises(ValueError, match="name"):
            pitstop.CheckpointManager([local, pitstop.Shared(tmp_path / "s", name=name)])


@pytest.mark.parametrize(
    "shared",
    ["local/n0", "local", "local/n0/x", ".", "file://{tmp}/local"],
    ids=[
        "a-node-dir",
        "the-local-base",
        "inside-a-node-dir",
        "holding-the-local-level",
        "file-url",
    ],
)
def test_a_level_inside_another_levels_directory_is_refused(tmp_path: Any, shared: str) -> None:
    """A shared level in a node's directory would meet the local commit of every step it is
    given (each flush failed, logged only: one copy where the job believes in two)."""
    path = shared.format(tmp=tmp_path) if "://" in shared else str(tmp_path / shared)
    levels = [pitstop.Local(tmp_path / "local" / "{node}"), pitstop.Shared(path)]
    with pytest.raises(ValueError, match="a directory of its own for each level"):
        pitstop.CheckpointManager(levels, topology=["n0"])
    levels = [
        pitstop.Local(tmp_path / "local" / "{node}"),
        pitstop.Shared(tmp_path / "a"),
        pitstop.Shared(tmp_path / "a" / "b"),
    ]
    with pytest.raises(ValueError, match="a directory of its own for each level"):
        pitstop.CheckpointManager(levels, topology=["n0"])


def test_ls_of_the_local_level_names_every_level_after_the_first_shared_one(
    tmp_path: Any, capsys: Any
) -> None:
    from pitstop.cli.main import main

    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_three(tmp_path), topology=["n0"]) as ckpt:
        _train(ckpt, model, range(1, 4))
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "local" / "n0")]) == 0
    out = capsys.readouterr().out
    assert "shared every 1" in out and "far: " in out and "(every 3)" in out
    assert "near: " not in out  # the level listed is not listed again
    assert main(["ls", str(tmp_path / "far")]) == 0
    out = capsys.readouterr().out
    assert f"shared level: {tmp_path / 'far'}\n" in out and "committed" in out
    assert "  near: " in out and "  far: " not in out  # from far: the other one is near


def test_flush_waits_for_a_flush_its_schedule_already_started(tmp_path: Any) -> None:
    """``flush()`` flushes the newest step and waits: also when the level's schedule had
    submitted that very step a moment before (it returned at once, with nothing copied)."""
    import threading

    from pitstop.storage.local import LocalStorage

    gate = threading.Event()

    class Slow(LocalStorage):
        def commit(self, directory: str, manifest: bytes) -> None:
            gate.wait(30)
            super().commit(directory, manifest)

    levels = [
        pitstop.Local(tmp_path / "local" / "{node}"),
        pitstop.Shared(Slow(tmp_path / "shared"), every=1),
    ]
    with pitstop.CheckpointManager(levels) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)})  # its flush starts, held at the commit
        threading.Timer(0.5, gate.set).start()
        record = ckpt.flush()
        assert record is not None and record.ok and record.step == 1
        assert [r.step for r in ckpt.flush_records] == [1]
    assert _steps(tmp_path / "shared") == [1]


def test_a_list_may_start_with_a_shared_level(tmp_path: Any) -> None:
    """No node-local level: every save commits to the first shared level, the next is
    flushed on its schedule, and a restart walks both (the first level lost: the second)."""
    model = torch.nn.Linear(4, 4)
    levels = [
        pitstop.Shared(tmp_path / "fast", keep_last=2, name="fast"),
        pitstop.Shared(tmp_path / "slow", every=2, name="slow"),
    ]
    with pitstop.CheckpointManager(levels) as ckpt:
        _train(ckpt, model, range(1, 6))
        _drain(ckpt)
        assert _steps(tmp_path / "fast") == [4, 5]
        assert _steps(tmp_path / "slow") == [2, 4]
    assert _steps(tmp_path / "slow") == [2, 4, 5]  # close() flushes the newest
    fresh = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(levels) as ckpt:
        assert ckpt.restore({"model": fresh}) == 5
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "fast"
    assert torch.equal(fresh.weight, model.weight)
    shutil.rmtree(tmp_path / "fast")
    fresh = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(levels) as ckpt:
        assert ckpt.restore({"model": fresh}) == 5
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "slow"
    assert torch.equal(fresh.weight, model.weight)
    with pytest.raises(ValueError, match="first level of the list"):
        pitstop.CheckpointManager([pitstop.Shared(tmp_path / "a", every=2), pitstop.Shared("b")])


def test_a_first_shared_level_that_cannot_be_listed_is_raised_not_passed_over(
    tmp_path: Any,
) -> None:
    """Every save commits to the first level: an I/O error listing it is raised (with its
    errno), never read as "resume the older step the next level holds"."""
    from pitstop.errors import CheckpointIOError
    from pitstop.storage.local import LocalStorage
    from pitstop.testing import FaultyStorage

    model = torch.nn.Linear(4, 4)
    levels = [pitstop.Shared(tmp_path / "a"), pitstop.Shared(tmp_path / "b", every=2)]
    with pitstop.CheckpointManager(levels) as ckpt:
        _train(ckpt, model, range(1, 6))
    broken = FaultyStorage(LocalStorage(str(tmp_path / "a")), fail={"entries": range(1, 99)})
    with (
        pitstop.CheckpointManager([pitstop.Shared(broken), levels[1]]) as ckpt,
        pytest.raises(CheckpointIOError) as info,
    ):
        ckpt.restore({"model": torch.nn.Linear(4, 4)})
    assert info.value.errno is not None
