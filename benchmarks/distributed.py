"""Checkpointing under torch.distributed: pitstop split and root against DCP and the disk.

Usage::

    python benchmarks/distributed.py                    # 20 x Linear(2048, 2048) + Adam (~1.0 GB), worlds 1,2, 3 reps
    python benchmarks/distributed.py --quick            # 5 layers (~250 MB), 1 rep (under a minute)
    python benchmarks/distributed.py --worlds 1,2,4 --reps 5 --dir /data/tmp

For each world size, ``pitstop.testing.distributed.run_ranks`` spawns that many gloo
ranks on this machine (one CPU thread each). Every rank builds the same replicated
state (same seed: the model and Adam state after one step, equal on all ranks, as under
DDP) and a restore target of the same shapes, and measures, inside the ranks:

* pitstop ``save`` (durable on return) with ``replicated="split"`` (the bytes cut into
  one slice per rank, each rank writing its own file) and ``replicated="root"`` (rank 0
  writes everything); one manager per mode, reused, warmed up by one save;
* ``torch.distributed.checkpoint`` ``dcp.save`` of the same tensors as state dicts at
  the same world size, as users run it (default planner: replicated tensors are
  deduplicated, each whole tensor written by one rank; recent torch balances them over
  the ranks by size; the report shows the bytes per file), followed by ``fsync_tree`` of
  its directory on rank 0 inside the timing (DCP fsyncs its files but not the
  directories: durability parity; the report gives that fsync's share);
* pitstop ``restore`` (collective, reused manager) per mode and ``dcp.load`` (+ the
  optimizer's ``load_state_dict``), the page cache dropped first when permitted;
* the disk's limits, on rank 0 only while the others wait: a raw O_DIRECT write of the
  same bytes (2 threads, 64 MiB requests, from a transparent-huge-page buffer, fsync)
  and a raw O_DIRECT read of them (cold); and, on every rank at once, a raw O_DIRECT
  write of its 1/N share of those bytes to a file of its own (what the disk gives N
  concurrent writers: the limit for ``split``, which is N writers).

Each method starts after a ``torch.distributed.barrier()``; its time is the maximum over
the ranks of that rank's wall time of the call. The disk's speed drifts, so the methods
run interleaved, in a fresh seeded order in every repetition; checkpoints written in a
repetition are deleted after it, outside the timing. The report gives medians and ratios
measured in the same run, never absolute figures to compare across runs. Restores read
the checkpoint the warm-up saved (or, when newer, the repetition's save of the same
bytes).

Memory at the default size: about 6 GB per rank (state, restore target, the arenas of
two pitstop managers, which a restore grows to the whole state on every rank, DCP's
copies; rank 0 also the raw buffer): 12 GB at world 2, ~24 GB at world 4 (use
``--layers`` to shrink). Disk: about 6 GB. The table's +RSS/state column gives the
memory each call adds once warm.

stdout: a table per world size (method, median seconds, GB/s, ratio to the raw write),
the split/root and split/DCP ratios, and, as the last line, one JSON object with every
median and sample. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import resource
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from _common import (
    AlignedBuffer,
    PeakRSS,
    build_state,
    drop_caches,
    fsync_tree,
    gbps,
    json_line,
    layout,
    log,
    median,
    raw_read,
    raw_write,
    remove_path,
    scramble,
    state_equal,
    state_tensors,
)

MIB = 1 << 20
perf = time.perf_counter
MODES = ("split", "root")

# key -> (label, group); "cold" methods drop the page cache first; "lead" ones run on rank 0.
METHODS: dict[str, tuple[str, str]] = {
    "pitstop_save_split": ("pitstop save, split", "save"),
    "pitstop_save_root": ("pitstop save, root", "save"),
    "dcp_save": ("DCP save + fsync_tree", "save"),
    "raw_write": ("raw O_DIRECT write, 1 process", "limit"),
    "raw_write_ranks": ("raw O_DIRECT write, every rank 1/N", "limit"),
    "pitstop_restore_split": ("pitstop restore, split", "restore"),
    "pitstop_restore_root": ("pitstop restore, root", "restore"),
    "dcp_load": ("DCP load", "restore"),
    "raw_read": ("raw O_DIRECT read, 1 process", "limit"),
}
COLD = {"pitstop_restore_split", "pitstop_restore_root", "dcp_load", "raw_read"}
LEAD_ONLY = {"raw_write", "raw_read"}


# --------------------------------------------------------------------------- in the ranks


def _state_dicts(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _file_sizes(path: str) -> dict[str, int]:
    """Bytes of every file under ``path`` (relative names)."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


def _remove_new(path: str, keep: set[str]) -> None:
    for name in os.listdir(path):
        if name not in keep:
            remove_path(os.path.join(path, name))


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of one world size: warm-up, ``reps`` interleaved rounds; samples per method."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import pitstop

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    lead = rank == 0

    def say(msg: str) -> None:
        if lead:
            log(f"world {world}: {msg}")

    base = cfg["root"]
    say(f"building the state ({cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) + Adam)")
    model, opt = build_state(cfg["layers"], cfg["width"], seed=0)
    state: dict[str, Any] = {"model": model, "optimizer": opt}
    tensors = state_tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    offsets, file_bytes = layout(tensors)
    # The restore target: same shapes, other values, Adam state allocated (as DCP needs).
    fresh_model, fresh_opt = build_state(cfg["layers"], cfg["width"], seed=1, step=False)
    for p in fresh_model.parameters():
        p.grad = torch.zeros_like(p)
    fresh_opt.step()
    fresh_opt.zero_grad(set_to_none=True)
    fresh: dict[str, Any] = {"model": fresh_model, "optimizer": fresh_opt}
    fresh_tensors = state_tensors(fresh_model, fresh_opt)

    info: dict[str, Any] = {"state_bytes": state_bytes, "file_bytes": file_bytes}
    verified: dict[str, bool] = {}
    warmup_rss: dict[str, int] = {}  # peak resident memory added by each first call

    def restored_ok(restore: Any) -> bool:
        scramble(fresh_tensors)
        restore()
        return state_equal(fresh_tensors, tensors)

    # pitstop: one reused manager per mode; the warm-up save (step 0) stays as restore source.
    dirs = {m: os.path.join(base, f"pitstop-{m}") for m in MODES}
    managers = {
        m: pitstop.CheckpointManager(
            dirs[m],
            options=pitstop.SaveOptions.from_env(
                replicated=m, dist_timeout_secs=cfg["dist_timeout"]
            ),
        )
        for m in MODES
    }
    keep: dict[str, set[str]] = {}
    for m in MODES:
        say(f"warm-up: pitstop save + restore, {m}")
        t0 = perf()
        with PeakRSS() as rss:
            h = managers[m].save(0, state)
        info[f"pitstop_{m}_warmup_secs"] = perf() - t0
        info[f"pitstop_{m}_direct_io"] = bool(h.stats.direct_io)
        info[f"pitstop_{m}_host_bytes_after_save"] = managers[m].host_bytes
        warmup_rss[f"pitstop_save_{m}"] = rss.added
        with PeakRSS() as rss:
            verified[f"pitstop_restore_{m}"] = restored_ok(lambda m=m: managers[m].restore(fresh))
        warmup_rss[f"pitstop_restore_{m}"] = rss.added
        info[f"pitstop_{m}_host_bytes_after_restore"] = managers[m].host_bytes
        dist.barrier()
        if lead:
            keep[m] = set(os.listdir(dirs[m]))
            info[f"pitstop_{m}_files"] = _file_sizes(dirs[m])

    # DCP: the load source is saved once and kept; every repetition saves to a new directory.
    dcp_dir = os.path.join(base, "dcp")
    dcp_src = os.path.join(base, "dcp-src")
    say("warm-up: DCP save + load")
    t0 = perf()
    with PeakRSS() as rss:
        dcp.save(_state_dicts(model, opt), checkpoint_id=dcp_src)
    warmup_rss["dcp_save"] = rss.added
    if lead:
        fsync_tree(dcp_src)
    info["dcp_warmup_secs"] = perf() - t0

    def dcp_load() -> None:
        sd = _state_dicts(fresh_model, fresh_opt)
        dcp.load(sd, checkpoint_id=dcp_src)
        fresh_opt.load_state_dict(sd["optimizer"])

    with PeakRSS() as rss:
        verified["dcp_load"] = restored_ok(dcp_load)
    warmup_rss["dcp_load"] = rss.added
    dist.barrier()
    if lead:
        info["dcp_files"] = _file_sizes(dcp_src)
        os.makedirs(dcp_dir, exist_ok=True)

    # Raw limits (rank 0): the state packed 4 KiB-aligned in a huge-page buffer; and every
    # rank writing its 1/N share of those bytes to a file of its own at the same time (the
    # disk's limit for N writers, which split is).
    pool = ThreadPoolExecutor(2, thread_name_prefix="raw-io")
    share = -(-file_bytes // world // MIB) * MIB
    share_bytes = max(0, min(share, file_bytes - rank * share))
    share_buf = AlignedBuffer(max(share_bytes, MIB))
    share_buf.tensor.copy_(torch.randint(0, 256, share_buf.tensor.shape, dtype=torch.uint8))
    share_out = os.path.join(base, "raw", f"share{rank}.bin")
    raw_dir = os.path.join(base, "raw")
    raw_src = os.path.join(raw_dir, "src.bin")
    raw_out = os.path.join(raw_dir, "write.bin")
    buf: AlignedBuffer | None = None
    if lead:
        say("warm-up: raw write + read")
        os.makedirs(raw_dir, exist_ok=True)
        buf = AlignedBuffer(file_bytes)
        with torch.no_grad():
            for dst, src in zip(buf.views(tensors, offsets), tensors):
                dst.copy_(src)
        info["raw_huge_bytes"] = buf.huge_bytes()
        info["raw_direct_io"] = raw_write(
            raw_src, buf.view, file_bytes, request=64 * MIB, pool=pool
        )
        buf.tensor.zero_()
        raw_read(raw_src, buf.view, file_bytes, request=64 * MIB, pool=pool)
        verified["raw_read"] = state_equal(buf.views(tensors, offsets), tensors)
    info["cache"] = "cold" if not lead or drop_caches() else "warm"
    dist.barrier()

    def run(key: str, step: int) -> float | None:
        if key in LEAD_ONLY and not lead:
            return None
        t0 = perf()
        if key.startswith("pitstop_save_"):
            managers[key.rsplit("_", 1)[1]].save(step, state)
        elif key.startswith("pitstop_restore_"):
            managers[key.rsplit("_", 1)[1]].restore(fresh)
        elif key == "dcp_save":
            path = os.path.join(dcp_dir, f"step{step}")
            dcp.save(_state_dicts(model, opt), checkpoint_id=path)
            if lead:
                t1 = perf()
                fsync_tree(path)
                fsync_secs.append(perf() - t1)  # its share of the DCP row, for the report
        elif key == "dcp_load":
            dcp_load()
        elif key == "raw_write":
            assert buf is not None
            raw_write(raw_out, buf.view, file_bytes, request=64 * MIB, pool=pool)
        elif key == "raw_write_ranks":
            raw_write(share_out, share_buf.view, share_bytes, request=64 * MIB, pool=pool)
        elif key == "raw_read":
            assert buf is not None
            raw_read(raw_src, buf.view, file_bytes, request=64 * MIB, pool=pool)
        else:
            raise KeyError(key)
        return perf() - t0

    samples: dict[str, list[float | None]] = {k: [] for k in METHODS}
    rss_added: dict[str, list[int | None]] = {k: [] for k in METHODS}
    fsync_secs: list[float] = []
    orders: list[list[str]] = []
    for rep in range(cfg["reps"]):
        step = rep + 1
        # Same seeded order on every rank (no broadcast needed); a fresh one each round.
        order = random.Random(rep).sample(list(METHODS), len(METHODS))
        orders.append(order)
        say(f"round {rep + 1}/{cfg['reps']}: {' '.join(order)}")
        for key in order:
            if lead:
                os.sync()  # no dirty pages of an earlier method are written during this one
                if key in COLD and not drop_caches():
                    info["cache"] = "warm"
            dist.barrier()
            with PeakRSS() as rss:
                secs = run(key, step)
            samples[key].append(secs)
            rss_added[key].append(None if secs is None else rss.added)
            if secs is not None:
                say(f"  {key:24s} {secs:7.3f} s (rank 0)")
        dist.barrier()  # every rank done with this round: delete its outputs, untimed
        if lead:
            for m in MODES:
                _remove_new(dirs[m], keep[m])
            remove_path(os.path.join(dcp_dir, f"step{step}"))
            remove_path(raw_out)
        remove_path(share_out)
        dist.barrier()

    for m in MODES:
        managers[m].close()
    pool.shutdown(wait=True)
    info["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    info["rss_method"] = PeakRSS().method
    info["dcp_fsync_tree_secs"] = fsync_secs
    info["threads"] = torch.get_num_threads()
    return {
        "samples": samples,
        "rss_added": rss_added,
        "warmup_rss": warmup_rss,
        "orders": orders,
        "info": info,
        "verified": verified,
    }


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


def _per_rep_max(per_rank: list[dict[str, Any]], key: str, what: str = "samples") -> list[float]:
    """Each repetition's figure: the maximum over the ranks that ran the method."""
    reps = len(per_rank[0][what][key])
    out = []
    for i in range(reps):
        xs = [r[what][key][i] for r in per_rank if r[what][key][i] is not None]
        out.append(float(max(xs)) if xs else math.nan)
    return out


def _writers(files: dict[str, int]) -> str:
    """Bytes per data file, e.g. ``rank-00000.bin 0.50 GB, ...`` (files over 1 MB)."""
    big = sorted((k, v) for k, v in files.items() if v > 1_000_000)
    return ", ".join(f"{os.path.basename(k)} {v / 1e9:.2f} GB" for k, v in big) or "-"


def report_world(world: int, per_rank: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    info0 = per_rank[0]["info"]
    nb = info0["state_bytes"]
    maxes = {k: _per_rep_max(per_rank, k) for k in METHODS}
    med = {k: median(v) for k, v in maxes.items()}
    rss = {k: median(_per_rep_max(per_rank, k, "rss_added")) / nb for k in METHODS}
    first = {
        k: max(r["warmup_rss"].get(k, 0) for r in per_rank) / nb for k in per_rank[0]["warmup_rss"]
    }
    raw_w, raw_r = med["raw_write"], med["raw_read"]

    def out(*parts: object) -> None:
        print(*parts, flush=True)

    out()
    out(
        f"== world {world}: {nb:,} B replicated state per rank, {len(maxes['raw_write'])} "
        f"repetition(s), interleaved; restores: page cache {info0['cache']}; wall {wall:.1f} s"
    )
    header = (
        f"{'method':34s} {'median s':>9s} {'min':>7s} {'max':>7s} {'GB/s':>6s}  "
        f"{'vs raw write':>12s}  {'vs raw read':>11s}  {'+RSS/state':>10s}"
    )
    out(header)
    out("-" * len(header))
    for key, (label, group) in METHODS.items():
        xs = [x for x in maxes[key] if not math.isnan(x)]
        m = med[key]
        vs_read = _fmt(raw_r / m, ".2f") + "x" if group == "restore" or key == "raw_read" else ""
        out(
            f"{label:34s} {_fmt(m):>9s} {_fmt(min(xs) if xs else math.nan):>7s} "
            f"{_fmt(max(xs) if xs else math.nan):>7s} {_fmt(gbps(nb, m), '.2f'):>6s}  "
            f"{_fmt(raw_w / m, '.2f') + 'x':>12s}  {vs_read:>11s}  {_fmt(rss[key], '.2f'):>10s}"
        )
    fsyncs = info0.get("dcp_fsync_tree_secs") or []
    out(
        f"+RSS/state: median over repetitions of the max over ranks of the peak resident memory "
        f"added during the call / state bytes ({info0.get('rss_method')}); first calls (warm-up, "
        f"arenas allocated): " + ", ".join(f"{k} {v:.2f}" for k, v in first.items())
    )
    out(
        f"DCP save row includes rank 0's fsync_tree of its directory: median "
        f"{_fmt(median(fsyncs))} s of it"
    )
    ratios = {
        "save_split_vs_root": med["pitstop_save_root"] / med["pitstop_save_split"],
        "save_split_vs_dcp": med["dcp_save"] / med["pitstop_save_split"],
        "save_split_vs_raw_write": raw_w / med["pitstop_save_split"],
        "save_split_vs_raw_write_ranks": med["raw_write_ranks"] / med["pitstop_save_split"],
        "restore_split_vs_root": med["pitstop_restore_root"] / med["pitstop_restore_split"],
        "restore_split_vs_dcp": med["dcp_load"] / med["pitstop_restore_split"],
        "restore_split_vs_raw_read": raw_r / med["pitstop_restore_split"],
    }
    out(
        "ratios (speed of split over the other = other's median s / split's median s; >1: split faster)"
    )
    for k, v in ratios.items():
        out(f"  {k:28s} {_fmt(v, '.3f')}")
    out(
        "writers: split "
        + _writers(info0.get("pitstop_split_files", {}))
        + " | root "
        + _writers(info0.get("pitstop_root_files", {}))
        + " | DCP "
        + _writers(info0.get("dcp_files", {}))
    )
    bad = [k for r in per_rank for k, ok in r["verified"].items() if not ok]
    peak = ", ".join(f"{r['info']['peak_rss_bytes'] / 1e9:.2f}" for r in per_rank)
    direct = {m: info0.get(f"pitstop_{m}_direct_io") for m in MODES}
    out(
        f"verified (warm-up restores equal the saved state, every rank): {'yes' if not bad else 'NO: ' + ', '.join(sorted(set(bad)))}; "
        f"pitstop O_DIRECT {direct}; raw O_DIRECT {info0.get('raw_direct_io')}; "
        f"peak RSS per rank {peak} GB"
    )
    return {
        "world": world,
        "state_bytes": nb,
        "file_bytes": info0["file_bytes"],
        "wall_secs": wall,
        "median_secs": med,
        "gbps": {k: gbps(nb, v) for k, v in med.items()},
        "vs_raw_write": {k: raw_w / v for k, v in med.items()},
        "ratios": ratios,
        "rss_added_per_state": rss,
        "warmup_rss_added_per_state": first,
        "samples_max_over_ranks": maxes,
        "samples_per_rank": [r["samples"] for r in per_rank],
        "orders": per_rank[0]["orders"],
        "verified": [r["verified"] for r in per_rank],
        "info": [r["info"] for r in per_rank],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 20; --quick 5)")
    p.add_argument("--width", type=int, default=None, help="features per layer (default 2048)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="~250 MB state, 1 repetition")
    p.add_argument("--worlds", default="1,2", help="comma-separated world sizes (default 1,2)")
    p.add_argument(
        "--dir", default=None, help="parent directory of the scratch directory (default: temp dir)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds for one world size's whole run and its collectives (default 1800)",
    )
    args = p.parse_args(argv)
    args.layers = args.layers or (5 if args.quick else 20)
    args.width = args.width or 2048
    args.reps = args.reps or (1 if args.quick else 3)
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    if args.layers < 1 or args.width < 1 or args.reps < 1 or not args.worlds:
        p.error("--layers, --width, --reps and --worlds must be positive")
    if min(args.worlds) < 1:
        p.error("world sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    from pitstop.testing.distributed import run_ranks

    args = parse_args(argv)
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="pitstop-bench-dist-", dir=parent)
    print(
        f"state: {args.layers} x Linear({args.width}, {args.width}) + Adam after one step, equal on "
        f"every rank; worlds {args.worlds}; {args.reps} repetition(s); dir {root}; torch "
        f"{torch.__version__}; python {platform.python_version()}; {os.cpu_count()} CPUs; "
        "1 thread per rank",
        flush=True,
    )
    print(
        "time = max over ranks of the call's wall time after a barrier; DCP save includes "
        "fsync_tree of its directory on rank 0 (durability parity); raw rows: rank 0 alone",
        flush=True,
    )
    worlds = []
    try:
        for world in args.worlds:
            wroot = os.path.join(root, f"world{world}")
            os.makedirs(wroot)
            cfg = {
                "root": wroot,
                "layers": args.layers,
                "width": args.width,
                "reps": args.reps,
                "dist_timeout": args.timeout,
            }
            log(f"world {world}: spawning {world} rank(s)")
            t0 = perf()
            per_rank = run_ranks(rank_main, world, cfg, timeout_secs=args.timeout)
            worlds.append(report_world(world, per_rank, perf() - t0))
            remove_path(wroot)
    finally:
        remove_path(root)
    result = {
        "config": {
            "layers": args.layers,
            "width": args.width,
            "reps": args.reps,
            "quick": args.quick,
            "worlds": args.worlds,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "medians": {f"world{w['world']}": w["median_secs"] for w in worlds},
        "ratios": {f"world{w['world']}": w["ratios"] for w in worlds},
        "worlds": worlds,
    }
    print(json_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
