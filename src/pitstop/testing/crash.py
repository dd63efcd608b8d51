"""A training child for crash tests and benchmarks: saves a state that is a pure function of the step.

usage: python -m pitstop.testing.crash ROOT MODE STEPS [KEEP_LAST]
  MODE sync:  ckpt.save every step
  MODE async: a training step between async_saves; before each save it appends
              "<step> <digest>" to ROOT.digests (fsynced), so the parent knows what was saved.
  MODE gc:    ckpt.save every step, then leave debris of an interrupted save and run gc.
PITSTOP_KILL_AT in the environment makes it SIGKILL itself at a named point.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
from torch import nn

import pitstop

__all__ = ["digest", "main", "state_for"]


def state_for(step: int) -> dict[str, object]:
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 64)
    model(x).square().mean().backward()
    opt.step()
    return {
        "model": model,
        "optimizer": opt,
        "extra": {"step": step, "blob": torch.full((50_000,), float(step))},
    }


def digest(state: dict[str, object]) -> str:
    h = hashlib.sha256()
    model = state["model"]
    assert isinstance(model, nn.Module)
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.numpy().tobytes())
    extra = state["extra"]
    assert isinstance(extra, dict)
    h.update(extra["blob"].numpy().tobytes())
    h.update(str(extra["step"]).encode())
    return h.hexdigest()


def main() -> None:
    root, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keep_last = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    with pitstop.CheckpointManager(root, keep_last=keep_last) as ckpt:
        if mode in ("sync", "gc"):
            for step in range(1, steps + 1):
                ckpt.save(step, state_for(step))
            if mode == "gc":
                debris = os.path.join(root, f"step-{steps + 1:010d}")
                os.mkdir(debris)
                with open(os.path.join(debris, "rank-00000.bin"), "wb") as f:
                    f.write(b"\0" * 4096)
                ckpt.gc()
        else:
            with open(root + ".digests", "a") as log:
                for step in range(1, steps + 1):
                    state = state_for(step)
                    log.write(f"{step} {digest(state)}\n")
                    log.flush()
                    os.fsync(log.fileno())
                    ckpt.async_save(step, state)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
