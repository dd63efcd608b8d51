"""Checkpoints with the memory level, as a training process sees them (issue 27).

    python benchmarks/memory_level.py            # 1 GiB of state (a few minutes)
    python benchmarks/memory_level.py --quick    # 256 MiB, 2 rounds, no ranks (under a minute)

Everything on the same bytes (``--mib`` MiB of float32 in 16 tensors, plus the objects a
state carries), the competitors interleaved in one run (this machine's speed drifts):

Per checkpoint, in the training process (wall stall and CPU time of every thread of the
process, ``getrusage``), medians of ``--reps``:

* ``copy``: one memmove of every tensor into a reused, touched buffer (the floor: what a
  checkpoint must at least cost the training process).
* ``threads``: ``CheckpointManager(dir)``, ``async_save`` then ``wait``: today's path
  without a memory level (stage into the arena, hash and write in threads of the training
  process, commit, retention).
* ``memory snapshot``: ``[Memory(), Local(dir)]``, ``ckpt.step()`` between durable saves:
  the copy into a slot and its ``staged`` record; the keeper seals it (its CPU is counted
  apart, from /proc).
* ``memory durable``: the same list, ``save``: the keeper also writes the slot to ``dir``.

Restore after a crash, each in a fresh process (the writer SIGKILLs itself; its keeper
lingers; the restoring process adopts the slots): ``restore memory`` (``ckpt.restore``,
served by the memory level), ``restore disk`` (``CheckpointManager(dir).restore`` of the
step the keeper wrote), ``torch.load`` (of a ``torch.save`` of the same state, page cache
warm), against ``memcpy`` (copying the state between two touched buffers in that process).

Also: RSS of the training process and of the keeper, and the shared memory the slots use.

Several ranks (``--only ranks``): two gloo ranks, one emulated node each, the same small
training loop with no checkpoints, the local level every 10 steps, plus a memory snapshot
every step, plus partner copies of every snapshot into the other node's memory: the median
iteration time of each.

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(mib: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    n = 16
    per = mib * (1 << 20) // 4 // n
    tensors = {f"t{i:02d}": torch.randn(per, generator=g) for i in range(n)}
    return {"w": tensors, "progress": {"epoch": 1, "note": "x" * 100}}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _rss_mib(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _timed(fn: Any) -> tuple[float, float]:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, _cpu() - c0


# --------------------------------------------------------------------------- costs
def costs(args: argparse.Namespace, root: str) -> dict[str, Any]:
    import torch

    import pitstop
    from pitstop.engine.stage import copy_bytes
    from pitstop.policy import EveryN

    state = _state(args.mib)
    flat = list(state["w"].values())
    dst = [torch.empty_like(t) for t in flat]
    for d in dst:
        d.fill_(1.0)
    job = f"bench{os.getpid()}"
    plain = pitstop.CheckpointManager(os.path.join(root, "threads"), keep_last=2)
    mem = pitstop.CheckpointManager(
        [pitstop.Memory(job=job), pitstop.Local(os.path.join(root, "local"), keep_last=2)],
        policy=EveryN(10**9),
    )
    plain.reserve(state)
    mem.reserve(state)
    keeper_cpu: list[float] = []
    rows: dict[str, list[tuple[float, float]]] = {
        k: [] for k in ("copy", "threads", "memory snapshot", "memory durable")
    }
    step = 0

    def settle() -> None:  # let the keeper seal the snapshot (its own CPU, not ours)
        memory = mem.hooks.levels.memory
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            slots = memory.slots if memory is not None else None
            if slots is not None and slots.newest() and slots.newest()[1].step == step:
                return
            time.sleep(0.005)

    for rep in range(args.reps + 1):  # the first round warms up (slots, arena, keeper)
        out: dict[str, tuple[float, float]] = {}
        out["copy"] = _timed(lambda: [copy_bytes(d, s) for d, s in zip(dst, flat)])
        step += 1
        out["threads"] = _timed(lambda s=step: plain.async_save(s, state).wait())
        step += 1
        memory = mem.hooks.levels.memory
        k0 = _proc_cpu(memory.keeper.pid) if memory and memory.keeper else 0.0
        out["memory snapshot"] = _timed(lambda s=step: (mem.step(s, state), mem.wait()))
        settle()
        step += 1
        out["memory durable"] = _timed(lambda s=step: mem.save(s, state))
        if memory is not None and memory.keeper is not None:
            keeper_cpu.append(_proc_cpu(memory.keeper.pid) - k0)
        if rep:
            for k, v in out.items():
                rows[k].append(v)
        print(f"  round {rep}: " + ", ".join(f"{k} {w:.3f}s/{c:.3f}cpu"
                                            for k, (w, c) in out.items()), file=sys.stderr)  # fmt: skip
    memory = mem.hooks.levels.memory
    keeper_rss = _rss_mib(memory.keeper.pid) if memory and memory.keeper else 0.0
    shm = sum(s.nbytes for s in memory.slots.slots) if memory and memory.slots else 0
    result = {
        k: {"wall": statistics.median(w for w, _ in v), "cpu": statistics.median(c for _, c in v)}
        for k, v in rows.items()
    }
    result["keeper_cpu_per_snapshot_and_durable"] = statistics.median(keeper_cpu[1:] or [0.0])
    result["rss_mib"] = _rss_mib()
    result["keeper_rss_mib"] = keeper_rss
    result["shm_mib"] = shm / (1 << 20)
    result["state_mib"] = args.mib
    plain.close()
    mem.close()
    return result


# --------------------------------------------------------------------------- restores
def writer(args: argparse.Namespace) -> None:
    """A training process: a memory snapshot, a durable copy, a torch.save; then SIGKILL."""
    import torch

    import pitstop
    from pitstop.policy import EveryN

    state = _state(args.mib)
    ckpt = pitstop.CheckpointManager(
        [pitstop.Memory(job=args.job), pitstop.Local(args.dir, keep_last=1)], policy=EveryN(10**9)
    )
    ckpt.restore(state)
    ckpt.save(args.step, state)  # memory + disk (the keeper writes it)
    torch.save(state, os.path.join(args.dir, "state.pt"))
    os.sync()
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def restorer(args: argparse.Namespace) -> None:
    import torch

    import pitstop
    from pitstop.engine.stage import copy_bytes

    state = _state(args.mib)
    for t in state["w"].values():
        t.zero_()
    out: dict[str, Any] = {}
    if args.what == "memory":
        ckpt = pitstop.CheckpointManager(
            [pitstop.Memory(job=args.job), pitstop.Local(args.dir, keep_last=1)]
        )
        t0 = time.perf_counter()
        out["step"] = ckpt.restore(state)
        out["secs"] = time.perf_counter() - t0
        assert ckpt.last_restore is not None
        out["level"] = ckpt.last_restore.level
        os._exit(_emit(out))  # no close: the next round's writer adopts the slots
    elif args.what == "disk":
        ckpt = pitstop.CheckpointManager(args.dir)
        t0 = time.perf_counter()
        out["step"] = ckpt.restore(state)
        out["secs"] = time.perf_counter() - t0
        ckpt.close()
    elif args.what == "torch.load":
        t0 = time.perf_counter()
        loaded = torch.load(os.path.join(args.dir, "state.pt"), weights_only=True)
        for k, t in state["w"].items():
            t.copy_(loaded["w"][k])
        out["secs"] = time.perf_counter() - t0
    else:  # memcpy between two touched buffers of the state's size
        src = [t.clone() for t in state["w"].values()]
        t0 = time.perf_counter()
        for d, s in zip(state["w"].values(), src):
            copy_bytes(d, s)
        out["secs"] = time.perf_counter() - t0
    _emit(out)


def _emit(out: dict[str, Any]) -> int:
    print(json.dumps(out), flush=True)
    return 0


def restores(args: argparse.Namespace, root: str) -> dict[str, Any]:
    job = f"benchr{os.getpid()}"
    d = os.path.join(root, "restore")
    os.makedirs(d, exist_ok=True)
    rows: dict[str, list[float]] = {"restore memory": [], "restore disk": [], "torch.load": [],
                                    "memcpy": []}  # fmt: skip
    levels = []
    base = [sys.executable, os.path.abspath(__file__), "--mib", str(args.mib), "--job", job,
            "--dir", d]  # fmt: skip
    for rnd in range(args.reps):
        w = subprocess.run([*base, "--role", "writer", "--step", str(rnd + 1)],
                           capture_output=True, text=True, timeout=600)  # fmt: skip
        if "ready" not in w.stdout:
            raise SystemExit(f"writer failed: {w.stderr[-2000:]}")
        for what, row in (("memory", "restore memory"), ("disk", "restore disk"),
                          ("torch.load", "torch.load"), ("memcpy", "memcpy")):  # fmt: skip
            r = subprocess.run([*base, "--role", "restorer", "--what", what],
                               capture_output=True, text=True, timeout=600)  # fmt: skip
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if not lines:
                raise SystemExit(f"restorer {what} failed: {r.stderr[-2000:]}")
            got = json.loads(lines[-1])
            rows[row].append(got["secs"])
            if what == "memory":
                levels.append(got.get("level"))
        print(f"  restore round {rnd}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in rows.items())
              + f" (memory level served: {levels[-1]})", file=sys.stderr)  # fmt: skip
    from pitstop.levels.shm import SHM_DIR, remove_job

    time.sleep(0.5)
    remove_job(SHM_DIR, job)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in rows.items()}
    out["served_by"] = levels
    return out


# --------------------------------------------------------------------------- loop
def loop(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Every-step memory snapshots on the training loop of ``benchmarks/overhead.py`` (an MLP
    + Adam, the same widths): paired segments with and without checkpoints, alternating
    order, in one process; overhead = median of (with / without - 1). Beside it, the same
    pairs with today's path checkpointing every step (``CheckpointManager(dir)``,
    ``EveryN(1)``)."""
    import torch
    from torch import nn

    import pitstop
    from pitstop.policy import EveryN

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(args.width, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    state = {"model": model, "optimizer": opt}

    def train() -> float:
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    train()
    managers = {
        "memory every step": pitstop.CheckpointManager(
            [pitstop.Memory(job=f"benchl{os.getpid()}"),
             pitstop.Local(os.path.join(root, "loop-local"), keep_last=1)],
            policy=EveryN(10**9),
        ),
        "threads every step": pitstop.CheckpointManager(
            os.path.join(root, "loop-threads"), keep_last=1, policy=EveryN(1)
        ),
    }  # fmt: skip
    state_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20
    step = 0
    out: dict[str, Any] = {"state_mib": state_mib}
    for name, ckpt in managers.items():
        ckpt.reserve(state)
        ratios, taken = [], 0
        for pair in range(args.pairs + 1):  # the first pair warms up
            times = {}
            for with_ckpt in (True, False) if pair % 2 else (False, True):
                t0 = time.perf_counter()
                for _ in range(args.segment):
                    step += 1
                    loss = train()
                    if with_ckpt:
                        r = ckpt.step(step, state, loss=loss)
                        taken += bool(r) or r.name == "SKIPPED"
                if with_ckpt:
                    ckpt.wait()
                    ckpt.pause()
                times[with_ckpt] = time.perf_counter() - t0
            if pair:
                ratios.append(times[True] / times[False] - 1)
            print(f"  loop {name} pair {pair}: with {times[True]:.2f}s without "
                  f"{times[False]:.2f}s", file=sys.stderr)  # fmt: skip
        memory = ckpt.hooks.levels.memory
        snapshots = None
        if memory is not None and memory.slots is not None:
            newest = memory.slots.newest()
            snapshots = newest[1].gen if newest else 0  # slot generations: snapshots begun
        out[name] = {"overhead": statistics.median(ratios), "pairs": ratios,
                     "snapshots_begun": snapshots}  # fmt: skip
        ckpt.close()
    out["iter_secs"] = None
    t0 = time.perf_counter()
    for _ in range(3):
        train()
    out["iter_secs"] = (time.perf_counter() - t0) / 3
    return out


# --------------------------------------------------------------------------- main
# ---------------------------------------------------------------------- several ranks
def _ranks_state(mib: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    width = 1024
    layers = max(1, mib * (1 << 20) // (width * width * 4 * 3))  # weights + Adam's two
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return {"model": model, "optimizer": opt}


def _ranks_loop(
    rank: int, world: int, variant: str, root: str, shm: str, mib: int, steps: int
) -> dict[str, Any]:
    """One rank: ``steps`` iterations (forward, backward, Adam) with ``ckpt.step`` as the
    variant says; the wall time of each iteration, and (``crash``) a SIGKILL-like end once
    the newest snapshot is sealed and copied."""
    import torch

    import pitstop
    from pitstop.levels.shm import new_job_token

    torch.set_num_threads(1)
    state = _ranks_state(mib)
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank))
    ckpt = None
    if variant != "none":
        levels: list[Any] = [pitstop.Local(os.path.join(root, variant, "{node}"),
                                           redundancy="single")]  # fmt: skip
        if variant.startswith("memory"):
            levels.insert(0, pitstop.Memory(
                job="b" + new_job_token(), directory=os.path.join(shm, variant, "{node}"),
                redundancy="partner" if variant == "memory partner" else "single",
            ))  # fmt: skip
        ckpt = pitstop.CheckpointManager(
            levels, policy=pitstop.EveryN(10), topology=[f"n{r}" for r in range(world)]
        )
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if ckpt is not None:
            ckpt.step(step, state)
        times.append(time.perf_counter() - t0)
    if ckpt is not None:
        ckpt.close()
    return {"times": times}


def ranks(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Two ranks (gloo, one emulated node each), the same loop with: no checkpoints; the
    local level every 10 steps; plus a memory snapshot every step; plus partner copies of
    every snapshot into the other node's memory. Median iteration time of rank 0 after the
    first 5 iterations, each variant run ``reps`` times in turn."""
    from pitstop.testing.distributed import run_ranks

    shm = tempfile.mkdtemp(prefix="pitstop-bench-", dir="/dev/shm")
    variants = ("none", "local every 10", "memory every step", "memory partner")
    per: dict[str, list[float]] = {v: [] for v in variants}
    try:
        for _ in range(max(1, args.reps // 2)):
            for v in variants:
                out = run_ranks(_ranks_loop, 2, v, root, shm, args.ranks_mib, args.ranks_steps,
                                timeout_secs=300.0)  # fmt: skip
                per[v] += out[0]["times"][5:]
                shutil.rmtree(os.path.join(root, v), ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {"mib": args.ranks_mib, **{v: statistics.median(t) for v, t in per.items()}}


def report_ranks(rk: dict[str, Any], summary: dict[str, Any]) -> None:
    base = rk["none"]
    print(f"\ntwo ranks (gloo, a node each), {rk['mib']} MiB of model + Adam per rank, "
          "median iteration time of rank 0:")  # fmt: skip
    names = ("none", "local every 10", "memory every step", "memory partner")
    for k in names:
        print(f"  {k:20s} {rk[k] * 1e3:8.1f} ms  ({(rk[k] / base - 1) * 100:+6.1f} % vs none)")
    summary["ranks_iter_ms"] = {k: rk[k] * 1e3 for k in names}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mib", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--role", default="main")
    p.add_argument("--what", default="")
    p.add_argument("--job", default="")
    p.add_argument("--dir", default="")
    p.add_argument("--step", type=int, default=1)
    p.add_argument(
        "--only",
        default=None,
        help="sections to run (default costs,restores,loop,ranks; --quick: not ranks)",
    )
    p.add_argument("--ranks-mib", type=int, default=None)
    p.add_argument("--ranks-steps", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--segment", type=int, default=None)
    p.add_argument("--pairs", type=int, default=None)
    args = p.parse_args()
    args.width = args.width or (1024 if args.quick else 2048)  # benchmarks/overhead.py's loop
    args.layers = args.layers or (3 if args.quick else 7)
    args.batch = args.batch or (128 if args.quick else 256)
    args.segment = args.segment or (6 if args.quick else 16)
    args.pairs = args.pairs or (2 if args.quick else 3)
    args.mib = args.mib or (256 if args.quick else 1024)
    args.reps = args.reps or (2 if args.quick else 5)
    args.only = args.only or ("costs,restores,loop" if args.quick else "costs,restores,loop,ranks")
    args.ranks_mib = args.ranks_mib or (48 if args.quick else 96)
    args.ranks_steps = args.ranks_steps or (16 if args.quick else 40)
    if args.role == "writer":
        return writer(args)
    if args.role == "restorer":
        return restorer(args)
    root = tempfile.mkdtemp(prefix="pitstop-memckpt-", dir=os.environ.get("PITSTOP_BENCH_DIR"))
    try:
        print(f"state {args.mib} MiB, {args.reps} rounds; load {os.getloadavg()[0]:.1f}",
              file=sys.stderr)  # fmt: skip
        only = set(args.only.split(","))
        c = costs(args, root) if "costs" in only else None
        r = restores(args, root) if "restores" in only else None
        lp = loop(args, root) if "loop" in only else None
        rk = ranks(args, root) if "ranks" in only else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {"bench": "memory_level", "state_mib": args.mib}
    if c is not None:
        report_costs(args, c, summary)
    if r is not None:
        report_restores(r, summary)
    if lp is not None:
        report_loop(lp, summary)
    if rk is not None:
        report_ranks(rk, summary)
    print(json.dumps(summary))


def report_costs(args: argparse.Namespace, c: dict[str, Any], summary: dict[str, Any]) -> None:
    copy_cpu = c["copy"]["cpu"]
    names = ("copy", "threads", "memory snapshot", "memory durable")
    print(f"\nper checkpoint ({args.mib} MiB), medians: wall stall / CPU of the training process")
    for k in names:
        w, cpu = c[k]["wall"], c[k]["cpu"]
        print(f"  {k:16s} {w * 1e3:8.1f} ms  cpu {cpu * 1e3:8.1f} ms  "
              f"({cpu / copy_cpu:5.2f}x the copy's CPU)")  # fmt: skip
    budget = 1.5 * copy_cpu + 0.002
    print(f"  goal: memory snapshot CPU <= 1.5 x copy + 2 ms = {budget * 1e3:.1f} ms: "
          f"{'PASS' if c['memory snapshot']['cpu'] <= budget else 'MISS'}")  # fmt: skip
    print(f"  keeper CPU per snapshot + durable write: "
          f"{c['keeper_cpu_per_snapshot_and_durable']:.3f} s; RSS: training {c['rss_mib']:.0f} "
          f"MiB, keeper {c['keeper_rss_mib']:.0f} MiB (the slots it maps count there too); "
          f"shared memory {c['shm_mib']:.0f} MiB")  # fmt: skip
    summary.update({
        "cpu_ms": {k: c[k]["cpu"] * 1e3 for k in names},
        "stall_ms": {k: c[k]["wall"] * 1e3 for k in names},
        "snapshot_cpu_vs_copy": c["memory snapshot"]["cpu"] / copy_cpu,
        "rss_mib": c["rss_mib"], "keeper_rss_mib": c["keeper_rss_mib"], "shm_mib": c["shm_mib"],
    })  # fmt: skip


def report_restores(r: dict[str, Any], summary: dict[str, Any]) -> None:
    names = ("memcpy", "restore memory", "restore disk", "torch.load")
    print("\nrestore after a crash, fresh process, medians:")
    for k in names:
        print(f"  {k:16s} {r[k]:8.3f} s   memcpy/this {r['memcpy'] / r[k]:5.2f}x")
    print(f"  goal: restore memory >= 0.5x a memcpy: "
          f"{'PASS' if r['memcpy'] / r['restore memory'] >= 0.5 else 'MISS'}; "
          f"memory vs disk {r['restore disk'] / r['restore memory']:.2f}x faster; "
          f"served by {r['served_by']}")  # fmt: skip
    summary.update({
        "restore_memory_vs_memcpy": r["memcpy"] / r["restore memory"],
        "restore_memory_vs_disk": r["restore disk"] / r["restore memory"],
        "restore_secs": {k: r[k] for k in names}, "restore_served_by": r["served_by"],
    })  # fmt: skip


def report_loop(lp: dict[str, Any], summary: dict[str, Any]) -> None:
    print(f"\ncheckpoint every step on benchmarks/overhead.py's loop ({lp['state_mib']:.0f} MiB "
          f"of state, {lp['iter_secs']:.2f} s per iteration), overhead vs no checkpoints "
          "(median of pairs):")  # fmt: skip
    for k in ("memory every step", "threads every step"):
        extra = lp[k]["snapshots_begun"]
        print(f"  {k:20s} {lp[k]['overhead'] * 100:6.1f} %  pairs "
              f"{[round(x * 100, 1) for x in lp[k]['pairs']]}"
              + (f"; memory snapshots begun: {extra}" if extra is not None else ""))  # fmt: skip
    summary["loop"] = {k: lp[k]["overhead"] for k in ("memory every step", "threads every step")}
    summary["loop_state_mib"] = lp["state_mib"]


if __name__ == "__main__":
    main()
