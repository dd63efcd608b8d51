"""A save staged through a ring (a state larger than ``host_memory_bytes``) whose writes fail
fails at once: its error is raised, nothing is committed, no thread waits for ever for a
ring place that a failed write or hash would never give back, and the next save works."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
from pitstop.errors import CheckpointIOError
from pitstop.io.parallel import Extent
from pitstop.options import MIN_HOST_MEMORY_BYTES, SaveOptions
from pitstop.storage import LocalStorage
from pitstop.storage.wrap import StorageWrapper
from pitstop.testing import FaultyStorage

MIB = 1 << 20
BUDGET = MIN_HOST_MEMORY_BYTES  # the smallest ring there is (64 MiB)
PROMPT_SECS = 30.0  # a failed save reports long before this (a hang never does)

# a hang dumps every thread and ends the run (a "signal" timeout would then hang in close)
pytestmark = pytest.mark.timeout(60, method="thread")


class FailingExtents(StorageWrapper):
    """Fails the write of the ``nth`` extent a writer starts (1-based; -1: the last one) of
    each ``write_data`` while ``armed``, as a failed ``pwrite`` does: the extent was staged
    and handed to its hash, then the write raises ``OSError(code)``, which the storage
    reports as CheckpointIOError."""

    def __init__(self, inner: Any, nth: int, code: int = errno.ENOSPC) -> None:
        super().__init__(inner)
        self.nth, self.code, self.armed, self.failed = nth, code, True, 0

    def _call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name != "write_data":
            return fn

        def write_data(
            directory: str,
            file: str,
            view: memoryview,
            extents: Sequence[Extent],
            *,
            pool: Any,
            before_extent: Callable[[Extent], None] | None = None,
            on_extent: Callable[[Extent], None] | None = None,
        ) -> Any:
            nth = len(extents) if self.nth == -1 else self.nth
            lock, started = threading.Lock(), [0]

            def before(extent: Extent) -> None:
                if before_extent is not None:
                    before_extent(extent)
                with lock:
                    started[0] += 1
                    hit = self.armed and started[0] == nth
                if hit:
                    self.failed += 1
                    raise OSError(self.code, os.strerror(self.code))

            return fn(
                directory, file, view, extents, pool=pool, before_extent=before,
                on_extent=on_extent,
            )  # fmt: skip

        return write_data


def _tensors() -> dict[str, torch.Tensor]:
    """128 MiB of plain tensors (every one eager): twice the ring, about 5 extents."""
    return {f"t{i}": torch.full((4 * MIB,), float(i)) for i in range(8)}


def _model_state() -> dict[str, Any]:
    """About 100 MiB: weights and momentum (deferred) and a BatchNorm's buffers (eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.BatchNorm1d(2048)
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt)
    return {"model": model, "opt": opt}


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 2048)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _no_thread_left(before: set[threading.Thread]) -> None:
    deadline = time.monotonic() + 1.0
    while True:
        left = [
            t.name
            for t in threading.enumerate()
            if t not in before and t.is_alive() and t.name.startswith("pitstop")
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"threads left running after close: {left}"


def _save(ckpt: pitstop.CheckpointManager, step: int, state: dict[str, Any], sync: bool) -> None:
    if sync:
        ckpt.save(step, state)
        return
    handle = ckpt.async_save(step, state)  # may raise: the eager part waits for the writers
    if "model" in state:
        _train(state["model"], state["opt"])  # the optimizer hook must not wait for ever
    handle.wait(timeout=PROMPT_SECS)


def _fails_promptly(
    ckpt: pitstop.CheckpointManager, step: int, state: dict[str, Any], sync: bool, code: int
) -> None:
    t0 = time.monotonic()
    with pytest.raises(CheckpointIOError) as info:
        _save(ckpt, step, state, sync)
    assert time.monotonic() - t0 < PROMPT_SECS
    assert info.value.errno == code, info.value


@pytest.mark.parametrize("sync", [True, False], ids=["save", "async_save"])
@pytest.mark.parametrize("nth", [1, 2, -1], ids=["first", "second", "last"])
def test_a_failed_extent_write_fails_the_ring_save_at_once(root: str, nth: int, sync: bool) -> None:
    before = set(threading.enumerate())
    state = _tensors() if sync else _model_state()
    storage = FailingExtents(LocalStorage(root), nth)
    options = SaveOptions(host_memory_bytes=BUDGET)
    ckpt = pitstop.CheckpointManager(storage, options=options)
    try:
        storage.armed = False
        ckpt.save(1, state)  # disarmed, the storage works
        storage.armed = True
        _fails_promptly(ckpt, 2, state, sync, errno.ENOSPC)
        assert storage.failed == 1
        assert ckpt.steps() == [1]  # nothing committed
        storage.armed = False
        _save(ckpt, 3, state, sync)  # the same manager saves again
        assert ckpt.steps() == [1, 3]
    finally:
        ckpt.close()
    _no_thread_left(before)
    with pitstop.CheckpointManager(root, options=options) as again:  # a new one on the root
        assert again.steps() == [1, 3]
        again.save(4, state)
        assert again.steps() == [1, 3, 4]
    _no_thread_left(before)


@pytest.mark.parametrize("sync", [True, False], ids=["save", "async_save"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_a_failed_write_data_call_fails_the_ring_save_at_once(
    root: str, code: int, sync: bool
) -> None:
    """FaultyStorage fails a whole ``write_data`` call: the second save's (EIO is retried
    twice by the manager: its three attempts fail)."""
    before = set(threading.enumerate())
    state = _tensors() if sync else _model_state()
    calls = [2] if code == errno.ENOSPC else [2, 3, 4]
    storage = FaultyStorage(LocalStorage(root), fail={"write_data": calls}, errno=code)
    options = SaveOptions(host_memory_bytes=BUDGET)
    ckpt = pitstop.CheckpointManager(storage, options=options)
    try:
        _save(ckpt, 1, state, sync)
        _fails_promptly(ckpt, 2, state, sync, code)
        assert ckpt.steps() == [1]
        _save(ckpt, 3, state, sync)  # the next write_data call works
        assert ckpt.steps() == [1, 3]
    finally:
        ckpt.close()
    _no_thread_left(before)


class _FailingHashView:
    """Stands for a ring as the view persist hashes from: slices through it (the hashes) fail
    on the ``nth`` call; ``view[:n]`` (what the storage writes from) is the ring itself."""

    def __init__(self, ring: Any, nth: int) -> None:
        self.ring, self.nth, self.calls = ring, nth, 0
        self.lock = threading.Lock()

    def __getitem__(self, key: slice) -> Any:
        if key.start is None:
            return self.ring
        with self.lock:
            self.calls += 1
            hit = self.calls == self.nth
        if hit:
            raise MemoryError("injected: hashing failed")
        return self.ring[key]


@pytest.mark.parametrize("nth", [1, 3])
def test_a_failed_hash_fails_the_ring_at_once(root: str, nth: int) -> None:
    """A hash cannot be made to fail through the public API without patching: here the
    engine's stager, ring and persist run as the saver runs them, the ring's view failing
    the ``nth`` slice the hashing threads take. The stager and every writer stop at once
    and persist raises the hash's error."""
    from pitstop.engine.persist import persist
    from pitstop.engine.stage import Ring, stage_ring
    from pitstop.format.names import step_dir_name
    from pitstop.io.arena import Arena

    state = _tensors()
    storage = LocalStorage(root)
    with pitstop.CheckpointManager(storage, options=SaveOptions(host_memory_bytes=BUDGET)) as ckpt:
        saver = ckpt._saver
        flat, plan = saver._plan(state)
        plan = plan.recut(24 * MIB)  # as the saver cuts it for a 64 MiB ring
        arena = Arena(BUDGET)
        buffer = torch.frombuffer(arena.view, dtype=torch.uint8)
        ring = Ring(plan.extents, buffer, arena.view)
        assert len(plan.extents) >= 4
        directory = step_dir_name(1)
        storage.prepare(directory)
        job = stage_ring(flat, plan, ring, overlap=False, copier=saver._stage_pool)
        view = _FailingHashView(ring, nth)
        t0 = time.monotonic()
        try:
            with pytest.raises(MemoryError, match="injected"):
                persist(
                    storage, directory, plan, view, b"", algorithm=saver.algorithm,  # type: ignore[arg-type]
                    pool=saver.io_pool, before_extent=ring.wait_staged,
                    after_extent=ring.release, on_failure=ring.fail,  # the saver's, by default
                )  # fmt: skip
        finally:
            ring.fail(RuntimeError("persist ended"))  # what the saver does once persist raised
            job.settle()
            storage.abort(directory)
        assert time.monotonic() - t0 < PROMPT_SECS
        assert not all(ring._released), "the extents after the failed hash were still written"
        assert ckpt.steps() == []
