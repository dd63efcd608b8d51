"""The README's loop under ``torchrun --nproc_per_node=2`` (gloo, DDP, ResumableLoader):
the whole job SIGKILLed in the middle of a step and resumed ends with the same weights,
on every rank, as a run that was never interrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.fault]
SCRIPT = os.path.join(os.path.dirname(__file__), "ddp_train.py")
TIMEOUT = 120.0


def _torchrun(ckpt: str, out: str, *extra: str) -> subprocess.Popen[bytes]:
    os.makedirs(out, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--max-restarts=0",
        SCRIPT, "--ckpt", ckpt, "--out", out, *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(os.path.join(out, "log.txt"), "wb")
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _finish(proc: subprocess.Popen[bytes], out: str) -> list[str]:
    try:
        code = proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    log = open(os.path.join(out, "log.txt")).read()
    assert code == 0, log[-3000:]
    return [open(os.path.join(out, f"rank{r}.txt")).read().split() for r in (0, 1)]


def _hanging(out: str) -> list[str]:
    paths = [os.path.join(out, f"hanging{r}") for r in (0, 1)]
    return [p if os.path.exists(p) else os.devnull for p in paths]


def test_ddp_job_sigkilled_mid_step_resumes_to_the_same_weights(tmp_path: Any) -> None:
    whole = _finish(
        _torchrun(str(tmp_path / "ck-whole"), str(tmp_path / "whole")), str(tmp_path / "whole")
    )
    assert whole[0] == whole[1] == ["None", whole[0][1]]  # both ranks agree; nothing resumed

    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "cut")
    proc = _torchrun(ckpt, out, "--hang-at", "9")  # checkpoints at 3 and 6; 8 done, mid-9
    deadline = time.monotonic() + TIMEOUT
    while not all(os.path.getsize(p) for p in _hanging(out)):
        assert proc.poll() is None, open(os.path.join(out, "log.txt")).read()[-3000:]
        assert time.monotonic() < deadline, "the job never reached step 9"
        time.sleep(0.1)
    # the ranks (torchrun starts each in a session of its own) and torchrun, as a preemption
    for r in (0, 1):
        os.kill(int(open(os.path.join(out, f"hanging{r}")).read()), signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(TIMEOUT)

    resumed = _finish(_torchrun(ckpt, str(tmp_path / "resumed")), str(tmp_path / "resumed"))
    assert resumed[0][0] == resumed[1][0] == "6"  # the newest committed step, on both ranks
    assert resumed[0][1] == resumed[1][1] == whole[0][1]  # the same weights as uninterrupted
