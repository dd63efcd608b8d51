"""Markers (DAMAGED, ABANDONED, ROLLBACK) are evidence only when they are whole and consistent
with the step directory that holds them: sealed like manifests (or exactly the previous
format's unsealed shape), naming their own step, a rollback's ``after`` its own step and its
run and timeline those of its manifest. Anything else is reported by ``ls``/``verify`` and
never acted on: restore does not skip for it, gc does not delete for it, a new save does not
move a committed step aside for it."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import pitstop
from pitstop.cli.main import main
from pitstop.errors import CheckpointExistsError

S1, S2, S3 = "step-0000000001", "step-0000000002", "step-0000000003"


def _saved(root: str, steps: range) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        for s in steps:
            ckpt.save(s, {"w": torch.full((4,), float(s)), "extra": {"step": s}})


def _state() -> dict[str, Any]:
    return {"w": torch.zeros(4), "extra": {"step": 0}}


def _rolled_back(root: str) -> None:
    """Steps 1..3, then a restore to step 2: step 3 set aside, a ROLLBACK marker in step 2."""
    _saved(root, range(1, 4))
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(_state(), step=2) == 2
    assert os.path.exists(os.path.join(root, S2, "ROLLBACK"))


def _edit(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert old in text, text
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def _restore(root: str) -> int | None:
    state = _state()
    with pitstop.CheckpointManager(root) as ckpt:
        return ckpt.restore(state, rollback=False)


def _ls(root: str, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, Any]]:
    assert main(["ls", root, "--json"]) == 0
    return {r["name"]: r for r in json.loads(capsys.readouterr().out)}


# ---------------------------------------------------------------- ROLLBACK
@pytest.mark.parametrize("after", ["0", "-5", "7"])
def test_a_rollback_marker_whose_after_changed_is_no_evidence(
    root: str, after: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _rolled_back(root)
    _edit(os.path.join(root, S2, "ROLLBACK"), '"after": 2', f'"after": {after}')
    rows = _ls(root, capsys)
    assert rows[S1]["status"] == "committed" and rows[S2]["status"] == "committed"
    assert "ROLLBACK" in " ".join(rows[S2]["ignored_markers"])
    assert main(["verify", root]) == 1  # a damaged marker is found, and said
    out = capsys.readouterr().out
    assert "ROLLBACK" in out and "ignored" in out
    assert _restore(root) == 2  # the restart still finds its checkpoint


def test_a_rollback_marker_of_another_timeline_is_no_evidence(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, range(1, 4))
    doc = {"after": 1, "run": "someone-else", "timeline": "someone-else", "time": 0.0}
    with open(os.path.join(root, S1, "ROLLBACK"), "w") as f:
        f.write(json.dumps(doc))  # unsealed, as the previous format: its claims are checked
    rows = _ls(root, capsys)
    assert [rows[n]["status"] for n in (S1, S2, S3)] == ["committed"] * 3
    assert "not the run and timeline of its step" in " ".join(rows[S1]["ignored_markers"])
    assert _restore(root) == 3


# ---------------------------------------------------------------- DAMAGED and ABANDONED
@pytest.mark.parametrize("content", ["", "garbage", "{}", "[1, 2]", '{"reason": 7}'])
@pytest.mark.parametrize("marker", ["DAMAGED", "ABANDONED"])
def test_an_empty_or_garbage_marker_is_no_evidence(
    root: str, marker: str, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, range(1, 3))
    with open(os.path.join(root, S2, marker), "w") as f:
        f.write(content)
    rows = _ls(root, capsys)
    assert rows[S2]["status"] == "committed"
    assert marker in " ".join(rows[S2]["ignored_markers"])
    assert _restore(root) == 2  # the intact newest step is not skipped
    assert main(["gc", root, "--damaged", "--abandoned", "--min-age", "0"]) == 0
    assert os.path.exists(os.path.join(root, S2, "manifest.json"))  # and gc leaves it
    assert _restore(root) == 2


def test_a_damaged_marker_copied_from_another_step_is_no_evidence(root: str) -> None:
    _saved(root, range(1, 3))
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.hooks.catalog.mark_damaged(S1, "a test said so")
    os.replace(os.path.join(root, S1, "DAMAGED"), os.path.join(root, S2, "DAMAGED"))
    assert _restore(root) == 2


def test_an_abandoned_marker_after_its_own_step_is_no_evidence(root: str) -> None:
    _saved(root, range(1, 3))
    with open(os.path.join(root, S2, "ABANDONED"), "w") as f:
        f.write('{"after": 5}')  # a rollback abandons only steps after the one it restored
    assert _restore(root) == 2


def test_a_garbage_marker_does_not_move_a_committed_step_out_of_a_new_save(root: str) -> None:
    _saved(root, range(1, 3))
    with open(os.path.join(root, S2, "DAMAGED"), "w") as f:
        f.write("[[[")
    with pitstop.CheckpointManager(root) as ckpt, pytest.raises(CheckpointExistsError):
        ckpt.save(2, _state())
    assert sorted(os.listdir(root)) == [S1, S2]


def test_markers_are_sealed_and_name_their_step(root: str) -> None:
    from pitstop.format.manifest import seal

    _saved(root, range(1, 4))
    with pitstop.CheckpointManager(root) as ckpt:
        with ckpt.hooks.catalog.pin(S3):  # in use: marked ABANDONED in place, not moved
            assert ckpt.restore(_state(), step=2) == 2
        ckpt.hooks.catalog.mark_damaged(S1, "a test said so")
    for name, marker in ((S1, "DAMAGED"), (S2, "ROLLBACK"), (S3, "ABANDONED")):
        with open(os.path.join(root, name, marker)) as f:
            doc = json.load(f)
        assert doc["step"] == int(name[5:]) and doc["marker"] == marker
        assert seal(doc, doc["integrity"]["algorithm"]) == doc


# ---------------------------------------------------------------- gc re-checks its evidence
def test_gc_damaged_deletes_a_marked_step_only_if_it_fails_verification_again(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, range(1, 4))
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.hooks.catalog.mark_damaged(S2, "an old verify said so")  # but its bytes are whole
        ckpt.hooks.catalog.mark_damaged(S3, "a checksum failed")
    data = os.path.join(root, S3, "rank-00000.bin")
    with open(data, "r+b") as f:
        f.write(b"\xff\xff\xff\xff")  # and these are not
    assert main(["gc", root, "--damaged", "--min-age", "0"]) == 0
    out = capsys.readouterr().out
    assert os.path.exists(os.path.join(root, S2, "manifest.json"))
    assert f"kept {S2}" in out and "verifies" in out
    assert not os.path.exists(os.path.join(root, S3))


# ---------------------------------------------------------------- multi-level trees
def test_a_garbage_marker_on_a_node_is_no_evidence_and_said(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    levels: list[pitstop.Local | pitstop.Shared] = [
        pitstop.Local(tmp_path / "local" / "{node}", keep_last=2),
        pitstop.Shared(tmp_path / "shared", every=10),
    ]
    model = torch.nn.Linear(4, 4)
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"model": model})
        ckpt.close(flush=False)
    (tmp_path / "local" / "n0" / S2 / "DAMAGED").write_text("garbage")
    assert main(["verify", str(tmp_path / "shared"), "--level", "local", "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{S2}: ok" in out and "node n0: DAMAGED marker ignored" in out, out
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        assert ckpt.restore({"model": model}) == 2
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "local"
