"""pitstop.integrations.lightning: pointers, retention and errors of PitstopCheckpointIO, and
a bit-identical resume of examples/lightning_mnist.py after a SIGKILL (and a broken one that
is not)."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch

import pitstop
from conftest import assert_same_tensors, tensors_of
from pitstop.cli.main import main as pitstop_main
from pitstop.errors import CheckpointError
from pitstop.integrations.lightning import PitstopCheckpointIO
from pitstop.storage.local import LocalStorage
from pitstop.testing import FaultyStorage

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "lightning_mnist.py")
KILL_STEP = 35  # the example checkpoints every 10 of 80 steps: resumes from 30 (or 20)


def _ckpt(step: int, root: str) -> dict[str, Any]:
    """A Lightning-shaped checkpoint whose paths lie under ``root``."""
    return {
        "global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), float(step))},
        "callbacks": {"ModelCheckpoint{}": {
            "dirpath": root, "last_model_path": "",
            "best_k_models": {os.path.join(root, "a.ckpt"): torch.tensor(1.0)},
        }},
    }  # fmt: skip


def _named(path: str) -> int:
    with open(path) as f:
        return int(json.load(f)["step"])


def test_one_step_saved_under_two_paths_is_saved_once(tmp_path: Any, capsys: Any) -> None:
    root = str(tmp_path / "run")
    io = PitstopCheckpointIO(root)
    top, last = os.path.join(root, "epoch=0-step=5.ckpt"), os.path.join(root, "last.ckpt")
    io.save_checkpoint(_ckpt(5, root), top)
    io.save_checkpoint(_ckpt(5, root), last)  # the same step again: no CheckpointExistsError
    io.teardown()
    assert io.manager.steps() == [5] and len(io.manager.history) == 1
    assert _named(top) == _named(last) == 5
    loaded = io.load_checkpoint(last)
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4,), 5.0))
    saved = pitstop.load(root)["callbacks"]["ModelCheckpoint{}"]  # stored relative to the root
    assert (
        saved["dirpath"] == "{pitstop_root}" and "{pitstop_root}/a.ckpt" in saved["best_k_models"]
    )
    callback = loaded["callbacks"]["ModelCheckpoint{}"]
    real = os.path.realpath(root)
    assert callback["dirpath"] == real and os.path.join(real, "a.ckpt") in callback["best_k_models"]
    # the step holds the top-k file's dict; through last.ckpt it reads as Lightning's last.ckpt
    assert callback["last_model_path"] == os.path.join(real, "last.ckpt")
    assert io.load_checkpoint(top)["callbacks"]["ModelCheckpoint{}"]["last_model_path"] == ""
    io.close()
    # after close (the docs' end of a script), a later trainer.test() still loads and tears down
    assert torch.equal(io.load_checkpoint(top)["state_dict"]["w"], torch.full((4,), 5.0))
    io.teardown()
    io.close()
    with pytest.raises(pitstop.UnsupportedSetupError, match="is closed: cannot save"):
        io.save_checkpoint(_ckpt(6, root), top)
    capsys.readouterr()
    assert pitstop_main(["ls", root]) == 0
    assert "committed" in capsys.readouterr().out


def test_remove_checkpoint_keeps_what_a_pointer_names_and_the_newest(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    io = PitstopCheckpointIO(root)
    names = ("a", "b", "c", "d", "last")  # in a directory of their own, which the IO creates
    a, b, c, d, last = (os.path.join(root, "mc", f"{n}.ckpt") for n in names)
    io.save_checkpoint(_ckpt(10, root), a)
    io.save_checkpoint(_ckpt(10, root), last)
    io.save_checkpoint(_ckpt(20, root), b)
    io.save_checkpoint(_ckpt(20, root), last)  # ModelCheckpoint: save, then remove the old
    io.remove_checkpoint(a)
    io.teardown()
    assert io.manager.steps() == [20] and not os.path.exists(a) and _named(last) == 20
    io.save_checkpoint(_ckpt(30, root), c)
    io.remove_checkpoint(b)  # last.ckpt still names 20
    io.teardown()
    assert io.manager.steps() == [20, 30]
    io.remove_checkpoint(c)  # 30 is named by nothing, but it is the newest
    io.teardown()
    assert io.manager.steps() == [20, 30]
    io.save_checkpoint(_ckpt(40, root), d)
    io.remove_checkpoint(d)  # while 40 is written: the save goes on, its pointer never comes
    io.remove_checkpoint(last)
    io.teardown()
    assert io.manager.steps() == [40] and not os.path.exists(d) and not os.path.exists(last)
    io.close()


def test_a_restart_points_last_at_the_newest_commit(tmp_path: Any, caplog: Any) -> None:
    root = str(tmp_path / "run")
    last, stale = os.path.join(root, "last.ckpt"), os.path.join(root, "stale.ckpt")
    io = PitstopCheckpointIO(root)
    io.save_checkpoint(_ckpt(3, root), last)
    io.teardown()
    io.manager.save(7, _ckpt(7, root))  # committed, then killed before its pointer came
    io.close()
    with open(stale, "w") as f:  # names a step whose save never committed
        json.dump({"pitstop": "lightning-pointer", "version": 1, "step": 99, "root": "."}, f)
    io = PitstopCheckpointIO(root)  # before Lightning resolves ckpt_path="last"
    assert _named(last) == 7
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        loaded = io.load_checkpoint(stale)
    assert loaded["global_step"] == 7 and "names step 99" in caplog.text
    io.close()


def test_teardown_raises_the_error_of_a_failed_save(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    storage = FaultyStorage(LocalStorage(root), fail={"commit": range(1, 100)}, errno=errno.EIO)
    io = PitstopCheckpointIO(storage)
    io.save_checkpoint(_ckpt(1, root), os.path.join(root, "last.ckpt"))  # staged: returns
    with pytest.raises(CheckpointError) as info:
        io.teardown()
    assert info.value.step == 1
    assert not os.path.exists(os.path.join(root, "last.ckpt"))  # no pointer to a failed save
    io.close()


def test_without_lightning_the_import_names_the_extra(monkeypatch: Any) -> None:
    import importlib

    from pitstop.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # `import` of it now fails
    monkeypatch.delitem(sys.modules, "pitstop.integrations.lightning")
    with pytest.raises(MissingExtraError, match=r"pip install 'pitstop\[lightning\]'"):
        importlib.import_module("pitstop.integrations.lightning")


# ---------------------------------------------------------------- the example, killed
def _run_chains(base: Any, chains: list[Any]) -> list[str]:
    """Run ``chains`` of Lightning runs (forks of one process that imported Lightning once,
    ``lightning_runs.py``); the lines it reported, one per run."""
    spec = base / "spec.json"
    spec.write_text(json.dumps(chains))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PITSTOP_KILL", "PITSTOP_CR"))}
    proc = subprocess.run(
        [sys.executable, RUNNER, str(spec)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> dict[str, str]:
    """Uninterrupted and killed-then-resumed runs of the example, plain and ``--broken``: forks
    of one process that imported Lightning once (lightning_runs.py), two at a time; the
    killed run is SIGKILLed at KILL_STEP as ``pitstop crashtest`` kills it."""
    base = tmp_path_factory.mktemp("lightning")
    dirs = {name: str(base / name) for name in ("ref", "crash", "broken_ref", "broken_crash")}

    def run(name: str, *extra: str, kill: bool = False) -> dict[str, Any]:
        env = {"PITSTOP_CRASHTEST_KILL_STEP": str(KILL_STEP)} if kill else {}
        log = str(base / f"{name}.{'killed' if kill else 'run'}.log")
        return {"dir": dirs[name], "argv": ["--dir", dirs[name], *extra], "kill_at": None,
                "env": env, "log": log}  # fmt: skip

    chains = [
        [run("crash", kill=True), run("crash")],
        [run("broken_crash", "--broken", kill=True), run("broken_crash", "--broken")],
        [run("ref")],
        [run("broken_ref", "--broken")],
    ]
    lines = _run_chains(base, chains)
    reports = [json.loads(line) for line in lines]
    codes = [(r["dir"], r["env"] != {}, r["status"]) for r in reports]
    expected = [(dirs[n], False, 0) for n in dirs] + [
        (dirs[n], True, -signal.SIGKILL) for n in ("crash", "broken_crash")
    ]
    assert sorted(codes) == sorted(expected), [(r, _log(r)) for r in reports if r["status"]]
    return dirs


def _plain(obj: Any) -> Any:
    """``obj`` with every tensor left out (NumPy arrays as bytes): the other values a resume
    must reproduce too."""
    if type(obj).__module__ == "numpy":
        return obj.tobytes()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not isinstance(v, torch.Tensor)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj if not isinstance(v, torch.Tensor)]
    return obj


@pytest.mark.fault
def test_killed_and_resumed_run_ends_bit_identical(runs: dict[str, str], capsys: Any) -> None:
    ref, crash = pitstop.load(runs["ref"]), pitstop.load(runs["crash"])
    assert ref["global_step"] == crash["global_step"] == 80
    assert_same_tensors(tensors_of(ref), tensors_of(crash))  # weights, optimizer, RNG
    assert _plain(ref) == _plain(crash)  # loops, callbacks, schedulers: every other value
    capsys.readouterr()
    assert pitstop_main(["ls", runs["crash"]]) == 0
    assert " 80 " in capsys.readouterr().out
    assert _named(os.path.join(runs["crash"], "last.ckpt")) == 80


def test_a_validation_loader_drawing_from_the_global_generator_breaks_it(
    runs: dict[str, str],
) -> None:
    ref, crash = pitstop.load(runs["broken_ref"]), pitstop.load(runs["broken_crash"])
    assert ref["global_step"] == crash["global_step"] == 80
    a, b = ref["state_dict"], crash["state_dict"]
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)


MONITORED = """
import argparse, os, sys, warnings
sys.path.insert(0, EXAMPLES)
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_mnist import LitMNIST
from pitstop.integrations.lightning import PitstopCallback, PitstopCheckpointIO
p = argparse.ArgumentParser(); p.add_argument("--dir")
a = p.parse_args()
warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec|shuffling).*")
torch.set_num_threads(1)
L.seed_everything(1, verbose=False)
io = PitstopCheckpointIO(a.dir)
trainer = L.Trainer(max_steps=40, val_check_interval=10, check_val_every_n_epoch=None,
    accelerator="cpu", devices=1, deterministic=True, logger=False, enable_progress_bar=False,
    enable_model_summary=False, num_sanity_val_steps=0, plugins=[io],
    callbacks=[PitstopCallback(), ModelCheckpoint(dirpath=a.dir, monitor="val_loss",
               every_n_train_steps=10, save_top_k=1, save_last=True)])
trainer.fit(LitMNIST(1, 64, False), ckpt_path="last")
if io.manager.latest_step() != trainer.global_step:
    trainer.save_checkpoint(os.path.join(a.dir, "final.ckpt"))
io.close()
"""


@pytest.mark.fault
def test_crashtest_with_a_monitoring_model_checkpoint_says_what_it_did_not_test(
    tmp_path: Any, capsys: Any
) -> None:
    # ModelCheckpoint(monitor=...) keeps the score of its newest check (current_score), which
    # Lightning does not restore; and it saves every 10 steps by itself: crashtest cannot make
    # it save at the points after step 30, and says so. Issue 25: the step-40 checkpoint is
    # taken at another point of Lightning's loop after the resume, and that is the cause said
    script = tmp_path / "train.py"
    script.write_text(MONITORED.replace("EXAMPLES", repr(os.path.dirname(EXAMPLE))))
    cmd = [sys.executable, str(script), "--dir", "{dir}"]
    pitstop_main(["crashtest", "--seed", "0", "--workdir", str(tmp_path / "runs"), "--", *cmd])
    out = capsys.readouterr().out
    assert "resume points tested: step 10 (early), step 30 (middle)" in out
    untested = "resume points not tested: step 37 (late), step 39 (last step): the run saved no "
    assert untested + "checkpoint from step 37 to its final one" in out, out
    assert "ModelCheckpoint" in out  # the reason names who decides
    listed = out.split("identical:")[0].split("differs, not counted:")[-1]
    assert "/current_score" not in "\n".join(listed.splitlines()[1:]), out
    # after the resume no validation has run yet at step 40: ModelCheckpoint defers its save
    # to on_validation_end, so step 40 is saved after validation (loop counters, scores);
    # both saves reach pitstop from the same line of Lightning's strategy: the cause is the
    # place, not the computation
    assert "identical: no" in out, out
    causes = out.split("likely causes:")[-1]
    assert (
        "step 40 was saved from ModelCheckpoint.on_train_batch_end (model_checkpoint.py:" in causes
    ), out
    assert "and from ModelCheckpoint.on_validation_end (model_checkpoint.py:" in causes, out
    assert "lightning saves at a different point after a resume" in causes, out
    assert "state_dict" in causes.split("agree")[-1], out  # the weights are the same
    assert "the computation itself differs" not in out, out


def test_a_final_save_to_another_path_is_not_taken_for_a_kill(tmp_path: Any, caplog: Any) -> None:
    root = str(tmp_path / "run")
    last, final = os.path.join(root, "last.ckpt"), os.path.join(root, "final.ckpt")
    io = PitstopCheckpointIO(root)
    io.save_checkpoint(_ckpt(3, root), last)
    io.teardown()  # the end of fit
    io.save_checkpoint(_ckpt(7, root), final)  # trainer.save_checkpoint("final.ckpt") after fit
    io.close()
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        io = PitstopCheckpointIO(root)  # a clean rerun
    assert _named(last) == 3 and _named(final) == 7  # last stays what Lightning made it
    assert "the newest committed step is" not in caplog.text
    io.close()


def test_a_kill_after_the_top_k_pointer_before_last_is_repaired(tmp_path: Any, caplog: Any) -> None:
    """ModelCheckpoint saves a step to its top-k file, then to ``last.ckpt``; a kill after the
    first pointer was written leaves ``last.ckpt`` on the previous step (the newest committed
    one then collides with the rerun's save of it)."""
    root = str(tmp_path / "run")
    last, top = os.path.join(root, "last.ckpt"), os.path.join(root, "epoch=0-step={}.ckpt")
    io = PitstopCheckpointIO(root)
    io.save_checkpoint(_ckpt(10, root), top.format(10))
    io.save_checkpoint(_ckpt(10, root), last)
    io.save_checkpoint(_ckpt(20, root), top.format(20))
    io.remove_checkpoint(top.format(10))
    io.close()  # its pointer written; killed before save_checkpoint(last) (teardown: no kill)
    assert _named(last) == 10 and _named(top.format(20)) == 20
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        io = PitstopCheckpointIO(root)
    assert _named(last) == 20 and "the newest committed step is 20" in caplog.text
    io.close()


def test_a_last_path_registered_before_the_first_save_is_repaired(tmp_path: Any) -> None:
    """PitstopCallback registers ModelCheckpoint's ``last`` path as training starts: a kill
    after the first step committed, before Lightning first saves ``last``, is repaired too."""
    root = str(tmp_path / "run")
    last = os.path.join(root, "last.ckpt")
    io = PitstopCheckpointIO(root)
    io.fit_starts(last)
    io.save_checkpoint(_ckpt(10, root), os.path.join(root, "epoch=0-step=10.ckpt"))
    io.close()  # no save to last.ckpt came
    assert not os.path.exists(last)
    io = PitstopCheckpointIO(root)
    assert _named(last) == 10
    io.close()


# ---------------------------------------------------------------- killed between any two writes
RUNNER = os.path.join(os.path.dirname(__file__), "lightning_runs.py")
SHORT = ["--steps", "30", "--every", "10"]  # top-k and last.ckpt at steps 10, 20 and 30
# every write of the run in order: the registry as training starts; for each checkpoint the
# stage, the data, the manifest (commit), the top-k pointer, the last.ckpt pointer; from
# step 30 on, retention of a step no pointer names. N: the N-th time the point is reached
# (lightning.pointer: once the pointer thread is done with a pointer, in the order of the
# saves; one it need not write, superseded or removed by then, is not written).
KILLS = (
    "lightning.registry:1",  # the root's registry names last.ckpt: nothing saved
    "stage.mid:2",
    "persist.mid:2",
    "persist.after_data:2",
    "commit.before_rename:2",
    "commit.after_rename:2",  # step 20 committed, no pointer names it
    "lightning.pointer:1",  # epoch=0-step=10.ckpt names 10, there is no last.ckpt yet
    "lightning.pointer:2",
    "lightning.pointer:3",  # epoch=0-step=20.ckpt names 20, last.ckpt still 10 (the report)
    "lightning.pointer:4",
    "lightning.pointer:5",  # the same at the final step
    "lightning.pointer:6",
    "retention.mid:1",  # step 30 committed, step 10 half retired
)


@pytest.fixture(scope="module")
def kills(tmp_path_factory: Any) -> dict[str, list[dict[str, Any]]]:
    """An uninterrupted run of the example ("ref") and one killed at each of KILLS, then
    resumed with ckpt_path="last": forks of one process (lightning_runs.py), two at a time.
    Each entry: the reports of its runs (status, pointers left, log)."""
    base = tmp_path_factory.mktemp("lightning_kills")

    def run(name: str, kill_at: str | None, log: str) -> dict[str, Any]:
        root = str(base / name)
        return {"dir": root, "argv": ["--dir", root, *SHORT], "kill_at": kill_at, "log": log}

    chains = [[run("ref", None, str(base / "ref.log"))]]
    for i, kill_at in enumerate(KILLS):
        name = kill_at.replace(":", "-")
        log = str(base / f"{name}.{{}}.log")
        chains.append([run(name, kill_at, log.format("killed")), run(name, None, log.format(i))])
    lines = _run_chains(base, chains)
    names = {str(base / k.replace(":", "-")): k for k in KILLS} | {str(base / "ref"): "ref"}
    reports: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        report = json.loads(line)
        reports.setdefault(names[report["dir"]], []).append(report)
    return reports


def _log(report: dict[str, Any]) -> str:
    with open(report["log"]) as f:
        return f"{report['log']}:\n{f.read()[-3000:]}"


@pytest.mark.fault
def test_every_kill_point_is_reached(kills: dict[str, list[dict[str, Any]]]) -> None:
    assert [r["status"] for r in kills["ref"]] == [0], _log(kills["ref"][0])
    for kill_at in KILLS:
        assert kills[kill_at][0]["status"] == -signal.SIGKILL, _log(kills[kill_at][0])
    # before the first save, the registry names the last path: a kill after the first commit
    # and before Lightning's first save to last.ckpt is repaired like the others
    assert kills["lightning.registry:1"][0]["pointers"] == {".pitstop-lightning.json": "last.ckpt"}


@pytest.mark.parametrize("kill_at", KILLS)
def test_a_run_killed_between_any_two_writes_resumes_from_last_bit_identical(
    kills: dict[str, list[dict[str, Any]]], kill_at: str, capsys: Any
) -> None:
    killed, resumed = kills[kill_at]
    assert killed["status"] == -signal.SIGKILL, _log(killed)
    assert resumed["status"] == 0, _log(resumed)
    ref, run = pitstop.load(kills["ref"][0]["dir"]), pitstop.load(resumed["dir"])
    assert ref["global_step"] == run["global_step"] == 30
    assert_same_tensors(tensors_of(ref), tensors_of(run))  # weights, optimizer, RNG
    assert _plain(ref) == _plain(run)  # loops, callbacks, schedulers: every other value
    assert resumed["pointers"]["last.ckpt"] == 30
    capsys.readouterr()
    assert pitstop_main(["verify", resumed["dir"]]) == 0
