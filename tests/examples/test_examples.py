"""Each example in ``examples/`` resumes bit for bit under ``pitstop crashtest``, and its
``--broken`` variant (a loader drawing from the global generator outside the saved state)
is reported as differing, with that cause named. Run as a user would: the CLI, in a
subprocess, on the example scripts themselves (shortened)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

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


MNIST = [sys.executable, example("mnist.py"), "--dir", "{dir}", "--epochs", "2"]


def test_mnist_resumes_identically(tmp_path: Any) -> None:
    code, out = crashtest(tmp_path, MNIST, "--seed", "0")
    assert code == 0, out
    assert "identical: yes" in out and "SIGKILL at step" in out


def test_mnist_broken_differs_and_names_the_cause(tmp_path: Any) -> None:
    code, out = crashtest(tmp_path, [*MNIST, "--broken"], "--seed", "0")
    assert code == 1, out
    assert "identical: no" in out and "model/fc2.weight" in out
    assert DRAWN_OUTSIDE in out


@pytest.mark.dist
def test_ddp_torchrun_resumes_identically_on_every_rank(tmp_path: Any) -> None:
    cmd = [*TORCHRUN, example("ddp_torchrun.py"), "--dir", "{dir}", "--steps", "24"]
    code, out = crashtest(tmp_path, cmd, "--seed", "2")
    assert code == 0, out
    assert "identical: yes" in out
    assert "2 ranks saved the newest step: each rank's own values are compared" in out


HF = [sys.executable, example("hf_gpt2.py"), "--dir", "{dir}"]


def test_hf_gpt2_resumes_identically(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    code, out = crashtest(tmp_path, HF, "--seed", "0")
    assert code == 0, out
    assert "identical: yes" in out and "SIGKILL at step" in out


def test_hf_gpt2_broken_differs_and_names_the_cause(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    code, out = crashtest(tmp_path, [*HF, "--broken"], "--seed", "0")
    assert code == 1, out
    assert "identical: no" in out and DRAWN_OUTSIDE in out


LIGHTNING = [sys.executable, example("lightning_mnist.py"), "--dir", "{dir}"]


def test_lightning_mnist_resumes_identically(tmp_path: Any) -> None:
    pytest.importorskip("lightning")
    code, out = crashtest(tmp_path, LIGHTNING, "--seed", "0")
    assert code == 0, out
    assert "identical: yes" in out and "SIGKILL at step" in out


def test_lightning_mnist_broken_differs_and_names_the_cause(tmp_path: Any) -> None:
    pytest.importorskip("lightning")
    code, out = crashtest(tmp_path, [*LIGHTNING, "--broken"], "--seed", "0")
    assert code == 1, out
    assert "identical: no" in out and DRAWN_OUTSIDE in out
