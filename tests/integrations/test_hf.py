"""pitstop.integrations.hf: a Trainer run killed with SIGKILL and resumed ends bit for bit where
an uninterrupted one does; failed saves raise; misuse is refused.

The crash test runs examples/hf_gpt2.py in subprocesses (the reference and the killed run side
by side, then the resumed run); the other tests train a tiny model in this process.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import pitstop
from pitstop.integrations import hf
from pitstop.storage.local import LocalStorage
from pitstop.testing import FaultyStorage

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2.py"
TIMEOUT = 300


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_CRASHTEST")}
    env.update(extra)
    return env


def _start(root: str, *args: str, **env: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(EXAMPLE), "--dir", root, "--steps", "16", "--every", "4", *args]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(**env)
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out


def _differences(a: Any, b: Any, key: str = "") -> list[str]:
    """Key paths where two loaded checkpoints differ (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        )  # fmt: skip
        return [] if same else [key]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{key} (keys {sorted(set(a) ^ set(b), key=str)})"]
        return [d for k in a for d in _differences(a[k], b[k], f"{key}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [key]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{key}/{i}")]
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays (RNG state)
        import numpy as np

        return [] if np.array_equal(a, b) else [key]
    return [] if a == b else [key]


@pytest.mark.fault
def test_killed_and_resumed_run_ends_bit_identical(tmp_path: Path) -> None:
    """Also what crashtest does not see: the train_loss hf.train returns is the whole run's.
    (tests/examples runs the --broken variant through crashtest.)"""
    flags: list[str] = []
    ref, crashed = str(tmp_path / "ref"), str(tmp_path / "crashed")
    ref_proc = _start(ref, *flags)
    kill_proc = _start(crashed, *flags, PITSTOP_CRASHTEST_KILL_STEP="13")
    (ref_code, ref_out), (kill_code, kill_out) = _finish(ref_proc), _finish(kill_proc)
    assert ref_code == 0, ref_out
    assert kill_code == -signal.SIGKILL, f"the run was not killed at step 13:\n{kill_out}"
    assert "done at step" not in kill_out

    code, out = _finish(_start(crashed, *flags))
    assert code == 0, out
    resumed_at = int(out.split("training from step ")[1].split()[0])
    # crashtest's kill step is a checkpoint the run commits before it dies (its resume point)
    assert resumed_at == 13, out

    a, b = pitstop.load(ref), pitstop.load(crashed)
    assert a["trainer"]["global_step"] == b["trainer"]["global_step"] == 16
    differences = _differences(a, b)
    assert {"model", "optimizer", "scheduler", "rng", "trainer", "data"} <= set(a)
    assert a["optimizer"]["state"], "AdamW state (exp_avg, exp_avg_sq) is compared too"
    assert a["scheduler"]["last_epoch"] == 16
    assert differences == []
    loss = ref_out.split("train_loss ")[1].split()[0]
    assert f"train_loss {loss}" in out, out  # the whole run's average, not this process's

    exe = shutil.which("pitstop", path=os.path.dirname(sys.executable))
    assert exe is not None, "the pitstop console script is not installed"
    ls = subprocess.run([exe, "ls", crashed], capture_output=True, text=True, timeout=TIMEOUT)
    assert ls.returncode == 0, ls.stderr
    assert "16" in ls.stdout and "committed" in ls.stdout


def test_import_without_transformers_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n    import pitstop.integrations.hf\n"
        "except ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert out.stdout.startswith("MissingExtraError"), out.stdout + out.stderr
    assert "pip install 'pitstop[hf]'" in out.stdout


# ---------------------------------------------------------------------- in this process
class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _trainer(tmp_path: Path, callback: Any, steps: int = 4, accumulate: int = 1) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=8,
        save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
        gradient_accumulation_steps=accumulate,
    )  # fmt: skip
    callbacks = [callback] if callback is not None else []
    return Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=_Tokens(), callbacks=callbacks
    )


def test_a_failed_save_raises_from_train(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpts")
    os.makedirs(root)
    # persist calls 1 and 2 write step 2 (data, objects); the 3rd, step 4's data, fails
    storage = FaultyStorage(LocalStorage(root), fail={"persist": [3]}, errno=errno.ENOSPC)
    trainer = _trainer(tmp_path, hf.PitstopCallback(storage, every=2))
    with pytest.raises(pitstop.CheckpointIOError) as info:
        hf.train(trainer)
    assert info.value.errno == errno.ENOSPC and info.value.step == 4
    with pitstop.CheckpointManager(root) as mgr:
        assert mgr.steps() == [2]


def test_trainer_train_without_the_helper_is_refused(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, hf.PitstopCallback(str(tmp_path / "ckpts"), every=2))
    with pytest.raises(pitstop.UnsupportedSetupError, match=r"hf\.train\(trainer\)"):
        trainer.train()


def test_a_finished_run_trains_nothing_more(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpts")
    first = _trainer(tmp_path, hf.PitstopCallback(root, every=3))
    assert hf.train(first).global_step == 4
    with pitstop.CheckpointManager(root) as mgr:
        assert mgr.steps() == [3, 4]  # every 3 steps, and the last one

    again = _trainer(tmp_path, hf.PitstopCallback(root, every=3))  # the same script, rerun
    result = hf.train(again)
    assert result.global_step == 4 and again.state.global_step == 4
    for name, value in again.model.state_dict().items():
        assert torch.equal(value, first.model.state_dict()[name]), name
    with pitstop.CheckpointManager(root) as mgr:
        assert mgr.steps() == [3, 4]  # the Trainer alone would have trained a step 5


def test_a_changed_setting_is_refused_before_anything_is_overwritten(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpts")
    first = _trainer(tmp_path, hf.PitstopCallback(root, every=1), steps=2)
    hf.train(first)
    again = _trainer(tmp_path, hf.PitstopCallback(root, every=1), steps=4, accumulate=2)
    before = {k: v.clone() for k, v in again.model.state_dict().items()}
    with pytest.raises(pitstop.StateMismatchError, match="gradient_accumulation_steps=1") as info:
        hf.train(again)
    assert not isinstance(info.value, pitstop.PartialRestoreError)
    for name, value in again.model.state_dict().items():
        assert torch.equal(value, before[name]), name  # the live model was not touched
