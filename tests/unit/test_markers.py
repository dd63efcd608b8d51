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


# ---------------------------------------------------------------- a marker names its checkpoint
def _manifest(root: str, name: str) -> Any:
    from pitstop.format.manifest import Manifest

    with open(os.path.join(root, name, "manifest.json"), "rb") as f:
        return Manifest.loads(f.read())


def _write(root: str, name: str, marker: str, text: str) -> None:
    with open(os.path.join(root, name, marker), "w") as f:
        f.write(text)


def _previous_sealed(marker: str, step: int, **fields: Any) -> str:
    """A marker as the previous sealed format wrote it: sealed, without the manifest's digest."""
    from pitstop.format.manifest import seal

    return json.dumps(seal({"marker": marker, "step": step, **fields, "time": 1.0}))


def _bound(root: str, name: str, kind: str, **fields: Any) -> str:
    """A marker of today's format that names the manifest beside it (digest, run, timeline)."""
    from pitstop.format.manifest import manifest_digest
    from pitstop.format.markers import marker_text

    m = _manifest(root, name)
    if kind == "abandoned":
        fields.update(run=m.lineage.run, timeline=m.lineage.timeline)
    return marker_text(kind, m.step, manifest_digest=manifest_digest(m), time=1.0, **fields)


def _untouched(root: str, steps: list[str]) -> None:
    assert sorted(os.listdir(root)) == steps, os.listdir(root)
    for name in steps:
        assert os.path.exists(os.path.join(root, name, "manifest.json"))


@pytest.mark.parametrize(
    "text",
    [
        '{"after": 2}',  # the unsealed format
        '{"after": 0}',  # ... claiming a step that does not exist
        _previous_sealed("ABANDONED", 3, after=2),  # sealed, without a digest
    ],
)
def test_an_abandoned_marker_whose_rollback_is_nowhere_is_no_evidence(
    root: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, range(1, 4))  # one run, one timeline: no rollback ever happened
    _write(root, S3, "ABANDONED", text)
    rows = _ls(root, capsys)
    assert rows[S3]["status"] == "committed", rows[S3]
    assert "no rollback" in " ".join(rows[S3]["ignored_markers"])
    assert main(["gc", root, "--abandoned", "--min-age", "0"]) == 0
    _untouched(root, [S1, S2, S3])
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(_state()) == 3  # a rollback restore: nothing newer set aside
    _untouched(root, [S1, S2, S3])


def test_a_bound_abandoned_marker_without_its_rollback_is_no_evidence(root: str) -> None:
    _saved(root, range(1, 4))
    _write(root, S3, "ABANDONED", _bound(root, S3, "abandoned", after=2))  # resealed by hand
    assert _restore(root) == 3
    with pitstop.CheckpointManager(root) as ckpt, pytest.raises(CheckpointExistsError):
        ckpt.save(3, _state())  # a new save does not move it aside either
    _untouched(root, [S1, S2, S3])


def test_an_abandoned_marker_copied_from_another_run_is_no_evidence(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _saved(a, range(1, 4))
    _saved(b, range(1, 4))
    with pitstop.CheckpointManager(b) as ckpt, ckpt.hooks.catalog.pin(S3):  # in use: marked
        assert ckpt.restore(_state(), step=2) == 2  # a genuine abandonment in run b
    os.replace(os.path.join(b, S3, "ABANDONED"), os.path.join(a, S3, "ABANDONED"))
    rows = _ls(a, capsys)
    assert rows[S3]["status"] == "committed"
    assert "another checkpoint" in " ".join(rows[S3]["ignored_markers"])
    assert main(["gc", a, "--abandoned", "--min-age", "0"]) == 0
    assert _restore(a) == 3
    _untouched(a, [S1, S2, S3])


@pytest.mark.parametrize("text", ["copied", "previous"])
def test_a_damaged_marker_of_another_checkpoint_is_no_evidence(
    tmp_path: Any, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _saved(a, range(1, 4))
    if text == "copied":  # from step 3 of another run, where it was genuine
        _saved(b, range(1, 4))
        with pitstop.CheckpointManager(b) as ckpt:
            ckpt.hooks.catalog.mark_damaged(S3, "copied from run b")
        os.replace(os.path.join(b, S3, "DAMAGED"), os.path.join(a, S3, "DAMAGED"))
    else:  # the previous sealed format names no checkpoint: a copy looks the same
        _write(a, S3, "DAMAGED", _previous_sealed("DAMAGED", 3, reason="copied from run b"))
    assert main(["verify", a]) == 1  # the marker is said, as no evidence
    out = capsys.readouterr().out
    assert f"{S3}: ok" in out and "DAMAGED marker ignored" in out and "marked damaged" not in out
    with pitstop.CheckpointManager(a) as ckpt:
        assert ckpt.restore(_state()) == 3  # not skipped
        with pytest.raises(CheckpointExistsError):
            ckpt.save(3, _state())  # and never moved out of a new save's way
    assert main(["gc", a, "--damaged", "--min-age", "0"]) == 0
    _untouched(a, [S1, S2, S3])


def test_an_unsealed_damaged_marker_makes_the_restore_verify_again(root: str) -> None:
    _saved(root, range(1, 4))
    _write(root, S2, "DAMAGED", '{"reason": "an old pitstop said so"}')  # bytes are whole
    _write(root, S3, "DAMAGED", '{"reason": "an old pitstop said so"}')
    with open(os.path.join(root, S3, "rank-00000.bin"), "r+b") as f:
        f.write(b"\xff\xff\xff\xff")  # and these are not
    assert _restore(root) == 2  # step 3 failed verification again; step 2 verified
    with open(os.path.join(root, S3, "DAMAGED")) as f:
        doc = json.load(f)  # marked again, in today's format: it names its checkpoint
    from pitstop.format.manifest import manifest_digest

    assert doc["manifest_digest"] == manifest_digest(_manifest(root, S3))


def test_verify_marks_anew_a_damaged_step_whose_marker_names_no_checkpoint(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop.format.manifest import manifest_digest

    _saved(root, range(1, 3))
    _write(root, S2, "DAMAGED", '{"reason": "an old pitstop said so"}')
    with open(os.path.join(root, S2, "rank-00000.bin"), "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    assert main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert f"{S2}: CORRUPT" in out and "marker ignored" not in out  # replaced, not said
    with open(os.path.join(root, S2, "DAMAGED")) as f:
        assert json.load(f)["manifest_digest"] == manifest_digest(_manifest(root, S2))
    assert _ls(root, capsys)[S2]["status"] == "damaged"


def test_markers_name_the_checkpoint_they_lie_beside(root: str) -> None:
    from pitstop.format.manifest import manifest_digest

    _saved(root, range(1, 4))
    with pitstop.CheckpointManager(root) as ckpt:
        with ckpt.hooks.catalog.pin(S3):
            assert ckpt.restore(_state(), step=2) == 2
        ckpt.hooks.catalog.mark_damaged(S1, "a test said so")
    for name, marker in ((S1, "DAMAGED"), (S3, "ABANDONED")):
        with open(os.path.join(root, name, marker)) as f:
            doc = json.load(f)
        m = _manifest(root, name)
        assert doc["manifest_digest"] == manifest_digest(m)
        if marker == "ABANDONED":
            assert (doc["run"], doc["timeline"]) == (m.lineage.run, m.lineage.timeline)


# ---------------------------------------------------------------- genuine rollbacks still hold
@pytest.mark.parametrize("marks", ["today", "unsealed"])
def test_an_abandonment_holds_after_retention_removed_its_rollback(
    root: str, marks: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s4 = "step-0000000004"
    _saved(root, range(1, 5))
    with pitstop.CheckpointManager(root, keep_last=1) as ckpt:
        with ckpt.hooks.catalog.pin(s4):  # in use: marked ABANDONED in place
            assert ckpt.restore(_state(), step=2) == 2
        ckpt.save(3, {"w": torch.full((4,), 33.0), "extra": {"step": 3}})
    # retention kept the new timeline's step 3 only: step 2 and its ROLLBACK are gone
    assert [n for n in sorted(os.listdir(root)) if n.startswith("step-")] == [S3, s4]
    if marks == "unsealed":  # as a pitstop before the seal wrote it
        _write(root, s4, "ABANDONED", '{"after": 2}')
    assert _ls(root, capsys)[s4]["status"] == "abandoned"
    state = _state()
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(state, rollback=False) == 3  # not the abandoned step 4
    assert state["extra"]["step"] == 3 and float(state["w"][0]) == 33.0
    assert main(["gc", root, "--abandoned", "--min-age", "0"]) == 0
    assert sorted(os.listdir(root)) == [S3]


def test_an_abandonment_of_another_timeline_holds(root: str) -> None:
    _saved(root, range(1, 3))
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(_state(), step=1) == 1  # timeline 2 starts at step 1
        ckpt.save(2, _state())
        ckpt.save(3, _state())
        with ckpt.hooks.catalog.pin(S3):  # back to step 1 (of timeline 1) once more
            assert ckpt.restore(_state(), step=1) == 1
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(_state()) == 1  # step 3 of timeline 2 stays abandoned
        assert ckpt.steps() == [1]


# ---------------------------------------------------------------- gc re-verifies what damage set aside
def test_gc_damaged_keeps_a_set_aside_checkpoint_that_verifies(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, range(1, 5))
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.hooks.catalog.mark_damaged(S3, "a transient read error, taken for damage")
        ckpt.hooks.catalog.mark_damaged("step-0000000004", "a checksum failed")
    with open(os.path.join(root, "step-0000000004", "rank-00000.bin"), "r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(_state()) == 2  # both set aside as damaged
    aside = sorted(n for n in os.listdir(root) if n.startswith(".damaged-"))
    assert [n[: len(".damaged-step-0000000003")] for n in aside] == [
        ".damaged-step-0000000003", ".damaged-step-0000000004"
    ]  # fmt: skip
    assert main(["gc", root, "--damaged", "--min-age", "0"]) == 0
    out = capsys.readouterr().out
    assert f"kept {aside[0]}" in out and "verifies" in out, out
    assert os.path.exists(os.path.join(root, aside[0], "manifest.json"))
    assert not os.path.exists(os.path.join(root, aside[1]))


# ---------------------------------------------------------------- what a marker that is no file is
@pytest.mark.parametrize("what", ["fifo", "directory", "huge"])
def test_a_marker_that_is_not_a_small_file_is_said_for_what_it_is(
    root: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _saved(root, range(1, 3))
    path = os.path.join(root, S2, "DAMAGED")
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(200 * 2**20)
    rows = _ls(root, capsys)
    said = " ".join(rows[S2]["ignored_markers"])
    assert rows[S2]["status"] == "committed" and "does not parse" not in said
    assert {"fifo": "a FIFO", "directory": "a directory", "huge": "209715200 bytes"}[what] in said
    assert _restore(root) == 2
