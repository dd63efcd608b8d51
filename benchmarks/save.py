"""Checkpoint save/restore: pitstop against its peers and the machine's limits, on the same bytes.

Usage::

    python benchmarks/save.py            # 24 x Linear(2048, 2048) + Adam (~1.2 GB), 5 repetitions
    python benchmarks/save.py --quick    # ~150 MB, 3 repetitions (under a minute)
    python benchmarks/save.py --layers 8 --width 4096 --reps 7 --dir /data/tmp
    python benchmarks/save.py --spawn exec   # fresh processes as new interpreters (slower)

Every method saves (or restores) the same state in one process, except the
fresh-process rows below. The disk's
speed drifts (up to 2x within an hour on the CI machines, see
../shared/MACHINE.md), so the methods run interleaved, one repetition of each
per round in a fresh seeded order, and the report gives medians and
ratios measured in the same run, never absolute figures to compare across runs.

Save rows: pitstop ``save`` (durable; outputs deleted outside the timing, and
once more with keep_last=1 deleting the previous checkpoint inside ``save``)
and ``async_save`` (default overlap, and overlap=False); ``torch.save`` + fsync;
``torch.distributed.checkpoint`` save and async_save; torchsnapshot take (+ an
fsync of its files, when installed). The limits: raw O_DIRECT writes of the
same bytes (2 threads, 64 and 256 MiB requests) from a buffer backed by
transparent huge pages, the same from a buffer allocated as pitstop allocates
its arenas (4 KiB pages), and a copy into a reused, pre-touched buffer. Restore
rows, page cache dropped before each (when permitted): pitstop ``restore``
(reused manager, and a new manager as after a restart), ``torch.load``, DCP
load, raw O_DIRECT reads into both kinds of buffer. Rows whose library is
missing or that fail are skipped with a note. ``--only KEY,...`` runs a subset.

Fresh-process rows (a restart): each repetition runs in a new process that gets
its paths, sizes and the saved tensors' sha256 digests from the parent and
reports one result (``--child KIND``). It builds its own restore target (same
shapes, other values, Adam state touched) or, for the raw read, allocates and
prefaults a pitstop Arena, drops the page cache, resets VmHWM
(/proc/self/clear_refs) and times: ``CheckpointManager(root).restore(state)``
(manager creation included), ``torch.load`` + ``load_state_dict``, DCP ``load``,
and a raw O_DIRECT read of pitstop's rank-00000.bin (2 threads, 64 MiB
requests), the limit. Each reports the peak RSS it added (VmHWM after - VmRSS
before) and whether the restored bytes have the saved digests. One more
fresh-process row measures the memory of saves: a new manager with default
options does 3 durable ``save`` and 3 ``async_save`` issued back to back +
``wait``; peak RSS added / state bytes. By default the children are forked
from a fork server (a new interpreter that has only imported torch; ~3 s of
imports per child saved); ``--spawn exec`` starts each as a new interpreter.
They run in the first ``--process-reps`` rounds (default: all).

Memory and disk at the default size: about 13 GB resident (state, restore
target, six pitstop arenas, two raw buffers), a child adds up to ~2.5 GB, and
about 13 GB of files at most (the saves row keeps its 6 checkpoints until the
repetition ends).

stdout: a table, the pitstop breakdown, target checks (PASS/MISS lines, not
asserts) and, as the last line, one JSON object with every figure. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from _common import (
    AlignedBuffer,
    PeakRSS,
    anon_huge_bytes,
    build_state,
    build_target,
    drop_caches,
    fsync_dir,
    fsync_tree,
    gbps,
    hwm_bytes,
    json_line,
    layout,
    log,
    median,
    raw_read,
    raw_write,
    remove_children,
    remove_path,
    rss_bytes,
    scramble,
    state_equal,
    state_tensors,
    tensor_digests,
)

MIB = 1 << 20
perf = time.perf_counter
SCRIPT = os.path.abspath(__file__)
CHILD_TIMEOUT_SECS = 1800
# What the fork server imports once, so that a child forked from it starts as a restarted
# job does after its imports (importing torch, and torch._dynamo at the first optimizer,
# takes ~3 s per process here). pitstop itself is imported in each child.
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.checkpoint"]

# The issue's targets: ratio name -> comparison and threshold (checked, printed, never asserted).
TARGETS = {
    "save_vs_disk": ">= 0.95",
    "save_vs_torch_save": ">= 2.5",
    "async_stall_vs_memcpy": "<= 1.5",
    "async_stall_vs_dcp_async_stall": "<= 0.25",
    "restore_vs_disk": ">= 0.8",
    "rss_per_arena": "<= 1.1",
    "restore_process_vs_raw": ">= 0.9",
    "restore_peak_rss_mib": "<= 256",
    "save_peak_rss_x_state": "<= 1.1",
}

# --------------------------------------------------------------------------- phases
# Where a pitstop save's or restore's time goes. Each entry: metric name -> (module or
# class, attribute, how it is counted). "wall" phases run one after another on the
# critical path; "thread" phases run in several threads at once (their seconds are
# summed over the threads: the CPU or I/O work done, not wall time); "span" also records
# when the first call started and the last one ended (the I/O's start and end).
SAVE_PHASES: list[tuple[str, str, str, str]] = [
    ("dir_prepare", "pitstop.storage.local:LocalStorage", "prepare", "wall"),
    ("objects_encode", "pitstop.engine.saver", "encode_objects", "wall"),
    ("data_file", "pitstop.storage.local:LocalStorage", "write_data", "wall"),
    ("wait_copy_thr", "pitstop.engine.stage:StageJob", "wait_items", "thread"),
    ("pwrite_thr", "pitstop.io.parallel", "_pwrite_all", "span"),
    ("hash_thr", "pitstop.engine.persist", "get_checksum", "hasher"),
    ("fsync_all", "os", "fsync", "thread"),
    ("objects_file", "pitstop.storage.local:LocalStorage", "write_object", "wall"),
    ("manifest_build", "pitstop.engine.saver", "manifest_for", "wall"),
    ("manifest_commit", "pitstop.storage.local:LocalStorage", "commit", "wall"),
]
RESTORE_PHASES: list[tuple[str, str, str, str]] = [
    ("load_entry", "pitstop.manager", "load_entry", "wall"),
    ("check_sizes", "pitstop.engine.restore", "check_sizes", "wall"),
    ("objects_read", "pitstop.engine.restore", "read_objects", "wall"),
    ("plan_restore", "pitstop.engine.restore", "plan_restore", "wall"),
    ("landing", "pitstop.engine.restore:Landing", "__init__", "wall"),
    ("read_buffers", "pitstop.engine.restore", "read_buffers", "wall"),
    ("read_all", "pitstop.engine.restore", "read_all", "wall"),
    ("buffer_touch_thr", "pitstop.engine.verify", "Arena", "thread"),
    ("pread_thr", "pitstop.io.parallel:FileReader", "read_into", "span"),
    ("hash_thr", "pitstop.engine.verify", "get_checksum", "hasher"),
    ("copy_thr", "pitstop.engine.restore:Landing", "deliver", "thread"),
    ("apply", "pitstop.engine.restore", "_apply", "wall"),
]


class PhaseClock:
    """Times the phases of ``SAVE_PHASES`` or ``RESTORE_PHASES`` while it is entered, by
    wrapping those pitstop functions (a few hundred calls per save, microseconds each;
    installed only around the pitstop rows' repetitions). ``metrics()``: seconds per
    phase, and for "span" phases ``<name>_first`` / ``<name>_last``: when the first call
    started and the last one ended, from ``t0``."""

    def __init__(self, phases: list[tuple[str, str, str, str]]) -> None:
        self.phases = phases
        self.t0 = perf()
        self.secs: dict[str, float] = {}
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    def _add(self, key: str, start: float, end: float, span: bool) -> None:
        with self._lock:
            self.secs[key] = self.secs.get(key, 0.0) + end - start
            if span:
                first = self.secs.get(f"{key}_first", math.inf)
                self.secs[f"{key}_first"] = min(first, start - self.t0)
                self.secs[f"{key}_last"] = max(self.secs.get(f"{key}_last", 0.0), end - self.t0)

    def _timed(self, key: str, fn: Callable[..., Any], span: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(key, start, perf(), span)

        return timed

    def _hasher(self, key: str, get: Callable[..., Any]) -> Callable[..., Any]:
        def get_timed(*args: Any, **kwargs: Any) -> Any:
            return self._timed(key, get(*args, **kwargs), False)

        return get_timed

    def __enter__(self) -> PhaseClock:
        import importlib

        self.t0 = perf()
        for key, where, attr, kind in self.phases:
            module, _, cls = where.partition(":")
            owner = importlib.import_module(module)
            if cls:
                owner = getattr(owner, cls)
            fn = owner.__dict__[attr] if cls else getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            if kind == "hasher":
                setattr(owner, attr, self._hasher(key, fn))
            else:
                setattr(owner, attr, self._timed(key, fn, kind == "span"))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def metrics(self) -> Metrics:
        return {f"ph_{k}": v for k, v in self.secs.items()}


# Rows measured in a fresh process (``--child KIND``): kind -> key, label, note.
PROCESS_ROWS = {
    "pitstop": (
        "pitstop_restore_process",
        "pitstop restore, new process",
        "fresh process: CheckpointManager(root).restore(state), manager creation timed",
    ),
    "torch": (
        "torch_load_process",
        "torch.load + load_state_dict, new process",
        "fresh process: torch.load(weights_only=True) + model/optimizer load_state_dict",
    ),
    "dcp": (
        "dcp_load_process",
        "DCP load, new process",
        "fresh process: dcp.load + optimizer load_state_dict",
    ),
    "raw": (
        "raw_read_process",
        "raw O_DIRECT read 64 MiB, new process",
        "fresh process: pitstop's rank-00000.bin read into a prefaulted Arena, 2 threads",
    ),
}

Metrics = dict[str, float]


@dataclass
class Row:
    """One method: ``run`` does one timed repetition and returns its metrics (``secs`` at least)."""

    key: str
    label: str
    group: str  # "save", "limit", "restore" or "memory"
    run: Callable[[], Metrics]
    after: Callable[[], None] | None = None  # untimed cleanup after every repetition
    cold: bool = False  # drop the page cache before every repetition
    reps: int | None = None  # run in the first ``reps`` rounds only (None: every round)
    note: str = ""
    skipped: str | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def add(self, metrics: Metrics) -> None:
        for k, v in metrics.items():
            self.samples.setdefault(k, []).append(float(v))

    def med(self, metric: str = "secs") -> float:
        return median(self.samples.get(metric, []))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        parent = args.dir or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix="pitstop-bench-", dir=parent)
        log(f"building the state: {args.layers} x Linear({args.width}, {args.width}) + Adam")
        self.model, self.opt = build_state(args.layers, args.width, seed=0)
        self.state: dict[str, Any] = {"model": self.model, "optimizer": self.opt}
        self.tensors = state_tensors(self.model, self.opt)
        self.state_bytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.offsets, self.file_bytes = layout(self.tensors)
        # The restore target: same shapes, other values, Adam state allocated (as DCP needs).
        self.fresh_model, self.fresh_opt = build_target(args.layers, args.width, seed=1)
        self.fresh_state: dict[str, Any] = {"model": self.fresh_model, "optimizer": self.fresh_opt}
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="raw-io")
        self._buffer: AlignedBuffer | None = None
        self._step = 0
        self.managers: list[Any] = []
        self.rows: list[Row] = []
        self.cache_mode = "cold" if drop_caches() else "warm (drop_caches not permitted)"
        self.notes: list[str] = []
        self._dcp_checked = False
        self.orders: list[list[str]] = []
        self._arena: tuple[Any, torch.Tensor] | None = None
        self._digests: list[str] | None = None
        self._mp: Any = None

    # ------------------------------------------------------------------ helpers
    def next_step(self) -> int:
        self._step += 1
        return self._step

    def subdir(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        return path

    def state_dicts(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def buffer(self) -> AlignedBuffer:
        """The aligned buffer of the raw rows, holding the state in the pitstop-like layout."""
        if self._buffer is None:
            self._buffer = AlignedBuffer(self.file_bytes)
            with torch.no_grad():
                for dst, src in zip(self._buffer.views(self.tensors, self.offsets), self.tensors):
                    dst.copy_(src)
        return self._buffer

    def arena_buffer(self) -> tuple[memoryview, torch.Tensor]:
        """A pitstop Arena (allocated exactly as pitstop allocates its own) holding the state."""
        if self._arena is None:
            from pitstop.io.arena import Arena

            arena = Arena(self.file_bytes)
            target = torch.frombuffer(arena.view, dtype=torch.uint8)
            with torch.no_grad():
                for src, off in zip(self.tensors, self.offsets):
                    n = src.numel() * src.element_size()
                    target[off : off + n].view(src.dtype).view(src.shape).copy_(src)
            self._arena = (arena, target)
        return self._arena[0].view, self._arena[1]

    def fresh_restored_ok(self, restore: Callable[[], object]) -> bool:
        """Scramble the restore target, run ``restore``, compare with the saved state."""
        scramble(state_tensors(self.fresh_model, self.fresh_opt))
        restore()
        return state_equal(state_tensors(self.fresh_model, self.fresh_opt), self.tensors)

    def add_row(self, builder: Callable[[], Row], key: str, label: str) -> None:
        if self.args.only and key not in self.args.only:
            return
        log(f"setting up {label}")
        t0 = perf()
        try:
            row = builder()
        except Exception as e:
            row = Row(
                key, label, "?", run=lambda: {}, skipped=f"setup failed: {type(e).__name__}: {e}"
            )
            log(f"  skipped: {row.skipped}")
            if not isinstance(e, ImportError):
                traceback.print_exc(file=sys.stderr)
        row.info.setdefault("setup_secs", perf() - t0)
        self.rows.append(row)

    # ------------------------------------------------------------------ pitstop
    def _pitstop_run(self, mgr: Any, *, sync: bool) -> Callable[[], Metrics]:
        def run() -> Metrics:
            phases: Metrics = {}
            t0 = perf()
            if sync:
                with PhaseClock(SAVE_PHASES) as clock:
                    h = mgr.save(self.next_step(), self.state)
                stall = wall = perf() - t0
                phases = clock.metrics()
            else:
                h = mgr.async_save(self.next_step(), self.state)
                stall = perf() - t0
                h.wait()
                wall = perf() - t0
            s = h.stats
            return {
                "secs": wall,
                "stall": stall,
                "stats_stall": s.stall_secs,
                "staged": s.stage_secs,
                "persist": s.persist_secs,
                "committed": s.total_secs,
                "after_commit": wall - s.total_secs,
                "direct_io": float(s.direct_io),
                "alloc": s.alloc_secs,
                **phases,
            }

        return run

    def row_pitstop_save(self, *, retain: bool = False, nice: int | None = None) -> Row:
        """``mgr.save`` on a reused manager; with ``retain`` keep_last=1 deletes the previous one.

        Without ``retain`` every repetition's output is deleted outside the timing, like the
        other rows. With it, the steady state of a training job: the previous checkpoint is
        removed by retention, inside ``save()``. ``nice``: ``SaveOptions.background_nice``
        (what the writer threads' lowered priority costs a synchronous save on busy cores).
        """
        import pitstop

        key = "pitstop_save_retain" if retain else "pitstop_save"
        options = None
        if nice is not None:
            key = f"pitstop_save_nice{nice}"
            options = pitstop.SaveOptions.from_env(background_nice=nice)
        d = self.subdir(key)
        mgr = pitstop.CheckpointManager(d, keep_last=1, options=options)
        self.managers.append(mgr)
        t0 = perf()
        mgr.save(self.next_step(), self.state)  # warm-up: allocates the arena, caches the plan
        info: dict[str, Any] = {"warmup_secs": perf() - t0, "host_bytes": mgr.host_bytes}
        try:  # private attribute, for the report only
            ptr = next(iter(mgr._saver._buffers.values())).data_ptr()
            info["arena_huge_bytes"] = anon_huge_bytes(ptr)
        except Exception:
            pass
        if retain:
            return Row(
                key,
                "pitstop save, keep_last=1 deleting previous",
                "save",
                self._pitstop_run(mgr, sync=True),
                info=info,
                note="retention deletes the previous checkpoint before save() returns",
            )
        remove_children(d)
        return Row(
            key,
            "pitstop save (durable)" if nice is None else f"pitstop save, background_nice={nice}",
            "save",
            self._pitstop_run(mgr, sync=True),
            after=lambda: remove_children(d),
            info=info,
        )

    def row_pitstop_async(self, overlap: bool) -> Row:
        import pitstop

        name = "pitstop_async" if overlap else "pitstop_async_nooverlap"
        d = self.subdir(name)
        info: dict[str, Any] = {}
        base = rss_bytes()
        mgr = pitstop.CheckpointManager(
            d, keep_last=1, options=pitstop.SaveOptions.from_env(overlap=overlap)
        )
        self.managers.append(mgr)
        # Warm-up, measuring the memory the manager adds: one save (one arena), then two saves
        # in flight at once (a second arena). Arenas are kept; later saves add nothing.
        t0 = perf()
        with PeakRSS() as p1:
            mgr.async_save(self.next_step(), self.state).wait()
        info["warmup_secs"] = perf() - t0
        info["rss_method"] = p1.method
        arena_bytes = mgr.host_bytes
        info["first_save"] = {
            "added_rss": p1.peak - base,
            "host_bytes": arena_bytes,
            "added_rss_per_state_per_arena": (p1.peak - base) / self.state_bytes,
        }
        remove_children(d)
        if overlap:
            with PeakRSS() as p2:
                h1 = mgr.async_save(self.next_step(), self.state)
                h2 = mgr.async_save(self.next_step(), self.state)
                h1.wait()
                h2.wait()
            arenas = round(mgr.host_bytes / arena_bytes) if arena_bytes else 0
            info["two_in_flight"] = {
                "added_rss": p2.peak - base,
                "host_bytes": mgr.host_bytes,
                "arenas": arenas,
                "added_rss_per_state_per_arena": (p2.peak - base)
                / self.state_bytes
                / max(arenas, 1),
            }
            remove_children(d)
        label = "pitstop async_save" + ("" if overlap else " overlap=False")
        note = "" if overlap else "every byte copied before async_save returns"
        return Row(
            name,
            label,
            "save",
            self._pitstop_run(mgr, sync=False),
            after=lambda: remove_children(d),
            info=info,
            note=note,
        )

    def row_pitstop_restore(self) -> Row:
        import pitstop

        d = self.subdir("restore_pitstop")
        mgr = pitstop.CheckpointManager(d, keep_last=1)
        self.managers.append(mgr)
        mgr.save(0, self.state)  # the source; its arena is reused by the restores
        ok = self.fresh_restored_ok(lambda: mgr.restore(self.fresh_state))

        def run() -> Metrics:
            t0 = perf()
            mgr.restore(self.fresh_state)
            return {"secs": perf() - t0}

        return Row(
            "pitstop_restore", "pitstop restore", "restore", run, cold=True, info={"verified": ok}
        )

    def pitstop_source(self) -> str:
        """The checkpoint root the pitstop restores read (saved here unless a row did already)."""
        import pitstop

        d = self.subdir("restore_pitstop")
        if not os.listdir(d):
            with pitstop.CheckpointManager(d) as m:
                m.save(0, self.state)
        return d

    def row_pitstop_restore_fresh(self) -> Row:
        import pitstop

        d = self.pitstop_source()

        def restore() -> float:
            t0 = perf()
            mgr = pitstop.CheckpointManager(d)
            try:
                mgr.restore(self.fresh_state)
                return perf() - t0
            finally:
                mgr.close()  # frees its arena, as a process exit would

        ok = self.fresh_restored_ok(restore)
        return Row(
            "pitstop_restore_fresh",
            "pitstop restore (new manager)",
            "restore",
            lambda: {"secs": restore()},
            cold=True,
            info={"verified": ok},
            note="manager created in the timing, as after a restart: allocates its arena",
        )

    # ------------------------------------------------------------------ torch.save / load
    def row_torch_save(self) -> Row:
        d = self.subdir("torch_save")
        path = os.path.join(d, "ckpt.pt")

        def run() -> Metrics:
            t0 = perf()
            with open(path, "wb") as f:
                torch.save(self.state_dicts(self.model, self.opt), f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(d)
            return {"secs": perf() - t0}

        run()  # warm-up
        remove_children(d)
        return Row(
            "torch_save", "torch.save + fsync", "save", run, after=lambda: remove_children(d)
        )

    def torch_source(self) -> str:
        """The file the torch.load rows read (written on first use)."""
        path = os.path.join(self.subdir("restore_torch"), "ckpt.pt")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                torch.save(self.state_dicts(self.model, self.opt), f)
        return path

    def row_torch_load(self) -> Row:
        path = self.torch_source()

        def load() -> None:
            sd = torch.load(path, map_location="cpu", weights_only=True)
            self.fresh_model.load_state_dict(sd["model"])
            self.fresh_opt.load_state_dict(sd["optimizer"])

        ok = self.fresh_restored_ok(load)

        def run() -> Metrics:
            t0 = perf()
            load()
            return {"secs": perf() - t0}

        return Row(
            "torch_load",
            "torch.load + load_state_dict",
            "restore",
            run,
            cold=True,
            info={"verified": ok},
        )

    # ------------------------------------------------------------------ DCP
    def _dcp(self) -> Any:
        import torch.distributed.checkpoint as dcp

        if not self._dcp_checked:
            probe = os.path.join(self.root, "dcp_probe")
            try:
                dcp.save({"x": torch.zeros(4)}, checkpoint_id=probe)
            except Exception as e:  # older torch: needs a process group
                import torch.distributed as dist

                log(
                    f"dcp.save without a process group failed ({e!r}); initialising gloo, world_size 1"
                )
                store = dist.FileStore(os.path.join(self.root, "dcp_store"), 1)
                dist.init_process_group("gloo", store=store, rank=0, world_size=1)
                self.notes.append("DCP needed a process group: gloo, world_size 1, FileStore")
                dcp.save({"x": torch.zeros(4)}, checkpoint_id=probe)
            remove_path(probe)
            self._dcp_checked = True
        return dcp

    def row_dcp_save(self) -> Row:
        dcp = self._dcp()
        d = self.subdir("dcp_save")

        def run() -> Metrics:
            path = os.path.join(d, f"step{self.next_step()}")
            t0 = perf()
            dcp.save(self.state_dicts(self.model, self.opt), checkpoint_id=path)
            return {"secs": perf() - t0}

        run()
        remove_children(d)
        return Row(
            "dcp_save",
            "DCP save",
            "save",
            run,
            after=lambda: remove_children(d),
            note="fsyncs its files (FileSystemWriter sync_files=True), not the directory; 1 writer thread",
        )

    def row_dcp_async(self) -> Row:
        dcp = self._dcp()
        d = self.subdir("dcp_async")

        def run() -> Metrics:
            path = os.path.join(d, f"step{self.next_step()}")
            t0 = perf()
            response = dcp.async_save(self.state_dicts(self.model, self.opt), checkpoint_id=path)
            stall = perf() - t0
            future = getattr(response, "upload_completion", response)
            future.result()
            return {"secs": perf() - t0, "stall": stall}

        run()
        remove_children(d)
        return Row(
            "dcp_async",
            "DCP async_save",
            "save",
            run,
            after=lambda: remove_children(d),
            note="thread executor, default stager (copies the state to new CPU memory)",
        )

    def dcp_source(self) -> str:
        """The DCP checkpoint the DCP load rows read (saved on first use)."""
        dcp = self._dcp()
        src = os.path.join(self.subdir("restore_dcp"), "ckpt")
        if not os.path.exists(src):
            dcp.save(self.state_dicts(self.model, self.opt), checkpoint_id=src)
        return src

    def row_dcp_load(self) -> Row:
        dcp = self._dcp()
        src = self.dcp_source()

        def load() -> None:
            sd = self.state_dicts(self.fresh_model, self.fresh_opt)
            dcp.load(sd, checkpoint_id=src)
            self.fresh_opt.load_state_dict(sd["optimizer"])

        ok = self.fresh_restored_ok(load)

        def run() -> Metrics:
            t0 = perf()
            load()
            return {"secs": perf() - t0}

        return Row("dcp_load", "DCP load", "restore", run, cold=True, info={"verified": ok})

    # ------------------------------------------------------------------ torchsnapshot
    def row_torchsnapshot(self) -> Row:
        import torchsnapshot

        d = self.subdir("torchsnapshot")
        app_state = {"model": self.model, "optimizer": self.opt}

        def run() -> Metrics:
            path = os.path.join(d, f"step{self.next_step()}")
            t0 = perf()
            torchsnapshot.Snapshot.take(path, app_state)
            take = perf() - t0
            fsync_tree(path)
            return {"secs": perf() - t0, "take": take}

        run()
        remove_children(d)
        return Row(
            "torchsnapshot",
            "torchsnapshot take + fsync",
            "save",
            run,
            after=lambda: remove_children(d),
            note="does not fsync: an fsync of every file is timed after take",
        )

    # ------------------------------------------------------------------ limits
    def row_raw_write(self, request: int, *, arena: bool = False) -> Row:
        """Raw O_DIRECT writes: from the huge-page buffer, or (``arena``) from a pitstop Arena."""
        if arena:
            view, target = self.arena_buffer()
            info = {"huge_bytes": anon_huge_bytes(target.data_ptr())}
            key, label = (
                f"raw_write_{request // MIB}_arena",
                f"raw O_DIRECT write {request // MIB} MiB, pitstop Arena",
            )
        else:
            buf = self.buffer()
            view = buf.view
            info = {"huge_bytes": buf.huge_bytes()}
            key, label = (
                f"raw_write_{request // MIB}",
                f"raw O_DIRECT write {request // MIB} MiB x2 thr",
            )
        path = os.path.join(self.subdir("raw_write"), f"{key}.bin")

        def run() -> Metrics:
            t0 = perf()
            direct = raw_write(path, view, self.file_bytes, request=request, pool=self.pool)
            return {"secs": perf() - t0, "direct_io": float(direct)}

        run()
        remove_path(path)
        note = (
            "4 KiB pages (MADV_HUGEPAGE after MAP_POPULATE), as pitstop's saves write"
            if arena
            else ""
        )
        return Row(key, label, "limit", run, after=lambda: remove_path(path), info=info, note=note)

    def row_memcpy(self) -> Row:
        views = self.buffer().views(self.tensors, self.offsets)

        def run() -> Metrics:
            t0 = perf()
            with torch.no_grad():
                for dst, src in zip(views, self.tensors):
                    dst.copy_(src)
            return {"secs": perf() - t0}

        run()
        return Row("memcpy", "memcpy into reused buffer", "limit", run)

    def row_raw_read(self, request: int, *, arena: bool = False) -> Row:
        """Raw O_DIRECT reads: into the huge-page buffer, or (``arena``) into a pitstop Arena."""
        buf = self.buffer()
        path = os.path.join(self.subdir("restore_raw"), "raw.bin")
        if not os.path.exists(path):
            raw_write(path, buf.view, self.file_bytes, request=64 * MIB, pool=self.pool)
        if arena:
            view, target = self.arena_buffer()
            key = f"raw_read_{request // MIB}_arena"
            label = f"raw O_DIRECT read {request // MIB} MiB, pitstop Arena"
        else:
            view, target = buf.view, buf.tensor
            key = f"raw_read_{request // MIB}"
            label = f"raw O_DIRECT read {request // MIB} MiB x2 thr"
        target.zero_()
        raw_read(path, view, self.file_bytes, request=request, pool=self.pool)
        ok = state_equal(
            [
                target[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                for t, o in zip(self.tensors, self.offsets)
            ],
            self.tensors,
        )

        def run() -> Metrics:
            t0 = perf()
            direct = raw_read(path, view, self.file_bytes, request=request, pool=self.pool)
            return {"secs": perf() - t0, "direct_io": float(direct)}

        info = {"verified": ok, "huge_bytes": anon_huge_bytes(target.data_ptr())}
        note = "4 KiB pages, as pitstop's restore reads" if arena else ""
        return Row(key, label, "limit", run, cold=True, info=info, note=note)

    # ------------------------------------------------------------------ fresh processes
    def digests(self) -> list[str]:
        """sha256 of every saved tensor (``state_tensors`` order), for the children to verify."""
        if self._digests is None:
            self._digests = tensor_digests(self.tensors, self.pool)
        return self._digests

    def forkserver(self) -> Any:
        """The multiprocessing context of the fresh-process rows (``--spawn forkserver``).

        The fork server is a new interpreter (``sys.executable``) that only imports
        FORKSERVER_PRELOAD, single-threaded; every child is forked from it, so it has
        allocated nothing and holds no arena, no manager and no thread of this process.
        """
        if self._mp is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
            from multiprocessing import forkserver

            t0 = perf()
            forkserver.ensure_running()
            first = ctx.Process(target=_noop)  # returns once the server has imported its preload
            first.start()
            first.join()
            log(f"fork server started ({perf() - t0:.1f} s)")
            self._mp = ctx
        return self._mp

    def spawn(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Run ``kind`` in a fresh process; what the child reports."""
        if self.args.spawn == "forkserver":
            return self._spawn_forked(kind, spec)
        return self._spawn_exec(kind, spec)

    def _spawn_forked(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        ctx = self.forkserver()
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child_entry, args=(kind, spec, send), name=f"bench-{kind}")
        proc.start()
        send.close()
        try:
            if not recv.poll(CHILD_TIMEOUT_SECS):
                raise TimeoutError(f"child {kind!r} gave no result in {CHILD_TIMEOUT_SECS} s")
            status, out = recv.recv()
        except (EOFError, TimeoutError) as e:
            proc.kill()
            proc.join()
            raise RuntimeError(f"child {kind!r} failed (exit code {proc.exitcode}): {e!r}") from e
        finally:
            recv.close()
        proc.join()
        if status != "ok":
            raise RuntimeError(f"child {kind!r} failed: {out}")
        return out

    def _spawn_exec(self, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        """``sys.executable save.py --child KIND SPEC.json``: a new interpreter, imports and all."""
        path = os.path.join(self.root, f"child-{kind}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, SCRIPT, "--child", kind, path]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECS)
        lines = p.stdout.strip().splitlines()
        if p.returncode != 0 or not lines:
            tail = " | ".join(p.stderr.strip().splitlines()[-6:])
            raise RuntimeError(f"child {kind!r} exited with {p.returncode}: {tail}")
        return json.loads(lines[-1])

    def row_process(self, kind: str) -> Row:
        """A restore (or the raw read) in a fresh process, page cache dropped in the child.

        The child builds its own restore target (``build_target``: same shapes, other values,
        Adam state touched) or, for the raw read, allocates and prefaults a pitstop Arena, all
        before the timing; drops the page cache; resets VmHWM; times the restore; reports the
        seconds, the peak RSS added (VmHWM after - VmRSS before) and whether the restored
        bytes have the saved sha256 digests.
        """
        spec: dict[str, Any] = {
            "layers": self.args.layers,
            "width": self.args.width,
            "threads": torch.get_num_threads(),
            "state_bytes": self.state_bytes,
        }
        if kind == "raw":
            files = sorted(
                glob.glob(os.path.join(self.pitstop_source(), "step-*", "rank-00000.bin"))
            )
            if not files:
                raise FileNotFoundError("no rank-00000.bin in the pitstop checkpoint")
            spec["path"] = files[-1]
            spec["nbytes"] = os.path.getsize(files[-1])
            spec["request"] = 64 * MIB
            h = hashlib.sha256()
            with open(files[-1], "rb") as f:
                while chunk := f.read(64 * MIB):
                    h.update(chunk)
            spec["sha256"] = h.hexdigest()
        else:
            spec["digests"] = self.digests()
            if kind == "pitstop":
                spec["path"] = self.pitstop_source()
            elif kind == "torch":
                spec["path"] = self.torch_source()
            elif kind == "dcp":
                spec["path"] = self.dcp_source()
                spec["dcp_process_group"] = any("process group" in n for n in self.notes)
            else:
                raise ValueError(kind)
        key, label, note = PROCESS_ROWS[kind]
        info: dict[str, Any] = {}
        if self.args.spawn == "forkserver":
            self.forkserver()  # started now, not inside the first round

        def run() -> Metrics:
            t0 = perf()
            out = self.spawn(kind, spec)
            wall = perf() - t0
            info["verified"] = info.get("verified", True) and bool(out["verified"])
            info["rss_method"] = out["rss_method"]
            if not out["cold"]:
                info["cache"] = "warm"
            return {**out["metrics"], "process_secs": wall}

        return Row(key, label, "restore", run, info=info, note=note, reps=self.args.process_reps)

    def row_saves_process(self) -> Row:
        """Peak RSS of a new manager (default options) doing 3 saves and 3 async_saves.

        Fresh process: builds the state, resets VmHWM, creates the manager, 3 durable
        ``save`` then 3 ``async_save`` issued back to back (as many in flight as the defaults
        allow) and ``wait``. The figure is the peak RSS added / state bytes.
        """
        d = self.subdir("saves_process")
        saves = 3
        spec = {
            "layers": self.args.layers,
            "width": self.args.width,
            "threads": torch.get_num_threads(),
            "state_bytes": self.state_bytes,
            "path": d,
            "saves": saves,
        }
        info: dict[str, Any] = {"saves": 2 * saves}
        if self.args.spawn == "forkserver":
            self.forkserver()

        def run() -> Metrics:
            t0 = perf()
            out = self.spawn("saves", spec)
            info["rss_method"] = out["rss_method"]
            return {**out["metrics"], "process_secs": perf() - t0}

        return Row(
            "pitstop_saves_process",
            f"pitstop {saves} save + {saves} async_save, new proc",
            "memory",
            run,
            after=lambda: remove_children(d),
            info=info,
            note=f"new process, new manager with default options: {saves} durable saves, then "
            f"{saves} async_saves back to back + wait; time is all {2 * saves} saves",
            reps=self.args.process_reps,
        )

    # ------------------------------------------------------------------ run
    def setup(self) -> None:
        a = self.add_row
        a(self.row_pitstop_save, "pitstop_save", "pitstop save (durable)")
        a(
            lambda: self.row_pitstop_save(retain=True),
            "pitstop_save_retain",
            "pitstop save, keep_last=1 deleting previous",
        )
        a(
            lambda: self.row_pitstop_save(nice=0),
            "pitstop_save_nice0",
            "pitstop save, background_nice=0",
        )
        a(lambda: self.row_pitstop_async(True), "pitstop_async", "pitstop async_save")
        a(
            lambda: self.row_pitstop_async(False),
            "pitstop_async_nooverlap",
            "pitstop async_save overlap=False",
        )
        a(self.row_torch_save, "torch_save", "torch.save + fsync")
        a(self.row_dcp_save, "dcp_save", "DCP save")
        a(self.row_dcp_async, "dcp_async", "DCP async_save")
        a(self.row_torchsnapshot, "torchsnapshot", "torchsnapshot take + fsync")
        a(lambda: self.row_raw_write(64 * MIB), "raw_write_64", "raw O_DIRECT write 64 MiB")
        a(lambda: self.row_raw_write(256 * MIB), "raw_write_256", "raw O_DIRECT write 256 MiB")
        a(
            lambda: self.row_raw_write(64 * MIB, arena=True),
            "raw_write_64_arena",
            "raw O_DIRECT write 64 MiB, pitstop Arena",
        )
        a(self.row_memcpy, "memcpy", "memcpy into reused buffer")
        a(self.row_pitstop_restore, "pitstop_restore", "pitstop restore")
        a(self.row_pitstop_restore_fresh, "pitstop_restore_fresh", "pitstop restore (new manager)")
        a(self.row_torch_load, "torch_load", "torch.load")
        a(self.row_dcp_load, "dcp_load", "DCP load")
        a(lambda: self.row_raw_read(64 * MIB), "raw_read_64", "raw O_DIRECT read 64 MiB")
        a(lambda: self.row_raw_read(256 * MIB), "raw_read_256", "raw O_DIRECT read 256 MiB")
        a(
            lambda: self.row_raw_read(64 * MIB, arena=True),
            "raw_read_64_arena",
            "raw O_DIRECT read 64 MiB, pitstop Arena",
        )
        for kind, (key, label, _) in PROCESS_ROWS.items():
            a(lambda kind=kind: self.row_process(kind), key, label)
        a(self.row_saves_process, "pitstop_saves_process", "pitstop saves, new process")

    def measure(self, row: Row, rep: int) -> None:
        if row.skipped:
            return
        os.sync()  # no dirty pages of an earlier method are written during this one
        if row.cold and not drop_caches():
            row.info["cache"] = "warm"
        try:
            with PeakRSS() as rss:
                metrics = row.run()
            metrics.setdefault("rss_added", rss.added)  # a child reports its own
            row.add(metrics)
        except Exception as e:
            row.skipped = f"failed in repetition {rep + 1}: {type(e).__name__}: {e}"
            log(f"  {row.label}: {row.skipped}")
            traceback.print_exc(file=sys.stderr)
        finally:
            if row.after is not None:
                try:
                    row.after()
                except Exception as e:
                    log(f"  {row.label}: cleanup failed: {e!r}")

    def rounds(self) -> None:
        active = [r for r in self.rows if not r.skipped]
        for rep in range(self.args.reps):
            # A fresh order every round (seeded, so runs are comparable): no method always
            # follows the same one, e.g. the first write after a cache drop or a big delete.
            order = random.Random(rep).sample(active, len(active))
            order = [r for r in order if r.reps is None or rep < r.reps]
            self.orders.append([r.key for r in order])
            log(f"round {rep + 1}/{self.args.reps}: {' '.join(r.key for r in order)}")
            for row in order:
                self.measure(row, rep)
                if "secs" in row.samples and not row.skipped:
                    log(f"  {row.key:24s} {row.samples['secs'][-1]:7.3f} s")

    def close(self) -> None:
        for mgr in self.managers:
            try:
                mgr.close()
            except Exception as e:
                log(f"closing {mgr!r} failed: {e!r}")
        self.pool.shutdown(wait=True)
        remove_path(self.root)


# --------------------------------------------------------------------------- report


def _by_key(rows: list[Row]) -> dict[str, Row]:
    return {r.key: r for r in rows if not r.skipped and r.samples.get("secs")}


def _paired(
    a: Row | None,
    b: Row | None,
    fn: Callable[[float, float], float],
    ma: str = "secs",
    mb: str = "secs",
) -> float:
    """Median over rounds of fn(a's sample, b's sample): ratios of measurements taken close in time."""
    if a is None or b is None:
        return math.nan
    xs, ys = a.samples.get(ma, []), b.samples.get(mb, [])
    n = min(len(xs), len(ys))
    return median([fn(xs[i], ys[i]) for i in range(n)]) if n else math.nan


def _best_limit(rows: dict[str, Row], keys: tuple[str, ...]) -> Row | None:
    """The fastest of the limit rows (by median), e.g. the better request size."""
    present = [rows[k] for k in keys if k in rows]
    return min(present, key=lambda r: r.med()) if present else None


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _times(x: float, what: str) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x {what}"


def _check(name: str, value: float, target: str, detail: str) -> dict[str, Any]:
    op, thr = target.split()
    if math.isnan(value):
        status = "SKIP"
    else:
        ok = value >= float(thr) if op == ">=" else value <= float(thr)
        status = "PASS" if ok else "MISS"
    return {"name": name, "value": value, "target": target, "status": status, "detail": detail}


def report(bench: Bench) -> dict[str, Any]:
    nb = bench.state_bytes
    rows = _by_key(bench.rows)
    disk_w = _best_limit(rows, ("raw_write_64", "raw_write_256", "raw_write_64_arena"))
    disk_r = _best_limit(rows, ("raw_read_64", "raw_read_256", "raw_read_64_arena"))
    memcpy = rows.get("memcpy")
    w_gbps = gbps(nb, disk_w.med()) if disk_w else math.nan
    r_gbps = gbps(nb, disk_r.med()) if disk_r else math.nan
    memcpy_secs = memcpy.med() if memcpy else math.nan

    def out(*parts: object) -> None:
        print(*parts, flush=True)

    out()
    out(
        f"state: {bench.args.layers} x Linear({bench.args.width}, {bench.args.width}) + Adam after one step = "
        f"{nb:,} B in {len(bench.tensors)} tensors; {bench.args.reps} repetitions, interleaved; "
        f"restores: page cache {bench.cache_mode}"
    )
    out(
        f"dir: {bench.root} ; torch {torch.__version__} ; threads {torch.get_num_threads()} ; "
        f"python {platform.python_version()}"
    )
    out(
        f"disk limit (best raw O_DIRECT): write {_fmt(w_gbps, '.2f')} GB/s ({disk_w.key if disk_w else '-'}), "
        f"read {_fmt(r_gbps, '.2f')} GB/s ({disk_r.key if disk_r else '-'}); memcpy {_fmt(memcpy_secs)} s "
        f"= {_fmt(gbps(nb, memcpy_secs), '.1f')} GB/s"
    )
    out()
    header = f"{'method':44s} {'median s':>9s} {'min':>7s} {'max':>7s} {'GB/s':>6s}  {'ratio':<18s} {'+RSS/state':>10s}"
    out(header)
    out("-" * len(header))
    for row in bench.rows:
        if row.skipped:
            out(f"{row.label:44s} skipped: {row.skipped}")
            continue
        lines: list[tuple[str, str]] = []
        if (
            "stall" in row.samples
            and row.group == "save"
            and not row.key.startswith("pitstop_save")
        ):
            lines.append((f"{row.label}: stall", "stall"))
            if row.key.startswith("pitstop"):
                lines.append((f"{row.label}: staged", "staged"))
            lines.append((f"{row.label}: committed", "secs"))
        else:
            lines.append((row.label, "secs"))
        for label, metric in lines:
            xs = row.samples[metric]
            med = median(xs)
            rate = gbps(nb, med) if metric == "secs" and row.group != "memory" else math.nan
            if row.group == "memory":
                ratio = f"{row.info.get('saves', '')} saves"
            elif metric != "secs":
                ratio = _times(med / memcpy_secs, "memcpy")
            elif row.group == "restore" or row.key.startswith("raw_read"):
                ratio = _times(rate / r_gbps, "disk read")
            elif row.key == "memcpy":
                ratio = ""
            else:
                ratio = _times(rate / w_gbps, "disk write")
            rss = median(row.samples.get("rss_added", [])) / nb if metric == "secs" else math.nan
            out(
                f"{label:44s} {med:9.3f} {min(xs):7.3f} {max(xs):7.3f} {_fmt(rate, '6.2f'):>6s}  "
                f"{ratio:<18s} {_fmt(rss, '.2f'):>10s}"
            )
    out()
    out(
        "+RSS/state: median peak resident memory added during one repetition / state bytes "
        "(pitstop arenas are allocated in the warm-up, so steady-state saves add ~0; "
        "new-process rows: added in the child, beyond its state, VmHWM reset before)"
    )
    notes = [f"{r.label}: {r.note}" for r in bench.rows if r.note and not r.skipped]
    notes += bench.notes
    if notes:
        out("notes:")
        for n in notes:
            out(f"  - {n}")

    # pitstop breakdown
    out()
    out(
        "pitstop breakdown (medians, s): stall = async_save returned; staged = every byte in the arena;"
    )
    out(
        "  persist = write + commit after staging; committed = call to commit; after = wall - committed"
    )
    for key in (
        "pitstop_save",
        "pitstop_save_nice0",
        "pitstop_save_retain",
        "pitstop_async",
        "pitstop_async_nooverlap",
    ):
        row = rows.get(key)
        if row is None:
            continue
        m = {
            k: row.med(k)
            for k in ("stats_stall", "staged", "persist", "committed", "secs", "after_commit")
        }
        write = gbps(nb, m["persist"])
        direct = "yes" if row.med("direct_io") == 1.0 else "NO"
        out(
            f"  {key:26s} stall {m['stats_stall']:.3f}  staged {m['staged']:.3f}  persist {m['persist']:.3f} "
            f"({write:.2f} GB/s)  committed {m['committed']:.3f}  wall {m['secs']:.3f}  "
            f"after {m['after_commit']:.3f}  O_DIRECT {direct}  warm-up {row.info.get('warmup_secs', math.nan):.2f}"
        )
    a_row = rows.get("pitstop_async")
    rss_info: dict[str, Any] = {}
    if a_row is not None:
        rss_info = {k: a_row.info[k] for k in ("first_save", "two_in_flight") if k in a_row.info}
        for k, v in rss_info.items():
            out(
                f"  RSS {k}: +{v['added_rss'] / 1e9:.3f} GB over the pre-manager baseline, arenas hold "
                f"{v['host_bytes'] / 1e9:.3f} GB -> {v['added_rss_per_state_per_arena']:.3f} x state per arena "
                f"({a_row.info.get('rss_method')})"
            )
    huge = {
        r.key: r.info[k]
        for r in bench.rows
        for k in ("huge_bytes", "arena_huge_bytes")
        if k in r.info
    }
    if huge:
        out(
            "  transparent huge pages backing the buffers (AnonHugePages / file bytes): "
            + ", ".join(f"{k} {v / max(bench.file_bytes, 1):.2f}" for k, v in huge.items())
        )
    for row in bench.rows:
        if "verified" in row.info and not row.info["verified"]:
            out(f"  WARNING: {row.label} did not restore the saved values in the warm-up check")

    phases = phase_report(rows, disk_w, out)

    # ratios and checks
    ps, ts = rows.get("pitstop_save"), rows.get("torch_save")
    pa, da = rows.get("pitstop_async"), rows.get("dcp_async")
    pr = rows.get("pitstop_restore")
    pp, rp = rows.get("pitstop_restore_process"), rows.get("raw_read_process")
    tp, dp = rows.get("torch_load_process"), rows.get("dcp_load_process")
    sp = rows.get("pitstop_saves_process")

    def vs_raw(row: Row | None) -> float:
        return rp.med() / row.med() if rp and row else math.nan

    def peak_mib(row: Row | None) -> float:
        return row.med("rss_added") / MIB if row else math.nan

    ratios = {
        "save_vs_disk": gbps(nb, ps.med()) / w_gbps if ps else math.nan,
        "save_vs_torch_save": ts.med() / ps.med() if ps and ts else math.nan,
        "async_stall_vs_memcpy": pa.med("stall") / memcpy_secs if pa else math.nan,
        "async_stall_vs_dcp_async_stall": pa.med("stall") / da.med("stall")
        if pa and da
        else math.nan,
        "restore_vs_disk": gbps(nb, pr.med()) / r_gbps if pr else math.nan,
        "rss_per_arena": max(
            (v["added_rss_per_state_per_arena"] for v in rss_info.values()), default=math.nan
        ),
        "restore_process_vs_raw": vs_raw(pp),
        "restore_peak_rss_mib": peak_mib(pp),
        "save_peak_rss_x_state": sp.med("rss_x_state") if sp else math.nan,
    }
    paired = {
        "save_vs_disk": _paired(disk_w, ps, lambda a, b: a / b),
        "save_vs_torch_save": _paired(ts, ps, lambda a, b: a / b),
        "async_stall_vs_memcpy": _paired(pa, memcpy, lambda a, b: a / b, "stall", "secs"),
        "async_stall_vs_dcp_async_stall": _paired(pa, da, lambda a, b: a / b, "stall", "stall"),
        "restore_vs_disk": _paired(disk_r, pr, lambda a, b: a / b),
        "restore_process_vs_raw": _paired(rp, pp, lambda a, b: a / b),
        "torch_load_process_vs_raw": _paired(rp, tp, lambda a, b: a / b),
        "dcp_load_process_vs_raw": _paired(rp, dp, lambda a, b: a / b),
    }
    extra = {
        "async_nooverlap_stall_vs_memcpy": (
            rows["pitstop_async_nooverlap"].med("stall") / memcpy_secs
            if "pitstop_async_nooverlap" in rows
            else math.nan
        ),
        "async_nooverlap_stall_vs_dcp_async_stall": (
            rows["pitstop_async_nooverlap"].med("stall") / da.med("stall")
            if "pitstop_async_nooverlap" in rows and da
            else math.nan
        ),
        "async_staged_vs_memcpy": pa.med("staged") / memcpy_secs if pa else math.nan,
        "async_committed_vs_disk": gbps(nb, pa.med()) / w_gbps if pa else math.nan,
        "restore_new_manager_vs_disk": (
            gbps(nb, rows["pitstop_restore_fresh"].med()) / r_gbps
            if "pitstop_restore_fresh" in rows
            else math.nan
        ),
        "save_vs_raw_write_from_pitstop_arena": (
            rows["raw_write_64_arena"].med() / ps.med()
            if ps and "raw_write_64_arena" in rows
            else math.nan
        ),
        "raw_arena_vs_raw_hugepage_buffer": (
            rows["raw_write_64"].med() / rows["raw_write_64_arena"].med()
            if "raw_write_64" in rows and "raw_write_64_arena" in rows
            else math.nan
        ),
        "restore_vs_raw_read_into_pitstop_arena": (
            rows["raw_read_64_arena"].med() / pr.med()
            if pr and "raw_read_64_arena" in rows
            else math.nan
        ),
        "raw_read_arena_vs_raw_read_hugepage_buffer": (
            rows["raw_read_64"].med() / rows["raw_read_64_arena"].med()
            if "raw_read_64" in rows and "raw_read_64_arena" in rows
            else math.nan
        ),
        "save_background_nice0_vs_disk": (
            gbps(nb, rows["pitstop_save_nice0"].med()) / w_gbps
            if "pitstop_save_nice0" in rows
            else math.nan
        ),
        "save_keep_last_retention_secs": (
            rows["pitstop_save_retain"].med("after_commit")
            if "pitstop_save_retain" in rows
            else math.nan
        ),
        "save_keep_last_vs_save_time": (
            rows["pitstop_save_retain"].med() / ps.med()
            if ps and "pitstop_save_retain" in rows
            else math.nan
        ),
        "save_vs_dcp_save": rows["dcp_save"].med() / ps.med()
        if ps and "dcp_save" in rows
        else math.nan,
        "restore_vs_torch_load": rows["torch_load"].med() / pr.med()
        if pr and "torch_load" in rows
        else math.nan,
        "restore_vs_dcp_load": rows["dcp_load"].med() / pr.med()
        if pr and "dcp_load" in rows
        else math.nan,
        "torch_load_process_vs_raw": vs_raw(tp),
        "dcp_load_process_vs_raw": vs_raw(dp),
        "restore_process_vs_torch_load_process": tp.med() / pp.med() if pp and tp else math.nan,
        "restore_process_vs_dcp_load_process": dp.med() / pp.med() if pp and dp else math.nan,
        "restore_process_vs_raw_in_process": (gbps(nb, pp.med()) / r_gbps if pp else math.nan),
        "torch_load_peak_rss_mib": peak_mib(tp),
        "dcp_load_peak_rss_mib": peak_mib(dp),
        "raw_read_process_peak_rss_mib": peak_mib(rp),
        "save_peak_rss_x_state_sync_saves": sp.med("sync_rss_x_state") if sp else math.nan,
        "save_host_bytes_x_state": sp.med("host_x_state") if sp else math.nan,
    }
    details = {
        "save_vs_disk": f"pitstop save {_fmt(gbps(nb, ps.med()) if ps else math.nan, '.2f')} GB/s vs raw "
        f"O_DIRECT write {_fmt(w_gbps, '.2f')} GB/s",
        "save_vs_torch_save": f"pitstop save {_fmt(ps.med() if ps else math.nan)} s vs torch.save + fsync "
        f"{_fmt(ts.med() if ts else math.nan)} s",
        "async_stall_vs_memcpy": f"async_save stall {_fmt(pa.med('stall') if pa else math.nan, '.4f')} s vs "
        f"memcpy {_fmt(memcpy_secs, '.4f')} s",
        "async_stall_vs_dcp_async_stall": f"async_save stall {_fmt(pa.med('stall') if pa else math.nan, '.4f')} s "
        f"vs DCP async_save stall {_fmt(da.med('stall') if da else math.nan, '.4f')} s",
        "restore_vs_disk": f"pitstop restore ({bench.cache_mode.split()[0]}) "
        f"{_fmt(gbps(nb, pr.med()) if pr else math.nan, '.2f')} GB/s vs raw O_DIRECT read {_fmt(r_gbps, '.2f')} GB/s",
        "rss_per_arena": "peak RSS added by the async manager (arena allocation + saves), per arena, / state bytes",
        "restore_process_vs_raw": f"pitstop restore in a new process {_fmt(pp.med() if pp else math.nan)} s "
        f"vs raw O_DIRECT read into a prefaulted Arena in a new process {_fmt(rp.med() if rp else math.nan)} s",
        "restore_peak_rss_mib": "peak RSS added by a restore in a new process (manager creation "
        "included), beyond the state, MiB",
        "save_peak_rss_x_state": "peak RSS added by a new manager's 3 saves + 3 async_saves "
        "(default options, new process) / state bytes",
    }
    checks = [_check(k, ratios[k], TARGETS[k], details[k]) for k in TARGETS]
    out()
    out("target checks (ratio of medians; in brackets: median of per-round paired ratios)")
    for c in checks:
        p = paired.get(c["name"], math.nan)
        out(
            f"{c['status']} {c['name']:32s} {_fmt(c['value'], '.3f'):>7s} (target {c['target']}; "
            f"paired {_fmt(p, '.3f')})  {c['detail']}"
        )
    out("INFO (not targets):")
    for k, v in extra.items():
        out(f"  {k:44s} {_fmt(v, '.3f')}")

    summary = {
        "restore_process_vs_raw": ratios["restore_process_vs_raw"],
        "torch_load_process_vs_raw": extra["torch_load_process_vs_raw"],
        "dcp_load_process_vs_raw": extra["dcp_load_process_vs_raw"],
        "restore_peak_rss_mib": ratios["restore_peak_rss_mib"],
        "save_peak_rss_x_state": ratios["save_peak_rss_x_state"],
    }
    out()
    out("fresh process (page cache dropped in the child; raw seconds / method seconds, medians):")
    out(
        f"restore in a fresh process vs raw O_DIRECT read: {_fmt(summary['restore_process_vs_raw'], '.2f')} x (target >= 0.9)"
    )
    out(
        f"torch.load in a fresh process vs raw O_DIRECT read: {_fmt(summary['torch_load_process_vs_raw'], '.2f')} x"
    )
    out(
        f"DCP load in a fresh process vs raw O_DIRECT read: {_fmt(summary['dcp_load_process_vs_raw'], '.2f')} x"
    )
    out(
        f"peak RSS added by restore: {_fmt(summary['restore_peak_rss_mib'], '.0f')} MiB (target <= 256 MiB beyond the state; "
        f"torch.load {_fmt(extra['torch_load_peak_rss_mib'], '.0f')} MiB, DCP {_fmt(extra['dcp_load_peak_rss_mib'], '.0f')} MiB, "
        f"state {nb / MIB:.0f} MiB)"
    )
    out(
        f"peak RSS added by saves: {_fmt(summary['save_peak_rss_x_state'], '.2f')} x state (target <= 1.1; "
        f"3 durable saves alone {_fmt(extra['save_peak_rss_x_state_sync_saves'], '.2f')} x, "
        f"arenas held {_fmt(extra['save_host_bytes_x_state'], '.2f')} x)"
    )

    return {
        **summary,
        "config": {
            "layers": bench.args.layers,
            "width": bench.args.width,
            "reps": bench.args.reps,
            "quick": bench.args.quick,
            "state_bytes": nb,
            "file_bytes": bench.file_bytes,
            "tensors": len(bench.tensors),
            "cache": bench.cache_mode,
            "dir": bench.root,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "rss_method": PeakRSS().method,
            "process_reps": bench.args.process_reps,
            "spawn": bench.args.spawn,
        },
        "limits": {
            "disk_write_gbps": w_gbps,
            "disk_write_row": disk_w.key if disk_w else None,
            "disk_read_gbps": r_gbps,
            "disk_read_row": disk_r.key if disk_r else None,
            "memcpy_secs": memcpy_secs,
            "memcpy_gbps": gbps(nb, memcpy_secs),
        },
        "rows": {
            r.key: {
                "label": r.label,
                "group": r.group,
                "note": r.note,
                "skipped": r.skipped,
                "median": {k: median(v) for k, v in r.samples.items()},
                "gbps": gbps(nb, r.med())
                if r.samples.get("secs") and r.group != "memory"
                else None,
                "samples": r.samples,
                "info": r.info,
            }
            for r in bench.rows
        },
        "orders": bench.orders,
        "phases": phases,
        "ratios": ratios,
        "paired_ratios": paired,
        "extra_ratios": extra,
        "checks": checks,
        "notes": notes,
    }


def phase_report(
    rows: dict[str, Row], disk_w: Row | None, out: Callable[..., None]
) -> dict[str, dict[str, float]]:
    """Where the time of a durable save and of a fresh-process restore goes (medians of the
    PhaseClock metrics), beside the raw O_DIRECT write and read of the same bytes. Returns
    the figures printed."""
    result: dict[str, dict[str, float]] = {}

    def med(row: Row, key: str) -> float:
        return row.med(key) if row.samples.get(key) else math.nan

    def line(label: str, secs: float, note: str = "") -> None:
        out(f"    {label:46s} {_fmt(secs):>7s}  {note}")

    ps, rp, pp = (
        rows.get("pitstop_save"),
        rows.get("raw_read_process"),
        rows.get("pitstop_restore_process"),
    )
    out()
    out("where the time goes (medians, s; 'thread-s': summed over threads working at once)")
    if ps is not None and ps.samples.get("ph_pwrite_thr"):
        m = {k[3:]: med(ps, k) for k in ps.samples if k.startswith("ph_")}
        m.update({k: med(ps, k) for k in ("secs", "stats_stall", "staged", "after_commit")})
        m["raw_write"] = disk_w.med() if disk_w else math.nan
        first, last = m["pwrite_thr_first"], m["pwrite_thr_last"]
        result["save"] = m
        out(f"  pitstop save {_fmt(m['secs'])} s vs raw O_DIRECT write {_fmt(m['raw_write'])} s "
            f"({disk_w.key if disk_w else '-'})")  # fmt: skip
        line("until the first data byte is written", first,
             "= plan + eager copy (stall) + objects encode + dir prepare + copy of 1st extent")  # fmt: skip
        line("  plan + eager copy (returned from async part)", m["stats_stall"])
        line("  objects file encoded", m.get("objects_encode", math.nan))
        line("  step directory prepared", m.get("dir_prepare", math.nan))
        line("data written (first pwrite start -> last end)", last - first,
             f"vs raw {_fmt(m['raw_write'])}")  # fmt: skip
        line("  every byte copied into the arena at", m["staged"], "(from the call)")
        line("  pwrite, thread-s", m.get("pwrite_thr", math.nan))
        line("  hashing, thread-s", m.get("hash_thr", math.nan))
        line("  writers waiting for the copy, thread-s", m.get("wait_copy_thr", math.nan))
        line("after the last data byte", m["secs"] - last, "= the rest below")
        line("  fsyncs (data, objects, manifest, dirs), total", m.get("fsync_all", math.nan))
        line("  objects file written + fsync", m.get("objects_file", math.nan))
        line("  manifest built + checked", m.get("manifest_build", math.nan))
        line(
            "  manifest committed (write, fsync, link, dir fsyncs)",
            m.get("manifest_commit", math.nan),
        )
        line("  after commit (retention, return)", m["after_commit"])
        n0 = rows.get("pitstop_save_nice0")
        if n0 is not None:
            m["nice0"] = n0.med()
            for k in ("pwrite_thr_first", "pwrite_thr_last"):
                m[f"nice0_{k}"] = med(n0, f"ph_{k}")
            line("the same save, writer threads not niced", m["nice0"],
                 f"(background_nice=0; first byte at {_fmt(m['nice0_pwrite_thr_first'])}, "
                 f"data written in {_fmt(m['nice0_pwrite_thr_last'] - m['nice0_pwrite_thr_first'])})")  # fmt: skip
    if pp is not None and pp.samples.get("ph_pread_thr"):
        m = {k[3:]: med(pp, k) for k in pp.samples if k.startswith("ph_")}
        m["secs"] = pp.med()
        m["raw_read"] = rp.med() if rp else math.nan
        result["restore_process"] = m
        first, last = m["pread_thr_first"], m["pread_thr_last"]
        out(f"  pitstop restore in a new process {_fmt(m['secs'])} s vs raw O_DIRECT read "
            f"{_fmt(m['raw_read'])} s (new process, prefaulted buffer)")  # fmt: skip
        line("manager created", m["manager"])
        line("catalog: list, manifest read + verified, locks", m["restore"] - m["load_entry"])
        line("sizes checked", m.get("check_sizes", math.nan))
        line("objects file read + verified", m.get("objects_read", math.nan))
        line("state paired with the checkpoint (plan)", m.get("plan_restore", math.nan))
        line("landing prepared", m.get("landing", math.nan))
        line("reader threads started", m.get("read_buffers", math.nan))
        line("first read issued at (from the manager's creation)", first)
        line("data read (first pread start -> last end)", last - first,
             f"vs raw {_fmt(m['raw_read'])}")  # fmt: skip
        line("  read buffers first touched, thread-s", m.get("buffer_touch_thr", math.nan))
        line("  pread, thread-s", m.get("pread_thr", math.nan))
        line("  hashing, thread-s", m.get("hash_thr", math.nan))
        line("  copy into the live tensors, thread-s", m.get("copy_thr", math.nan))
        line("after the last read (hash, copy, apply)", m["secs"] - last)
        line("  state loaded (load_state_dict & co.)", m.get("apply", math.nan))
    return result


# --------------------------------------------------------------------------- children


def _child_restore(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One restore of ``kind`` in this (fresh) process; see ``Bench.row_process``."""
    t_start = perf()
    import pitstop

    pool = ThreadPoolExecutor(2, thread_name_prefix="child-io")
    managers: list[Any] = []
    restore: Callable[[], Metrics]
    if kind == "raw":
        from pitstop.io.arena import Arena

        nbytes = spec["nbytes"]
        arena = Arena(nbytes)  # allocated and prefaulted before the timing

        def restore() -> Metrics:
            direct = raw_read(spec["path"], arena.view, nbytes, request=spec["request"], pool=pool)
            return {"direct_io": float(direct)}

        def verify() -> bool:
            return hashlib.sha256(arena.view[:nbytes]).hexdigest() == spec["sha256"]

    else:
        model, opt = build_target(spec["layers"], spec["width"], seed=1)
        state = {"model": model, "optimizer": opt}
        if kind == "pitstop":

            def restore() -> Metrics:
                with PhaseClock(RESTORE_PHASES) as clock:
                    mgr = pitstop.CheckpointManager(spec["path"])
                    managers.append(mgr)
                    t1 = perf()
                    if mgr.restore(state) is None:
                        raise RuntimeError(f"nothing to restore in {spec['path']}")
                return {**clock.metrics(), "ph_manager": t1 - clock.t0, "ph_restore": perf() - t1}

        elif kind == "torch":

            def restore() -> Metrics:
                sd = torch.load(spec["path"], map_location="cpu", weights_only=True)
                model.load_state_dict(sd["model"])
                opt.load_state_dict(sd["optimizer"])
                return {}

        elif kind == "dcp":
            import torch.distributed.checkpoint as dcp

            if spec.get("dcp_process_group"):  # as the parent needed (older torch)
                import torch.distributed as dist

                store_path = os.path.join(os.path.dirname(spec["path"]), f"store-{os.getpid()}")
                store = dist.FileStore(store_path, 1)
                dist.init_process_group("gloo", store=store, rank=0, world_size=1)

            def restore() -> Metrics:
                sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                dcp.load(sd, checkpoint_id=spec["path"])
                opt.load_state_dict(sd["optimizer"])
                return {}

        else:
            raise ValueError(f"unknown child kind {kind!r}")

        def verify() -> bool:
            return tensor_digests(state_tensors(model, opt), pool) == spec["digests"]

    t_drop = perf()
    cold = drop_caches()
    with PeakRSS() as rss:
        t0 = perf()
        metrics = restore()
        secs = perf() - t0
    for mgr in managers:
        mgr.close()
    t1 = perf()
    verified = verify()
    timings = {
        "setup_secs": t_drop - t_start,
        "drop_secs": t0 - t_drop,
        "verify_secs": perf() - t1,
    }
    return {
        "metrics": {"secs": secs, "rss_added": rss.added, **metrics, **timings},
        "verified": verified,
        "cold": cold,
        "rss_method": rss.method,
    }


def _child_saves(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS of a new manager's saves in this (fresh) process; see ``Bench.row_saves_process``."""
    import pitstop

    model, opt = build_state(spec["layers"], spec["width"], seed=2)
    state = {"model": model, "optimizer": opt}
    n = spec["saves"]
    with PeakRSS() as rss:
        t0 = perf()
        mgr = pitstop.CheckpointManager(spec["path"])
        for step in range(n):
            mgr.save(step, state)
        t1 = perf()
        # peak so far (VmHWM was reset on entry; the sampled peak otherwise)
        sync_peak = max(hwm_bytes(), rss_bytes()) if rss.method == "VmHWM" else rss.peak
        handles = [mgr.async_save(step, state) for step in range(n, 2 * n)]
        mgr.wait()
        t2 = perf()
        host_bytes = mgr.host_bytes
    mgr.close()
    nb = spec["state_bytes"]
    return {
        "metrics": {
            "secs": t2 - t0,
            "sync_secs": t1 - t0,
            "async_secs": t2 - t1,
            "async_stall_max": max(h.stats.stall_secs for h in handles),
            "rss_added": rss.added,
            "rss_x_state": rss.added / nb,
            "sync_rss_added": sync_peak - rss.start,
            "sync_rss_x_state": (sync_peak - rss.start) / nb,
            "host_bytes": host_bytes,
            "host_x_state": host_bytes / nb,
        },
        "rss_method": rss.method,
    }


def _child_run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = _child_saves(spec) if kind == "saves" else _child_restore(kind, spec)
    out["pid"] = os.getpid()
    return out


def _noop() -> None:
    pass


def _child_entry(kind: str, spec: dict[str, Any], conn: Any) -> None:
    """A child forked from the fork server: sends ("ok", result) or ("error", traceback)."""
    try:
        conn.send(("ok", _child_run(kind, spec)))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def child_main(kind: str, spec_path: str) -> int:
    """``--child KIND SPEC.json`` (``--spawn exec``): the result as one JSON line on stdout."""
    with open(spec_path) as f:
        spec = json.load(f)
    print(json_line(_child_run(kind, spec)), flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 24; --quick 3)")
    p.add_argument("--width", type=int, default=None, help="features per layer (default 2048)")
    p.add_argument(
        "--reps", type=int, default=None, help="repetitions per method (default 5; --quick 3)"
    )
    p.add_argument("--quick", action="store_true", help="~150 MB state, 3 repetitions")
    p.add_argument(
        "--dir",
        default=None,
        help="parent directory of the scratch directory (default: the temp dir)",
    )
    p.add_argument("--only", default=None, help="comma-separated row keys to run (default: all)")
    p.add_argument(
        "--process-reps",
        type=int,
        default=None,
        help="repetitions of the fresh-process rows, in the first rounds (default: --reps)",
    )
    p.add_argument(
        "--spawn",
        choices=("forkserver", "exec"),
        default="forkserver",
        help="how the fresh processes start: forked from a fork server that has imported torch "
        "(default), or a new interpreter each (exec; ~3 s of imports per child)",
    )
    args = p.parse_args(argv)
    args.layers = args.layers or (3 if args.quick else 24)
    args.width = args.width or 2048
    args.reps = args.reps or (3 if args.quick else 5)
    args.process_reps = min(
        args.reps if args.process_reps is None else args.process_reps, args.reps
    )
    args.only = set(args.only.split(",")) if args.only else None
    if args.layers < 1 or args.width < 1 or args.reps < 1 or args.process_reps < 1:
        p.error("--layers, --width, --reps and --process-reps must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        if len(argv) != 3:
            raise SystemExit("usage: save.py --child KIND SPEC.json")
        rc = child_main(argv[1], argv[2])
        sys.stderr.flush()
        os._exit(rc)  # skips interpreter teardown (~0.8 s with torch), untimed anyway
    args = parse_args(argv)
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    bench = Bench(args)
    try:
        bench.setup()
        bench.rounds()
        result = report(bench)
    finally:
        bench.close()
    print(json_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
