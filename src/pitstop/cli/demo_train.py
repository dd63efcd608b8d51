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

__all__ = ["Noisy", "build", "main", "state_digest"]

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


class Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The synthetic set with random augmentation (noise and feature dropout) per sample."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(FEATURES)
        x = x * (torch.rand(FEATURES) > 0.1)
        return x, self.y[i]


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
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--final", required=True, help="where to save the final weights")
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model, opt, sched, x, y = build(args.seed)
    loader = pitstop.ResumableLoader(
        Noisy(x, y), BATCH, shuffle=True, seed=args.seed, num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )  # fmt: skip
    state = {
        "model": model, "optimizer": opt, "scheduler": sched, "data": loader,
        "progress": {"step": 0}, "rng": pitstop.RNGState(),
    }  # fmt: skip
    with pitstop.CheckpointManager(args.dir, keep_last=3) as ckpt:
        t0 = time.perf_counter()
        restored = ckpt.restore(state)
        if restored is not None:
            _emit(event="restored", step=restored, secs=time.perf_counter() - t0)
        step = state["progress"]["step"]
        loss_fn = nn.CrossEntropyLoss()
        model.train()
        while step < args.steps:
            for xb, yb in loader:  # starts where the restored loader left off
                loss = loss_fn(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                state["progress"]["step"] = step
                if step % args.every == 0:
                    ckpt.async_save(step, state)
                _emit(event="step", step=step, epoch=loader.epoch, loss=round(loss.item(), 6))
                if step >= args.steps:
                    break
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
