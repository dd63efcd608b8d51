"""``pitstop bench``: what checkpoints cost on this machine, measured on the same bytes.

Rows, run interleaved round by round (the disk's speed drifts, so only same-round
ratios mean much): raw O_DIRECT write and read of the state's bytes from one aligned
buffer (the disk's limit), pitstop ``save`` (durable), ``async_save`` (stall and time to
commit), ``restore`` (page cache dropped first where permitted), and ``torch.save`` +
fsync. It prints a table and can write a profile JSON that ``pitstop simulate
--profile`` reads (``stall_secs``, ``persist_secs``, ...).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent, read_file, write_file
from pitstop.manager import CheckpointManager

__all__ = ["BenchResult", "drop_caches", "run_bench"]

_RAW_CHUNK = 64 << 20


@dataclass
class BenchResult:
    state_bytes: int
    cache: str
    rows: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        values = self.rows.get(name) or [float("nan")]
        return statistics.median(values)

    def gbps(self, name: str) -> float:
        return self.state_bytes / self.median(name) / 1e9

    def profile(self) -> dict[str, Any]:
        return {
            "state_bytes": self.state_bytes,
            "stall_secs": self.median("async_save stall"),
            "persist_secs": self.median("async_save commit") - self.median("async_save stall"),
            "save_secs": self.median("pitstop save"),
            "restore_secs": self.median("pitstop restore"),
            "write_gbps": self.gbps("raw O_DIRECT write"),
            "read_gbps": self.gbps("raw O_DIRECT read"),
            "cache": self.cache,
        }


def _build(nbytes: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear(2048, 2048) layers + Adam after one step: about 50 MB of state per layer."""
    per_layer = 3 * (2048 * 2048 + 2048) * 4
    layers = max(1, round(nbytes / per_layer))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    return model, opt


def drop_caches() -> bool:
    """sync + drop the page cache (needs root). False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"\rbench: {msg:60}", end="", file=sys.stderr, flush=True)


def run_bench(
    directory: str | None, size_bytes: int, reps: int, *, progress: bool | None = None
) -> BenchResult:
    progress = sys.stderr.isatty() if progress is None else progress
    root = directory or tempfile.mkdtemp(prefix="pitstop-bench-", dir=os.getcwd())
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=root)
    try:
        return _run(work, size_bytes, reps, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
        if progress:
            print(file=sys.stderr)


def _run(work: str, size_bytes: int, reps: int, progress: bool) -> BenchResult:
    _say("building the state", progress)
    model, opt = _build(size_bytes)
    state = {"model": model, "optimizer": opt}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    cold = drop_caches()
    result = BenchResult(state_bytes=nbytes, cache="cold" if cold else "warm (cannot drop caches)")
    raw = Arena(nbytes)
    torch.frombuffer(raw.view, dtype=torch.uint8).fill_(7)
    extents = [Extent(s, min(s + _RAW_CHUNK, raw.nbytes)) for s in range(0, raw.nbytes, _RAW_CHUNK)]
    pool = ThreadPoolExecutor(2, thread_name_prefix="pitstop-bench")
    raw_path = os.path.join(work, "raw.bin")
    mgr = CheckpointManager(os.path.join(work, "ckpts"), keep_last=1)
    step = [0]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    def raw_write() -> float:
        fresh = raw_path + ".new"  # a new file each time, as every checkpoint is
        secs = write_file(fresh, raw.view, extents, pool=pool).secs
        os.replace(fresh, raw_path)  # the old one is freed after the timing
        return secs

    def raw_read() -> float:
        if cold:
            drop_caches()
        return read_file(raw_path, raw.view, extents, pool=pool).secs

    def save() -> float:
        t0 = time.perf_counter()
        mgr.save(next_step(), state)
        return time.perf_counter() - t0

    def async_save() -> float:
        t0 = time.perf_counter()
        handle = mgr.async_save(next_step(), state)
        result.rows.setdefault("async_save stall", []).append(time.perf_counter() - t0)
        handle.wait()
        return time.perf_counter() - t0

    def restore() -> float:
        mgr.wait()
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        mgr.restore(state)
        return time.perf_counter() - t0

    def torch_save() -> float:
        path = os.path.join(work, "torch.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        secs = time.perf_counter() - t0
        os.unlink(path)
        return secs

    rows: dict[str, Callable[[], float]] = {
        "raw O_DIRECT write": raw_write,
        "raw O_DIRECT read": raw_read,
        "pitstop save": save,
        "async_save commit": async_save,
        "pitstop restore": restore,
        "torch.save + fsync": torch_save,
    }
    try:
        _say("warm-up (allocates the arena once)", progress)
        raw_write()
        save()
        for r in range(reps):
            for i, (name, fn) in enumerate(rows.items()):
                _say(f"round {r + 1}/{reps}: {name} ({i + 1}/{len(rows)})", progress)
                result.rows.setdefault(name, []).append(fn())
    finally:
        mgr.close()
        pool.shutdown()
        raw.close()
    return result


def print_report(result: BenchResult) -> None:
    n = result.state_bytes
    print(f"state: {n / 1e9:.2f} GB (Linear layers + Adam); page cache for reads: {result.cache}")
    print(f"{'method':22} {'median s':>9} {'GB/s':>6}  ratio")
    limits = {
        "write": result.median("raw O_DIRECT write"),
        "read": result.median("raw O_DIRECT read"),
    }
    for name in ("raw O_DIRECT write", "pitstop save", "async_save commit", "torch.save + fsync",
                 "raw O_DIRECT read", "pitstop restore"):  # fmt: skip
        secs = result.median(name)
        kind = "read" if "read" in name or "restore" in name else "write"
        ratio = limits[kind] / secs if secs > 0 else float("nan")
        print(f"{name:22} {secs:9.3f} {n / secs / 1e9:6.2f}  {ratio:.2f}x the disk's {kind} limit")
    stall = result.median("async_save stall")
    print(
        f"{'async_save stall':22} {stall:9.4f}        (the training loop is blocked only this long)"
    )
    print(
        f"\nsave is {result.median('torch.save + fsync') / result.median('pitstop save'):.1f}x faster than torch.save + fsync"
    )


def write_profile(result: BenchResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result.profile(), f, indent=1)
