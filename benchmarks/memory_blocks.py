"""The memory level's building blocks, timed against a plain memcpy of the same bytes.

    python benchmarks/memory_blocks.py            # 512 MiB of state, 7 rounds
    python benchmarks/memory_blocks.py --quick    # 512 MiB, 3 rounds (under a minute)

One run, interleaved rounds (this machine's speed drifts: compare within a run, as
ratios). The state is ``--mib`` MiB of float32 tensors (16 of them). Per round:

* ``memcpy``: ``dst.copy_(src)`` of every tensor into a reused, already-touched anonymous
  buffer laid out as the data file: the floor of any staging.
* ``stage arena``: the engine's ``stage`` into a pre-faulted anonymous ``Arena`` (what the
  saver does today).
* ``stage slot``: the same ``stage`` into a shared-memory slot (``levels.shm``; the slot is
  the memory checkpoint, no second copy), plus ``slots.staged`` (record and objects).
* ``seal``: hashing every segment and writing the manifest (the keeper's work, not the
  training process's), 2 hash threads.
* ``read memcpy``: copying the slot's data back into live tensors (no verification): the
  "plain memcpy of the state" the restore rows are compared with.
* ``restore memory``: ``restore_from_memory`` through a fresh ``SlotStorage`` (what a
  restarted process runs: map the slots, scan, pin, recover + ``load_entry``): every
  checksum verified in place in the slot, the bytes copied straight into the live tensors.
* ``restore buffered``: the same call through a SlotStorage whose reader hides its
  in-place view (``data_view``), so the engine reads through its read buffers (a copy),
  hashes there, then copies into the tensors: the restore before the in-place path.
* ``verify+copy direct``: hash each segment in the slot and copy it to its tensor, two
  threads, nothing else (no catalog, no pins, no mapping): the floor of a verified restore.
* ``restore disk``: ``pitstop.load`` of the same step persisted to a local directory by
  ``keeper.persist_slot`` (page cache warm).

Prints medians and ratios, then a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch

import pitstop
from pitstop.engine.persist import encode_objects
from pitstop.engine.stage import arena_tensor, stage
from pitstop.format.checksum import get_checksum, segments
from pitstop.io.arena import Arena
from pitstop.levels.keeper import persist_slot, start_keeper
from pitstop.levels.memory import SlotStorage, plan_state, record_for, restore_from_memory
from pitstop.levels.shm import DATA_OFFSET, SHM_DIR, SlotSet, new_job_token, seal
from pitstop.storage.base import DataReader
from pitstop.storage.local import LocalStorage

_RESTORES = ("restore memory", "restore buffered", "verify+copy direct", "restore disk")


def _state(mib: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    n = 16
    per = mib * (1 << 20) // 4 // n
    return {"w": {f"t{i:02d}": torch.randn(per, generator=g) for i in range(n)}}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def _timed(
    fn: Callable[[], object], cpu: dict[str, list[float]] | None = None, name: str = ""
) -> float:
    c0, t0 = _cpu(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    if cpu is not None:
        cpu.setdefault(name, []).append(_cpu() - c0)
    return wall


def keeper_run(b: Bench) -> dict[str, float]:
    """The real keeper: seal four snapshots (the first of each slot maps it), persist the
    last one to a local directory; its RSS."""
    keeper = start_keeper(b.job, next_dir=b.root)
    try:
        seals = []
        for _ in range(4):
            b.stage_slot()
            t0 = time.perf_counter()
            keeper.request_seal(b.slot.index)
            keeper.wait_for("sealed", step=b.step, timeout=120)
            seals.append(time.perf_counter() - t0)
        keeper.request_persist(b.slot.index)
        done = keeper.wait_for("persisted", step=b.step, timeout=300)
        with open(f"/proc/{keeper.pid}/status") as f:
            status = f.read()
        rss = {
            line.split(":")[0]: int(line.split()[1]) * 1024
            for line in status.splitlines()
            if line.startswith(("VmRSS", "RssAnon", "RssShmem"))
        }
        return {
            "seal_first_secs": seals[0],
            "seal_secs": statistics.median(seals[2:]),
            "persist_secs": done["secs"],
            **{f"keeper_{k}": v for k, v in rss.items()},
        }
    finally:
        keeper.stop(unlink=False)
        shutil.rmtree(b.root, ignore_errors=True)


class _Reader:
    """A slot's reader without its ``data_view`` hook: the engine's buffered path."""

    direct = False

    def __init__(self, inner: DataReader) -> None:
        self._inner = inner

    def read_into(self, offset: int, out: memoryview) -> int:
        return self._inner.read_into(offset, out)

    def close(self) -> None:
        self._inner.close()


class BufferedSlotStorage(SlotStorage):
    """A SlotStorage whose data files are read through the engine's read buffers."""

    def open_data(self, directory: str, name: str) -> Any:
        return _Reader(super().open_data(directory, name))


class Bench:
    """The state, its slots, arena and target tensors; one method per timed operation."""

    def __init__(self, mib: int) -> None:
        self.state = _state(mib)
        self.into = {"w": {k: torch.empty_like(v) for k, v in self.state["w"].items()}}
        self.flat, self.plan = plan_state(self.state)
        self.nbytes = self.plan.file_bytes
        self.job = "bench" + new_job_token()
        self.slots = SlotSet.create(self.job, data_bytes=self.nbytes)
        self.arena = Arena(self.nbytes)
        self.abuf = arena_tensor(self.arena)
        self.copier = ThreadPoolExecutor(1)
        self.hashers = ThreadPoolExecutor(2)
        self.root = tempfile.mkdtemp(prefix="pitstop-memlevel-")
        self.items = list(self.plan.items)
        self.srcs = [self.flat.tensors[it.key] for it in self.items]
        self.dsts = [self.into["w"][it.key.rsplit("/", 1)[-1]] for it in self.items]
        self.views = [
            self.abuf[it.offset : it.offset + it.nbytes].view(torch.float32) for it in self.items
        ]
        self.objects = encode_objects(self.flat.tree, rank=0)
        self.slot: Any = None
        self.step = 0
        self.staged_secs: list[float] = []
        self.hash = get_checksum("xxh3_64")

    def close(self) -> None:
        self.slots.close(unlink=True)
        self.arena.close()
        self.copier.shutdown()
        self.hashers.shutdown()
        shutil.rmtree(self.root, ignore_errors=True)

    def memcpy(self) -> None:
        for dst, src in zip(self.views, self.srcs, strict=True):
            dst.copy_(src)

    def stage_arena(self) -> None:
        stage(self.flat, self.plan, self.abuf, overlap=False, copier=self.copier).wait_copied()

    def stage_slot(self) -> None:
        self.step += 1
        slot = self.slots.begin(self.step)
        assert slot is not None
        buf = arena_tensor(cast(Any, slot))  # a Slot is arena-like
        stage(self.flat, self.plan, buf, overlap=False, copier=self.copier).wait_copied()
        t0 = time.perf_counter()
        self.slots.staged(slot, record_for(self.plan, self.step), self.objects, self.nbytes)
        self.staged_secs.append(time.perf_counter() - t0)
        self.slot = slot

    def seal(self) -> None:
        assert seal(self.slot, pool=self.hashers) is not None

    def read_memcpy(self) -> None:
        data = self.slot.view
        for it, dst in zip(self.items, self.dsts, strict=True):
            piece = data[it.offset : it.offset + it.nbytes]
            dst.view(-1).view(torch.uint8).copy_(torch.frombuffer(piece, dtype=torch.uint8))

    def restore_memory(self, kind: type[SlotStorage] = SlotStorage) -> None:
        with kind(SHM_DIR, self.job) as storage:
            result = restore_from_memory(storage, self.into)
        assert result.step == self.step, result

    def restore_buffered(self) -> None:
        self.restore_memory(BufferedSlotStorage)

    def direct(self) -> None:
        data = self.slot.view

        def one(k: int) -> None:
            it, dst = self.items[k], self.dsts[k].view(-1).view(torch.uint8)
            for a, n in segments(it.offset, it.nbytes, self.plan.segment_bytes):
                piece = data[a : a + n]
                self.hash(piece)
                dst[a - it.offset : a - it.offset + n].copy_(
                    torch.frombuffer(piece, dtype=torch.uint8)
                )

        list(self.hashers.map(one, range(len(self.items))))

    def restore_disk(self) -> None:
        assert pitstop.load(self.root, self.into, step=self.step) == self.step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    b = Bench(args.mib)
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    stages = [("memcpy", b.memcpy), ("stage arena", b.stage_arena), ("stage slot", b.stage_slot)]
    reads = [("read memcpy", b.read_memcpy), ("restore memory", b.restore_memory),
             ("restore buffered", b.restore_buffered), ("verify+copy direct", b.direct)]  # fmt: skip
    try:
        for r in range(rounds):
            for name, fn in stages if r % 2 == 0 else stages[::-1]:
                times.setdefault(name, []).append(_timed(fn, cpu, name))
            times.setdefault("seal", []).append(_timed(b.seal))
            for name, fn in reads if r % 2 == 0 else reads[::-1]:
                times.setdefault(name, []).append(_timed(fn))
            persist_slot(b.slot, LocalStorage(b.root), pool=b.hashers)
            times.setdefault("restore disk", []).append(_timed(b.restore_disk))
            shutil.rmtree(b.root, ignore_errors=True)
            if r == 0:
                for fn in (b.restore_buffered, b.restore_memory):  # both land every bit
                    for t in b.into["w"].values():
                        t.fill_(float("nan"))
                    fn()
                    for k, v in b.state["w"].items():
                        assert torch.equal(v, b.into["w"][k]), k
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        keeper = keeper_run(b)
    finally:
        b.close()
    extra = {
        "trainer_cpu_memcpy_secs": statistics.median(cpu["memcpy"]),
        "trainer_cpu_stage_slot_secs": statistics.median(cpu["stage slot"]),
        "staged_meta_secs": statistics.median(b.staged_secs),
        "shm_bytes": 2 * (DATA_OFFSET + b.nbytes),
        **keeper,
    }
    report(times, b.nbytes, len(b.items), rounds, extra)


def report(
    times: dict[str, list[float]], nbytes: int, count: int, rounds: int, extra: dict[str, float]
) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    base, rbase = med["memcpy"], med["read memcpy"]
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    print(f"state: {nbytes / 2**20:.0f} MiB in {count} tensors; {rounds} rounds, medians")
    for k, v in med.items():
        ref = rbase if k in _RESTORES else base
        print(f"{k:20s} {v * 1e3:8.1f} ms  {gbps[k]:6.2f} GB/s  {ref / v:5.2f}x a memcpy")
    out = {
        "bytes": nbytes,
        "rounds": rounds,
        "median_secs": {k: round(v, 5) for k, v in med.items()},
        "stage_slot_vs_memcpy": round(base / med["stage slot"], 3),
        "stage_arena_vs_memcpy": round(base / med["stage arena"], 3),
        "restore_memory_vs_memcpy": round(rbase / med["restore memory"], 3),
        "restore_buffered_vs_memcpy": round(rbase / med["restore buffered"], 3),
        "direct_vs_memcpy": round(rbase / med["verify+copy direct"], 3),
        "restore_disk_vs_memcpy": round(rbase / med["restore disk"], 3),
        "seal_gbps": round(gbps["seal"], 2),
        **{k: round(v, 5) if isinstance(v, float) else v for k, v in extra.items()},
    }
    c = extra
    print(
        f"trainer CPU per checkpoint: memcpy {c['trainer_cpu_memcpy_secs'] * 1e3:.1f} ms, stage "
        f"into a slot {c['trainer_cpu_stage_slot_secs'] * 1e3:.1f} ms (of which the staged "
        f"record + objects write {c['staged_meta_secs'] * 1e3:.2f} ms wall)"
    )
    print(
        f"keeper: seal {c['seal_secs']:.3f} s (first of a slot {c['seal_first_secs']:.3f} s), persist to disk {c['persist_secs']:.3f} s; RSS "
        f"{c.get('keeper_VmRSS', 0) / 2**20:.0f} MiB (anon {c.get('keeper_RssAnon', 0) / 2**20:.0f}"
        f" MiB, shmem {c.get('keeper_RssShmem', 0) / 2**20:.0f} MiB); /dev/shm used "
        f"{c['shm_bytes'] / 2**20:.0f} MiB"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("PITSTOP_LOG", "warning")
    main()
