"""The command line: in-process ``main(argv)``, plus the installed console script and the demo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import pitstop
from pitstop.cli.main import main


@pytest.fixture
def two_steps(root: str) -> str:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(10, {"w": torch.ones(4, 4), "extra": {"epoch": 1}})
        ckpt.save(20, {"w": torch.zeros(4, 4), "extra": {"epoch": 2}})
    return root


def test_ls_table_and_json(two_steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", two_steps]) == 0
    out = capsys.readouterr().out
    assert "STEP" in out and out.count("committed") == 2
    assert main(["ls", two_steps, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [10, 20] and rows[0]["tensors"] == 1


def test_inspect(two_steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", two_steps, "--step", "10"]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "w" in out and "float32" in out
    assert main(["inspect", two_steps, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 20


def test_verify_whole_root_one_step_and_step_dir(
    two_steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", two_steps]) == 0
    assert main(["verify", two_steps, "--step", "20"]) == 0
    assert main(["verify", os.path.join(two_steps, "step-0000000010")]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == 4


def test_usage_errors_exit_2(two_steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", two_steps, "--step", "99"]) == 2
    assert "no checkpoint of step 99" in capsys.readouterr().err
    assert main(["ls", "/nonexistent/dir"]) == 2
    assert main([]) == 2
    with pytest.raises(SystemExit) as e:
        main(["verify"])
    assert e.value.code == 2


def test_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("ls", "inspect", "verify", "gc", "demo"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        assert "example:" in capsys.readouterr().out


def test_gc_removes_partial(two_steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    os.makedirs(os.path.join(two_steps, "step-0000000030"))
    assert main(["gc", two_steps]) == 0  # just written: a save may be running
    assert "kept step-0000000030" in capsys.readouterr().out
    assert os.path.exists(os.path.join(two_steps, "step-0000000030"))
    assert main(["gc", two_steps, "--dry-run", "--min-age", "0"]) == 0
    assert "would remove step-0000000030" in capsys.readouterr().out
    assert main(["gc", two_steps, "--min-age", "0"]) == 0
    assert not os.path.exists(os.path.join(two_steps, "step-0000000030"))


def test_console_script_smoke(two_steps: str) -> None:
    exe = shutil.which("pitstop", path=os.path.dirname(sys.executable))
    assert exe is not None, "the pitstop console script is not installed"
    out = subprocess.run([exe, "ls", two_steps], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "committed" in out.stdout
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"pitstop {pitstop.__version__}"


@pytest.mark.fault
def test_demo_proves_identical_weights(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    workdir = os.path.join(str(tmp_path), "demo")
    code = main(["demo", "--dir", workdir, "--steps", "60", "--every", "5", "--kill-at", "33"])
    out = capsys.readouterr().out
    assert "killed (SIGKILL) at step 3" in out  # 33 or a step or two later
    assert "resumed from step" in out
    assert "weights identical: yes" in out
    assert code == 0


def test_log_records_name_rank_and_phase(root: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="pitstop"):
        pitstop.save(root, {"x": torch.ones(4)}, step=3)
    lines = [r for r in caplog.records if "checkpoint step=3" in r.getMessage()]
    assert len(lines) == 1
    record = lines[0]
    assert record.phase == "commit" and record.rank == 0  # type: ignore[attr-defined]
    assert record.getMessage().startswith("[rank 0] commit: checkpoint step=3 bytes=")
    assert "GB/s" in record.getMessage()


def test_verify_progress_on_stderr(two_steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", two_steps, "--progress"]) == 0
    err = capsys.readouterr().err
    assert "verify step-0000000010:" in err and "100.0%" in err and "GB/s" in err


def test_bench_small_writes_a_profile_simulate_reads(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = os.path.join(str(tmp_path), "profile.json")
    code = main(
        [
            "bench",
            "--dir",
            str(tmp_path),
            "--size",
            "60MB",
            "--reps",
            "1",
            "--profile",
            prof,
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "pitstop save" in out and "raw O_DIRECT write" in out and "torch.save + fsync" in out
    profile = json.load(open(prof))
    assert (
        profile["stall_secs"] > 0 and profile["persist_secs"] > 0 and profile["state_bytes"] > 50e6
    )
    assert main(["simulate", "--profile", prof, "--iter-secs", "0.5", "--hours", "1", "--seeds", "1",
                 "--jobs", "1", "--policy", "checkfreq"]) == 0  # fmt: skip
    assert "CheckFreq(2%)" in capsys.readouterr().out
    assert [n for n in os.listdir(str(tmp_path)) if n.startswith("run-")] == []  # cleaned up
