"""stage: copy the state into a host arena laid out exactly as the data file.

Call sequence (training thread unless noted)::

    arena_tensor(arena)                  # once per arena: a uint8 tensor viewing it
    job = stage(flat, plan, arena, ...)  # copies the eager part now, starts the deferred part
    job.wait_copied()                    # persist thread: every byte is in the arena
    job.wait_for_optimizer()             # optimizer step pre-hook (training thread)

*Eager* tensors (module buffers such as BatchNorm statistics, plain tensors,
RNG state: anything a forward pass or the user may change) are copied before
:func:`stage` returns. *Deferred* tensors (parameters owned by an optimizer in
the state, and that optimizer's state) change only in ``optimizer.step()``: on
CPU a stage thread copies them while the next forward and backward run, on CUDA
a side stream does; the engine's optimizer step pre-hook waits for them, so the
snapshot equals the state at the step of the save exactly.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

import torch

from pitstop.engine.plan import SavePlan
from pitstop.faults import killpoint
from pitstop.format.codec import tensor_view
from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent
from pitstop.log import get_logger
from pitstop.state.tree import Flat

__all__ = [
    "Ring",
    "StageJob",
    "arena_tensor",
    "copy_bytes",
    "pin_arena",
    "stage",
    "stage_ring",
    "unpin_arena",
]

_log = get_logger("pitstop.engine")


def _plain(t: torch.Tensor) -> bool:
    """A dense, contiguous CPU tensor whose memory holds exactly its values."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and t.is_contiguous()
    )


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``dst.copy_(src)``; between two plain CPU tensors of one dtype and size, one
    ``memmove`` in this thread (the GIL released). ``copy_`` splits a large copy over the
    intra-op threads and waits for the slowest: on 2 busy cores it copied at 0.8 GB/s
    where one memmove in one thread ran at 1.8-2.4 GB/s, and it competes with the
    training's own intra-op threads."""
    if (
        dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and dst.numel() > 0
        and _plain(dst)
        and _plain(src)
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src, non_blocking=non_blocking)


def arena_tensor(arena: Arena) -> torch.Tensor:
    """A flat uint8 tensor viewing the whole arena (no copy)."""
    return torch.frombuffer(arena.view, dtype=torch.uint8)


def pin_arena(arena: Arena, buffer: torch.Tensor) -> None:
    """Page-lock the arena for CUDA (cudaHostRegister), so device copies are asynchronous."""
    if arena.pinned or not torch.cuda.is_available():
        return
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), arena.nbytes, 0)
    if int(err) != 0:
        _log.warning(
            "cudaHostRegister of a %d-byte arena failed (%s); device copies will block",
            arena.nbytes,
            err,
            phase="stage",
        )
        return
    arena.pinned = True


def unpin_arena(arena: Arena, buffer: torch.Tensor) -> None:
    if arena.pinned and torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        arena.pinned = False


class StageJob:
    """The copy of one save into its arena, item by item, so that writers can start early.

    ``wait_items(i)`` returns once plan items 0..i are in the arena: a writer thread calls it
    for the items of its extent, so writing overlaps with the deferred copy (a synchronous
    ``save`` is then about as long as the longer of the two, not their sum).
    """

    def __init__(self, count: int) -> None:
        self.eager_secs = 0.0
        self.copied_at: float | None = None
        self._future: Future[None] | None = None
        self._events: list[torch.cuda.Event] = []
        self._cond = threading.Condition()
        self._done = [False] * count
        self._frontier = 0
        self._error: BaseException | None = None
        self._eager: threading.Event | None = None  # set by a ring's stager (None: no wait)
        self._t0 = time.perf_counter()

    def mark(self, index: int) -> None:
        """Item ``index`` is in the arena (stage thread or training thread)."""
        with self._cond:
            self._done[index] = True
            while self._frontier < len(self._done) and self._done[self._frontier]:
                self._frontier += 1
            if self._frontier == len(self._done) and self.copied_at is None:
                self.copied_at = time.perf_counter()
            self._cond.notify_all()

    def wait_eager(self) -> None:
        """Training thread, once the writers run: the eager tensors are in the arena (a save
        staged through a ring waits here for room; otherwise they already are)."""
        if self._eager is None:
            return
        self._eager.wait()
        self.eager_secs = time.perf_counter() - self._t0
        future = self._future
        if future is not None and future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]

    def settle(self) -> None:
        """Wait until no copy into the arena is running any more, whatever its outcome."""
        if self._future is not None:
            self._future.exception()
        for event in self._events:
            event.synchronize()

    def _on_copy_done(self, future: Future[None]) -> None:
        """However the copy ended, waiting writers must not wait for ever."""
        error = future.exception()
        if error is not None:
            self.fail(error)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def wait_items(self, last: int) -> None:
        """Block until items 0..last are copied (a writer thread, before it writes them)."""
        with self._cond:
            self._cond.wait_for(lambda: self._frontier > last or self._error is not None)
            if self._error is not None and self._frontier <= last:
                raise self._error

    def wait_for_optimizer(self) -> None:
        """Optimizer step pre-hook: block the update until the deferred copy is done.
        A failed copy does not stop training: the save's handle reports it."""
        if self._future is not None:
            self._future.exception()
        for event in self._events:  # the device waits; the host goes on
            torch.cuda.current_stream().wait_event(event)

    def wait_copied(self) -> None:
        """Every byte of the snapshot is in the arena (host-synchronous); raises a failed copy."""
        if self._future is not None:
            self._future.result()
        for event in self._events:
            event.synchronize()
        self.wait_items(len(self._done) - 1)
        if self.copied_at is None:
            self.copied_at = time.perf_counter()

    @property
    def copied(self) -> bool:
        with self._cond:
            if self._frontier < len(self._done):
                return False
        return all(e.query() for e in self._events)


Copy = tuple[int, torch.Tensor, torch.Tensor]  # (plan index, arena view, source)


def _copy(job: StageJob, items: list[Copy], progress: list[int], half: int) -> None:
    try:
        with torch.no_grad():
            for index, dst, src in items:
                copy_bytes(dst, src, non_blocking=src.device.type != "cpu")
                if not src.is_cuda:
                    job.mark(index)
                progress[0] += 1
                if progress[0] == half:
                    killpoint("stage.mid")
    except BaseException as e:
        job.fail(e)
        raise


def stage(
    flat: Flat,
    plan: SavePlan,
    buffer: torch.Tensor,
    *,
    overlap: bool,
    copier: Executor,
) -> StageJob:
    """Copy the eager tensors now and start the deferred ones (see the module docstring)."""
    t0 = time.perf_counter()
    job = StageJob(len(plan.items))
    eager: list[Copy] = []
    deferred: list[Copy] = []
    for index, item in enumerate(plan.items):
        if item.nbytes == 0:
            job.mark(index)
            continue
        dst = tensor_view(buffer, item.offset, item.nbytes, item.dtype, item.shape)
        (deferred if overlap and item.deferrable else eager).append(
            (index, dst, item.source(flat.tensors[item.key]))
        )
    progress = [0]
    half = max(1, (len(eager) + len(deferred) + 1) // 2)
    if any(src.is_cuda for _, _, src in eager + deferred):
        _stage_cuda(job, eager, deferred, progress, half)
    else:
        _copy(job, eager, progress, half)
        if deferred:
            job._future = copier.submit(_copy, job, deferred, progress, half)
            job._future.add_done_callback(job._on_copy_done)
    job.eager_secs = time.perf_counter() - t0
    return job


def _stage_cuda(
    job: StageJob, eager: list[Copy], deferred: list[Copy], progress: list[int], half: int
) -> None:
    """Eager copies go on the current stream (ordered before the next forward's kernels);
    deferred ones on a side stream that first waits for the work already queued."""
    current = torch.cuda.current_stream()
    _copy(job, eager, progress, half)
    done_eager = torch.cuda.Event()
    done_eager.record(current)
    job._events.append(done_eager)
    if deferred:
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            _copy(job, deferred, progress, half)
            done_side = torch.cuda.Event()
            done_side.record(side)
        job._events.append(done_side)
    # host-side progress: the writers wait for the events, then for every item at once
    events = list(job._events)

    def finish() -> None:
        for event in events:
            event.synchronize()
        for index, _, _ in eager + deferred:
            job.mark(index)

    threading.Thread(target=finish, name="pitstop-stage-cuda", daemon=True).start()


class Ring:
    """A staging buffer smaller than the data file (``SaveOptions.host_memory_bytes``).

    Extent ``k`` of the plan is staged at ``pos[k]``, positions running round the buffer,
    and may be staged only once every earlier extent whose bytes it overwrites has been
    written and hashed (``release``). The writers see the buffer laid out as the file
    (``view``), the extent they write mapped to where it is staged.
    """

    def __init__(self, extents: tuple[Extent, ...], buffer: torch.Tensor, view: memoryview) -> None:
        self.extents, self.buffer, self._view = extents, buffer, view
        self.starts = [e.start for e in extents]
        self.pos: list[int] = []
        self.after: list[list[int]] = []  # every earlier extent whose bytes it overwrites
        placed: list[tuple[int, int, int]] = []  # (start, end, index) of what the ring holds
        at = 0
        for k, e in enumerate(extents):
            if at + e.nbytes > len(view):
                at = 0
            lo, hi = at, at + e.nbytes
            # writers finish out of order: every one of them must be released, not the newest
            self.after.append(sorted({j for s, t, j in placed if s < hi and lo < t}))
            kept = [(s, t, j) for s, t, j in placed if t <= lo or hi <= s]
            for s, t, j in placed:  # what is left of a partly overwritten one still counts
                if s < hi and lo < t:
                    kept += [(a, b, j) for a, b in ((s, lo), (hi, t)) if a < b]
            placed = [*kept, (lo, hi, k)]
            self.pos.append(at)
            at = hi
        self._cond = threading.Condition()
        self._staged = [False] * len(extents)
        self._released = [False] * len(extents)
        self._error: BaseException | None = None

    def __getitem__(self, key: slice) -> memoryview:
        """Bytes ``key`` of the file, where they are staged (within one extent)."""
        if key.start is None:  # the whole file (``view[:file_bytes]``, as persist passes it)
            return self  # type: ignore[return-value]
        k = bisect.bisect_right(self.starts, key.start) - 1
        base = self.pos[k] - self.extents[k].start
        return self._view[base + key.start : base + key.stop]

    def stage(self, k: int, copy: Callable[[torch.Tensor], None]) -> None:
        """Stage thread: wait until extent ``k``'s place is free, ``copy`` into it, mark it."""
        with self._cond:
            before = self.after[k]
            self._cond.wait_for(
                lambda: self._error is not None or all(self._released[j] for j in before)
            )
            if self._error is not None:
                raise self._error
        e = self.extents[k]
        copy(self.buffer[self.pos[k] : self.pos[k] + e.nbytes])
        with self._cond:
            self._staged[k] = True
            self._cond.notify_all()

    def wait_staged(self, extent: Extent) -> None:
        """Writer thread, before writing ``extent``; raises once the ring failed (a failed
        save writes nothing more, even what is staged)."""
        k = bisect.bisect_right(self.starts, extent.start) - 1
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or self._staged[k])
            if self._error is not None:
                raise self._error

    def release(self, extent: Extent) -> None:
        """Writer thread, once ``extent`` is written and hashed: its place may be reused."""
        k = bisect.bisect_right(self.starts, extent.start) - 1
        with self._cond:
            self._released[k] = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Whatever waits on the ring stops waiting (a failed copy, write or hash: persist
        fails its ring as soon as one of them does); the first error is kept."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()


def _late_eager(flat: Flat, plan: SavePlan, overlap: bool) -> dict[int, torch.Tensor]:
    """Copies, made now, of the eager items that lie past a deferred one in the file. The plan
    puts eager items first, but a rank's own values (RNG streams) follow its slice of the
    replicated stream: staged in file order through a ring, they would hold the loop for the
    whole write before them. Set aside, they cost the loop their copy and the host their
    size, nothing more."""
    if not overlap:
        return {}
    deferred = [item.offset for item in plan.items if item.nbytes and item.deferrable]
    if not deferred:
        return {}
    first = min(deferred)
    with torch.no_grad():
        return {
            i: _flat_bytes(item.source(flat.tensors[item.key])).clone()
            for i, item in enumerate(plan.items)
            if item.nbytes and not item.deferrable and item.offset > first
        }


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)


def stage_ring(
    flat: Flat, plan: SavePlan, ring: Ring, *, overlap: bool, copier: Executor
) -> StageJob:
    """Stage through ``ring``, extent by extent, on the stage thread. The caller starts the
    writers, then ``job.wait_eager()`` returns once the eager tensors (which come first in
    the plan; those that cannot, a rank's own values past its stream slice, are copied aside
    at once) are staged: the loop stalls for as much of the write as it takes to make room
    for them. Deferred tensors follow while training goes on; the optimizer step pre-hook
    waits for all of them, as with a whole arena."""
    job = StageJob(len(plan.items))
    eager_done = job._eager = threading.Event()
    sources: dict[int, torch.Tensor] = _late_eager(flat, plan, overlap)
    eager_end = 0  # the byte after the last eager item staged in file order
    for i, item in enumerate(plan.items):
        if item.nbytes and not (overlap and item.deferrable) and i not in sources:
            eager_end = max(eager_end, item.offset + item.nbytes)
    ends = {i: item.offset + item.nbytes for i, item in enumerate(plan.items)}
    for i, item in enumerate(plan.items):
        if item.nbytes == 0:
            job.mark(i)

    def source(i: int) -> torch.Tensor:
        if i not in sources:
            sources[i] = _flat_bytes(plan.items[i].source(flat.tensors[plan.items[i].key]))
        return sources[i]

    half = max(1, (len(plan.extents) + 1) // 2)

    # items in file order, as extents are: each extent's items are found by one sweep
    order = sorted((i for i, item in enumerate(plan.items) if item.nbytes), key=ends.__getitem__)

    def run() -> None:
        first = 0  # the first item (in ``order``) that ends past the extents staged so far
        try:
            with torch.no_grad():
                for k, e in enumerate(plan.extents):
                    if k == half:
                        killpoint("stage.mid")
                    while first < len(order) and ends[order[first]] <= e.start:
                        first += 1
                    parts = []
                    for i in order[first:]:
                        item = plan.items[i]
                        if item.offset >= e.end:
                            break
                        parts.append((i, max(item.offset, e.start), min(ends[i], e.end)))

                    def copy(
                        dst: torch.Tensor,
                        parts: list[tuple[int, int, int]] = parts,
                        at: int = e.start,
                    ) -> None:
                        for i, lo, hi in parts:
                            off = plan.items[i].offset
                            copy_bytes(dst[lo - at : hi - at], source(i)[lo - off : hi - off])

                    ring.stage(k, copy)
                    for i, _, hi in parts:
                        if hi == ends[i]:
                            sources.pop(i, None)
                            job.mark(i)
                    if e.end >= eager_end:
                        eager_done.set()
        except BaseException as err:
            job.fail(err)
            ring.fail(err)
            raise
        finally:
            eager_done.set()

    job._future = copier.submit(run)
    job._future.add_done_callback(job._on_copy_done)
    return job
