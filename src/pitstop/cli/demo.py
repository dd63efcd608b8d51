"""``pitstop demo``: train, SIGKILL at a random step, resume in a fresh process, and prove
that the final weights equal those of an uninterrupted run of the same seed."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["run_demo"]


def _train(
    workdir: str, name: str, args: argparse.Namespace, kill_at: int | None
) -> dict[str, Any]:
    """Run one training process; SIGKILL it once it reports step ``kill_at``."""
    cmd = [
        sys.executable, "-m", "pitstop.cli.demo_train",
        "--dir", os.path.join(workdir, name), "--steps", str(args.steps), "--every", str(args.every),
        "--seed", str(args.seed), "--workers", str(args.workers), "--final", os.path.join(workdir, f"{name}-final"),
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out: dict[str, Any] = {"killed_at": None, "restored": None, "done": None}
    assert proc.stdout is not None
    for line in proc.stdout:
        event = json.loads(line)
        if (
            event["event"] == "step"
            and kill_at is not None
            and event["step"] >= kill_at
            and out["killed_at"] is None
        ):
            proc.send_signal(signal.SIGKILL)
            out["killed_at"] = event["step"]
        elif event["event"] == "restored":
            out["restored"] = event
        elif event["event"] == "done":
            out["done"] = event
    code = proc.wait()
    out["code"], out["secs"] = code, time.perf_counter() - t0
    if code != 0 and out["killed_at"] is None:
        raise RuntimeError(f"training process {name} exited with {code}")
    return out


def run_demo(args: argparse.Namespace) -> int:
    import torch

    import pitstop

    workdir = args.dir or tempfile.mkdtemp(prefix="pitstop-demo-")
    os.makedirs(workdir, exist_ok=True)
    kill_at = (
        args.kill_at
        if args.kill_at is not None
        else random.randint(args.steps // 5, args.steps * 4 // 5)
    )
    print(
        f"pitstop demo: {args.steps} steps (DataLoader with {args.workers} workers, shuffling,"
        f" augmentation, dropout), async_save every {args.every}, SIGKILL near step {kill_at}"
    )
    print(f"  working directory: {workdir}")
    try:
        first = _train(workdir, "interrupted", args, kill_at)
        ckpts = pitstop.CheckpointManager(os.path.join(workdir, "interrupted")).steps()
        print(
            f"  run 1: killed (SIGKILL) at step {first['killed_at']}; committed checkpoints on disk: {ckpts}"
        )
        second = _train(workdir, "interrupted", args, None)
        restored = second["restored"]
        if restored is None:
            print("  run 2: found no checkpoint and started over")
        else:
            print(f"  run 2: resumed from step {restored['step']} in {restored['secs'] * 1000:.0f} ms, "
                  f"trained to step {args.steps}")  # fmt: skip
        reference = _train(workdir, "uninterrupted", args, None)
        print(f"  run 3: uninterrupted reference, {args.steps} steps")
        a = pitstop.load(os.path.join(workdir, "interrupted-final"))["model"]
        b = pitstop.load(os.path.join(workdir, "uninterrupted-final"))["model"]
        identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        done = second["done"]
        print()
        print(
            f"  checkpoints taken (run 2): {done['checkpoints']} of {done['nbytes'] / 1e6:.2f} MB each"
        )
        print(f"  time per checkpoint: stall {done['stall_secs'] * 1000:.2f} ms, "
              f"until committed {done['total_secs'] * 1000:.1f} ms")  # fmt: skip
        if restored is not None:
            print(
                f"  recovery time: {restored['secs'] * 1000:.0f} ms (restore of step {restored['step']})"
            )
        print(
            f"  final digest: resumed {done['digest'][:16]}, uninterrupted {reference['done']['digest'][:16]}"
        )
        print(f"  weights identical: {'yes' if identical else 'no'}")
        return 0 if identical and done["digest"] == reference["done"]["digest"] else 1
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
