"""Multi-level checkpoints: node-local levels with partner/XOR redundancy against one shared root.

Usage::

    python benchmarks/multilevel.py                  # 4 ranks on 4 emulated nodes, ~64 MB per rank, 5 saves, 3 restart rounds
    python benchmarks/multilevel.py --quick          # ~8 MB per rank, 3 saves, 1 restart round (under a minute)
    python benchmarks/multilevel.py --mb 256 --reps 7 --dir /data/tmp
    python benchmarks/multilevel.py --state own      # every rank saves its own tensors (FSDP-like)

``pitstop.testing.distributed.run_ranks`` spawns 4 gloo ranks on this machine (one CPU
thread each), placed on 4 emulated nodes with ``topology=["n0", "n1", "n2", "n3"]``: each
node id gets its own directory (``{node}`` in the Local path), so the "nodes" share this
machine's disk, memory and cores. The state (``--state``):

* ``replicated`` (default): ``Linear(512, 512)`` layers + Adam after one step, ~``--mb``
  MB, equal on every rank (DDP): the same bytes on every rank;
* ``own``: ~``--mb`` MB of loose tensors per rank, different on every rank (each rank's
  own bytes, as FSDP shards): ``root`` and ``split`` then write the same (every rank its
  own file).

Save configurations, every one a ``CheckpointManager(keep_last=2)`` with
``dist_timeout_secs``, all in the same process group, saving the same state:

* ``root``: ``CheckpointManager(<disk>/root, replicated="root")``: rank 0 writes every
  replicated byte to one shared directory (the classic baseline; ratios are against it);
* ``split``: the same directory layout, ``replicated="split"`` (each rank 1/N);
* ``shm partner`` / ``shm xor``: ``levels=[Local("/dev/shm/<unique>/<cfg>/{node}",
  redundancy=...), Shared(<disk>/<cfg>/shared, every=--every)]``: the node-local level in
  RAM (tmpfs: O_DIRECT since Linux 6.6, else pitstop falls back to buffered I/O; the
  report says which), every ``--every``-th committed step flushed to the disk in the
  background;
* ``disk partner`` / ``disk xor``: the same with the local level on the disk
  (``<disk>/<cfg>/local/{node}``).

Saves: one untimed warm-up save per manager (arenas allocated), then ``--reps`` rounds,
each running every configuration once in a fresh seeded order. Before every save, untimed:
``os.sync()`` on rank 0 (nothing dirty from an earlier save is written during this one)
and a barrier. Timed on every rank: *stall* = ``async_save`` returning; *durable* = from
the same start until ``handle.wait()`` returns (committed: for the levels, on every
node's local directory with its partner copy or parity). After it, untimed, every rank
waits until its flush queue is empty, so a flush never overlaps the next save; the
flush's own time (read the local files, verify, write and commit on the shared level)
is reported from ``ckpt.flush_records``. Every figure is the maximum over the
ranks of one save; the table gives medians over the rounds.

Restarts run in a fresh process group (a second ``run_ranks``): ``--restore-reps``
rounds, configurations in a fresh seeded order, each a new ``CheckpointManager`` (its
construction, with the peer group of the levels, is the *open* column) and a timed
``restore`` into a scrambled state of the same shapes, verified bit for bit afterwards.
Before each, rank 0 syncs and drops the page cache when permitted (cold, as after a
reboot; tmpfs pages stay in RAM whatever happens; ``--warm``: not dropped). Scenarios,
set up and undone outside the timings by renaming node directories aside (and back):

* the newest step on its own level (``root``, ``split``, the levels: served by the
  local level);
* ``n1 lost``: node n1's local directory is gone (its own files and the partner copy or
  parity it held): the local level rebuilds it from the other nodes;
* ``from shared``: every node's local directory is gone: the newest flushed step is read
  from the shared level, then fetched back into the local level and re-protected (all
  inside ``restore``).

``--quick`` runs the two failure scenarios on the /dev/shm levels only (the disk levels'
restore rows are the newest step alone): a smoke run, not a measurement.

stdout: the save table (median stall, durable, flush; ratios root/this, >1: faster than
root), the restart table (level that served it, bytes by source, median open and
restore; restore ratio root/this), bytes stored per step on each level, and as the last
line one JSON object with every median and sample. Progress goes to stderr. Scratch:
``--dir`` (default: the temp dir, on disk) and a unique directory under /dev/shm,
both removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from _common import (
    build_state,
    build_target,
    drop_caches,
    json_line,
    log,
    median,
    remove_path,
    scramble,
    state_equal,
    state_tensors,
)

MB = 1_000_000
perf = time.perf_counter
NODES = ["n0", "n1", "n2", "n3"]
WIDTH = 512
OWN_COLS = 1024

# save configuration -> (label, local level: None | "shm" | "disk", redundancy)
CONFIGS: dict[str, tuple[str, str | None, str | None]] = {
    "root": ("root dir, replicated=root", None, None),
    "split": ("root dir, replicated=split", None, None),
    "shm_partner": ("levels: /dev/shm partner + disk", "shm", "partner"),
    "shm_xor": ("levels: /dev/shm xor + disk", "shm", "xor"),
    "disk_partner": ("levels: disk partner + disk", "disk", "partner"),
    "disk_xor": ("levels: disk xor + disk", "disk", "xor"),
}
SCENARIOS = {"": "newest step", "lost": "n1 lost", "shared": "from shared"}


def _restore_keys(configs: list[str], quick: bool) -> list[str]:
    """The restart rows; ``quick``: the failure scenarios on the /dev/shm levels only."""
    out = []
    for c in configs:
        out.append(c)
        if CONFIGS[c][1] == "shm" or (CONFIGS[c][1] == "disk" and not quick):
            out += [f"{c}/lost", f"{c}/shared"]
    return out


# --------------------------------------------------------------------------- in the ranks


def _make_state(cfg: dict[str, Any], rank: int, *, target: bool) -> tuple[dict[str, Any], list]:
    """The saved state (``target=False``) or a restore target of the same shapes."""
    if cfg["state"] == "replicated":
        if target:
            model, opt = build_target(cfg["layers"], WIDTH, seed=1)
        else:
            model, opt = build_state(cfg["layers"], WIDTH, seed=0)
        return {"model": model, "optimizer": opt}, state_tensors(model, opt)
    g = torch.Generator().manual_seed(1000 + rank)
    rows = cfg["own_rows"]
    shard = {
        f"t{i:03d}": torch.zeros(rows, OWN_COLS)
        if target
        else torch.randn(rows, OWN_COLS, generator=g)
        for i in range(cfg["own_tensors"])
    }
    return {"shard": shard}, list(shard.values())


def _levels(cfg: dict[str, Any], key: str) -> list[Any]:
    import pitstop

    return [
        pitstop.Local(_local_base(cfg, key) + "/{node}", redundancy=CONFIGS[key][2]),
        pitstop.Shared(os.path.join(cfg["disk"], key, "shared"), every=cfg["every"]),
    ]


def _local_base(cfg: dict[str, Any], key: str) -> str:
    where = CONFIGS[key][1]
    return (
        os.path.join(cfg["shm"], key) if where == "shm" else os.path.join(cfg["disk"], key, "local")
    )


def _manager(cfg: dict[str, Any], key: str) -> Any:
    import pitstop

    timeout = cfg["dist_timeout"]
    if CONFIGS[key][1] is None:
        options = pitstop.SaveOptions.from_env(replicated=key, dist_timeout_secs=timeout)
        return pitstop.CheckpointManager(os.path.join(cfg["disk"], key), 2, options=options)
    options = pitstop.SaveOptions.from_env(dist_timeout_secs=timeout)
    return pitstop.CheckpointManager(_levels(cfg, key), 2, topology=NODES, options=options)


def _wait_flushes(ckpt: Any, timeout: float) -> None:
    flusher = ckpt.hooks.levels.flusher if ckpt.hooks.levels is not None else None
    deadline = time.monotonic() + timeout
    while flusher is not None and flusher.pending:
        if time.monotonic() > deadline:
            raise TimeoutError("flush still pending")
        time.sleep(0.005)


def _dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file retention deleted meanwhile
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


def save_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Every configuration: a warm-up save, then ``reps`` interleaved rounds of async_save."""
    import torch.distributed as dist

    from pitstop.format.names import step_dir_name

    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    lead = rank == 0

    def say(msg: str) -> None:
        if lead:
            log(f"saves: {msg}")

    state, tensors = _make_state(cfg, rank, target=False)
    info: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    configs = cfg["configs"]
    managers: dict[str, Any] = {}
    for key in configs:
        t0 = perf()
        managers[key] = _manager(cfg, key)
        info[f"{key}_open_secs"] = perf() - t0
        t0 = perf()
        h = managers[key].save(0, state)
        _wait_flushes(managers[key], cfg["dist_timeout"])
        info[f"{key}_warmup_secs"] = perf() - t0
        info[f"{key}_direct_io"] = bool(h.stats.direct_io)
        dist.barrier()
        say(f"warm-up {key}: {perf() - t0:.2f} s")

    samples: dict[str, dict[str, list[float]]] = {
        k: {"stall": [], "durable": [], "stage": [], "persist": []} for k in configs
    }
    orders = []
    for rep in range(cfg["reps"]):
        step = rep + 1
        order = random.Random(rep).sample(configs, len(configs))
        orders.append(order)
        say(f"round {rep + 1}/{cfg['reps']}: {' '.join(order)}")
        for key in order:
            ckpt = managers[key]
            if lead:
                os.sync()
            dist.barrier()
            t0 = perf()
            h = ckpt.async_save(step, state)
            t1 = perf()
            h.wait()
            t2 = perf()
            _wait_flushes(ckpt, cfg["dist_timeout"])
            s = samples[key]
            s["stall"].append(t1 - t0)
            s["durable"].append(t2 - t0)
            s["stage"].append(h.stats.stage_secs)
            s["persist"].append(h.stats.persist_secs)
            dist.barrier()
            if lead:
                log(f"saves:   {key:14s} stall {t1 - t0:6.3f} s  durable {t2 - t0:6.3f} s (rank 0)")

    flushes: dict[str, list[tuple[int, bool, float, str | None]]] = {}
    for key in configs:
        ckpt = managers[key]
        if ckpt.hooks.levels is not None and ckpt.hooks.levels.flusher is not None:
            flushes[key] = [(r.step, r.ok, r.secs, r.error) for r in ckpt.flush_records]
        ckpt.close()
    dist.barrier()
    say("managers closed")
    last = cfg["reps"]
    stored: dict[str, dict[str, int]] = {}
    if lead:  # bytes of the newest step on each level (every node's directory)
        for key in configs:
            if CONFIGS[key][1] is None:
                stored[key] = {
                    "root": _dir_bytes(os.path.join(cfg["disk"], key, step_dir_name(last)))
                }
                continue
            base = _local_base(cfg, key)
            local = sum(_dir_bytes(os.path.join(base, n, step_dir_name(last))) for n in NODES)
            ok = [f[0] for f in flushes.get(key, []) if f[1]]
            shared = (
                _dir_bytes(os.path.join(cfg["disk"], key, "shared", step_dir_name(max(ok))))
                if ok
                else 0
            )
            stored[key] = {"local": local, "shared": shared}
    say("done")
    return {
        "samples": samples,
        "flushes": flushes,
        "orders": orders,
        "info": info,
        "stored": stored,
    }


def _aside(base: str, nodes: list[str]) -> None:
    for n in nodes:
        os.rename(os.path.join(base, n), os.path.join(base, f".aside-{n}"))


def _back(base: str, nodes: list[str]) -> None:
    for n in nodes:
        remove_path(os.path.join(base, n))
        os.rename(os.path.join(base, f".aside-{n}"), os.path.join(base, n))


def restore_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A fresh process group: every restore scenario, ``restore_reps`` interleaved rounds."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    lead = rank == 0
    _, expected = _make_state(cfg, rank, target=False)
    target, got = _make_state(cfg, rank, target=True)
    keys = _restore_keys(cfg["configs"], cfg["quick"])
    samples: dict[str, dict[str, list[float]]] = {k: {"open": [], "restore": []} for k in keys}
    served: dict[str, list[Any]] = {k: [] for k in keys}
    verified: dict[str, bool] = {}
    cache = "cold"
    for rep in range(cfg["restore_reps"]):
        order = random.Random(100 + rep).sample(keys, len(keys))
        if lead:
            log(f"restarts: round {rep + 1}/{cfg['restore_reps']}: {' '.join(order)}")
        for k in order:
            config, _, scenario = k.partition("/")
            moved = {"lost": ["n1"], "shared": NODES}.get(scenario, [])
            base = _local_base(cfg, config) if moved else ""
            scramble(got)
            if lead:
                if moved:
                    _aside(base, moved)
                if not cfg["drop_caches"] or not drop_caches():
                    cache = "warm"
            dist.barrier()
            t0 = perf()
            ckpt = _manager(cfg, config)
            t1 = perf()
            step = ckpt.restore(target)
            t2 = perf()
            r = ckpt.last_restore
            ckpt.close()
            samples[k]["open"].append(t1 - t0)
            samples[k]["restore"].append(t2 - t1)
            served[k].append(
                {
                    "step": step,
                    "level": getattr(r, "level", None),
                    "sources": dict(getattr(r, "sources", {}) or {}),
                    "repaired": list(getattr(r, "repaired", []) or []),
                }
            )
            verified[k] = verified.get(k, True) and state_equal(got, expected)
            dist.barrier()
            if lead:
                if moved:
                    _back(base, moved)
                log(f"restarts:   {k:22s} open {t1 - t0:6.3f} s  restore {t2 - t1:6.3f} s (rank 0)")
            dist.barrier()
    return {"samples": samples, "served": served, "verified": verified, "cache": cache}


# --------------------------------------------------------------------------- report


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _max_over_ranks(per_rank: list[dict[str, Any]], key: str, what: str) -> list[float]:
    n = len(per_rank[0]["samples"][key][what])
    return [max(r["samples"][key][what][i] for r in per_rank) for i in range(n)]


def _summarise(
    per_rank: list[dict[str, Any]], keys: list[str], whats: tuple[str, ...]
) -> tuple[dict[str, dict[str, list[float]]], dict[str, dict[str, float]]]:
    """Per configuration and measure: the samples (max over ranks) and their median."""
    maxes = {k: {w: _max_over_ranks(per_rank, k, w) for w in whats} for k in keys}
    return maxes, {k: {w: median(v) for w, v in m.items()} for k, m in maxes.items()}


def _flush_secs(per_rank: list[dict[str, Any]], key: str) -> list[float]:
    """Per flushed step (every flush of the run): the maximum over the ranks of its time."""
    by_step: dict[int, float] = {}
    for r in per_rank:
        for step, ok, secs, _err in r["flushes"].get(key, []):
            if ok:
                by_step[step] = max(by_step.get(step, 0.0), secs)
    return [by_step[s] for s in sorted(by_step)]


def _sources(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / MB:.0f}" for k, v in sorted(d.items()) if v) or "-"


def report(
    saves: list[dict[str, Any]], restores: list[dict[str, Any]], cfg: dict[str, Any]
) -> dict[str, Any]:
    configs = cfg["configs"]
    nb = saves[0]["info"]["state_bytes"]

    def out(*parts: object) -> None:
        print(*parts, flush=True)

    # saves
    maxes, med = _summarise(saves, configs, ("stall", "durable", "stage", "persist"))
    for key in configs:
        maxes[key]["flush"] = _flush_secs(saves, key)
        med[key]["flush"] = median(maxes[key]["flush"])
    base = med.get("root", {})
    out()
    out(
        f"== saves: 4 ranks on nodes {NODES}, {nb / MB:.1f} MB per rank ({cfg['state']}), "
        f"{cfg['reps']} round(s), interleaved; time = max over ranks"
    )
    header = (
        f"{'configuration':34s} {'stall s':>8s} {'durable s':>10s} {'flush s':>8s}  "
        f"{'stall vs root':>13s} {'durable vs root':>15s}"
    )
    out(header)
    out("-" * len(header))
    save_ratios: dict[str, dict[str, float]] = {}
    for key in configs:
        m = med[key]
        ratios = {
            w: base.get(w, math.nan) / m[w] if m[w] > 0 else math.nan for w in ("stall", "durable")
        }
        save_ratios[key] = ratios
        flush = _fmt(m["flush"]) if CONFIGS[key][1] is not None else ""
        out(
            f"{CONFIGS[key][0]:34s} {_fmt(m['stall']):>8s} {_fmt(m['durable']):>10s} "
            f"{flush:>8s}  {_fmt(ratios['stall'], '.2f') + 'x':>13s} "
            f"{_fmt(ratios['durable'], '.2f') + 'x':>15s}"
        )
    out(
        "stall: async_save returns; durable: until handle.wait() returns (levels: committed on "
        "every node's local dir with its redundancy); flush: the background copy to the "
        f"shared level of one commit in {cfg['every']} (warm-up's counted), median over "
        "every flush of the run, max over ranks (waited for between saves, untimed); "
        "ratios: root's median / this median"
    )
    failed = {k: [f for r in saves for f in r["flushes"].get(k, []) if not f[1]] for k in configs}
    failed = {k: v for k, v in failed.items() if v}
    if failed:
        out(f"FLUSH FAILURES: {failed}")
    stored = saves[0]["stored"]
    out(
        "bytes of the newest step on disk/RAM (MB; all nodes): "
        + "; ".join(
            f"{k} " + ", ".join(f"{lv} {v / MB:.0f}" for lv, v in stored[k].items())
            for k in configs
            if k in stored
        )
    )

    # restarts
    keys = _restore_keys(configs, cfg["quick"])
    rmax, rmed = _summarise(restores, keys, ("open", "restore"))
    rbase = rmed.get("root", {})
    out()
    out(
        f"== restarts: a fresh process group; {cfg['restore_reps']} round(s), interleaved; "
        f"page cache {restores[0]['cache']} before each; time = max over ranks"
    )
    header = (
        f"{'configuration / scenario':48s} {'step':>4s} {'level':>6s} {'open s':>7s} "
        f"{'restore s':>9s} {'restore vs root':>15s}  {'MB by source (all ranks)':s}"
    )
    out(header)
    out("-" * len(header))
    restore_ratios: dict[str, float] = {}
    served_out: dict[str, Any] = {}
    for k in keys:
        config, _, scenario = k.partition("/")
        first = restores[0]["served"][k][0]
        served_out[k] = first
        ratio = rbase.get("restore", math.nan) / rmed[k]["restore"]
        restore_ratios[k] = ratio
        label = CONFIGS[config][0] + (f", {SCENARIOS[scenario]}" if scenario else "")
        out(
            f"{label:48s} {first['step']!s:>4s} {first['level'] or 'root':>6s} "
            f"{_fmt(rmed[k]['open']):>7s} {_fmt(rmed[k]['restore']):>9s} "
            f"{_fmt(ratio, '.2f') + 'x':>15s}  {_sources(first['sources'])}"
        )
    out(
        "open: CheckpointManager(...) (levels: with its peer group); restore: ckpt.restore "
        "(from shared: includes fetching the step back into every node's local dir and "
        "re-protecting it); ratio: root's median / this median"
    )
    repaired = {k: served_out[k]["repaired"] for k in keys if served_out[k]["repaired"]}
    out(
        "repaired by the restore: "
        + ("; ".join(f"{k}: {', '.join(v)}" for k, v in repaired.items()) or "nothing")
    )
    uneven = sorted(
        k
        for k in keys
        for r in restores
        for x in r["served"][k]
        if (x["step"], x["level"]) != (served_out[k]["step"], served_out[k]["level"])
    )
    if uneven:
        out(f"SERVED DIFFERENTLY across rounds or ranks: {sorted(set(uneven))}")
    bad = sorted({k for r in restores for k, ok in r["verified"].items() if not ok})
    out(
        f"verified (every restore equals the saved state, every rank): {'yes' if not bad else 'NO: ' + ', '.join(bad)}"
    )
    direct = {k: saves[0]["info"].get(f"{k}_direct_io") for k in configs}
    out(f"O_DIRECT used by the saves (rank 0): {direct}")
    return {
        "state_bytes": nb,
        "save_median_secs": med,
        "save_ratios_vs_root": save_ratios,
        "restore_median_secs": rmed,
        "restore_ratios_vs_root": restore_ratios,
        "served": served_out,
        "served_differently": sorted(set(uneven)),
        "stored_bytes": stored,
        "verified": not bad,
        "save_samples_max_over_ranks": maxes,
        "restore_samples_max_over_ranks": rmax,
        "flush_failures": failed,
        "cache": restores[0]["cache"],
        "orders": saves[0]["orders"],
        "info": [r["info"] for r in saves],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--mb", type=float, default=None, help="MB of state per rank (default 64; --quick 8)"
    )
    p.add_argument("--state", choices=("replicated", "own"), default="replicated")
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed saves per configuration (default 5; --quick 3)",
    )
    p.add_argument(
        "--restore-reps", type=int, default=None, help="restart rounds (default 3; --quick 1)"
    )
    p.add_argument("--every", type=int, default=2, help="Shared(every=) (default 2)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="~8 MB per rank, 3 saves, 1 restart round, no failure rows for the disk levels",
    )
    p.add_argument("--warm", action="store_true", help="do not drop the page cache before restores")
    p.add_argument("--no-shm", action="store_true", help="skip the /dev/shm configurations")
    p.add_argument(
        "--dir", default=None, help="parent of the disk scratch directory (default: temp dir)"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds for each phase and its collectives"
    )
    args = p.parse_args(argv)
    args.mb = args.mb or (8.0 if args.quick else 64.0)
    args.reps = args.reps or (3 if args.quick else 5)
    args.restore_reps = args.restore_reps or (1 if args.quick else 3)
    if args.mb <= 0 or args.reps < 1 or args.restore_reps < 1 or args.every < 1:
        p.error("--mb, --reps, --restore-reps and --every must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    from pitstop.testing.distributed import run_ranks

    args = parse_args(argv)
    configs = list(CONFIGS)
    if args.no_shm or not os.path.isdir("/dev/shm"):
        configs = [k for k in configs if CONFIGS[k][1] != "shm"]
    layer_bytes = 3 * 4 * (WIDTH * WIDTH + WIDTH)  # weights + bias, Adam's two moments
    own_rows = 1024  # 4 MB tensors
    cfg: dict[str, Any] = {
        "state": args.state,
        "layers": max(1, round(args.mb * MB / layer_bytes)),
        "own_rows": own_rows,
        "own_tensors": max(1, round(args.mb * MB / (own_rows * OWN_COLS * 4))),
        "reps": args.reps,
        "restore_reps": args.restore_reps,
        "every": args.every,
        "configs": configs,
        "dist_timeout": args.timeout,
        "drop_caches": not args.warm,
        "quick": args.quick,
    }
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    disk = tempfile.mkdtemp(prefix="pitstop-bench-ml-", dir=parent)
    shm: str | None = None
    try:
        if any(CONFIGS[k][1] == "shm" for k in configs):
            shm = tempfile.mkdtemp(prefix="pitstop-bench-ml-", dir="/dev/shm")
        cfg["disk"], cfg["shm"] = disk, shm or ""
        what = (
            f"{cfg['layers']} x Linear({WIDTH}, {WIDTH}) + Adam, equal on every rank"
            if args.state == "replicated"
            else f"{cfg['own_tensors']} x {own_rows} x {OWN_COLS} fp32 own tensors per rank"
        )
        print(
            f"state: {what}; 4 ranks on nodes {NODES} (one machine); {args.reps} save(s), "
            f"{args.restore_reps} restart round(s); Shared(every={args.every}); disk dir "
            f"{disk}; shm dir {shm}; torch {torch.__version__}; python "
            f"{platform.python_version()}; {os.cpu_count()} CPUs; 1 thread per rank",
            flush=True,
        )
        t0 = perf()
        log("saves: spawning 4 ranks")
        saves = run_ranks(save_main, 4, cfg, timeout_secs=args.timeout)
        t1 = perf()
        log("restarts: spawning 4 fresh ranks")
        restores = run_ranks(restore_main, 4, cfg, timeout_secs=args.timeout)
        t2 = perf()
        result = report(saves, restores, cfg)
    finally:  # the /dev/shm directory is RAM: never left behind
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
        remove_path(disk)
    print(f"wall: saves {t1 - t0:.1f} s, restarts {t2 - t1:.1f} s", flush=True)
    result["config"] = {
        **{k: v for k, v in cfg.items() if k not in ("disk", "shm")},
        "mb": args.mb,
        "quick": args.quick,
        "nodes": NODES,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "wall_secs": {"saves": t1 - t0, "restarts": t2 - t1},
    }
    print(json_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
