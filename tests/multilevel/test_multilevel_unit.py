"""Multi-level pieces in one process: placement of copies and parity, level arguments, a
flush that fails on the shared level (ENOSPC) while training goes on."""

from __future__ import annotations

import errno
import json
import os
from typing import Any

import pytest
import torch

import pitstop
from pitstop.levels.spec import Placement
from pitstop.storage.local import LocalStorage
from pitstop.testing import FaultyStorage


def test_two_ranks_per_node_keep_their_partners_and_sets_on_other_nodes() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    p = Placement(nodes, "partner")
    assert p.leaders == (0, 0, 2, 2, 4, 4)
    for r in range(6):
        assert nodes[p.partner_holder(r)] != nodes[r]
        assert p.partner_source(p.partner_holder(r)) == r
        members = p.xor_set(r)
        assert len({nodes[m] for m in members}) == len(members) == 3
    assert p.partner_holder(0) == 2 and p.partner_holder(1) == 3 and p.partner_holder(4) == 0


def test_sets_split_the_nodes_and_never_leave_a_set_of_one() -> None:
    p = Placement([f"n{i}" for i in range(5)], "xor", set_size=2)
    assert p.sets == [["n0", "n1"], ["n2", "n3", "n4"]]
    assert p.xor_set(4) == [2, 3, 4]
    assert p.recoverable({1, 3}, [True] * 5)
    assert not p.recoverable({2, 3}, [True] * 5)


def test_one_node_keeps_a_single_copy_and_uneven_nodes_are_refused() -> None:
    assert Placement(["a", "a"], "partner").scheme == "single"
    with pytest.raises(pitstop.UnsupportedSetupError, match="same number of ranks"):
        Placement(["a", "a", "b"], "xor")


def test_bad_level_arguments_name_what_is_wrong(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="redundancy"):
        pitstop.Local(tmp_path / "{node}", redundancy="raid6")
    with pytest.raises(ValueError, match="every"):
        pitstop.Shared(tmp_path, every=0)
    with pytest.raises(ValueError, match="Local path"):
        pitstop.Shared(tmp_path / "{node}")
    with pytest.raises(ValueError, match="not both"), pytest.warns(DeprecationWarning):
        pitstop.CheckpointManager(tmp_path, levels=[pitstop.Local(tmp_path / "{node}")])
    with pytest.raises(ValueError, match="give a root"):
        pitstop.CheckpointManager()
    with pytest.raises(ValueError, match="at most one"):
        pitstop.CheckpointManager([pitstop.Local(tmp_path / "a"), pitstop.Local(tmp_path / "b")])


def test_a_full_shared_level_fails_the_flush_not_training(tmp_path: Any) -> None:
    shared = FaultyStorage(
        LocalStorage(str(tmp_path / "shared")), fail={"write_object": [1, 2, 3]}, errno=errno.ENOSPC
    )
    model = torch.nn.Linear(4, 4)
    levels = [pitstop.Local(tmp_path / "local" / "{node}"), pitstop.Shared(shared, every=1)]
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight += 1
            ckpt.save(step, {"model": model})
            assert ckpt.hooks.levels is not None and ckpt.hooks.levels.flusher is not None
            ckpt.hooks.levels.flusher.drain()
        assert ckpt.hooks.levels is not None and ckpt.hooks.levels.flusher is not None
        ckpt.hooks.levels.flusher.close()
        records = [(r.step, r.ok) for r in ckpt.flush_records]
        error = ckpt.flush_records[0].error
    assert records == [(1, False), (2, True), (3, True)]
    assert error is not None and "No space left" in error
    assert sorted(os.listdir(tmp_path / "local" / "n0")) == [
        "levels.json", "step-0000000002", "step-0000000003",
    ]  # fmt: skip
    fresh = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": fresh}) == 3
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "local"
    assert torch.equal(fresh.weight, model.weight)


def _job(tmp_path: Any, every: int = 2, keep: int = 2) -> list[Any]:
    return [
        pitstop.Local(tmp_path / "local" / "{node}", keep_last=keep),
        pitstop.Shared(tmp_path / "shared", every=every),
    ]


def _steps(path: Any) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(path) if n.startswith("step-"))


def _save_to(ckpt: pitstop.CheckpointManager, model: torch.nn.Module, steps: range) -> None:
    """Saves, each flush finished before the next save: a local step still pinned by its
    flush is skipped by the local retention of the next commit (kept until the one after)."""
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(float(step))
        ckpt.save(step, {"model": model})
        for flusher in ckpt.hooks.levels.flushers:
            flusher.drain()


def test_restore_of_an_older_step_sets_the_newer_ones_aside_on_both_levels(
    tmp_path: Any,
) -> None:
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        _save_to(ckpt, model, range(1, 5))  # local keeps 3, 4; shared holds 2, 4
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}, step=3) == 3
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "local"
        assert _steps(tmp_path / "local" / "n0") == [3] and _steps(tmp_path / "shared") == [2]
        with torch.no_grad():
            model.weight.fill_(40.0)  # the new timeline's step 4
        ckpt.save(4, {"model": model})
    fresh = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": fresh}) == 4
    assert torch.equal(fresh.weight, torch.full((4, 4), 40.0))
    assert _steps(tmp_path / "shared") == [2, 4]  # the new step 4 (flushed: 3 was not there)


def test_a_newer_intact_local_step_wins_over_an_older_shared_one(tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        _save_to(ckpt, model, range(1, 5))
    for level in ("local/n0", "shared"):  # step 4 damaged everywhere; local 3 intact
        with open(tmp_path / level / "step-0000000004" / "rank-00000.bin", "r+b") as f:
            f.seek(0)
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0xFF]))
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 3
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "local"
        assert torch.equal(model.weight, torch.full((4, 4), 3.0))
        _save_to(ckpt, model, range(4, 6))  # step 4's name is free on both levels


def test_close_flushes_the_newest_step_and_the_schedule_survives_a_restart(
    tmp_path: Any,
) -> None:
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path, every=10), topology=["n0"]) as ckpt:
        _save_to(ckpt, model, range(1, 4))
        assert _steps(tmp_path / "shared") == []
    assert _steps(tmp_path / "shared") == [3]  # flushed at close
    with pitstop.CheckpointManager(_job(tmp_path, every=10), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 3
        _save_to(ckpt, model, range(4, 6))
        record = ckpt.flush()
        assert record is not None and record.ok and record.step == 5
        assert ckpt.flush() is None  # flushed already
    assert _steps(tmp_path / "shared") == [3, 5]
    # a restart from a step the shared level lacks flushes the first step after it
    with pitstop.CheckpointManager(_job(tmp_path, every=10), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}, step=4) == 4
        _save_to(ckpt, model, range(5, 6))
        assert ckpt.hooks.levels is not None and ckpt.hooks.levels.flusher is not None
        ckpt.hooks.levels.flusher.drain()
        assert [(r.step, r.ok) for r in ckpt.flush_records] == [(5, True)]
        ckpt.close(flush=False)


def test_an_exception_in_the_with_block_does_not_flush(tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 4)
    levels = _job(tmp_path, every=10)
    with (
        pytest.raises(RuntimeError, match="boom"),
        pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt,
    ):
        _save_to(ckpt, model, range(1, 3))
        raise RuntimeError("boom")
    assert _steps(tmp_path / "shared") == []


def test_a_step_a_rollback_left_is_never_resumed(tmp_path: Any) -> None:
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path, every=10), topology=["n0"]) as ckpt:
        _save_to(ckpt, model, range(1, 5))
        ckpt.close(flush=False)
    # a rollback to step 3 that found step 4 in use: ROLLBACK in step 3, step 4 marked in place
    for step, kind in ((3, "rollback"), (4, "abandoned")):
        _mark(tmp_path / "local" / "n0" / f"step-{step:010d}", kind, after=3)
    with pitstop.CheckpointManager(_job(tmp_path, every=10), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 3
        assert ckpt.last_restore is not None and ckpt.last_restore.repaired == []
        _save_to(ckpt, model, range(4, 5))  # the marked step 4 moves out of the way


def _mark(step_dir: Any, kind: str, **fields: Any) -> None:
    """Marker ``kind`` as pitstop writes it, naming the checkpoint of ``step_dir``."""
    from pitstop.format.manifest import Manifest, manifest_digest
    from pitstop.format.markers import marker_text

    m = Manifest.loads((step_dir / "manifest.json").read_bytes())
    assert m.lineage is not None
    fields.update(run=m.lineage.run, timeline=m.lineage.timeline, time=0.0)
    if kind != "rollback":
        fields["manifest_digest"] = manifest_digest(m)
    (step_dir / kind.upper()).write_text(marker_text(kind, m.step, **fields))


def test_node_ids_are_the_hostname_unless_one_host_runs_several_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from pitstop.levels.spec import node_ids

    host = socket.gethostname()
    monkeypatch.delenv("PITSTOP_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert node_ids(None, 0, lambda o: [o]) == [host]  # one process
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_ids(None, 0, lambda o: [o] * 4) == [host] * 4  # one torchrun on the host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    expected = [f"{host}-0", f"{host}-0", f"{host}-1", f"{host}-1"]
    assert node_ids(None, 0, lambda o: [o] * 4) == expected  # two "nodes" on one host
    monkeypatch.setenv("PITSTOP_NODE", "a/b")
    with pytest.raises(ValueError, match="PITSTOP_NODE of rank 0"):
        node_ids(None, 0, lambda o: [o])


def test_a_rollback_killed_after_its_first_mark_still_holds_on_both_levels(
    tmp_path: Any,
) -> None:
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        _save_to(ckpt, model, range(1, 5))  # local 3, 4; shared 2, 4
        newest = next(e for e in ckpt.entries() if e.step == 4 and e.manifest is not None)
        lineage = newest.manifest.lineage  # type: ignore[union-attr]
    assert lineage is not None
    mark = {"after": 3, "run": lineage.run, "timeline": lineage.timeline, "time": 0.0}
    (tmp_path / "local" / "n0" / "step-0000000003" / "ROLLBACK").write_text(json.dumps(mark))
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 3  # not the shared level's step 4
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "local"
    assert _steps(tmp_path / "shared") == [2] and _steps(tmp_path / "local" / "n0") == [3]


def test_a_repair_replaces_a_hard_linked_file_and_never_writes_through_it(
    tmp_path: Any,
) -> None:
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        _save_to(ckpt, model, range(1, 5))
    node = tmp_path / "local" / "n0"
    mine = node / "step-0000000004" / "rank-00000.bin"
    mine.unlink()
    os.link(node / "step-0000000003" / "rank-00000.bin", mine)  # as `cp -al` would leave it
    before = (node / "step-0000000003" / "rank-00000.bin").read_bytes()
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 4  # the shared level's, fetched back
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "shared"
    assert (node / "step-0000000003" / "rank-00000.bin").read_bytes() == before
    with pitstop.CheckpointManager(_job(tmp_path), topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 4
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "local"
