"""What ``ckpt.step`` costs each iteration under DDP (2 gloo ranks), when it does not save.

Usage::

    python benchmarks/ddp_step.py            # 6 x Linear(512, 512) + Adam, 2 ranks, 8 pairs of 40-step segments
    python benchmarks/ddp_step.py --quick    # 4 pairs of 25-step segments (under a minute)
    python benchmarks/ddp_step.py --world 2 --width 1024 --layers 4 --pairs 10

``pitstop.testing.distributed.run_ranks`` spawns the ranks (one CPU thread each, gloo).
Every rank trains the same DDP model (forward, backward, ``optimizer.step()``) in
segments with and without ``ckpt.step`` (a manager whose policy never saves,
``EveryN(10**9)``, so what is measured is the decision alone: bookkeeping and the
ranks' agreement on rank 0's decision), alternating the order in every pair. Per rank:
the time inside ``ckpt.step`` (median and mean of the calls), the iteration with and
without it (mean over a segment; medians over the pairs), and what the profiler
counted as ``ckpt.step``'s own cost (``stats().step_secs``, where the version has it).
Then one run of ``CheckFreq(0.02)`` (the default policy) for ``--checkfreq-steps``
steps: how many checkpoints it took and its interval.

To compare two versions, run it with ``PYTHONPATH=<other checkout>/src``.

stdout: a table per rank, the ratio (iteration with step / without), and, as the last
line, one JSON object with every figure. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

import pitstop
from _common import json_line, log
from pitstop.testing.distributed import run_ranks


def _model(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def _rank(rank: int, world: int, root: str, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model(cfg["width"], cfg["layers"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["width"])
    state = {"model": model, "opt": opt}
    options = pitstop.SaveOptions(dist_timeout_secs=60.0)

    def iterate() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = 0
    calls: list[float] = []
    plain: list[float] = []
    stepped: list[float] = []
    seg = cfg["segment"]
    with pitstop.CheckpointManager(
        os.path.join(root, "never"), policy=pitstop.EveryN(10**9), options=options
    ) as ckpt:
        for _ in range(cfg["warmup"]):
            iterate()
            step += 1
            ckpt.step(step, state)
        for pair in range(cfg["pairs"]):
            for kind in ("plain", "step") if pair % 2 == 0 else ("step", "plain"):
                t0 = time.perf_counter()
                for _ in range(seg):
                    iterate()
                    step += 1
                    if kind == "step":
                        c0 = time.perf_counter()
                        ckpt.step(step, state)
                        calls.append(time.perf_counter() - c0)
                mean = (time.perf_counter() - t0) / seg
                (plain if kind == "plain" else stepped).append(mean)
                if kind == "plain":
                    ckpt.pause()  # the plain segment is no iteration of the manager's
        step_secs = getattr(ckpt.stats(), "step_secs", None)
    saved = 0
    policy = pitstop.CheckFreq(0.02)
    with pitstop.CheckpointManager(
        os.path.join(root, "checkfreq"), keep_last=2, policy=policy, options=options
    ) as ckpt:
        t0 = time.perf_counter()
        for s in range(1, cfg["checkfreq_steps"] + 1):
            iterate()
            saved += bool(ckpt.step(s, state))
        checkfreq_secs = time.perf_counter() - t0
        overhead = ckpt.stats().overhead
    return {
        "rank": rank,
        "call_median_ms": 1e3 * statistics.median(calls),
        "call_mean_ms": 1e3 * statistics.fmean(calls),
        "iter_plain_ms": 1e3 * statistics.median(plain),
        "iter_step_ms": 1e3 * statistics.median(stepped),
        "pair_ratios": [s / p for s, p in zip(stepped, plain, strict=True)],
        "profiler_step_ms": None if step_secs is None else 1e3 * step_secs,
        "checkfreq_checkpoints": saved,
        "checkfreq_interval": policy.interval,
        "checkfreq_secs": checkfreq_secs,
        "checkfreq_profiler_overhead": overhead,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--segment", type=int, default=None)
    ap.add_argument("--checkfreq-steps", type=int, default=None)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    cfg = {
        "width": args.width,
        "layers": args.layers,
        "batch": args.batch,
        "pairs": args.pairs or (4 if args.quick else 8),
        "segment": args.segment or (25 if args.quick else 40),
        "warmup": 10,
        "checkfreq_steps": args.checkfreq_steps or (80 if args.quick else 200),
    }
    log(f"pitstop {pitstop.__version__} from {os.path.dirname(pitstop.__file__)}; {cfg}")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="pitstop-ddp-step-") as root:
        t0 = time.perf_counter()
        out = run_ranks(_rank, args.world, root, cfg, timeout_secs=600.0)
        log(f"ranks done in {time.perf_counter() - t0:.1f} s")
    print(f"ckpt.step under DDP, {args.world} gloo ranks, {cfg['layers']} x Linear({args.width})")
    print(
        f"{'rank':>4}  {'call med ms':>11}  {'call mean ms':>12}  {'iter plain ms':>13}  "
        f"{'iter+step ms':>12}  {'ratio':>6}  {'counted ms':>10}  {'CheckFreq ckpts':>15}"
    )
    for r in out:
        ratio = statistics.median(r["pair_ratios"])
        counted = r["profiler_step_ms"]
        print(
            f"{r['rank']:>4}  {r['call_median_ms']:>11.3f}  {r['call_mean_ms']:>12.3f}  "
            f"{r['iter_plain_ms']:>13.2f}  {r['iter_step_ms']:>12.2f}  {ratio:>6.3f}  "
            f"{'-' if counted is None else f'{counted:.3f}':>10}  "
            f"{r['checkfreq_checkpoints']:>5} in {cfg['checkfreq_steps']} (k={r['checkfreq_interval']})"
        )
    ratio = statistics.median(x for r in out for x in r["pair_ratios"])
    print(f"iteration with ckpt.step / without (median over pairs and ranks): {ratio:.3f}")
    print(json_line({"config": cfg, "ratio": ratio, "ranks": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
