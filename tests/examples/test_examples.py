"""Each example in ``examples/`` resumes bit for bit under ``pitstop crashtest``, and its
``--broken`` variant (a loader drawing from the global generator outside the saved state)
is reported as differing, with that cause named. Run as a user would: the CLI, in a
subprocess, on the example scripts themselves (shortened)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from conftest import AheadRuns, uses_runs

pytestmark = pytest.mark.fault

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
PITSTOP = [sys.executable, "-m", "pitstop.cli.main"]
TORCHRUN = [
    sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
    "--rdzv-endpoint=localhost:0", "--max-restarts=0",
]  # fmt: skip
DRAWN_OUTSIDE = "were drawn outside the saved state"


def crashtest(tmp_path: Any, cmd: list[str], *options: str) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*PITSTOP, "crashtest", "--workdir", str(tmp_path / "runs"), "--timeout", "300",
         *options, "--", *cmd],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


def example(name: str) -> str:
    return os.path.join(EXAMPLES, name)


SINGLE = {  # example -> (command, the extra it needs)
    "mnist": ([sys.executable, example("mnist.py"), "--dir", "{dir}", "--epochs", "2"], None),
    "hf_gpt2": ([sys.executable, example("hf_gpt2.py"), "--dir", "{dir}"], "transformers"),
    "lightning_mnist": ([sys.executable, example("lightning_mnist.py"), "--dir", "{dir}"], "lightning"),
}  # fmt: skip


def _command(name: str) -> list[str]:
    cmd, extra = SINGLE[name]
    if extra is not None:
        pytest.importorskip(extra)
    return cmd


def _installed(name: str) -> bool:
    extra = SINGLE[name][1]
    return extra is None or importlib.util.find_spec(extra) is not None


# the crashtests of the single-process examples, by key: (example, its options, crashtest's)
RUNS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    **{f"{name}": (name, (), ("--seed", "0")) for name in SINGLE},
    **{f"{name} --broken": (name, ("--broken",), ("--seed", "0")) for name in SINGLE},
    # one resume point (the one kept first: in a later epoch) shows these broken variants
    # (lightning_mnist's saves are its ModelCheckpoint's: one point may have none after it)
    **{f"{name} --broken": (name, ("--broken",), ("--kills", "1", "--seed", "0"))
       for name in ("mnist", "hf_gpt2")},
    "mnist --every 5": ("mnist", ("--every", "5"), ("--seed", "0")),
    "mnist --broken --every 4, resumed in the first epoch": (
        "mnist", ("--broken", "--every", "4"), ("--kill-at", "5")),
    "mnist --broken --every 4, one point": (
        "mnist", ("--broken", "--every", "4"), ("--kills", "1", "--seed", "1")),
}  # fmt: skip


def _run(base: str, key: str) -> tuple[int, str]:
    name, script_options, options = RUNS[key]
    cmd = [*SINGLE[name][0], *script_options]
    return crashtest(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base)), cmd, *options)


@pytest.fixture(scope="module")
def runs(request: Any, tmp_path_factory: Any) -> Any:
    """The crashtests above, started ahead of the tests that read them (:class:`AheadRuns`);
    the torchrun one, on gloo, runs alone."""
    ahead = AheadRuns.for_module(
        request, functools.partial(_run, str(tmp_path_factory.mktemp("examples")))
    )
    yield ahead
    ahead.close()


def _result(runs: AheadRuns, key: str) -> tuple[int, str]:
    _command(RUNS[key][0])  # skipped if its extra is not installed
    result: tuple[int, str] = runs.result(key)
    return result


@pytest.mark.parametrize("name", sorted(SINGLE))
@uses_runs(of=lambda p: [p["name"]] if _installed(p["name"]) else [])
def test_example_resumes_identically(runs: AheadRuns, name: str) -> None:
    code, out = _result(runs, name)
    assert code == 0, out
    assert "identical: yes" in out and "SIGKILL at step" in out


@pytest.mark.parametrize("name", sorted(SINGLE))
@uses_runs(of=lambda p: [f"{p['name']} --broken"] if _installed(p["name"]) else [])
def test_broken_example_differs_and_names_the_cause(runs: AheadRuns, name: str) -> None:
    code, out = _result(runs, f"{name} --broken")
    assert code == 1, out
    assert "identical: no" in out and DRAWN_OUTSIDE in out
    assert "max |a-b| = " in out  # the differing tensors, with how much


@uses_runs("mnist --every 5")
def test_mnist_with_a_fixed_schedule_resumes_identically(runs: AheadRuns) -> None:
    # every 5 steps: the last step (32) is not one of them, the final save takes it
    code, out = _result(runs, "mnist --every 5")
    assert code == 0, out
    assert "identical: yes" in out


@uses_runs(
    "mnist --broken --every 4, resumed in the first epoch", "mnist --broken --every 4, one point"
)
def test_mnist_broken_is_caught_by_a_resume_in_the_second_epoch(runs: AheadRuns) -> None:
    # its test loader's first pass in each process draws: a resume in the first epoch does
    # not show it (--kill-at 5: identical); the one point crashtest keeps when asked for one
    # is in a later epoch, and shows it
    code, out = _result(runs, "mnist --broken --every 4, resumed in the first epoch")
    assert code == 0, out
    code, out = _result(runs, "mnist --broken --every 4, one point")
    assert code == 1, out
    tested = [line for line in out.splitlines() if line.startswith("resume points tested:")]
    assert tested and "(epoch 1)" in tested[0], out  # the second: loader.epoch 1
    assert "differ at the save of step 32 (by save_final()" in out


@pytest.mark.dist
@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
def test_ddp_torchrun_resumes_identically_on_every_rank(
    tmp_path: Any, runs: AheadRuns, memory: bool
) -> None:
    """With ``--memory`` (a memory snapshot every step, the disk every 5): each SIGKILL of
    the process group resumes at the killed step, from the segments the ranks left."""
    runs.alone()  # its ranks on gloo have the machine to themselves
    cmd = [*TORCHRUN, example("ddp_torchrun.py"), "--dir", "{dir}", "--steps", "24"]
    code, out = crashtest(tmp_path, cmd + (["--memory"] if memory else []), "--seed", "2")
    assert code == 0, out
    assert "identical: yes" in out
    assert "2 ranks saved the newest step: each rank's own values are compared" in out
    if memory:  # SIGKILL at step N after N-1 committed: resumed at N-1 or N, never older
        killed = [int(m) for m in re.findall(r"SIGKILL at step (\d+)", out)]
        resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", out)]
        assert killed and len(resumed) == len(killed), out
        assert all(k - 1 <= r <= k for k, r in zip(killed, resumed, strict=True)), out
