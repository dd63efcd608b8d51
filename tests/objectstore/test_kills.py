"""A job killed (SIGKILL) at each named point of a save to a bucket: restore takes the last
committed step with identical bytes, and ``pitstop gc`` leaves no orphaned object and no open
multipart upload. (benchmarks/object_store.py --kills 20 kills at random times.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import pitstop

pytestmark = pytest.mark.fault

CHILD = textwrap.dedent(
    """
    import sys, torch, pitstop
    from pitstop.options import IOOptions
    from pitstop.storage.object_store import ObjectStorage

    def state_at(step):
        torch.manual_seed(step)
        return {"w": torch.randn(600_000), "b": torch.randn(1000), "step": step}

    url, levels = sys.argv[1], sys.argv[2]
    io = IOOptions(chunk_bytes=256 * 1024, threads=4)
    if levels == "root":
        root = ObjectStorage(url, io, part_bytes=128 * 1024)
    else:
        root = [pitstop.Local(sys.argv[3] + "/{node}"), pitstop.Shared(url, every=1)]
    with pitstop.CheckpointManager(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state_at(step))
            ckpt.wait()
    """
)


def _state_at(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(600_000), "b": torch.randn(1000), "step": step}


@pytest.mark.parametrize(
    ("point", "levels", "committed"),
    [
        ("persist.mid:2", "root", 1),
        ("commit.before_rename:2", "root", 1),
        ("commit.after_rename:2", "root", 2),
        ("flush.mid:2", "shared", 1),
    ],
)
def test_a_kill_during_an_upload_leaves_the_last_committed_step_and_gc_leaves_nothing(
    bucket: Any, tmp_path: Any, point: str, levels: str, committed: int
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**bucket.env(), "PITSTOP_KILL_AT": point}
    r = subprocess.run(
        [sys.executable, str(script), bucket.url(), levels, str(tmp_path / "local")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr
    keys = bucket.list_keys("run/")
    manifests = {k.split("/")[1] for k in keys if k.endswith("/manifest.json")}
    assert max(manifests) == f"step-{committed:010d}"
    if not point.startswith("commit.after"):
        debris = {k.split("/")[1] for k in keys} - manifests
        assert debris, "the kill should have left an upload half-done"
    out = {"w": torch.zeros(600_000), "b": torch.zeros(1000), "step": 0}
    assert pitstop.load(bucket.url(), out) == committed
    expected = _state_at(committed)
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["b"], expected["b"])
    assert out["step"] == committed
    cli = os.path.join(os.path.dirname(sys.executable), "pitstop")
    gc = subprocess.run(
        [cli, "gc", bucket.url(), "--min-age", "0"], env=bucket.env(), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert gc.returncode == 0, gc.stdout + gc.stderr
    left = bucket.list_keys("run/")
    committed_dirs = {k.split("/")[1] for k in left if k.endswith("/manifest.json")}
    assert {k.split("/")[1] for k in left} == committed_dirs  # nothing orphaned
    assert bucket.open_uploads() == []
