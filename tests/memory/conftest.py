"""Fixtures of the memory-level tests: a fresh job token per test, and a check that the test
left no segment of that job in /dev/shm (whatever it left is removed, then the test fails)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pitstop.levels.keeper import keeper_log
from pitstop.levels.shm import SHM_DIR, new_job_token, remove_job, segment_names

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture
def job() -> Iterator[str]:
    """A job token of this test; no segment of it may be left when the test ends."""
    token = "t" + new_job_token()
    yield token
    left = segment_names(SHM_DIR, token)
    remove_job(SHM_DIR, token)
    with contextlib.suppress(FileNotFoundError):  # a killed or adopted keeper's (empty) log
        os.unlink(keeper_log(token))
    assert not left, f"segments left in {SHM_DIR}: {left}"


def small_state(seed: int = 0) -> dict[str, Any]:
    """A model, its optimizer after one step, a loose tensor and plain values."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": torch.arange(10), "progress": {"step": 3}}


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by a path (model and optimizer state dicts, loose tensors)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state["model"].state_dict().items():
        out[f"model/{k}"] = v
    for i, s in state["optimizer"].state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{i}/{k}"] = v
    out["extra"] = state["extra"]
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory under /dev/shm (cleanup tests there never touch other jobs'
    segments); it must be empty when the test ends."""
    import shutil
    import tempfile

    where = tempfile.mkdtemp(prefix="pitstop-test-", dir=SHM_DIR)
    yield where
    left = os.listdir(where)
    shutil.rmtree(where, ignore_errors=True)
    assert not left, f"segments left in {where}: {left}"


def dead_job(shm_dir: str) -> tuple[str, list[str]]:
    """A job whose process exited without cleaning up (its lock: nobody's): its token and
    its segments (two slots and the lock file) under ``shm_dir``."""
    import subprocess
    import textwrap

    dead = "t" + new_job_token()
    script = textwrap.dedent(
        f"""
        import os
        from pitstop.levels.shm import SlotSet
        SlotSet.create({dead!r}, data_bytes=8192, directory={shm_dir!r})
        os._exit(0)  # no cleanup: the segments stay
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    names = segment_names(shm_dir, dead)
    assert len(names) == 3  # two slots and the lock file
    return dead, names
