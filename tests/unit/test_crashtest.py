"""``pitstop crashtest``, ``pitstop diff`` and the value-by-value comparison behind them.

crashtest runs a small training script (written here) three ways; the variants break
exact resume in the ways users do, and crashtest must say so and name the cause."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from conftest import AheadRuns, uses_runs
from pitstop.cli.compare import compare
from pitstop.cli.crashtest_causes import Record, diagnose, final_sites, read_log
from pitstop.cli.crashtest_points import ResumePoint, Timeline, choose
from pitstop.cli.main import main

pytestmark = pytest.mark.fault

SCRIPT = textwrap.dedent(
    """
    import argparse, random, torch, pitstop
    p = argparse.ArgumentParser()
    p.add_argument("--dir"); p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--variant", default="good")
    a = p.parse_args()
    if a.variant == "fail":
        raise SystemExit(3)
    if a.variant != "unseeded":
        torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stepped after training
    if a.variant.startswith("torchdata"):
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler
        if a.variant == "torchdata":  # torchdata's sampler, its generator apart from the loader's
            sampler = RandomSampler(data, generator=torch.Generator().manual_seed(2))
            loader = StatefulDataLoader(data, batch_size=8, sampler=sampler,
                                        generator=torch.Generator().manual_seed(3))
        else:
            gen = None if a.variant == "torchdata-nogen" else torch.Generator().manual_seed(2)
            loader = StatefulDataLoader(data, batch_size=8, shuffle=True, generator=gen)
    else:
        loader = pitstop.ResumableLoader(data, batch_size=8, shuffle=True, seed=2)
    # evaluated at the end of each epoch; persistent workers and no generator of its own: its
    # first pass in each process draws a base seed from torch's global generator
    evaluation = torch.utils.data.DataLoader(data, batch_size=32, num_workers=1,
                                             persistent_workers=True)
    progress = {"step": 0}
    state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader,
             "progress": progress}
    if a.variant == "outside-counter":  # the step counter is not in the state
        del state["progress"]
    if a.variant != "no-rng":
        state["rng"] = pitstop.RNGState()
    every = a.steps if a.variant == "late" else a.every
    if a.variant.startswith("timed") and a.dir.endswith("crashed"):
        every = 1  # the crashed runs save at other steps than the reference, as a timed policy may
    if a.variant == "selfkill" and a.dir.endswith("crashed"):  # dies by itself, not by crashtest
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    old_idiom = a.variant in ("timed-old-idiom", "no-final")
    with pitstop.CheckpointManager(a.dir, keep_last=2, policy=pitstop.policy.EveryN(every)) as ckpt:
        if a.variant != "norestore":
            ckpt.restore(state)
        if a.variant == "eval-draws":  # evaluates what it starts from, drawing from torch's RNG
            for _ in torch.utils.data.DataLoader(data, batch_size=16, shuffle=True):
                pass
        while progress["step"] < a.steps:
            for x, y in loader:
                if a.variant == "py-random":  # python's unseeded generator in the training
                    x = x * (1 + 0.1 * random.random())
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                progress["step"] += 1
                if old_idiom:
                    ckpt.step(progress["step"], state)
                else:  # the last step is saved by save_final, after the end-of-training work
                    ckpt.step(progress["step"], state, last=progress["step"] == a.steps)
                if progress["step"] >= a.steps:
                    break
            else:  # the epoch ended
                if a.variant == "eval-leak":
                    for _ in evaluation:
                        pass
        sched.step()  # end-of-training work that changes the state
        if a.variant == "timed-old-idiom":  # save the final state if the policy did not
            ckpt.wait()
            if ckpt.latest_step() != progress["step"]:
                ckpt.save(progress["step"], state)
        elif a.variant != "no-final":
            ckpt.save_final(progress["step"], state)
    """
)


EPOCHS = textwrap.dedent(
    """
    import argparse, torch, pitstop  # torch only: numpy's and python's generators untouched
    p = argparse.ArgumentParser()
    p.add_argument("--dir"); p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--every", type=int, default=8)
    a = p.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g), torch.randn(48, 1, generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = pitstop.ResumableLoader(data, batch_size=8, shuffle=True, seed=2)  # 6 batches
    progress = {"step": 0}
    state = {"model": model, "optimizer": opt, "data": loader, "rng": pitstop.RNGState(),
             "progress": progress}
    with pitstop.CheckpointManager(a.dir, keep_last=2, policy=pitstop.policy.EveryN(a.every)) as ckpt:
        ckpt.restore(state)
        while loader.epoch < a.epochs:
            epoch = loader.epoch
            for i, (x, y) in enumerate(loader, start=loader.position):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                progress["step"] += 1
                ckpt.step(progress["step"], state, last=epoch == a.epochs - 1 and i == len(loader) - 1)
        ckpt.save_final(progress["step"], state)
    """
)


NOKILL = textwrap.dedent(
    """
    import sys, torch, pitstop  # saves with save() itself and never calls ckpt.step()/reached()
    m = torch.nn.Linear(2, 2)
    with pitstop.CheckpointManager(sys.argv[1]) as c:
        for s in (1, 2, 3):
            c.save(s, {'model': m})
    """
)


@dataclass(frozen=True)
class Crashtest:
    """A finished ``pitstop crashtest`` (the CLI in a subprocess, as a user runs it): its
    exit code, its output (stdout then stderr) and its --workdir."""

    code: int
    out: str
    runs: Path


def _run_crashtest(base: Path, env: dict[str, str], key: tuple[str, tuple[str, ...]]) -> Crashtest:
    """``key``: (variant of SCRIPT, or "epochs" (EPOCHS), "nokill" (NOKILL), "no-dir" (SCRIPT
    with a directory that is not {dir}); crashtest's options after ``--seed 1``)."""
    variant, options = key
    work = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=base))
    py = [sys.executable]
    if variant == "epochs":
        cmd = [*py, str(base / "epochs.py"), "--dir", "{dir}"]
    elif variant == "nokill":
        cmd = [*py, str(base / "nokill.py"), "{dir}"]
    elif variant == "no-dir":
        cmd = [*py, str(base / "train.py"), "--dir", str(work / "x"), "--variant", "good"]
    else:
        cmd = [*py, str(base / "train.py"), "--dir", "{dir}", "--variant", variant]
    runs = work / "runs"
    proc = subprocess.run(
        [*py, "-m", "pitstop.cli.main", "crashtest", "--seed", "1", "--workdir", str(runs),
         *options, "--", *cmd],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    return Crashtest(proc.returncode, proc.stdout + proc.stderr, runs)


@pytest.fixture(scope="module")
def crashtests(request: Any, tmp_path_factory: Any) -> Any:
    """The module's crashtests, started ahead of the tests that read them (:class:`AheadRuns`)."""
    base = tmp_path_factory.mktemp("crashtests")
    for name, text in (("train.py", SCRIPT), ("epochs.py", EPOCHS), ("nokill.py", NOKILL)):
        (base / name).write_text(text)
    # the environment now, not as a test's monkeypatch leaves it; one thread per core
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_CRASHTEST_")}
    env["OMP_NUM_THREADS"] = "1"
    runs = AheadRuns.for_module(request, functools.partial(_run_crashtest, base, env))
    yield runs
    runs.close()


def _crashtest(crashtests: AheadRuns, variant: str, *options: str) -> tuple[int, str]:
    result = crashtests.result((variant, options))
    return result.code, result.out


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


TORCHDATA = _have("torchdata.stateful_dataloader")


@uses_runs(("good", ("--kills", "2", "--keep")))
def test_a_script_that_resumes_exactly_is_identical(crashtests: AheadRuns) -> None:
    code, out = _crashtest(crashtests, "good", "--kills", "2", "--keep")
    assert code == 0, out
    assert "identical: yes" in out
    assert out.count("crashed run") == 2 and "SIGKILL at step" in out
    # the killed runs really were killed after a commit, and the resumed runs restored one
    runs = crashtests.result(("good", ("--kills", "2", "--keep"))).runs
    records = [json.loads(line) for name in sorted(os.listdir(runs)) if name.endswith(".log")
               for line in (runs / name).read_text().splitlines()]  # fmt: skip
    kills = [r["step"] for r in records if r["event"] == "kill"]
    restores = [r["step"] for r in records if r["event"] == "restore"]
    assert len(kills) == 2 and len(restores) == 2
    assert all(r < k for r, k in zip(restores, kills[1:]))  # each restore precedes the next kill
    # python's random and NumPy's global generator are unseeded in the script, but nothing
    # draws from them: not compared, and not named as a cause
    assert "not compared: rng/numpy, rng/python" in out
    assert "does not seed" not in out


@uses_runs(("eval-draws", ("--kills", "1")))
def test_drawing_from_the_global_generator_after_a_restore_is_named(
    crashtests: AheadRuns,
) -> None:
    code, out = _crashtest(crashtests, "eval-draws", "--kills", "1")
    assert code == 1, out
    assert "identical: no" in out and "model/0.weight" in out and "max |a-b| = " in out
    assert "(torch) were drawn outside the saved state" in out
    assert "docs/determinism.md" in out


@uses_runs(("no-rng", ("--kills", "1")))
def test_a_state_without_rng_state_is_named(crashtests: AheadRuns) -> None:
    code, out = _crashtest(crashtests, "no-rng", "--kills", "1")
    assert code == 1, out
    assert "the state holds no pitstop.RNGState" in out
    assert "the state does not restore them" in out


@uses_runs(("outside-counter", ("--kill-at", "13")))
def test_a_step_counter_outside_the_state_is_named(crashtests: AheadRuns) -> None:
    code, out = _crashtest(crashtests, "outside-counter", "--kill-at", "13")
    assert code == 1, out
    assert "checkpoint of step 13 committed, SIGKILL at step 14" in out
    assert "the runs made a different number of optimizer steps" in out
    assert "optimizer/state/0/step differs by" in out


@uses_runs(("no-final", ()), ("good", ("--kill-at", "30")))
def test_a_run_that_does_not_save_its_final_state_is_noted(crashtests: AheadRuns) -> None:
    code, out = _crashtest(crashtests, "no-final")
    assert code == 0, out
    assert "trained to step 30 but its newest checkpoint is of step 28" in out
    # resumed at the reference's own checkpoints only (every 4th step): a resume elsewhere
    # would shift the schedule, and the newest checkpoint would not be of step 28
    tested = next(line for line in out.splitlines() if line.startswith("resume points tested:"))
    assert all(int(step) % 4 == 0 for step in re.findall(r"step (\d+)", tested)), tested
    code, out = _crashtest(crashtests, "good", "--kill-at", "30")
    assert code == 2 and "choose steps from 1 to 29" in out


@uses_runs(("timed", ("--kills", "1")))
def test_the_final_checkpoint_does_not_depend_on_when_the_policy_saves(
    crashtests: AheadRuns,
) -> None:
    # the crashed runs save at every step (a timed policy may save at any step, the last one
    # included) and the reference every 4th; work after the last step (scheduler.step())
    # changes the state: with last=True and save_final the final checkpoint always holds
    # the state after that work (one resume point: whichever it is, the resumed run saves
    # every step to the last)
    code, out = _crashtest(crashtests, "timed", "--kills", "1")
    assert code == 0, out
    assert "identical: yes" in out


@uses_runs(("timed-old-idiom", ("--kills", "1")))
def test_a_final_checkpoint_taken_at_another_place_is_named(crashtests: AheadRuns) -> None:
    # the former idiom (save the last step if the policy did not): in the reference the final
    # save after scheduler.step(), in the resumed run the policy's save inside the loop
    code, out = _crashtest(crashtests, "timed-old-idiom", "--kills", "1")
    assert code == 1, out
    assert "scheduler/last_epoch" in out
    assert "the checkpoint of step 30 was taken at different places" in out
    assert "last=True" in out and "save_final" in out
    # not the causes that the different places explain
    assert "the data position differs" not in out and "drawn outside" not in out


LIBRARY = textwrap.dedent(
    """
    def save_checkpoint(probe, step, state):  # the library's checkpoint-writing layer
        probe.saved(step, state)

    def on_train_batch_end(probe, step, state):
        save_checkpoint(probe, step, state)

    def on_validation_end(probe, step, state):
        save_checkpoint(probe, step, state)
    """
)


def _library(tmp_path: Any) -> dict[str, Any]:
    """A framework's module as if installed (its file under site-packages)."""
    path = tmp_path / "site-packages" / "framework" / "callbacks.py"
    path.parent.mkdir(parents=True)
    path.write_text(LIBRARY)
    module: dict[str, Any] = {}
    exec(compile(LIBRARY, str(path), "exec"), module)
    return module


def test_the_probe_records_the_chain_of_callers_of_a_save(tmp_path: Any, monkeypatch: Any) -> None:
    from pitstop.probe import CrashProbe

    monkeypatch.delenv("PITSTOP_CRASHTEST_KILL_STEP", raising=False)
    lib, log = _library(tmp_path), str(tmp_path / "probe.log")
    probe = CrashProbe(None, log)

    def training_loop() -> None:  # the script's code
        lib["on_train_batch_end"](probe, 4, {})
        lib["on_validation_end"](probe, 8, {})

    training_loop()
    saves = [r.data for r in read_log(log, "run") if r.event == "save"]
    assert all(s["site"].endswith("callbacks.py:3") for s in saves), saves
    chains = [[frame[2].split(".")[-1] for frame in s["stack"][:3]] for s in saves]
    assert chains == [
        ["save_checkpoint", "on_train_batch_end", "training_loop"],
        ["save_checkpoint", "on_validation_end", "training_loop"],
    ]
    assert saves[0]["site"] == saves[1]["site"]  # the same line of the library: not enough


def _save_record(run: str, place: str, line: int) -> Record:
    lib = "/venv/lib/python3.11/site-packages/lightning/pytorch/"
    stack = [
        [lib + "strategies/strategy.py", 491, "Strategy.save_checkpoint"],
        [lib + "trainer/trainer.py", 1400, "Trainer.save_checkpoint"],
        [lib + "callbacks/model_checkpoint.py", 600, "ModelCheckpoint._save_checkpoint"],
        [lib + "callbacks/model_checkpoint.py", line, f"ModelCheckpoint.{place}"],
        [lib + "trainer/call.py", 227, "_call_callback_hooks"],
        ["/home/u/train.py", 20, "<module>"],
    ]
    site = f"{stack[0][0]}:{stack[0][1]}"
    return Record(run, "save", 40, 0, 1, {"via": "save_checkpoint", "site": site, "stack": stack})


def test_a_step_saved_at_another_point_of_a_frameworks_loop_is_named() -> None:
    from pitstop.cli.compare import Difference

    ref = [_save_record("reference", "on_train_batch_end", 422)]
    crashed = [_save_record("run2", "on_validation_end", 508)]
    diffs = [
        Difference("loops/fit_loop/epoch_loop.batch_progress/total/completed", "39 vs 40", 1),
        Difference("callbacks/ModelCheckpoint{}/best_model_score", "values differ", 0.05, True, 1),
    ]
    held = ["state_dict", "optimizer_states", "callbacks"]
    cause = final_sites(ref, crashed, 40, diffs, held)
    assert cause is not None
    assert cause.startswith(
        "step 40 was saved from ModelCheckpoint.on_train_batch_end (model_checkpoint.py:422) in "
        "the reference and from ModelCheckpoint.on_validation_end (model_checkpoint.py:508) "
        "in the resumed run: lightning saves at a different point after a resume"
    ), cause
    assert "under loops, callbacks" in cause and "agree: state_dict, optimizer_states" in cause
    # the same chain in both runs: the same place, no cause
    assert final_sites(ref, [_save_record("run2", "on_train_batch_end", 422)], 40, diffs) is None
    # and the generic cause is not said for what the different places explain
    causes = diagnose(ref, crashed, set(), set(), {40}, explained=True)
    assert not any("computation itself" in c for c in causes), causes


@uses_runs(("eval-leak", ("--seed", "2", "--keep")))
def test_a_leak_that_shows_only_after_the_first_epoch_is_caught(crashtests: AheadRuns) -> None:
    # the evaluation loader's first pass in each process draws from torch's generator: only a
    # resume after the first epoch's evaluation shows it (seed 2 killed in the first epoch)
    code, out = _crashtest(crashtests, "eval-leak", "--seed", "2", "--keep")
    runs = crashtests.result(("eval-leak", ("--seed", "2", "--keep"))).runs
    assert code == 1, out
    assert "identical: no" in out and "(torch) were drawn outside the saved state" in out
    tested = next(line for line in out.splitlines() if line.startswith("resume points tested:"))
    assert "early" in tested and "(mid-epoch 0)" in tested and "(epoch 1)" in tested
    assert "step 29 (last step" in tested
    restores = [json.loads(line)["step"] for name in sorted(os.listdir(runs))
                if name.endswith(".log") for line in (runs / name).read_text()
                .splitlines() if json.loads(line)["event"] == "restore"]  # fmt: skip
    assert len(restores) == 4 and any(r > 8 for r in restores)  # one after the first epoch


@uses_runs(("py-random", ("--kill-at", "13")))
def test_generators_are_named_only_when_the_script_draws_from_them(
    crashtests: AheadRuns,
) -> None:
    code, out = _crashtest(crashtests, "py-random", "--kill-at", "13")
    assert code == 1, out
    assert "the script does not seed python and draws from it" in out
    assert "numpy" not in out.split("identical: no")[1]  # numpy is unseeded but unused


def _kill_at(steps: list[str]) -> tuple[str, ...]:
    return tuple(o for k in steps for o in ("--kill-at", k))


@pytest.mark.parametrize("kill_at", [["5"], ["2", "11"]])
@uses_runs(of=lambda params: [("epochs", _kill_at(params["kill_at"]))])
def test_generators_nothing_draws_from_do_not_make_runs_differ(
    crashtests: AheadRuns, kill_at: list[str]
) -> None:
    # the reference saves at steps 8 and 16 only: the first crashed run saves at step 5 (or 2)
    # and no save of the two fresh runs is at the same step. numpy's and python's generators
    # are unseeded (the script never touches them): they start apart in every process, and
    # nothing draws from them, so they must not count
    code, out = _crashtest(crashtests, "epochs", *_kill_at(kill_at))
    assert code == 0, out
    assert "identical: yes" in out
    assert "not compared: rng/numpy, rng/python (unseeded, and nothing in the runs draws" in out
    assert "drawn outside" not in out


@uses_runs(("epochs", _kill_at(["2", "11"])))
def test_epochs_are_counted_and_named_as_the_loader_counts_them(crashtests: AheadRuns) -> None:
    # 3 epochs of 6 steps (loader.epoch 0, 1, 2), the first checkpoint at step 8 (epoch 1):
    # the epochs before the first checkpoint count too, and are named by loader.epoch (the
    # crashtest of the test above, resumed at steps 2 and 11)
    code, out = _crashtest(crashtests, "epochs", *_kill_at(["2", "11"]))
    assert code == 0, out
    assert "final step 18, 3 saves, 3 epochs (loader.epoch 0 to 2)" in out
    assert "resume points tested: step 2 (chosen, epoch 0), step 11 (chosen, epoch 1)" in out


def test_the_last_step_is_left_to_save_final(tmp_path: Any, caplog: Any) -> None:
    state = {"w": torch.zeros(2), "progress": {"step": 0, "done": False}}
    root = str(tmp_path / "ck")
    with pitstop.CheckpointManager(root, policy=pitstop.policy.EveryN(1)) as ckpt:
        for step in range(1, 4):
            state["w"] += 1
            state["progress"]["step"] = step
            assert ckpt.step(step, state, last=step == 3) == (step < 3)  # the policy: every step
        state["progress"]["done"] = True  # end-of-training work
        handle = ckpt.save_final(3, state)
        assert handle is not None and handle.committed
        assert ckpt.steps() == [1, 2, 3]
    assert pitstop.load(root)["progress"] == {"step": 3, "done": True}
    # a rerun of the finished run restores step 3 and saves nothing again, silently
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(state) == 3
        assert ckpt.save_final(3, state) is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # without last=True the policy took step 3 before the end-of-training work: said so
    with pitstop.CheckpointManager(str(tmp_path / "b"), policy=pitstop.policy.EveryN(1)) as ckpt:
        ckpt.step(1, state)
        state["progress"]["done"] = False
        assert ckpt.save_final(1, state) is None
    assert pitstop.load(str(tmp_path / "b"))["progress"]["done"] is True
    assert any("last=True" in r.getMessage() for r in caplog.records)


@uses_runs(("unseeded", ("--kills", "1")))
def test_an_unseeded_script_is_named(crashtests: AheadRuns) -> None:
    code, out = _crashtest(crashtests, "unseeded", "--kills", "1")
    assert code == 1, out
    assert "does not seed torch" in out


@pytest.mark.parametrize(
    ("variant", "cmd_has_dir", "message"),
    [
        ("fail", True, "the reference run exited 3"),
        ("late", True, "checkpointed first at its last step"),
        ("good", False, "must take its checkpoint directory as {dir}"),
        ("norestore", True, "restored no checkpoint"),
        ("selfkill", True, "(killed by SIGKILL) before crashtest killed it"),
    ],
)
@uses_runs(of=lambda p: [(p["variant"] if p["cmd_has_dir"] else "no-dir", ())])
def test_runs_that_cannot_be_compared_exit_2(
    crashtests: AheadRuns, variant: str, cmd_has_dir: bool, message: str
) -> None:
    code, out = _crashtest(crashtests, variant if cmd_has_dir else "no-dir")
    assert code == 2, out
    assert message in out


def test_bad_options_are_usage_errors(tmp_path: Any, capsys: Any) -> None:
    for option in (["--kills", "0"], ["--timeout", "-1"], ["--restarts", "-1"]):
        with pytest.raises(SystemExit) as exit_:
            main(["crashtest", *option, "--", "python", "x.py", "{dir}"])
        assert exit_.value.code == 2
    (tmp_path / "file").write_text("x")
    assert main(["crashtest", "--workdir", str(tmp_path / "file"), "--", "x", "{dir}"]) == 2
    assert "--workdir" in capsys.readouterr().err


@uses_runs(("nokill", ()))
def test_a_script_that_never_reaches_the_kill_step_is_reported(crashtests: AheadRuns) -> None:
    # NOKILL saves with save() itself and never calls ckpt.step()/reached(): crashtest cannot
    # kill it
    code, out = _crashtest(crashtests, "nokill")
    assert code == 2, out
    assert "without being killed" in out and "reached(step)" in out


def test_the_kill_waits_for_a_committed_checkpoint(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, PITSTOP_CRASHTEST_KILL_STEP="3", PITSTOP_CRASHTEST_LOG=str(log))
    proc = subprocess.run(
        [sys.executable, str(script), "--dir", str(tmp_path / "ck"), "--every", "5"],
        env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kill = next(r for r in records if r["event"] == "kill")
    # the policy (every 5) would not save step 3: crashtest's resume point is saved anyway,
    # and the kill at the next step waits until that checkpoint has committed
    assert (kill["step"], kill["resume"]) == (4, 3)
    assert pitstop.CheckpointManager(str(tmp_path / "ck")).steps() == [3]


@uses_runs(of=lambda _: [("torchdata", ("--kills", "2"))] if TORCHDATA else [])
def test_torchdata_stateful_loader_with_its_own_generator_resumes_exactly(
    crashtests: AheadRuns,
) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    code, out = _crashtest(crashtests, "torchdata", "--kills", "2")
    assert code == 0, out
    assert "identical: yes" in out


@uses_runs(of=lambda _: [("torchdata-nogen", ("--kills", "1"))] if TORCHDATA else [])
def test_torchdata_stateful_loader_without_a_generator_is_named(crashtests: AheadRuns) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    code, out = _crashtest(crashtests, "torchdata-nogen", "--kills", "1")
    assert code == 1, out
    assert "loaders in the state without their own generator: data" in out
    assert "(torch) were drawn outside the saved state" in out


@uses_runs(of=lambda _: [("torchdata-shared", ())] if TORCHDATA else [])
def test_torchdata_loader_sharing_its_generator_with_the_sampler_is_named(
    crashtests: AheadRuns,
) -> None:
    # StatefulDataLoader(shuffle=True, generator=g): the sampler and the loader's base seed
    # draw from one generator, and the resumed order of the next epochs is not the same
    pytest.importorskip("torchdata.stateful_dataloader")
    code, out = _crashtest(crashtests, "torchdata-shared")
    assert code == 1, out
    assert "the data loader's own state differs (data/" in out


def _timeline(
    saves: list[int], final: int, per_epoch: int | None, trained: int | None = None
) -> Timeline:
    def epoch(step: int) -> dict[str, Any]:
        return {} if per_epoch is None else {"epoch": (step - 1) // per_epoch}

    records = [Record("ref", "save", s, 0, 1, epoch(s)) for s in [*saves, final]]
    steps = range(saves[0], (trained or final) + 1)
    records += [Record("ref", "step", s, 0, 1, epoch(s)) for s in steps]
    return Timeline.of(records, final)


def test_resume_points_cover_early_mid_epoch_a_later_epoch_and_the_last_step() -> None:
    tl = _timeline(list(range(4, 29, 4)), 30, per_epoch=8)  # epochs: 1-8, 9-16, 17-24, 25-30
    assert tl.starts == [(0, 1), (1, 9), (2, 17), (3, 25)] and tl.label(17) == "epoch 2"
    for seed in range(30):
        points = choose(tl, None, random.Random(seed))
        assert [p.kind for p in points] == ["early", "mid-epoch 0", "epoch 1", "last step"]
        early, mid, later, last = (p.step for p in points)
        assert early == 4 and 5 <= mid <= 7 and 9 <= later <= 12 and last == 29
    assert [p.kind for p in choose(tl, 1, random.Random(0))] == ["epoch 1"]
    more = choose(tl, 6, random.Random(0))
    assert len({p.step for p in more}) == 6 and sum(p.kind == "random" for p in more) == 2
    # the first checkpoint late in the first epoch (a timed policy): both epoch points in the
    # second epoch, the later-epoch one first
    tl = _timeline([15], 32, per_epoch=16)
    for seed in range(30):
        points = choose(tl, None, random.Random(seed))
        assert [p.kind for p in points] == ["early", "epoch 1", "mid-epoch 1", "last step"]
        assert points[0].step == 15 and 17 <= points[1].step < points[2].step <= 31
    # no epochs known: the middle and the last quarter instead
    points = choose(_timeline([4, 8], 40, per_epoch=None), None, random.Random(0))
    assert [p.kind for p in points] == ["early", "middle", "late", "last step"]
    assert choose(_timeline([4], 5, per_epoch=None), None, random.Random(0)) == [
        ResumePoint(4, "early")
    ]
    # no final save (trained to 30, newest checkpoint 28): the reference's checkpoints only
    tl = _timeline(list(range(4, 28, 4)), 28, per_epoch=8, trained=30)
    for seed in range(30):
        points = choose(tl, None, random.Random(seed))
        assert all(p.step % 4 == 0 for p in points) and points[-1] == ResumePoint(24, "last step")


# ---------------------------------------------------------------------- compare and diff
def test_compare_is_bit_for_bit_and_type_exact() -> None:
    nan = torch.tensor([math.nan, 1.0])
    a = {"t": nan, "z": torch.tensor([0.0]), "tup": (1, 2), "f": math.nan, "s": "x", "n": 1}
    b = {"t": nan.clone(), "z": torch.tensor([-0.0]), "tup": [1, 2], "f": math.nan, "s": "x",
         "n": 1.0, "extra": 3}  # fmt: skip
    diffs = {d.key: d for d in compare(a, b)}
    assert set(diffs) == {"z", "tup", "n", "extra"}  # NaN == NaN; -0.0 != 0.0; tuple != list
    assert diffs["z"].is_tensor and diffs["z"].max_abs == 0.0
    assert diffs["tup"].what == "tuple vs list" and diffs["n"].what == "int vs float"
    assert diffs["extra"].what == "only in B"
    assert compare(a, b, ignore=["z", "tup", "n", "extra"]) == []
    assert compare({"w": torch.ones(2)}, {"w": torch.ones(3)})[0].what.startswith(
        "torch.float32 [2]"
    )


def test_diff_exits_1_when_only_a_plain_value_differs(tmp_path: Any, capsys: Any) -> None:
    m = torch.nn.Linear(2, 2)
    pitstop.save(str(tmp_path / "a"), {"model": m, "progress": {"step": 1, "epoch": 0}})
    pitstop.save(str(tmp_path / "b"), {"model": m, "progress": {"step": 2, "epoch": 0}})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "progress/step" in out and "1 vs 2" in out
    assert "0 tensors and 1 other values differ" in out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "progress/*"]) == 0


def test_load_reads_the_view_of_any_saved_rank_and_refuses_others(tmp_path: Any) -> None:
    pitstop.save(str(tmp_path / "c"), {"x": torch.ones(2)})
    assert torch.equal(pitstop.load(str(tmp_path / "c"), rank=0)["x"], torch.ones(2))
    with pytest.raises(ValueError, match="rank 1: step 0 was saved by 1 rank"):
        pitstop.load(str(tmp_path / "c"), rank=1)


def test_crashtest_variables_set_by_hand_are_checked_and_never_stop_training(
    tmp_path: Any, monkeypatch: Any, caplog: Any
) -> None:
    monkeypatch.setenv("PITSTOP_CRASHTEST_KILL_STEP", "0")
    with pytest.raises(ValueError, match="PITSTOP_CRASHTEST_KILL_STEP=0 is not a step"):
        pitstop.CheckpointManager(str(tmp_path / "a"))
    monkeypatch.delenv("PITSTOP_CRASHTEST_KILL_STEP")
    monkeypatch.setenv("PITSTOP_CRASHTEST_LOG", str(tmp_path))  # a directory: cannot append
    with pitstop.CheckpointManager(str(tmp_path / "b")) as ckpt:
        ckpt.save(1, {"w": torch.ones(2)})
        ckpt.save(2, {"w": torch.ones(2)})
        assert ckpt.steps() == [1, 2]
    assert sum("crashtest's log is off" in r.getMessage() for r in caplog.records) == 1
