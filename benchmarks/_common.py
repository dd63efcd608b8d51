"""Helpers shared by the benchmark scripts (not part of the pitstop package).

Timing is always ``time.perf_counter``; sizes are bytes and rates are 1e9 bytes
per second (GB/s). Nothing here is pitstop-specific, so the peers and the raw
limits are measured with the same tools as pitstop itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from types import TracebackType

import torch
from torch import nn

from pitstop.bench import drop_caches
from pitstop.io.files import fsync_dir

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "PeakRSS",
    "anon_huge_bytes",
    "build_state",
    "build_target",
    "drop_caches",
    "fsync_dir",
    "fsync_tree",
    "gbps",
    "hwm_bytes",
    "json_line",
    "layout",
    "log",
    "median",
    "raw_read",
    "raw_write",
    "remove_children",
    "remove_path",
    "rss_bytes",
    "scramble",
    "state_equal",
    "state_tensors",
    "tensor_digests",
]

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr, so that stdout ends with the JSON line."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _strict(obj: object) -> object:
    """NaN and infinities become null, so the line is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def json_line(result: object) -> str:
    """A benchmark's final line: compact, strict JSON."""
    return json.dumps(_strict(result), separators=(",", ":"))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9 if secs > 0 else float("nan")


# --------------------------------------------------------------------------- state


def build_state(
    layers: int, width: int, *, seed: int, step: bool = True
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``layers`` x Linear(width, width) + Adam; with ``step`` after one optimizer step.

    The step gives Adam its ``exp_avg``/``exp_avg_sq``/``step`` tensors, so the
    state is weights + 2 x weights (+ the small step tensors).
    """
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if step:
        x = torch.randn(8, width)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def build_target(
    layers: int, width: int, *, seed: int = 1
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A restore target: ``build_state``'s shapes, other values, Adam state allocated and touched.

    A zero-gradient step allocates ``exp_avg``/``exp_avg_sq``/``step`` (DCP needs them to
    exist), so a restore into it copies into memory that is already resident.
    """
    model, opt = build_state(layers, width, seed=seed, step=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the model and optimizer state, in a fixed order."""
    out = [t.detach() for t in model.state_dict().values()]
    for per_param in opt.state.values():
        out.extend(v for _, v in sorted(per_param.items()) if isinstance(v, torch.Tensor))
    return out


def state_equal(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    la, lb = list(a), list(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb)
    )


def _digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # releases the GIL
    return h.hexdigest()


def tensor_digests(tensors: Iterable[torch.Tensor], pool: Executor | None = None) -> list[str]:
    """sha256 of every tensor's dtype, shape and bytes (in ``pool`` when given), in order."""
    ts = list(tensors)
    return list(pool.map(_digest, ts)) if pool is not None else [_digest(t) for t in ts]


def scramble(tensors: Iterable[torch.Tensor]) -> None:
    """Overwrite tensors in place, so that a restore that does nothing is noticed."""
    with torch.no_grad():
        for t in tensors:
            t.fill_(-7.0) if t.is_floating_point() else t.zero_()


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """4 KiB-aligned offsets of ``tensors`` packed one after another, and the total size."""
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN
    return offsets, off


# --------------------------------------------------------------------------- memory


class AlignedBuffer:
    """An anonymous, page-aligned, pre-faulted mapping, plus a uint8 tensor viewing it.

    With ``huge`` the mapping is advised MADV_HUGEPAGE *before* it is touched, so it is
    backed by transparent huge pages where the kernel allows (advising after MAP_POPULATE
    leaves the 4 KiB pages in place). Physically contiguous 2 MiB pages let the block layer
    build requests of max_sectors_kb instead of max_segments x 4 KiB.
    """

    def __init__(self, nbytes: int, *, huge: bool = True) -> None:
        self.nbytes = max((nbytes + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if not huge:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(-1, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self.mm)
        self.tensor = torch.frombuffer(self.view, dtype=torch.uint8)
        self.tensor.fill_(0)  # touch every page (faults them in when not populated)

    def huge_bytes(self) -> int:
        """Bytes of this mapping backed by transparent huge pages (AnonHugePages)."""
        return anon_huge_bytes(self.tensor.data_ptr())

    def views(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
        """Views of the buffer shaped like ``tensors`` at ``offsets``."""
        out = []
        for t, off in zip(tensors, offsets):
            n = t.numel() * t.element_size()
            out.append(self.tensor[off : off + n].view(t.dtype).view(t.shape))
        return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (from /proc/self/smaps); 0 if unknown."""
    current: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if parts and "-" in parts[0] and not parts[0].endswith(":"):
                    lo, _, hi = parts[0].partition("-")
                    current = (int(lo, 16), int(hi, 16))
                elif (
                    parts
                    and parts[0] == "AnonHugePages:"
                    and current
                    and current[0] <= address < current[1]
                ):
                    return int(parts[1]) * 1024
    except (OSError, ValueError):
        return 0
    return 0


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    """VmHWM: the resident high-water mark (since the last reset, see ``PeakRSS``)."""
    return _status_kib("VmHWM") * 1024


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Peak resident memory added inside a ``with`` block, in bytes (``added``).

    Resets VmHWM via /proc/self/clear_refs where permitted; otherwise samples
    VmRSS every millisecond in a background thread (``method`` says which).
    """

    can_reset: bool | None = None

    def __init__(self) -> None:
        if PeakRSS.can_reset is None:
            PeakRSS.can_reset = _reset_peak()
        self.method = "VmHWM" if PeakRSS.can_reset else "sampled 1 ms"
        self.start = 0
        self.peak = 0
        self.added = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self.start = rss_bytes()
        self.peak = self.start
        if PeakRSS.can_reset:
            _reset_peak()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, _status_kib("VmHWM") * 1024)
        self.peak = max(self.peak, rss_bytes())
        self.added = max(0, self.peak - self.start)


# --------------------------------------------------------------------------- files


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (for writers that do not)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def remove_children(root: str) -> None:
    for name in os.listdir(root):
        remove_path(os.path.join(root, name))


def _chunks(total: int, request: int) -> list[tuple[int, int]]:
    return [(off, min(request, total - off)) for off in range(0, total, request)]


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError:
            pass  # tmpfs and some network file systems refuse O_DIRECT
    return os.open(path, flags, 0o644), False


def _run(pool: Executor, job: Callable[[int, int], None], chunks: list[tuple[int, int]]) -> None:
    for f in [pool.submit(job, off, n) for off, n in chunks]:
        f.result()


def raw_write(path: str, view: memoryview, nbytes: int, *, request: int, pool: Executor) -> bool:
    """Write ``view[:nbytes]`` to ``path`` with aligned pwrite requests in ``pool``, then fsync.

    Returns whether O_DIRECT was used (``nbytes`` must be a multiple of 4 KiB for it).
    """
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)

    def job(off: int, n: int) -> None:
        data = view[off : off + n]
        while data:
            k = os.pwrite(fd, data, off)
            data, off = data[k:], off + k

    try:
        _run(pool, job, _chunks(nbytes, request))
        os.fsync(fd)
    finally:
        os.close(fd)
    return direct


def raw_read(path: str, view: memoryview, nbytes: int, *, request: int, pool: Executor) -> bool:
    """Read ``nbytes`` of ``path`` into ``view`` with aligned preadv requests in ``pool``."""
    fd, direct = _open(path, os.O_RDONLY, True)

    def job(off: int, n: int) -> None:
        out = view[off : off + n]
        while out:
            k = os.preadv(fd, [out], off)
            if k == 0:
                raise OSError(f"unexpected end of {path} at byte {off}")
            out, off = out[k:], off + k

    try:
        _run(pool, job, _chunks(nbytes, request))
    finally:
        os.close(fd)
    return direct
