"""Two ranks failing at once, each in its own way (gloo, spawned ranks): every rank's error
names every failed rank's message, in the plan (a gather), the persist round (the store's
words) and a restore; each rank keeps its own error type."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest
import torch

import pitstop
import pitstop.errors
from pitstop.testing.distributed import run_ranks

pytestmark = pytest.mark.dist
TIMEOUT = 60.0


def _state(rank: int, width: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(width, 3), "own": torch.full((2,), float(rank))}


def _fail(fn: Any) -> str:
    try:
        fn()
    except pitstop.errors.CheckpointError as e:
        return f"{type(e).__name__}|{e}"
    return "no error"


def _both_fail(rank: int, world: int, root: str) -> dict[str, str]:
    from pitstop.storage.local import LocalStorage
    from pitstop.testing import FaultyStorage

    out = {}
    with pitstop.CheckpointManager(os.path.join(root, "plan"), dist_timeout_secs=TIMEOUT) as ck:
        state: dict[str, Any] = {**_state(rank), f"socket_of_rank_{rank}": object()}
        out["plan"] = _fail(lambda: ck.save(1, state))
    # rank 0 meets ENOSPC, rank 1 EIO, both writing their files
    code = errno.ENOSPC if rank == 0 else errno.EIO
    faulty = FaultyStorage(
        LocalStorage(os.path.join(root, "persist")), fail={"persist": range(1, 100)}, errno=code
    )
    with pitstop.CheckpointManager(faulty, dist_timeout_secs=TIMEOUT) as ck:
        out["persist"] = _fail(lambda: ck.save(1, _state(rank)))
    restore = os.path.join(root, "restore")
    with pitstop.CheckpointManager(restore, dist_timeout_secs=TIMEOUT) as ck:
        ck.save(1, _state(rank))
        fresh = _state(rank, width=5 + rank)  # fits neither, each rank its own way
        out["restore"] = _fail(lambda: ck.restore(fresh))
    return out


def test_every_rank_names_every_failed_ranks_message(tmp_path: Any) -> None:
    out = run_ranks(_both_fail, 2, str(tmp_path), timeout_secs=TIMEOUT)
    for rank in (0, 1):
        kind, text = out[rank]["plan"].split("|", 1)
        assert kind == "UnsupportedValueError", out[rank]["plan"]  # its own error
        assert "socket_of_rank_0" in text and "socket_of_rank_1" in text, text
        kind, text = out[rank]["persist"].split("|", 1)
        assert kind == "CheckpointIOError", out[rank]["persist"]
        assert "ENOSPC" in text and "EIO" in text, text
        kind, text = out[rank]["restore"].split("|", 1)
        assert kind == "StateMismatchError", out[rank]["restore"]
        assert "[3, 5]" in text and "[3, 6]" in text, text  # each rank's live shape
    assert not pitstop.CheckpointManager(str(tmp_path / "persist")).steps()
