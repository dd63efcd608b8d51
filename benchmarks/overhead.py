"""Training overhead of checkpoint policies on a CPU training loop (issue: when to checkpoint).

    python benchmarks/overhead.py            # default: ~400 MB of state, 60 iterations per run, 3 rounds
    python benchmarks/overhead.py --quick    # ~100 MB, 25 iterations, 1 round (under a minute)

One process, one model, the same data. Each round runs every configuration once, in a
rotating order (the disk's speed drifts, so configurations are compared within rounds):

* ``none``: no checkpoints (the baseline);
* pitstop ``ckpt.step`` with ``EveryN(1)``, ``EveryN(10)`` and ``CheckFreq(0.02)``;
* DCP ``async_save`` every 10 iterations (the previous one is waited for first, as DCP's
  docs recommend; its stall is the call plus that wait);
* ``torch.save`` + fsync every 10 iterations (synchronous).

Overhead = (median wall time of the run - median of ``none``) / median of ``none``.
Prints a table and a final JSON line.
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
from dataclasses import dataclass, field
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


@dataclass
class Run:
    name: str
    walls: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    intervals: list[Any] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)


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

    # ---- configurations: each returns (wall, stalls, checkpoints, interval)
    def none(self) -> tuple[float, list[float], int, Any]:
        t0 = time.perf_counter()
        for _ in range(self.args.iters):
            self.train_step()
        return time.perf_counter() - t0, [], 0, None

    def pitstop(
        self, policy_factory: Callable[[], Any]
    ) -> Callable[[], tuple[float, list[float], int, Any]]:
        def run() -> tuple[float, list[float], int, Any]:
            policy = policy_factory()
            with pitstop.CheckpointManager(
                self.fresh_dir("pitstop"), keep_last=2, policy=policy
            ) as ckpt:
                t0 = time.perf_counter()
                for i in range(self.args.iters):
                    loss = self.train_step()
                    ckpt.step(self.step_no, self.state, loss=loss)
                    del i
                ckpt.wait()
                wall = time.perf_counter() - t0
                stalls = [h.stats.stall_secs for h in ckpt.history]
                interval = getattr(policy, "interval", None) or getattr(policy, "n", None)
                return wall, stalls, len(stalls), interval

        return run

    def dcp_async(self) -> tuple[float, list[float], int, Any]:
        import torch.distributed.checkpoint as dcp

        d = self.fresh_dir("dcp")
        pending = None
        stalls: list[float] = []
        t0 = time.perf_counter()
        for i in range(1, self.args.iters + 1):
            self.train_step()
            if i % 10 == 0:
                s0 = time.perf_counter()
                if pending is not None:
                    pending.result()
                sd = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
                resp = dcp.async_save(sd, checkpoint_id=os.path.join(d, f"s{self.step_no}"))
                pending = getattr(resp, "upload_completion", resp)
                stalls.append(time.perf_counter() - s0)
        if pending is not None:
            pending.result()
        return time.perf_counter() - t0, stalls, len(stalls), 10

    def torch_save(self) -> tuple[float, list[float], int, Any]:
        d = self.fresh_dir("torch")
        stalls: list[float] = []
        t0 = time.perf_counter()
        for i in range(1, self.args.iters + 1):
            self.train_step()
            if i % 10 == 0:
                s0 = time.perf_counter()
                path = os.path.join(d, "ckpt.pt")
                with open(path + ".tmp", "wb") as f:
                    torch.save(
                        {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f
                    )
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(path + ".tmp", path)
                stalls.append(time.perf_counter() - s0)
        return time.perf_counter() - t0, stalls, len(stalls), 10


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    args.width = args.width or (1536 if args.quick else 2048)
    args.layers = args.layers or (3 if args.quick else 7)
    args.batch = args.batch or (128 if args.quick else 256)
    args.iters = args.iters or (25 if args.quick else 60)
    args.rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(2)
    root = args.dir or tempfile.mkdtemp(prefix="pitstop-overhead-")
    loop = Loop(args, root)
    for _ in range(3):
        loop.train_step()  # warm up the allocator and kernels
    configs: dict[str, Callable[[], tuple[float, list[float], int, Any]]] = {
        "none": loop.none,
        "pitstop EveryN(1)": loop.pitstop(lambda: EveryN(1)),
        "pitstop EveryN(10)": loop.pitstop(lambda: EveryN(10)),
        "pitstop CheckFreq(0.02)": loop.pitstop(lambda: CheckFreq(0.02)),
        "DCP async_save every 10": loop.dcp_async,
        "torch.save every 10": loop.torch_save,
    }
    runs = {name: Run(name) for name in configs}
    names = list(configs)
    log(
        f"state {loop.state_bytes / 1e6:.0f} MB, {args.iters} iterations per run, {args.rounds} rounds"
    )
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            wall, stalls, count, interval = configs[name]()
            run = runs[name]
            run.walls.append(wall)
            run.stalls += stalls
            run.checkpoints.append(count)
            run.intervals.append(interval)
            log(f"round {r + 1}: {name}: {wall:.2f} s, {count} checkpoints")
    base = runs["none"].wall
    iter_secs = base / args.iters
    print(
        f"state {loop.state_bytes / 1e6:.0f} MB; an iteration takes {iter_secs:.3f} s; {args.iters} iterations per run"
    )
    print(
        f"{'configuration':26} {'wall s':>8} {'overhead':>9} {'interval':>9} {'ckpts':>6} {'stall/ckpt s':>13}"
    )
    results: dict[str, Any] = {"state_bytes": loop.state_bytes, "iter_secs": iter_secs, "runs": {}}
    for name, run in runs.items():
        overhead = (run.wall - base) / base
        stall = statistics.median(run.stalls) if run.stalls else 0.0
        interval = run.intervals[-1]
        ckpts = statistics.median(run.checkpoints)
        print(
            f"{name:26} {run.wall:8.2f} {100 * overhead:8.2f}% {interval!s:>9} {ckpts:6.0f} {stall:13.4f}"
        )
        results["runs"][name] = {
            "wall_secs": run.wall, "overhead": overhead, "interval": interval,
            "checkpoints": ckpts, "stall_secs": stall, "walls": run.walls,
        }  # fmt: skip
    cf = results["runs"]["pitstop CheckFreq(0.02)"]["overhead"]
    p10 = results["runs"]["pitstop EveryN(10)"]["overhead"]
    d10 = results["runs"]["DCP async_save every 10"]["overhead"]
    print(
        f"\nCheckFreq(0.02) overhead {100 * cf:.2f}% (target <= 2%): {'PASS' if cf <= 0.02 else 'MISS'}"
    )
    print(f"pitstop every 10 {100 * p10:.2f}% vs DCP async_save every 10 {100 * d10:.2f}%: "
          f"{'PASS' if p10 < d10 else 'MISS'}")  # fmt: skip
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
