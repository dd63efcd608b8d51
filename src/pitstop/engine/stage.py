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

import threading
import time
from concurrent.futures import Executor, Future

import torch

from pitstop.engine.plan import SavePlan
from pitstop.faults import killpoint
from pitstop.format.codec import tensor_view
from pitstop.io.arena import Arena
from pitstop.log import get_logger
from pitstop.state.tree import Flat

__all__ = ["StageJob", "arena_tensor", "pin_arena", "stage", "unpin_arena"]

_log = get_logger("pitstop.engine")


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

    def mark(self, index: int) -> None:
        """Item ``index`` is in the arena (stage thread or training thread)."""
        with self._cond:
            self._done[index] = True
            while self._frontier < len(self._done) and self._done[self._frontier]:
                self._frontier += 1
            if self._frontier == len(self._done) and self.copied_at is None:
                self.copied_at = time.perf_counter()
            self._cond.notify_all()

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
                dst.copy_(src, non_blocking=src.device.type != "cpu")
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
