"""The two-phase save pipeline: plan -> stage -> persist -> commit, with bounded memory.

Call sequence (training thread)::

    saver = Saver(storage, options, on_commit=...)
    handle = saver.async_save(step, state)   # returns once the eager part is copied
    ...                                      # training goes on; optimizer.step() waits
    handle.wait() / saver.wait_all()         #   for the deferred copy via a pre-hook
    saver.close()

Threads: ``pitstop-stage`` finishes deferred CPU copies; ``pitstop-persist``
writes, commits and runs ``on_commit`` (retention) for one save at a time, in
step order, before the save's handle reports it done (so when ``save()`` or
``wait()`` returns, retention for that commit has run); ``pitstop-io`` threads write the extents of a file in parallel (``pitstop-io-sync``, at
normal priority, those of a save the caller waits for: see ``waited``).
Memory: at most ``max_in_flight`` arenas of the state's size exist (default 1); a save
that finds them all busy waits for the oldest persist to finish. Under
``host_memory_bytes`` smaller than the state, one arena of that size is a ring through
which the save is staged and written in pieces. Arenas are reused across saves, never
allocated per save, and allocated outside the saver's lock (``reserve_async`` does it in
the background at the manager's first ``step()``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import socket
import threading
import time
import typing
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pitstop.engine.collective import NodeCommit, commit_together, local_items
from pitstop.engine.handle import SaveHandle
from pitstop.engine.persist import PersistResult, encode_objects, manifest_for, persist
from pitstop.engine.plan import PlanCache, SavePlan, plan_from_layout
from pitstop.engine.stage import (
    Ring,
    StageJob,
    arena_tensor,
    pin_arena,
    stage,
    stage_ring,
    unpin_arena,
)
from pitstop.errors import CheckpointError, CheckpointExistsError, DistributedCheckpointError
from pitstop.format.checksum import default_algorithm
from pitstop.format.manifest import FileEntry, Lineage, Manifest, TensorEntry
from pitstop.format.names import step_dir_name
from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent
from pitstop.log import get_logger
from pitstop.options import ALIGN_BYTES, SaveOptions
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import Outcome, agree, gather
from pitstop.ranks.sharding import assign
from pitstop.state.tree import Flat, flatten
from pitstop.storage.base import Storage

__all__ = ["Saver"]

_log = get_logger("pitstop.engine")


def _lower_priority(nice: int) -> None:
    """Thread initializer: on Linux a thread has its own nice value, so the background write
    and its hashing take the cores only when training leaves them idle (the stage thread
    keeps normal priority: optimizer.step() waits for it)."""
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


@dataclass(frozen=True)
class _Meta:
    lineage: Lineage | None
    metrics: dict[str, float]
    seq: int = 0
    writers: ThreadPoolExecutor | None = None  # None: io_pool


class _Ahead:
    """A one-process save's manifest, built and checked by the last hash's thread while the
    last extents are still being written (see ``persist``'s ``on_hashed``), and used if the
    commit's results are those very entries (they always are, unless the write then fails)."""

    def __init__(self, build: Callable[[list[PersistResult], list[str]], bytes]) -> None:
        self._build = build
        self._key: tuple[Any, ...] | None = None
        self._data: bytes | None = None

    def build(self, files: tuple[FileEntry, ...], tensors: tuple[TensorEntry, ...]) -> None:
        hosts = [socket.gethostname()]  # as result_to_json reports it
        data = self._build([PersistResult(files, tensors, 0, 0.0, False)], hosts)
        self._key, self._data = (files, tensors, hosts), data

    def get(self, results: list[PersistResult], hosts: list[str]) -> bytes | None:
        """The manifest built ahead, if it is the one for ``results`` (persist thread, after
        the persist returned: the hash thread that built it has ended)."""
        if self._key is None or len(results) != 1:
            return None
        if self._key != (results[0].files, results[0].tensors, hosts):
            return None
        return self._data


def _no_manifest(results: list[PersistResult], hosts: list[str]) -> bytes:
    raise AssertionError("a failed rank's commit round never commits")


class Saver:
    """Owns the arenas, the plan cache, the optimizer hooks and the background threads."""

    def __init__(
        self,
        storage: Storage,
        options: SaveOptions,
        *,
        on_commit: Callable[[int], None] | None = None,
        algorithm: str | None = None,
        group: Group | None = None,
        nodes: NodeCommit | None = None,
    ) -> None:
        self.storage = storage
        self.options = options
        self.group = group if group is not None else Group()
        self.nodes = nodes or NodeCommit.single(self.group.size)  # who leads which directory
        self._seq = 0  # saves started; every rank counts the same (saves are collective)
        self.algorithm = algorithm or default_algorithm()
        self._on_commit = on_commit
        self._plans = PlanCache()
        self._cond = threading.Condition()
        self._free: list[Arena] = []
        self._arenas: list[Arena] = []
        self._slots = 0  # arenas that exist or are being allocated
        self._reserver: threading.Thread | None = None
        self._buffers: dict[int, torch.Tensor] = {}
        self._inflight: dict[int, SaveHandle] = {}
        self._staging: list[StageJob] = []
        self._unreported: list[SaveHandle] = []
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = (
            weakref.WeakKeyDictionary()
        )
        self._stage_pool = ThreadPoolExecutor(1, thread_name_prefix="pitstop-stage")
        nice = (options.background_nice,)
        self._persist_pool = ThreadPoolExecutor(
            1, thread_name_prefix="pitstop-persist", initializer=_lower_priority, initargs=nice
        )
        self.io_pool = ThreadPoolExecutor(
            options.io.threads,
            thread_name_prefix="pitstop-io",
            initializer=_lower_priority,
            initargs=nice,
        )
        self._urgent_pool: ThreadPoolExecutor | None = None  # writers of waited-for saves
        self._urgent = False  # set by ``waited()``: the next save's caller waits for it
        self._closed = False
        self.hook_wait_secs = 0.0  # total time optimizer.step() waited for deferred copies
        self.history: collections.deque[SaveHandle] = collections.deque(maxlen=256)

    # ------------------------------------------------------------------ public
    @property
    def host_bytes(self) -> int:
        """Host memory held by the arenas."""
        with self._cond:
            return sum(a.nbytes for a in self._arenas)

    def async_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        lineage: Lineage | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> SaveHandle:
        """Stage ``state`` for ``step`` and persist it in the background; ``lineage`` and
        ``metrics`` go into its manifest."""
        t0 = time.perf_counter()
        self._check_open()
        self.raise_pending()
        directory = step_dir_name(step)
        handle = SaveHandle(step)
        with self._cond:
            if step in self._inflight:
                raise CheckpointExistsError(
                    f"step {step} is already being saved", step=step, phase="plan"
                )
            self._inflight[step] = handle
        planned = False
        try:
            flat, plan = self._plan(state, lambda: self._check_new(step, directory), step)
            planned = True  # every rank agreed: from here a failure takes its commit round
            job, plan, arena, ring, alloc = self._stage(flat, plan)
        except BaseException as e:
            with self._cond:
                self._inflight.pop(step, None)
                self._cond.notify_all()
            if planned:
                self._fail_together(directory, e)
            raise
        with self._cond:
            self._staging.append(job)
        handle._job = job
        handle.stats.stall_secs = time.perf_counter() - t0
        handle.stats.alloc_secs = alloc
        handle.stats.nbytes = plan.file_bytes
        self.history.append(handle)
        if self._in_round():
            self._seq += 1
        meta = _Meta(lineage, dict(metrics or {}), self._seq, self._writers())
        self._persist_pool.submit(
            self._persist, handle, job, flat, plan, arena, directory, t0, meta, ring
        )
        try:
            job.wait_eager()  # staged through a ring: the writers make room as they go
        except BaseException:
            handle.wait()  # the persist reports the same failure; let it end first
            raise
        handle.stats.stall_secs = time.perf_counter() - t0
        return handle

    @contextlib.contextmanager
    def waited(self) -> Iterator[None]:
        """Training thread: the saves started inside are waited for at once (a synchronous
        ``save``): nothing of the training runs meanwhile for ``background_nice`` to yield
        to, so their writer and hashing threads keep normal priority (niced ones lost
        5-10 % of the disk's speed here whenever the cores were busy: a woken writer waits
        for a core before it issues its next request)."""
        self._urgent = True
        try:
            yield
        finally:
            self._urgent = False

    def _writers(self) -> ThreadPoolExecutor:
        """The writer pool of the save being started (training thread)."""
        if not self._urgent or self.options.background_nice <= 0:
            return self.io_pool
        if self._urgent_pool is None:  # started once, when first needed
            self._urgent_pool = ThreadPoolExecutor(
                self.options.io.threads, thread_name_prefix="pitstop-io-sync"
            )
        return self._urgent_pool

    def _check_new(self, step: int, directory: str) -> None:
        if self.storage.has_manifest(directory) and not (
            {"damaged", "abandoned"} & set(self.storage.read_markers(directory))
        ):  # a marked one is moved out of the way by prepare
            raise CheckpointExistsError(
                f"step {step} is already committed; committed checkpoints are never rewritten",
                step=step, path=f"{self.storage.url}/{directory}", phase="plan",
            )  # fmt: skip

    def _stage(
        self, flat: Flat, plan: SavePlan
    ) -> tuple[StageJob, SavePlan, Arena, Ring | None, float]:
        """Copy the state into an arena (or, under ``host_memory_bytes``, start copying it
        through a ring, in requests that fit it twice); returns the job, the plan as written,
        the arena, the ring and the seconds spent on allocation (waiting for the background
        reservation included)."""
        t0 = time.perf_counter()
        if self._reserver is not None:
            self._reserver.join()
        waited = time.perf_counter() - t0
        nbytes, limit = self._arena_for(plan)
        arena, alloc = self._acquire_arena(nbytes, limit)
        ring = None
        try:
            buffer = self._buffers[id(arena)]
            if any(t.is_cuda for t in flat.tensors.values()):
                pin_arena(arena, buffer)
            self._hook_optimizers(flat.optimizers)
            if nbytes >= plan.file_bytes:
                job = stage(
                    flat, plan, buffer, overlap=self.options.overlap, copier=self._stage_pool
                )
            else:  # the state does not fit: stage and write it in pieces
                piece = max(ALIGN_BYTES, (nbytes * 4 // 9) // ALIGN_BYTES * ALIGN_BYTES)
                if max((e.nbytes for e in plan.extents), default=0) > nbytes // 2:
                    plan = plan.recut(min(piece, self.options.io.chunk_bytes))
                ring = Ring(plan.extents, buffer, arena.view)
                job = stage_ring(
                    flat, plan, ring, overlap=self.options.overlap, copier=self._stage_pool
                )
        except BaseException:
            if ring is not None:
                ring.fail(CheckpointError("staging failed", phase="stage"))
            self._release_arena(arena)
            raise
        return job, plan, arena, ring, waited + alloc

    @property
    def reserving(self) -> bool:
        """Whether ``reserve_async`` was called (its arena may still be filling in)."""
        return self._reserver is not None

    def reserve_async(self, state: Mapping[str, Any]) -> None:
        """Plan ``state`` now (training thread; collective under torch.distributed) and
        allocate its arena in the background, once: the manager calls it at its first
        ``step()``, so that no checkpoint's stall pays for first-touch memory."""
        if self._reserver is not None or self._closed:
            return
        _, plan = self._plan(state)
        nbytes, limit = self._arena_for(plan)

        def run() -> None:
            try:
                arena, secs = self._acquire_arena(nbytes, limit)
            except Exception as e:  # the first save allocates instead, and says why if it fails
                if not self._closed:
                    _log.warning("could not reserve a %d-byte arena: %r", nbytes, e, phase="stage")
                return
            self._release_arena(arena)
            _log.info("reserved a %d-byte arena in %.2f s", nbytes, secs, phase="stage")

        self._reserver = threading.Thread(target=run, name="pitstop-reserve", daemon=True)
        self._reserver.start()

    def reserve(self, state: Mapping[str, Any]) -> int:
        """Plan ``state`` and allocate its arena now (training thread, before the loop), so that
        the first save does not pay for first-touch memory. Returns the arena's bytes."""
        _, plan = self._plan(state)
        arena, _ = self._acquire_arena(*self._arena_for(plan))
        self._release_arena(arena)
        return arena.nbytes

    def _plan(
        self,
        state: Mapping[str, Any],
        check: Callable[[], None] | None = None,
        step: int | None = None,
    ) -> tuple[Flat, SavePlan]:
        """Flatten ``state`` and get its (cached) layout: collective (every rank's description
        is gathered, one process's by the null group; a failure on any rank fails it on
        all)."""
        chunk, rank = self.options.io.chunk_bytes, self.group.rank
        settings = [self.options.replicated, chunk, self.algorithm]
        context = {"step": step, "settings": settings}  # compared on every rank, failed or not
        flat: Flat | None = None
        items: list[Any] = []
        try:
            if check is not None:
                check()
            flat = flatten(state, allow_pickle=self.options.allow_pickle)
            items = local_items(flat, overlap=self.options.overlap)
            mine = Outcome.ok(rank, "plan", {**context, "digest": self._digest(items)})
        except Exception as e:
            mine = Outcome.of(e, rank, "plan", context)
        outcomes = gather(self.group, mine, "plan")
        seen = [tuple(o.value["settings"]) for o in outcomes]
        if len(set(seen)) > 1:
            raise DistributedCheckpointError(
                "ranks save with different settings (replicated, chunk_bytes, checksum): "
                f"{seen} (rank order); give every rank the same options "
                "and PITSTOP_* environment",
                ranks=[r for r, w in enumerate(seen) if w != seen[0]], rank=rank, phase="plan",
            )  # fmt: skip
        steps = [o.value["step"] for o in outcomes]
        if len(set(steps)) > 1:
            raise DistributedCheckpointError(
                f"ranks disagree on the step to save: {steps} (rank order); "
                "saves are collective: every rank saves the same step",
                ranks=[r for r, w in enumerate(steps) if w != steps[0]], rank=rank, phase="plan",
            )  # fmt: skip
        agree(outcomes, rank, "plan", phase="plan")
        assert flat is not None
        signature = tuple(o.value["digest"] for o in outcomes)
        plan = self._plans.cached(signature)
        if plan is None:
            everyone = self.group.all_gather(items, "plan")
            layout = assign(everyone, self.options.replicated)[self.group.rank]
            plan = self._plans.put(plan_from_layout(layout, chunk, signature))
        return flat, plan

    def _in_round(self) -> bool:
        """Whether the save being started takes a commit round (every one does here): its
        number names the round, and every rank must count the same saves."""
        return True

    def _digest(self, items: list[Any]) -> str:
        """What tells this rank's layouts apart (a plan's ``signature`` has every rank's)."""
        key = (self.options.io.chunk_bytes, self.options.replicated, items)
        return hashlib.sha256(repr(key).encode()).hexdigest()

    def save(self, step: int, state: Mapping[str, Any], **kwargs: Any) -> SaveHandle:
        """Durable and committed when it returns: ``async_save(...).wait()``."""
        with self.waited():
            handle = self.async_save(step, state, **kwargs)
        handle.wait()
        return handle

    def wait_all(self) -> None:
        """Wait for every save in flight and its retention; raise the first unreported error."""
        with self._cond:
            handles = list(self._inflight.values())
        for h in handles:
            h._finished.wait()
        if not self._closed:
            self._persist_pool.submit(lambda: None).result()  # FIFO: earlier retention is done
        self.raise_pending()

    def wait_staged(self) -> None:
        """Wait until every save in flight has its bytes in its arena (training thread): after
        this the live state may be changed by anything, not only by ``optimizer.step()``."""
        with self._cond:
            jobs = list(self._staging)
        for job in jobs:
            job.settle()

    def raise_pending(self) -> None:
        """Raise the error of a failed background save that nobody has seen yet."""
        with self._cond:
            pending, self._unreported = self._unreported, []
        for h in pending:
            err = h.take_error()
            if err is not None:
                raise err

    def close(self) -> None:
        """Wait for saves in flight, unhook optimizers, free arenas. Raises a pending error."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            if self._reserver is not None:
                self._reserver.join()  # its arena is freed below, not left behind
            for hook in list(self._hooks.values()):
                hook.remove()
            self._hooks.clear()
            self._persist_pool.shutdown(wait=True)
            self._stage_pool.shutdown(wait=True)
            self.io_pool.shutdown(wait=True)
            if self._urgent_pool is not None:
                self._urgent_pool.shutdown(wait=True)
            with self._cond:
                for arena in self._arenas:
                    unpin_arena(arena, self._buffers[id(arena)])
                    arena.close()
                self._arenas.clear()
                self._slots = 0
                self._free.clear()
                self._buffers.clear()

    # ------------------------------------------------------------------ arenas
    def _acquire_arena(self, nbytes: int, limit: int) -> tuple[Arena, float]:
        """A free arena of about ``nbytes`` (waiting for one while ``limit`` exist), and the
        seconds spent allocating it. A new arena is allocated outside the lock: its first
        touch takes seconds, and the optimizer hook must not wait for it."""
        with self._cond:
            while True:
                self._check_open()
                fit = [a for a in self._free if nbytes <= a.nbytes <= 2 * max(nbytes, 1 << 20)]
                if fit:
                    self._free.remove(fit[0])
                    return fit[0], 0.0
                if self._slots < limit or self._free:
                    if self._slots >= limit:
                        self._drop_arena(self._free.pop(0))  # wrong size: replace it
                    self._slots += 1  # taken now, so no other thread allocates past the limit
                    break
                self._cond.wait()
        t0 = time.perf_counter()
        try:
            arena = Arena(nbytes)
        except BaseException:
            with self._cond:
                self._slots -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            if self._closed:  # closed while this was allocated (a background reservation)
                self._slots -= 1
                arena.close()
                raise CheckpointError("the checkpoint manager is closed")
            self._arenas.append(arena)
            self._buffers[id(arena)] = arena_tensor(arena)
        return arena, time.perf_counter() - t0

    def _arena_for(self, plan: SavePlan) -> tuple[int, int]:
        """(bytes of the arena a save of ``plan`` uses, how many may exist): the state's size,
        ``max_in_flight`` of them; under ``host_memory_bytes``, as many as fit, or one ring
        of that size when the state does not fit."""
        budget = self.options.host_memory_bytes
        need = max(plan.file_bytes, 1)
        if budget is None:
            return need, self.options.max_in_flight
        if need <= budget:
            return need, max(1, min(self.options.max_in_flight, budget // need))
        return budget - budget % ALIGN_BYTES, 1

    def _drop_arena(self, arena: Arena) -> None:
        self._arenas.remove(arena)
        self._slots -= 1
        buffer = self._buffers.pop(id(arena))
        unpin_arena(arena, buffer)
        del buffer
        arena.close()

    def _release_arena(self, arena: Arena) -> None:
        with self._cond:
            self._free.append(arena)
            self._cond.notify_all()

    # ------------------------------------------------------------------ hooks
    def _hook_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            if opt not in self._hooks:
                self._hooks[opt] = opt.register_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, *_: Any) -> None:
        """Optimizer step pre-hook (training thread): the snapshot must see this step's state."""
        with self._cond:
            jobs = list(self._staging)
        if not jobs:
            return
        t0 = time.perf_counter()
        for job in jobs:
            job.wait_for_optimizer()
        waited = time.perf_counter() - t0
        with self._cond:
            self._staging = [j for j in self._staging if not j.copied]
            self.hook_wait_secs += waited  # the loop was stalled here too: the profiler counts it

    # ------------------------------------------------------------------ persist thread
    def _persist(
        self,
        handle: SaveHandle,
        job: StageJob,
        flat: Flat,
        plan: SavePlan,
        arena: Arena,
        directory: str,
        t0: float,
        meta: _Meta,
        ring: Ring | None = None,
    ) -> None:
        error: BaseException | None = None
        try:
            t1 = time.perf_counter()
            objects = encode_objects(flat.tree, rank=self.group.rank)

            def before_extent(
                extent: Extent,
            ) -> None:  # writer threads: wait for the extent's items
                if ring is not None:
                    ring.wait_staged(extent)
                elif extent.segments:
                    job.wait_items(max(tag[0] for _, _, tag in extent.segments))  # type: ignore[index]

            def write() -> PersistResult:
                result = persist(
                    self.storage,
                    directory,
                    plan,
                    arena.view if ring is None else typing.cast(memoryview, ring),
                    objects,
                    algorithm=self.algorithm,
                    pool=meta.writers or self.io_pool,
                    before_extent=before_extent,
                    after_extent=ring.release if ring is not None else None,
                    rank=self.group.rank,
                    hash_after=job.wait_copied if ring is None else None,
                    on_hashed=ahead.build if self.group.size == 1 else None,
                )
                job.wait_copied()
                handle.stats.stage_secs = (job.copied_at or time.perf_counter()) - t0
                handle._set_staged()
                with self._cond:
                    self._staging = [j for j in self._staging if j is not job]
                return result

            def manifest(results: list[PersistResult], hosts: list[str]) -> bytes:
                built = ahead.get(results, hosts)
                if built is not None:
                    return built
                return build(results, hosts)

            def build(results: list[PersistResult], hosts: list[str]) -> bytes:
                data = manifest_for(
                    handle.step,
                    results,
                    algorithm=self.algorithm,
                    segment_bytes=plan.segment_bytes,
                    world_size=self.group.size,
                    lineage=meta.lineage,
                    metrics=meta.metrics,
                    hosts=hosts,
                ).dumps()
                try:  # what no reader would accept is never committed
                    Manifest.loads(data, path=f"{self.storage.url}/{directory}")
                except CheckpointError as e:
                    raise CheckpointError(
                        f"the manifest of step {handle.step} would not load ({e}); not committed",
                        step=handle.step, phase="commit",
                    ) from e  # fmt: skip
                return data

            ahead = _Ahead(build)
            result = commit_together(  # one process: on the null group, in-process
                self.group, self.storage, directory, meta.seq, write, manifest, self.nodes
            )
            stats = handle.stats
            stats.nbytes, stats.direct_io = result.nbytes, result.direct
            stats.persist_secs = time.perf_counter() - t1
            stats.total_secs = time.perf_counter() - t0
            _log.info(
                "checkpoint step=%d bytes=%d stall=%.3fs persist=%.3fs write=%.2fGB/s direct=%s",
                handle.step, stats.nbytes, stats.stall_secs, stats.persist_secs, stats.write_gbps, stats.direct_io,
                phase="commit",
            )  # fmt: skip
        except BaseException as e:
            error = e
            if ring is not None:  # a stager waiting for room would wait for ever
                ring.fail(e)
            job.settle()  # no copy may still write into the arena once it is free
            self._abort(directory)
        finally:
            with self._cond:
                self._staging = [j for j in self._staging if j is not job]
            self._release_arena(arena)
        if error is None and self._on_commit is not None:
            try:  # part of the save: wait() returns after it; the next persist starts after it
                self._on_commit(handle.step)
            except Exception as e:  # retention never fails (or hangs) a committed save
                _log.warning("retention after step %d failed: %r", handle.step, e, phase="gc")
        self._finish(handle, error)

    def _finish(self, handle: SaveHandle, error: BaseException | None, report: bool = True) -> None:
        """A save ended (persist thread, or whatever finished it): no longer in flight; its
        error, if ``report``, is raised from the next call that waits; then its handle."""
        with self._cond:
            self._inflight.pop(handle.step, None)
            if error is not None and report:
                self._unreported.append(handle)
            self._cond.notify_all()
        handle._finish(error)

    def _fail_together(self, directory: str, error: BaseException) -> None:
        """This rank failed after every rank agreed to save: it still takes its turn in the
        save's commit round (reporting ``error``), so that the others fail at once instead of
        waiting out the timeout, and the next save's round is the next for every rank."""
        if self.group.size == 1:
            return
        self._seq += 1
        seq = self._seq

        def fail() -> PersistResult:
            if isinstance(error, CheckpointError) and error.phase:
                raise error
            raise CheckpointError(f"staging failed: {type(error).__name__}: {error}", phase="stage")

        def round_() -> None:
            try:
                commit_together(
                    self.group, self.storage, directory, seq, fail, _no_manifest, self.nodes
                )
            except BaseException:  # the caller already has its error; the debris goes
                self._abort(directory)

        self._persist_pool.submit(round_)

    def _abort(self, directory: str) -> None:
        try:
            self.storage.abort(directory)
        except Exception as e:  # the original error matters more; gc removes debris later
            _log.warning("could not remove debris of %s: %s", directory, e, phase="gc")

    @property
    def busy_directories(self) -> frozenset[str]:
        """Step directories of saves in flight (gc leaves them alone)."""
        with self._cond:
            return frozenset(step_dir_name(s) for s in self._inflight)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the checkpoint manager is closed")
