"""``pitstop keeper DIR``, the keeper a launcher starts on the node, with trainers made by
``Memory(keeper="external")``: it seals their snapshots, writes a killed one-process
trainer's newest snapshot to DIR, keeps the slots for the restart (which resumes from
memory, bit-exact) and exits once the job closed; a trainer without one seals itself."""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Any

import pytest
import torch

from conftest import launcher_keeper
from pitstop.cli.main import main

from . import memory_worker as w

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
STEPS = 40


@functools.cache
def _ref() -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    return w.reference(STEPS)


def _steps_on_disk(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(
        int(n.split("-")[1]) for n in os.listdir(root)
        if n.startswith("step-") and os.path.exists(os.path.join(root, n, "manifest.json"))
    )  # fmt: skip


def test_a_launchers_keeper_seals_writes_a_killed_trainers_newest_and_ends_with_the_job(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    root, out = os.path.join(str(tmp_path), "ck"), os.path.join(str(tmp_path), "final.pt")
    digests, want = _ref()
    keeper = launcher_keeper(root, shm_dir, job, "--linger-secs", "60")
    try:
        code, lines, err = w.run(
            root, shm_dir, job, STEPS, "--external", "--kill-at", "27", "--step-secs", "0.01"
        )
        assert code == -signal.SIGKILL, err
        assert "no keeper watches" not in err, err
        deadline = time.monotonic() + 30  # the keeper writes the dead trainer's newest
        while max(_steps_on_disk(root), default=0) < 26 and time.monotonic() < deadline:
            time.sleep(0.05)
        disk = _steps_on_disk(root)  # the newest snapshot: 27, or 26 if 27 was not staged;
        assert disk[-1] in (26, 27) and set(disk[:-1]) <= {20}, disk  # (the durable save at
        disk = disk[-1:]  # 20 may still have been in flight at the kill on a loaded machine)
        code, lines, err = w.run(root, shm_dir, job, STEPS, "--external", "--final", out)
        assert code == 0, err
        start = lines[0]
        assert (start["level"], start["restored"]) == ("memory", disk[0]), start
        assert start["digest"] == digests[disk[0]]
        got = torch.load(out)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert keeper.wait(30) == 0, keeper.communicate()  # the job closed: it ended
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
    assert os.listdir(shm_dir) == []


def test_a_second_keeper_of_the_same_job_refuses(job: str, shm_dir: str, tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ck")
    first = launcher_keeper(root, shm_dir, job)
    try:
        assert main(["keeper", root, "--job", job, "--shm-dir", shm_dir, "--max-secs", "1"]) == 1
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
    assert os.listdir(shm_dir) == []


def test_without_a_launchers_keeper_the_trainer_seals_itself(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    digests, _ = _ref()
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--external", "--kill-at", "25")
    assert code == -signal.SIGKILL
    assert "no keeper watches job" in err, err
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--external")
    assert code == 0, err
    start = lines[0]
    assert start["level"] == "memory" and start["restored"] >= 24, start
    assert start["digest"] == digests[start["restored"]]
    assert os.listdir(shm_dir) == []


def test_bad_input_is_a_usage_error(tmp_path: Any, capsys: Any) -> None:
    assert main(["keeper", str(tmp_path), "--job", "no/slash"]) == 2
    assert "--job takes" in capsys.readouterr().err
    assert main(["keeper", str(tmp_path), "--shm-dir", str(tmp_path / "none")]) == 2
    assert "no such directory" in capsys.readouterr().err
