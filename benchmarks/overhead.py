"""Training overhead of checkpoint policies on a CPU training loop (issue: when to checkpoint).

    python benchmarks/overhead.py            # ~350 MB of state, 0.4-0.5 s iterations (a few minutes)
    python benchmarks/overhead.py --quick    # ~100 MB, short segments (under a minute)

This machine's speed drifts by 10-20 % within minutes (the host is shared), which
swamps a 2 % effect if configurations are timed minutes apart. So each configuration
is measured in *pairs of segments*: S iterations with checkpoints, then S iterations
without (the order alternates from pair to pair), in the same process, on the same
model; overhead = median over pairs of (segment with / segment without - 1). Before the
pairs, one unmeasured segment warms up each configuration (arena allocation,
CheckFreq's probe), so the figures are steady-state costs. A segment with
checkpoints includes waiting for its last save to commit.

Configurations: pitstop ``ckpt.step`` with ``EveryN(1)``, ``EveryN(10)`` and
``CheckFreq(0.02)``; DCP ``async_save`` every 10 iterations (the previous one is
waited for first); ``torch.save`` + fsync every 10 iterations. Prints a table and a
final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pitstop
from _common import log
from pitstop.policy import CheckFreq, EveryN


def build(width: int, layers: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


class Loop:
    def __init__(self, args: argparse.Namespace, root: str) -> None:
        self.args, self.root = args, root
        self.model, self.opt = build(args.width, args.layers)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.batch, args.width, generator=g)
        self.y = torch.randint(0, 10, (args.batch,), generator=g)
        self.loss_fn = nn.CrossEntropyLoss()
        self.step_no = 0
        self.train_step()  # Adam state exists from here on
        self.state = {"model": self.model, "optimizer": self.opt}
        self.state_bytes = (
            sum(t.numel() * t.element_size() for t in self.model.state_dict().values()) * 3
        )

    def train_step(self) -> float:
        loss = self.loss_fn(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step_no += 1
        return loss.item()

    def fresh_dir(self, name: str) -> str:
        path = os.path.join(self.root, name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def plain(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.train_step()
        return time.perf_counter() - t0


class Pitstop:
    """A pitstop manager that lives across all segments of one configuration."""

    def __init__(self, loop: Loop, policy: Any) -> None:
        self.loop, self.policy = loop, policy
        self.ckpt = pitstop.CheckpointManager(loop.fresh_dir("pitstop"), keep_last=2, policy=policy)
        self.ckpt.reserve(loop.state)
        self.steps = 0  # the manager counts only the iterations of its own segments

    def segment(self, n: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        taken = 0
        for _ in range(n):
            loss = self.loop.train_step()
            self.steps += 1
            taken += self.ckpt.step(self.steps, self.loop.state, loss=loss)
        self.ckpt.wait()
        self.ckpt.pause()  # the segment without checkpoints is not one long iteration
        return time.perf_counter() - t0, taken

    def stalls(self) -> list[float]:
        return [h.stats.stall_secs for h in self.ckpt.history]

    def close(self) -> None:
        self.ckpt.close()


class EveryTen:
    """DCP async_save or torch.save every 10 iterations."""

    def __init__(self, loop: Loop, kind: str) -> None:
        self.loop, self.kind = loop, kind
        self.dir = loop.fresh_dir(kind)
        self.pending: Any = None
        self._stalls: list[float] = []

    def _save(self) -> None:
        s0 = time.perf_counter()
        sd = {"model": self.loop.model.state_dict(), "optimizer": self.loop.opt.state_dict()}
        if self.kind == "dcp":
            import torch.distributed.checkpoint as dcp

            if self.pending is not None:
                self.pending.result()
            resp = dcp.async_save(sd, checkpoint_id=os.path.join(self.dir, f"s{self.loop.step_no}"))
            self.pending = getattr(resp, "upload_completion", resp)
        else:
            path = os.path.join(self.dir, "ckpt.pt")
            with open(path + ".tmp", "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        self._stalls.append(time.perf_counter() - s0)

    def segment(self, n: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        taken = 0
        for _ in range(n):
            self.loop.train_step()
            if self.loop.step_no % 10 == 0:
                self._save()
                taken += 1
        if self.pending is not None:
            self.pending.result()
            self.pending = None
        return time.perf_counter() - t0, taken

    def stalls(self) -> list[float]:
        return self._stalls

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--segment", type=int, default=None, help="iterations per segment")
    p.add_argument("--pairs", type=int, default=None, help="pairs of segments per configuration")
    p.add_argument("--dir", default=None)
    p.add_argument("--only", default=None, help="run only configurations whose name contains this")
    args = p.parse_args(argv)
    args.width = args.width or (1536 if args.quick else 2048)
    args.layers = args.layers or (3 if args.quick else 7)
    args.batch = args.batch or (128 if args.quick else 256)
    args.segment = args.segment or (8 if args.quick else 24)
    args.pairs = args.pairs or (2 if args.quick else 3)
    torch.set_num_threads(2)
    root = args.dir or tempfile.mkdtemp(prefix="pitstop-overhead-")
    loop = Loop(args, root)
    for _ in range(3):
        loop.train_step()  # warm up the allocator and kernels
    configs: dict[str, Callable[[], Any]] = {
        "pitstop EveryN(1)": lambda: Pitstop(loop, EveryN(1)),
        "pitstop EveryN(10)": lambda: Pitstop(loop, EveryN(10)),
        "pitstop CheckFreq(0.02)": lambda: Pitstop(loop, CheckFreq(0.02)),
        "DCP async_save every 10": lambda: EveryTen(loop, "dcp"),
        "torch.save every 10": lambda: EveryTen(loop, "torch"),
    }
    if args.only:
        configs = {k: v for k, v in configs.items() if args.only in k}
    seg, pairs = args.segment, args.pairs
    log(
        f"state {loop.state_bytes / 1e6:.0f} MB; {pairs} pairs of {seg}-iteration segments per configuration"
    )
    results: dict[str, Any] = {
        "state_bytes": loop.state_bytes,
        "segment": seg,
        "pairs": pairs,
        "runs": {},
    }
    base_iters: list[float] = []
    print(
        f"{'configuration':26} {'overhead':>9} {'pairs (%)':>24} {'ckpts/seg':>9} {'interval':>9} {'stall/ckpt s':>13}"
    )
    for name, factory in configs.items():
        cfg = factory()
        cfg.segment(seg)  # warm-up: allocation, probe, first interval
        ratios, counts = [], []
        for r in range(pairs):
            if r % 2 == 0:
                with_ckpt, taken = cfg.segment(seg)
                without = loop.plain(seg)
            else:
                without = loop.plain(seg)
                with_ckpt, taken = cfg.segment(seg)
            ratios.append(with_ckpt / without - 1)
            counts.append(taken)
            base_iters.append(without / seg)
            log(
                f"{name}: pair {r + 1}: {with_ckpt:.2f} s with, {without:.2f} s without, {taken} checkpoints"
            )
        stalls = cfg.stalls()
        interval = getattr(getattr(cfg, "policy", None), "interval", None) or getattr(
            getattr(cfg, "policy", None), "n", None
        )
        interval = interval if interval is not None else 10
        cfg.close()
        overhead = statistics.median(ratios)
        stall = statistics.median(stalls) if stalls else 0.0
        pair_text = " ".join(f"{100 * x:+.1f}" for x in ratios)
        print(
            f"{name:26} {100 * overhead:8.2f}% {pair_text:>24} {statistics.median(counts):9.0f} {interval!s:>9} {stall:13.4f}"
        )
        results["runs"][name] = {
            "overhead": overhead, "pairs": ratios, "checkpoints_per_segment": statistics.median(counts),
            "interval": interval, "stall_secs": stall,
        }  # fmt: skip
    results["iter_secs"] = statistics.median(base_iters)
    print(f"an iteration takes {results['iter_secs']:.3f} s without checkpoints (median)")
    runs = results["runs"]
    if "pitstop CheckFreq(0.02)" in runs:
        cf = runs["pitstop CheckFreq(0.02)"]["overhead"]
        verdict = "PASS" if cf <= 0.02 else "MISS"
        print(f"\nCheckFreq(0.02) overhead {100 * cf:.2f}% (target <= 2%): {verdict}")
    if "pitstop EveryN(10)" in runs and "DCP async_save every 10" in runs:
        p10, d10 = (
            runs["pitstop EveryN(10)"]["overhead"],
            runs["DCP async_save every 10"]["overhead"],
        )
        verdict = "PASS" if p10 < d10 else "MISS"
        print(
            f"pitstop every 10 {100 * p10:.2f}% vs DCP async_save every 10 {100 * d10:.2f}%: {verdict}"
        )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
