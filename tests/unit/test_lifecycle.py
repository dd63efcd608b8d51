"""One checkpoint lifecycle: I/O errors are not damage, pins, rollback timelines, retention
as part of the save, refused saves reported, several ranks refused."""

from __future__ import annotations

import json
import os
import shutil
import threading
from typing import Any

import pytest
import torch

import pitstop
from conftest import assert_same_tensors, flip_byte, make_state, tensors_of
from pitstop.errors import CheckpointIOError
from pitstop.format.names import DAMAGED_MARKER
from pitstop.loop import StepResult
from pitstop.policy import EveryN, KeepBest, KeepEvery, KeepLast
from pitstop.storage.local import LocalStorage
from pitstop.storage.wrap import StorageWrapper
from pitstop.testing import FaultyStorage, GateStorage

READ_CALLS = [
    "entries",
    "has_manifest",
    "read_manifest",
    "file_size",
    "read_object",
    "open_data",
    "read_into",
]


def _until(pred: Any, secs: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + secs
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _saved(root: str, steps: range, **kw: Any) -> pitstop.CheckpointManager:
    ckpt = pitstop.CheckpointManager(root, **kw)
    for s in steps:
        ckpt.save(s, make_state(seed=s))
    return ckpt


# ---------------------------------------------------------------- 1. I/O errors are not damage
@pytest.mark.parametrize("call", READ_CALLS)
def test_one_transient_read_error_is_retried(root: str, call: str) -> None:
    _saved(root, range(1, 3)).close()
    storage = FaultyStorage(LocalStorage(root), fail={call: [1]})
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(storage) as ckpt:
        assert ckpt.restore(fresh) == 2
    assert storage.by_call[call] >= 2  # the failed call was made again
    assert_same_tensors(tensors_of(make_state(seed=2)), tensors_of(fresh))


@pytest.mark.parametrize("call", [*READ_CALLS, "lock"])
def test_persistent_read_error_raises_and_marks_nothing(root: str, call: str) -> None:
    _saved(root, range(1, 3)).close()
    storage = FaultyStorage(LocalStorage(root), fail={call: range(1, 100)})
    with pitstop.CheckpointManager(storage) as ckpt, pytest.raises(CheckpointIOError) as info:
        ckpt.restore(make_state(seed=99))
    assert info.value.errno is not None
    # nothing was set aside or marked: the next restart resumes the newest step
    assert sorted(os.listdir(root)) == ["step-0000000001", "step-0000000002"]
    assert not os.path.exists(os.path.join(root, "step-0000000002", DAMAGED_MARKER))
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh) == 2
    assert_same_tensors(tensors_of(make_state(seed=2)), tensors_of(fresh))


def test_damage_is_marked_not_moved_and_shown(root: str, capsys: Any) -> None:
    _saved(root, range(1, 3)).close()
    data = os.path.join(root, "step-0000000002", "rank-00000.bin")
    entry = pitstop.CheckpointManager(root).entries()[-1]
    assert entry.manifest is not None
    biggest = max(entry.manifest.tensors, key=lambda t: t.nbytes)
    flip_byte(data, biggest.offset + 3)
    assert pitstop.load(root, make_state(seed=99)) == 1  # read-only load: falls back, moves nothing
    assert os.path.isdir(os.path.join(root, "step-0000000002"))
    assert os.path.exists(os.path.join(root, "step-0000000002", DAMAGED_MARKER))
    from pitstop.cli.main import main

    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "checksum mismatch" in out
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(make_state(seed=99)) == 1
        assert ckpt.last_restore is not None
        assert any("step-0000000002" in name for name, _ in ckpt.last_restore.skipped)
        ckpt.save(2, make_state(seed=2))  # the damaged one was moved out of the new save's way
        assert ckpt.steps() == [1, 2]


# ---------------------------------------------------------------- 2. pins: restore vs retention
def test_restore_concurrent_with_retention_keeps_the_pinned_checkpoint(root: str) -> None:
    saver = _saved(root, range(1, 2), keep_last=1)
    gate = GateStorage(LocalStorage(root), hold={"open_data"})
    reader = pitstop.CheckpointManager(gate)
    fresh = make_state(seed=99)
    out: dict[str, Any] = {}

    def restore() -> None:
        try:
            out["step"] = reader.restore(fresh, rollback=False)
        except BaseException as e:  # reported below
            out["error"] = e

    t = threading.Thread(target=restore)
    t.start()
    assert gate.arrived["open_data"].wait(20)  # restore is reading step 1, pinned
    saver.save(2, make_state(seed=2))  # its retention wants step 1 gone: it is pinned, kept
    assert saver.steps() == [1, 2]
    gate.open("open_data")
    t.join(30)
    assert "error" not in out, out.get("error")
    assert out["step"] == 1
    assert_same_tensors(tensors_of(make_state(seed=1)), tensors_of(fresh))
    saver.save(3, make_state(seed=3))  # unpinned now: retention catches up
    assert saver.steps() == [3]
    saver.close()
    reader.close()


# ---------------------------------------------------------------- 3. rollback and timelines
def test_rollback_starts_a_timeline_and_a_restart_resumes_it(root: str) -> None:
    _saved(root, range(1, 6)).close()
    state = make_state(seed=99)
    with pitstop.CheckpointManager(root, policy=EveryN(1)) as ckpt:
        assert ckpt.restore(state, step=2) == 2
        assert ckpt.steps() == [1, 2]
        abandoned = sorted(e.step for e in ckpt.entries() if e.status == "abandoned")
        assert abandoned == [3, 4, 5]
        assert ckpt.step(3, make_state(seed=33)) is StepResult.SAVED
        assert ckpt.step(4, make_state(seed=44)) is StepResult.SAVED
        ckpt.wait()
        assert ckpt.stats().refused_saves == 0
        first = json.load(open(os.path.join(root, "step-0000000001", "manifest.json")))
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh) == 4
    assert_same_tensors(tensors_of(make_state(seed=44)), tensors_of(fresh))
    three = json.load(open(os.path.join(root, "step-0000000003", "manifest.json")))
    assert three["lineage"]["parent"] == 2
    assert three["lineage"]["run"] == first["lineage"]["run"]
    assert three["lineage"]["timeline"] != first["lineage"]["timeline"]
    # the abandoned ones are kept until asked for
    from pitstop.cli.main import main

    assert main(["gc", root]) == 0
    assert len([n for n in os.listdir(root) if n.startswith(".abandoned-")]) == 3
    assert main(["gc", root, "--abandoned"]) == 0
    assert not [n for n in os.listdir(root) if n.startswith(".abandoned-")]


def test_refused_save_is_reported(root: str, caplog: Any) -> None:
    _saved(root, range(1, 3)).close()
    with pitstop.CheckpointManager(root, policy=EveryN(1)) as ckpt:
        # no restore: step 2 is already committed, the policy's save of it is refused
        result = ckpt.step(2, make_state(seed=2))
        assert result is StepResult.REFUSED and not result
        assert ckpt.stats().refused_saves == 1
    assert "refused" in caplog.text


def test_background_refusal_does_not_escape_step(root: str) -> None:
    gate = GateStorage(LocalStorage(root), hold={"write_data"})
    writer = pitstop.CheckpointManager(gate)
    handle = writer.async_save(5, make_state(seed=5))
    assert gate.arrived["write_data"].wait(20)  # the writer holds step 5, uncommitted
    with pitstop.CheckpointManager(root, policy=EveryN(1)) as other:
        assert other.step(5, make_state(seed=55)) is StepResult.SAVED  # refused in the background
        _until(lambda: all(h.done() for h in other.history))
        other.step(6, make_state(seed=6))  # does not raise the background refusal
        assert other.stats().refused_saves == 1
    gate.open("write_data")
    handle.wait()
    writer.close()
    fresh = make_state(seed=99)
    assert pitstop.load(root, fresh, step=5) == 5
    assert_same_tensors(tensors_of(make_state(seed=5)), tensors_of(fresh))


# ---------------------------------------------------------------- 4. retention is part of the save
def test_keep_last_holds_when_save_returns(root: str) -> None:
    with pitstop.CheckpointManager(root, keep_last=2) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, make_state(seed=s))
            assert ckpt.steps() == list(range(max(1, s - 1), s + 1))
        h = ckpt.async_save(6, make_state(seed=6))
        h.wait()
        assert ckpt.steps() == [5, 6]


def test_retired_checkpoints_are_gone_before_their_files_are(root: str, capsys: Any) -> None:
    """Retention uncommits and moves a checkpoint aside inside the save; deleting its files
    comes after (not on the save's path). If that delete fails, the leftover is never a
    restore candidate, ``ls`` shows it as retired and ``gc`` removes it."""
    storage = FaultyStorage(LocalStorage(root), fail={"remove": range(1, 100)})
    with pitstop.CheckpointManager(storage, keep_last=1) as ckpt:
        for s in (1, 2):
            ckpt.save(s, make_state(seed=s))
        assert ckpt.steps() == [2]
    left = [n for n in os.listdir(root) if n.startswith(".retired-step-0000000001-")]
    assert len(left) == 1
    assert not os.path.exists(os.path.join(root, left[0], "MANIFEST.json"))
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh) == 2
    from pitstop.cli.main import main

    assert main(["ls", root]) == 0
    assert "retired" in capsys.readouterr().out
    assert main(["gc", root, "--min-age", "0"]) == 0
    assert not [n for n in os.listdir(root) if n.startswith(".retired-")]
    with pitstop.CheckpointManager(root, keep_last=1) as ckpt:  # the normal path deletes
        assert ckpt.restore(make_state(seed=98)) == 2
        ckpt.save(3, make_state(seed=3))
        assert ckpt.steps() == [3]
    assert sorted(os.listdir(root)) == ["step-0000000003"]  # close() waited for the delete


def test_retention_policies_combine(root: str) -> None:
    policy = KeepLast(2) | KeepEvery(steps=4) | KeepBest("loss")
    with pitstop.CheckpointManager(root, retention=policy) as ckpt:
        for s in range(1, 11):
            ckpt.save(s, {"x": torch.full((4,), float(s))}, metrics={"loss": abs(s - 3) + 0.5})
        # newest two; the first of each window of 4 steps (1, 4, 8); the best loss (3)
        assert ckpt.steps() == [1, 3, 4, 8, 9, 10]


def test_retention_never_touches_another_runs_checkpoints(root: str) -> None:
    a = pitstop.CheckpointManager(root, keep_last=1)
    b = pitstop.CheckpointManager(root, keep_last=1)
    for s in (1, 2, 3):
        a.save(s, {"x": torch.zeros(2)})
        b.save(100 + s, {"x": torch.ones(2)})
    assert a.steps() == [3, 103]
    a.close()
    b.close()


def test_io_knobs_with_a_storage_object_are_refused(tmp_path: Any) -> None:
    from pitstop.storage.local import RamStorage

    with pytest.raises(ValueError, match="IOOptions"), pytest.warns(DeprecationWarning):
        pitstop.CheckpointManager(RamStorage(str(tmp_path / "ram")), direct_io="on")
    with pytest.raises(ValueError, match=r"SaveOptions\(io=...\) configure a directory root"):
        pitstop.CheckpointManager(
            RamStorage(str(tmp_path / "ram")),
            options=pitstop.SaveOptions.from_env(io=pitstop.IOOptions.from_env(direct="on")),
        )


# ---------------------------------------------------------------- 5. partial and remapped restore
def test_partial_restore_of_the_model_only(root: str) -> None:
    state = make_state(seed=1)
    state["rng"] = pitstop.RNGState()
    _saved(root, range(0)).close()
    pitstop.save(root, state, step=1)
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore({"model": fresh["model"]}, strict=False) == 1
        report = ckpt.last_restore
    assert report is not None and report.keys is not None
    assert {"optimizer", "scheduler", "rng", "extra"} <= set(report.keys.skipped)
    assert_same_tensors(tensors_of({"m": state["model"]}), tensors_of({"m": fresh["model"]}))


def test_ddp_and_compile_prefixes_load_into_a_bare_model(root: str) -> None:
    class Wrap(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module, attr: str) -> None:
            super().__init__()
            setattr(self, attr, inner)

    bare = make_state(seed=1)["model"]
    wrapped = Wrap(Wrap(bare, "module"), "_orig_mod")  # compile(DDP(model))
    assert next(iter(wrapped.state_dict())).startswith("_orig_mod.module.")
    pitstop.save(root, {"model": wrapped}, step=1)
    fresh = make_state(seed=99)["model"]
    assert pitstop.load(root, {"model": fresh}) == 1
    assert_same_tensors(tensors_of({"m": bare}), tensors_of({"m": fresh}))
    # and the reverse: a bare checkpoint into a DDP-wrapped model
    other = os.path.join(root, "other")
    pitstop.save(other, {"model": bare}, step=1)
    target = Wrap(make_state(seed=98)["model"], "module")
    assert pitstop.load(other, {"model": target}) == 1
    assert_same_tensors(tensors_of({"m": bare}), tensors_of({"m": target.module}))


def test_restore_while_a_save_of_the_same_manager_commits_and_retires(root: str) -> None:
    """keep_last=1, a save in flight: restore picks the committed step and pins it; the save
    commits and its retention, which would delete the step being read, skips it."""
    s1, s2 = "step-0000000001", "step-0000000002"
    gate = GateStorage(
        LocalStorage(root),
        hold={"commit", "open_data"},
        when=lambda name, args: args[0] == (s2 if name == "commit" else s1),
    )
    ckpt = pitstop.CheckpointManager(gate, keep_last=1)
    ckpt.save(1, make_state(seed=1))
    handle = ckpt.async_save(2, make_state(seed=2))
    assert gate.arrived["commit"].wait(20)  # step 2 is written, its commit held
    fresh = make_state(seed=99)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(step=ckpt.restore(fresh)))
    t.start()
    assert gate.arrived["open_data"].wait(20)  # restore reads step 1, pinned
    gate.open("commit")
    handle.wait()  # committed; retention ran and left the pinned step alone
    assert ckpt.steps() == [1, 2]
    gate.open("open_data")
    t.join(30)
    assert out.get("step") == 1
    assert_same_tensors(tensors_of(make_state(seed=1)), tensors_of(fresh))
    ckpt.close()


def test_partial_restore_that_matches_nothing_is_an_error(root: str) -> None:
    pitstop.save(root, make_state(seed=1), step=1)
    other = torch.nn.Linear(3, 3)
    before = tensors_of({"m": other})
    with pytest.raises(pitstop.StateMismatchError, match="none of the 2 keys of the Linear"):
        pitstop.load(root, {"model": other}, strict=False)
    assert_same_tensors(before, tensors_of({"m": other}))


def test_partial_restore_of_an_older_step_rolls_nothing_back(root: str) -> None:
    _saved(root, range(1, 4)).close()
    model = make_state(seed=99)["model"]
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore({"model": model}, step=1, strict=False) == 1
        assert ckpt.steps() == [1, 2, 3]  # evaluation of an old step is no rollback
    assert_same_tensors(tensors_of({"m": make_state(seed=1)["model"]}), tensors_of({"m": model}))


# ---------------------------------------------------------------- second review round
def test_a_checkpoint_replaced_after_the_scan_is_read_as_it_is_now(root: str) -> None:
    _saved(root, range(1, 3)).close()
    gate = GateStorage(LocalStorage(root), hold={"lock"}, when=lambda n, a: a[0].endswith("2"))
    reader = pitstop.CheckpointManager(gate)
    fresh = make_state(seed=99)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(step=reader.restore(fresh, rollback=False)))
    t.start()
    assert gate.arrived["lock"].wait(20)  # the reader scanned and is about to pin step 2
    with pitstop.CheckpointManager(root) as other:  # rolls back and saves a new step 2
        other.restore(make_state(seed=98), step=1)
        other.save(2, make_state(seed=22))
    gate.open("lock")
    t.join(30)
    assert out.get("step") == 2
    assert_same_tensors(tensors_of(make_state(seed=22)), tensors_of(fresh))
    assert not os.path.exists(os.path.join(root, "step-0000000002", DAMAGED_MARKER))
    reader.close()


def test_a_failing_retention_policy_never_hangs_a_save(root: str, caplog: Any) -> None:
    class Broken:
        def keep(self, checkpoints: Any) -> set[int]:
            raise ValueError("boom")

    with pitstop.CheckpointManager(root, retention=Broken()) as ckpt:
        ckpt.save(1, {"x": torch.ones(2)})
        ckpt.save(2, {"x": torch.ones(2)})
        assert ckpt.steps() == [1, 2]
    assert "retention after step 2 failed" in caplog.text


def test_a_garbage_marker_is_no_evidence(root: str) -> None:
    _saved(root, range(1, 3)).close()
    with open(os.path.join(root, "step-0000000002", DAMAGED_MARKER), "w") as f:
        f.write("[" * 3000)
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:  # tests/unit/test_markers.py: the rest
        assert ckpt.restore(fresh, rollback=False) == 2


def test_nesting_depth_is_linear_on_escaped_quotes() -> None:
    from pitstop.format.jsonsafe import nesting_depth

    assert nesting_depth('{"a": ["\\\\", "\\"[[", {"b": "]"}]}') == 3
    # an unterminated string of escaped quotes (a damaged manifest): quadratic would take minutes
    assert nesting_depth('"' + '\\"' * 200_000) == 0


def test_rollback_leaves_other_runs_alone(root: str) -> None:
    a = _saved(root, range(1, 3))
    b = _saved(root, range(10, 12))
    a.close()
    b.close()
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(make_state(seed=99), step=1) == 1
        assert ckpt.steps() == [1, 10, 11]


def test_rollback_holds_when_a_newer_checkpoint_is_in_use(root: str) -> None:
    _saved(root, range(1, 4)).close()
    with pitstop.CheckpointManager(root) as ckpt:
        with ckpt.hooks.catalog.pin("step-0000000003"):  # e.g. `pitstop verify` in another process
            assert ckpt.restore(make_state(seed=99), step=1) == 1
        assert ckpt.steps() == [1]  # step 3 is marked abandoned in place
        ckpt.save(2, make_state(seed=22))
        ckpt.save(3, make_state(seed=33))  # moves the marked one out of the way
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh) == 3
    assert_same_tensors(tensors_of(make_state(seed=33)), tensors_of(fresh))


def test_a_rollback_killed_after_its_first_write_still_holds(root: str) -> None:
    _saved(root, range(1, 4)).close()
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.restore(make_state(seed=99), step=1, rollback=False)
        entry = next(e for e in ckpt.entries() if e.step == 1)
        assert entry.manifest is not None and entry.manifest.lineage is not None
        lineage = entry.manifest.lineage
        doc = {"after": 1, "run": lineage.run, "timeline": lineage.timeline}
        ckpt.hooks.storage.mark("step-0000000001", "rollback", json.dumps(doc))  # then: SIGKILL
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.steps() == [1]
        assert ckpt.restore(make_state(seed=99)) == 1


def test_partial_restore_that_matches_no_top_level_key_is_an_error(root: str) -> None:
    pitstop.save(root, make_state(seed=1), step=1)
    with pytest.raises(pitstop.StateMismatchError, match="nothing to load"):
        pitstop.load(root, {"modle": make_state(seed=2)["model"]}, strict=False)


def test_a_state_that_is_not_a_dict_is_the_callers_error_and_marks_nothing(root: str) -> None:
    _saved(root, range(1, 3)).close()
    with pytest.raises(
        pitstop.StateMismatchError, match=r'dict of named objects, such as \{"model": model\}'
    ):
        pitstop.load(root, torch.nn.Linear(2, 2), strict=False)  # type: ignore[arg-type]
    with pitstop.CheckpointManager(root) as ckpt:
        with pytest.raises(pitstop.StateMismatchError, match="not a Linear"):
            ckpt.restore(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
        assert [e.status for e in ckpt.entries()] == ["committed", "committed"]


def test_a_rank_joins_only_the_directory_its_rank_0_created(tmp_path: Any) -> None:
    root = str(tmp_path / "ck")
    coordinator, other = LocalStorage(root), LocalStorage(root)
    token = coordinator.prepare("step-0000000005")
    other.join("step-0000000005", token)  # the right directory: written through its handle
    other.write_object("step-0000000005", "objects-00001.json", b"{}")
    other.leave("step-0000000005")
    assert os.path.exists(os.path.join(root, "step-0000000005", "objects-00001.json"))
    # the first job died; a restarted job took the step: the old job's rank never writes there
    coordinator.abort("step-0000000005")
    LocalStorage(root).prepare("step-0000000005")
    with pytest.raises(pitstop.CheckpointExistsError, match="no longer the directory"):
        other.join("step-0000000005", token)
    assert os.listdir(os.path.join(root, "step-0000000005")) == [".owner"]


# ---------------------------------------------------------------- a restore racing retention
class _RetiresAfterFirstListing(StorageWrapper):
    """Another job's saves (and their retention) land just after the restore's first
    listing: the steps it chose from are gone when it looks again."""

    def __init__(self, inner: Any, root: str) -> None:
        super().__init__(inner)
        self.root, self.armed = root, False

    def _call(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            out = fn(*args, **kw)
            if name == "entries" and self.armed:
                self.armed = False
                _saved(self.root, range(4, 6)).close()
                for s in (2, 3):  # retired by that job's retention
                    shutil.rmtree(os.path.join(self.root, f"step-000000000{s}"))
            return out

        return call


def test_a_restore_whose_candidates_vanish_lists_again_and_never_starts_from_scratch(
    root: str,
) -> None:
    _saved(root, range(1, 4), keep_last=2).close()
    fresh = make_state(seed=99)
    storage = _RetiresAfterFirstListing(LocalStorage(root), root)
    with pitstop.CheckpointManager(storage) as ckpt:
        storage.armed = True
        assert ckpt.restore(fresh) == 5
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "root"
    assert_same_tensors(tensors_of(make_state(seed=5)), tensors_of(fresh))


def test_one_directory_reports_names_of_that_directory(root: str) -> None:
    """A list of one level: skipped and set-aside names are the directory's own."""
    _saved(root, range(1, 4)).close()
    flip_byte(os.path.join(root, "step-0000000003", "rank-00000.bin"), 10)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(make_state(seed=99), step=None) == 2
        assert ckpt.last_restore is not None
        assert [n for n, _ in ckpt.last_restore.skipped] == ["step-0000000003"]
        assert all(os.path.exists(os.path.join(root, n)) for n in ckpt.last_restore.set_aside)
