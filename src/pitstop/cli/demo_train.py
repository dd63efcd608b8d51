"""The demo's training process: a small deterministic model that checkpoints and resumes.

Run by ``pitstop demo`` as ``python -m pitstop.cli.demo_train --dir D ...``; it
prints one JSON line per event (``step``, ``restored``, ``done``) for the parent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

import torch
from torch import nn

import pitstop

__all__ = ["build", "main", "state_digest"]

SAMPLES, FEATURES, CLASSES, BATCH = 2048, 32, 8, 64


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, torch.Tensor, torch.Tensor]:
    """Model, optimizer, scheduler and a synthetic data set, all a function of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ w + 0.5 * torch.randn(SAMPLES, CLASSES, generator=g)).argmax(dim=1)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(FEATURES, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, CLASSES),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return model, opt, sched, x, y


def batch_indices(seed: int, step: int) -> torch.Tensor:
    """The batch of ``step``: epoch order is a pure function of (seed, epoch)."""
    per_epoch = SAMPLES // BATCH
    epoch, pos = divmod(step, per_epoch)
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return perm[pos * BATCH : (pos + 1) * BATCH]


def state_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--final", required=True, help="where to save the final weights")
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model, opt, sched, x, y = build(args.seed)
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "progress": {"step": 0},
        "rng": pitstop.RNGState(),
    }
    with pitstop.CheckpointManager(args.dir, keep_last=3) as ckpt:
        t0 = time.perf_counter()
        restored = ckpt.restore(state)
        if restored is not None:
            _emit(event="restored", step=restored, secs=time.perf_counter() - t0)
        start = state["progress"]["step"]
        loss_fn = nn.CrossEntropyLoss()
        for step in range(start, args.steps):
            model.train()
            idx = batch_indices(args.seed, step)
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            state["progress"]["step"] = step + 1
            if (step + 1) % args.every == 0:
                ckpt.async_save(step + 1, state)
            _emit(event="step", step=step + 1, loss=round(loss.item(), 6))
        ckpt.wait()
        stats = [h.stats for h in ckpt.history]
        pitstop.save(args.final, {"model": model}, step=args.steps)
    _emit(
        event="done",
        digest=state_digest(model),
        checkpoints=len(stats),
        stall_secs=sum(s.stall_secs for s in stats) / max(1, len(stats)),
        total_secs=sum(s.total_secs for s in stats) / max(1, len(stats)),
        nbytes=stats[-1].nbytes if stats else 0,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
