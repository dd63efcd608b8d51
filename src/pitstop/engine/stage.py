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
from dataclasses import dataclass, field

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


@dataclass
class StageJob:
    """The copy of one save into its arena."""

    eager_secs: float = 0.0
    copied_at: float | None = None
    _future: Future[None] | None = None
    _events: list[torch.cuda.Event] = field(default_factory=list)
    _done: threading.Event = field(default_factory=threading.Event)

    def wait_for_optimizer(self) -> None:
        """Optimizer step pre-hook: block the update until the deferred copy is done."""
        if self._future is not None:
            self._future.result()
        for event in self._events:  # the device waits; the host goes on
            torch.cuda.current_stream().wait_event(event)

    def wait_copied(self) -> None:
        """Every byte of the snapshot is in the arena (host-synchronous)."""
        if self._future is not None:
            self._future.result()
        for event in self._events:
            event.synchronize()
        if self.copied_at is None:
            self.copied_at = time.perf_counter()
        self._done.set()

    @property
    def copied(self) -> bool:
        if self._done.is_set():
            return True
        if self._future is not None and not self._future.done():
            return False
        return all(e.query() for e in self._events)


def _copy(items: list[tuple[torch.Tensor, torch.Tensor]], progress: list[int], half: int) -> None:
    with torch.no_grad():
        for dst, src in items:
            dst.copy_(src, non_blocking=src.device.type != "cpu")
            progress[0] += 1
            if progress[0] == half:
                killpoint("stage.mid")


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
    eager: list[tuple[torch.Tensor, torch.Tensor]] = []
    deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
    for item in plan.items:
        src = flat.tensors[item.key]
        if item.nbytes == 0:
            continue
        dst = tensor_view(buffer, item.offset, item.nbytes, item.dtype, item.shape)
        (deferred if overlap and item.deferrable else eager).append((dst, src))
    job = StageJob()
    progress = [0]
    half = max(1, (len(eager) + len(deferred) + 1) // 2)
    on_cuda = any(src.is_cuda for _, src in eager + deferred)
    if on_cuda:
        _stage_cuda(job, eager, deferred, progress, half)
    else:
        _copy(eager, progress, half)
        if deferred:
            job._future = copier.submit(_copy, deferred, progress, half)
    job.eager_secs = time.perf_counter() - t0
    if job._future is None and not job._events:
        job.copied_at = time.perf_counter()
    return job


def _stage_cuda(
    job: StageJob,
    eager: list[tuple[torch.Tensor, torch.Tensor]],
    deferred: list[tuple[torch.Tensor, torch.Tensor]],
    progress: list[int],
    half: int,
) -> None:
    """Eager copies go on the current stream (ordered before the next forward's kernels);
    deferred ones on a side stream that first waits for the work already queued."""
    current = torch.cuda.current_stream()
    _copy(eager, progress, half)
    done_eager = torch.cuda.Event()
    done_eager.record(current)
    job._events.append(done_eager)
    if deferred:
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            _copy(deferred, progress, half)
            done_side = torch.cuda.Event()
            done_side.record(side)
        job._events.append(done_side)
