"""A run SIGKILLed at any step and resumed ends bit-identical to an uninterrupted run
(DataLoader with 2 workers, shuffling, random augmentation, dropout, async_save)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fault

STEPS, EVERY = 60, 5


def _run(workdir: str, name: str, kill_at: int | None) -> dict[str, object]:
    cmd = [
        sys.executable, "-m", "pitstop.cli.demo_train", "--dir", os.path.join(workdir, name),
        "--steps", str(STEPS), "--every", str(EVERY), "--seed", "3", "--workers", "2",
        "--final", os.path.join(workdir, name + "-final"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    result: dict[str, object] = {}
    for line in proc.stdout:
        event = json.loads(line)
        if (
            event["event"] == "step"
            and kill_at is not None
            and event["step"] >= kill_at
            and "killed" not in result
        ):
            proc.send_signal(signal.SIGKILL)
            result["killed"] = event["step"]
        result[event["event"]] = event
    proc.wait(timeout=120)
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = _run(str(tmp_path_factory.mktemp("ref")), "ref", None)
    return str(out["done"]["digest"])  # type: ignore[index]


@pytest.mark.parametrize("kill_at", [3, 17, 44])
def test_resume_after_sigkill_is_bit_identical(
    tmp_path: object, reference: str, kill_at: int
) -> None:
    workdir = str(tmp_path)
    first = _run(workdir, "run", kill_at)
    assert "killed" in first and "done" not in first
    second = _run(workdir, "run", None)
    restored = second.get("restored")
    if kill_at >= 2 * EVERY:  # by then at least one checkpoint had time to commit
        assert restored is not None
    assert second["done"]["digest"] == reference  # type: ignore[index]
