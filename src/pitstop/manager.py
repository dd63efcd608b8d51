"""CheckpointManager: the object a training loop holds; a thin front over the engine.

Call sequence (training thread)::

    ckpt = CheckpointManager("ckpts", keep_last=3)
    start = ckpt.restore(state)            # newest valid step, loaded in place; None if none
    for step in range(start or 0, ...):
        ...                                # forward, backward, optimizer.step()
        ckpt.async_save(step, state)       # or ckpt.save(step, state): durable on return
    ckpt.close()                           # waits for saves in flight

or let a policy choose when: ``ckpt.step(step, state, loss=...)`` each iteration.
Behind it: :class:`~pitstop.engine.saver.Saver` (plan, stage, persist, commit),
:class:`~pitstop.engine.catalog.Catalog` (statuses, pins, retention, gc),
:func:`~pitstop.engine.recovery.recover` (restore with fallback and timelines) and
:class:`~pitstop.loop.LoopDriver` (profiler + schedule policy). Retention runs on the
persist thread right after each commit, before ``save()`` or ``wait()`` returns.

Under torch.distributed (torchrun; gloo or NCCL) the same calls are collective: every rank
constructs the manager, and calls ``save``/``async_save``/``step``/``restore``/``load``/
``close`` at the same steps. Ranks split the writing (:mod:`pitstop.ranks.sharding`), one
manifest is committed when every rank's files are durable, retention and gc run on rank 0,
and a rank that fails or does not arrive within ``dist_timeout_secs`` makes every rank
raise DistributedCheckpointError. The background threads never use the training's
process group.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pitstop.engine.catalog import Catalog, Entry, RunIdentity
from pitstop.engine.handle import SaveHandle
from pitstop.engine.recovery import RestoreResult
from pitstop.engine.restore import load_entry
from pitstop.engine.saver import Saver
from pitstop.errors import CheckpointExistsError, CheckpointNotFoundError
from pitstop.levels.flush import FlushRecord
from pitstop.levels.memory_saver import LayoutChangedError, MemorySaver, NoFreeSlotError
from pitstop.levels.spec import Local, Memory, Shared, check_levels, split_memory
from pitstop.levels.stack import LevelStack, open_levels
from pitstop.log import get_logger
from pitstop.loop import LoopDriver, StepResult
from pitstop.options import IOOptions, SaveOptions
from pitstop.policy import CheckFreq, CheckpointPolicy, KeepLast, RetentionPolicy
from pitstop.probe import CrashProbe
from pitstop.profiler import ProfileStats
from pitstop.ranks import make_group
from pitstop.ranks.group import Group
from pitstop.state.keys import KeyMap
from pitstop.storage.base import Storage
from pitstop.storage.local import open_root

__all__ = ["CheckpointManager", "ManagerHooks"]

_log = get_logger("pitstop")

_PRIVATE = ("catalog", "group", "identity", "storage", "levels")  # public before hooks
# keywords that copied SaveOptions / IOOptions fields: deprecated, still honoured
_LEGACY_SAVE = ("allow_pickle", "max_in_flight", "overlap", "replicated", "dist_timeout_secs")
_LEGACY_IO = {"io_threads": "threads", "chunk_bytes": "chunk_bytes", "direct_io": "direct"}


class CheckpointManager:
    """Saves, restores and retires the checkpoints of one training job.

    ``CheckpointManager(root, keep_last=None, *, policy=, retention=, options=)``:

    * ``root``: a directory or a :class:`~pitstop.storage.Storage`; or a list of levels,
      ``[pitstop.Local("/local/{node}", redundancy="partner"), pitstop.Shared(path,
      every=10)]``: every save to node-local storage, protected across nodes, every 10th
      flushed to the shared level (:mod:`pitstop.levels`; more shared levels may follow,
      fastest first, each on its own schedule); ``keep_last``/``retention`` then apply to
      the shared levels without a ``keep_last`` of their own, ``Local(keep_last=2)`` to the local one, and
      ``topology=`` (rank -> node id) places ranks on nodes (default: ``PITSTOP_NODE`` or
      the hostname).
    * ``keep_last=n`` keeps the newest n committed checkpoints of this run; ``retention=``
      takes any retention policy (``KeepLast(3) | KeepEvery(secs=3600) | KeepBest("loss")``);
      neither keeps everything.
    * ``policy=``: when ``step()`` checkpoints (default ``CheckFreq(0.02)``; combine with
      ``|``).
    * ``options=``: :class:`~pitstop.options.SaveOptions` (``allow_pickle``,
      ``host_memory_bytes``, ``max_in_flight``, ``replicated``, ``dist_timeout_secs``, and
      ``io=IOOptions(...)``). The keyword copies of its fields (``allow_pickle=``,
      ``io_threads=``, ...) and ``levels=`` are deprecated.

    Integrations and tools reach the rest through ``ckpt.hooks`` (:class:`ManagerHooks`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage | Sequence[Memory | Local | Shared] | None = None,
        keep_last: int | None = None,
        *,
        policy: CheckpointPolicy | None = None,
        retention: RetentionPolicy | None = None,
        options: SaveOptions | None = None,
        topology: Mapping[int, str] | Sequence[str] | None = None,
        levels: Sequence[Local | Shared] | None = None,
        **legacy: Any,
    ) -> None:
        if keep_last is not None and retention is not None:
            raise ValueError("give keep_last= or retention=, not both")
        self.retention = KeepLast(keep_last) if keep_last is not None else retention
        root, knobs, flags = _legacy_arguments(root, levels, legacy)
        if options is not None and legacy:
            raise ValueError(
                f"give {', '.join(f'{k}=' for k in legacy)} inside options=SaveOptions(...) "
                "(IOOptions for the I/O knobs), not beside it"
            )
        io, open_levels = _levels_of(root, options, knobs, topology, self.retention)
        self.options = SaveOptions.resolve(options, io, **flags)
        self._group = make_group(self.options.dist_timeout_secs)  # collective under torchrun
        self._identity = RunIdentity()
        self._levels = open_levels(self._group)  # collective with a list of levels
        self._levels.bind(self._identity)
        self._storage, self._catalog = self._levels.storage, self._levels.catalog
        self._memory = self._levels.memory  # pitstop.Memory() first: saves stage into it
        self._saver = (
            Saver(
                self._storage, self.options, on_commit=self._retain, group=self._group,
                nodes=self._levels.node_commit(),
            )
            if self._memory is None
            else MemorySaver(
                self._storage, self.options, memory=self._memory, on_commit=self._retain,
                group=self._group, nodes=self._levels.node_commit(),
            )
        )  # fmt: skip
        self._loop = LoopDriver(self, self._saver, policy if policy is not None else CheckFreq())
        self._loop.memory = self._memory
        self.hooks = ManagerHooks(self)
        self.last_restore: RestoreResult | None = None
        self._probe = CrashProbe.from_env(self.latest_step)  # None unless crashtest runs us
        if self._probe is not None:  # crashtest's resume point is a checkpoint
            self._loop.policy = self._probe.resume_point(self._loop.policy)
        self._committed = False  # a checkpoint of this root committed (or was restored)
        self._closed = False

    if not TYPE_CHECKING:  # (mypy keeps checking attribute names)

        def __getattr__(self, name: str) -> Any:
            """The attributes that were public before ``hooks``: deprecated, still there."""
            if name in _PRIVATE:
                warnings.warn(
                    f"CheckpointManager.{name} is private now: use ckpt.hooks.{name} "
                    "(integrations and tools) or ckpt.url / ckpt.flush_records",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return self.__dict__[f"_{name}"]
            raise AttributeError(f"'CheckpointManager' object has no attribute {name!r}")

    @property
    def url(self) -> str:
        """Where the checkpoints are (with levels: this node's local level)."""
        return self._storage.url

    @property
    def flush_records(self) -> list[FlushRecord]:
        """With shared levels: the outcome of each recent flush (``ok``/``error``; ``level``
        names the level), oldest first; empty otherwise."""
        return self._levels.flush_records()

    def __repr__(self) -> str:
        return f"CheckpointManager({self._storage.url!r}, retention={self.retention!r})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(flush=exc_type is None)

    # ------------------------------------------------------------------ save
    def async_save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None
    ) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background.
        ``metrics`` (e.g. ``{"val_loss": 0.3}``) are saved in the manifest for ``KeepBest``."""
        if not self._identity.checked_root:
            self._identity.checked_root = True
            self._catalog.warn_other_runs(self._identity)
        lineage = self._identity.lineage_for(step)
        if self._probe is not None:
            self._probe.saved(step, state)
        metrics = _finite_metrics(metrics, step)
        handle = self._saver.async_save(step, state, lineage=lineage, metrics=metrics)
        self._loop.saved(step)
        return handle

    def save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None
    ) -> SaveHandle:
        """Save ``state`` as ``step``; durable, committed and retention applied when it returns."""
        with self._saver.waited():  # its writers keep normal priority: nothing to yield to
            handle = self.async_save(step, state, metrics=metrics)
        handle.wait()
        return handle

    def save_final(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None
    ) -> SaveHandle | None:
        """After the last step (``step(..., last=True)``) and the work after it (evaluation,
        ``scheduler.step()``): wait for saves in flight, then save ``state`` as ``step``,
        durable when it returns. None if ``step`` is committed already: restored (a rerun of
        a finished run: nothing to do) or saved by the policy before the end-of-training work
        (a warning: that checkpoint holds the state of that moment)."""
        self.wait()
        if step not in self.steps():
            return self.save(step, state, metrics=metrics)
        restored = self.last_restore is not None and self.last_restore.step == step
        if not restored:
            _log.warning(
                "final state not saved: step %d was checkpointed during training, before the "
                "work after it; pass last=True to ckpt.step() at the last step",
                step, phase="plan",
            )  # fmt: skip
        return None

    def reserve(self, state: Mapping[str, Any]) -> int:
        """Allocate the staging arena now, not at the first save (first touch is slow)."""
        return self._saver.reserve(state)

    def wait(self) -> None:
        """Wait for every save in flight and its retention; raise the error of a failed one."""
        self._saver.wait_all()

    def flush(self) -> FlushRecord | None:
        """With a shared level: copy the newest checkpoint this process committed to it now,
        unless it is there already, and wait. Collective. Its FlushRecord (``ok``/``error``);
        None if there was nothing to flush. ``close()`` does this itself."""
        self._saver.wait_all()
        return self._levels.flush()

    def close(self, *, flush: bool = True) -> None:
        """Wait for saves in flight, flush the newest checkpoint to the shared level if it is
        not there yet (``flush=False``, or leaving a ``with`` block on an exception: not),
        and release memory and threads. A memory level's newest snapshot goes to the next
        level first; where it cannot (``flush=False``, a failed write), its segments are left
        as a crash would leave them (the keeper writes what it can, a restart takes them
        over). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._loop.restore_signals()
        try:
            if isinstance(self._saver, MemorySaver) and self._memory is not None:
                if not flush:  # (an exception left the with block): as at a crash
                    self._memory.leave("close(flush=False) wrote nothing from memory")
                elif not self._saver.write_newest():  # what only memory held: to the next
                    self._memory.leave("the newest snapshot was not written to the next level")
            self._saver.close()
            if flush:
                record = self._levels.flush()
                if record is not None and not record.ok:
                    _log.warning("the newest checkpoint stays on the local level only",
                                 phase="flush")  # fmt: skip
        finally:
            self._levels.close()
            self._group.close()

    @property
    def host_bytes(self) -> int:
        """Host memory held by staging arenas."""
        return self._saver.host_bytes

    @property
    def history(self) -> list[SaveHandle]:
        """Handles of the most recent saves (their ``stats`` hold the timings)."""
        return list(self._saver.history)

    # ------------------------------------------------------------------ policy-driven
    def step(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        loss: float | None = None,
        epoch: int | None = None,
        epoch_end: bool = False,
        last: bool = False,
    ) -> StepResult:
        """Once per iteration, after ``optimizer.step()``: measure, ask the policy, maybe
        ``async_save``. Returns SAVED (truthy), SKIPPED, SNAPSHOT (a memory level's snapshot,
        not durable) or REFUSED (also warned and counted in ``stats().refused_saves``). After
        a ``save_on_signal`` signal: save, SystemExit.
        ``last=True`` at the last step of training: the policy is not asked (SKIPPED), the
        final state is saved by ``save_final`` once the end-of-training work is done."""
        if last:
            self._reached(step, state)
            return StepResult.SKIPPED
        result = self._loop.step(step, state, loss=loss, epoch=epoch, epoch_end=epoch_end)
        memory = result is StepResult.SKIPPED and self._memory is not None
        if memory and self._snapshot(step, state):
            result = StepResult.SNAPSHOT
        self._reached(step, state)
        return result

    def _snapshot(self, step: int, state: Mapping[str, Any]) -> bool:
        """With a memory level: a memory snapshot of ``step`` on its schedule (``every``),
        between the policy's durable saves; whether one was staged. No free slot (the keeper
        is busy) or no memory level after all: skipped. Its time is not an iteration's (the
        policy measures iterations)."""
        assert self._memory is not None and isinstance(self._saver, MemorySaver)
        if step % self._memory.spec.every:
            return False
        if not self._memory.active:
            self._saver.skip_snapshot(step)
            return False
        t0 = time.perf_counter()
        staged = True
        try:
            self._saver.async_save(
                step, state, lineage=self._identity.lineage_for(step), durable=False
            )
        except LayoutChangedError as e:  # several ranks: a plan every rank agrees on is
            staged = False  # made by a durable save, which this rank asks for in the vote
            if self._loop.asked is None:
                _log.warning("rank %d: memory snapshot of step %d skipped: %s; every rank "
                             "saves at the next step, then the snapshots go on",
                             self._group.rank, step, e, phase="plan")  # fmt: skip
            self._loop.asked = str(e)
        except (NoFreeSlotError, CheckpointExistsError) as e:
            staged = False
            _log.debug("memory snapshot of step %d skipped: %s", step, e, phase="stage")
        self._loop.exclude(time.perf_counter() - t0)
        return staged

    def reached(self, step: int) -> None:
        """Deprecated: ``ckpt.hooks.reached(step)``."""
        _deprecated("reached")
        self._reached(step)

    def resumed(self, step: int) -> None:
        """Deprecated: ``ckpt.hooks.resumed(step)``."""
        _deprecated("resumed")
        self._resumed(step)

    def _reached(self, step: int, state: Mapping[str, Any] | None = None) -> None:
        """See :meth:`ManagerHooks.reached` (crashtest kills a run here, at a chosen step,
        once a checkpoint committed; ``state``: ``step()``'s, for the probe's epochs)."""
        if self._probe is None:
            return
        if not self._committed and self.latest_step() is not None:
            self._committed = True
        self._probe.reached(step, self._committed, state)

    def pause(self) -> None:
        """Other work (evaluation) follows: the time until the next ``step()`` is not measured."""
        self._loop.pause()

    def stats(self) -> ProfileStats:
        """Running estimates: iteration time, stall, persist time, slowdown, overhead, refusals."""
        return self._loop.stats()

    def save_on_signal(self, *signals: int, exit_code: int | None = 0) -> None:
        """On ``signals`` (default SIGTERM, SIGUSR1) the next ``step()`` saves and exits with
        ``exit_code`` (None: no exit). Call from the main thread."""
        self._loop.save_on_signal(signals, exit_code)

    @property
    def policy(self) -> CheckpointPolicy:
        return self._loop.policy

    @property
    def preempted(self) -> bool:
        """True once a signal of ``save_on_signal`` arrived."""
        return self._loop.preempted is not None

    # ------------------------------------------------------------------ query
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [e.step for e in self._catalog.committed() if e.step is not None]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def entries(self) -> list[Entry]:
        """Everything under the root with its status (committed, damaged, abandoned, ...)."""
        return self._catalog.scan()

    # ------------------------------------------------------------------ restore
    def restore(
        self,
        state: Mapping[str, Any],
        step: int | None = None,
        *,
        strict: bool = True,
        key_map: KeyMap | None = None,
        rollback: bool | None = None,
    ) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place; the step, or
        None. Damage: marked, next older tried; I/O errors: raised after retries. ``strict=False``
        loads the keys the state has; ``key_map`` renames saved keys. ``rollback`` (default: for a
        strict, whole-state restore) sets newer checkpoints aside: a new timeline starts. A
        partial restore (evaluation) rolls nothing back. ``last_restore``: what was skipped."""
        self._saver.raise_pending()
        self._saver.wait_staged()  # a save in flight must not copy what restore writes
        rollback = strict if rollback is None else rollback
        result = self._recover(
            lambda s, e: self._load(e, state, strict, key_map, storage=s), step, rollback
        )
        if result.step is None:
            return None
        _value, result.keys = result.value
        result.value = None
        self.last_restore = result
        if result.keys is not None and result.keys.missing:
            _log.warning(
                "restored step %d without %d keys the checkpoint lacks (left as they were): %s",
                result.step, len(result.keys.missing), ", ".join(result.keys.missing[:10]),
                phase="restore",
            )  # fmt: skip
        if rollback:
            self._adopt(result)
        self._resumed(result.step)
        return result.step

    def _resumed(self, step: int) -> None:
        """See :meth:`ManagerHooks.resumed` (``pitstop crashtest`` records the generators here
        to tell a faulty restore from draws outside the state)."""
        self._committed = True
        if self._probe is not None:
            self._probe.restored(step)

    def _adopt(self, result: RestoreResult) -> None:
        """Continue the restored checkpoint's run (its retention is ours now) and timeline."""
        assert result.step is not None
        self._identity.adopt(result.manifest, result.step, new_timeline=result.timeline)
        self._loop.ckpt_step = result.step  # the policy counts from the restored checkpoint

    def _load(
        self,
        entry: Entry,
        state: Mapping[str, Any] | None,
        strict: bool,
        key_map: KeyMap | None,
        rank: int | None = None,
        storage: Storage | None = None,
    ) -> Any:
        return load_entry(
            storage or self._storage, entry, state, saver=self._saver, allow_pickle=self.options.allow_pickle,
            strict=strict, key_map=key_map, view_rank=rank,
        )  # fmt: skip

    def load(self, step: int | None = None, *, rank: int | None = None) -> Any:
        """The saved state as fresh objects (Statefuls as state dicts); falls back like restore.
        ``rank`` (one process only): the values that saved rank kept for itself (RNG streams,
        data position) instead of rank 0's; the shared tensors are the same for every rank."""
        if rank is not None and (type(rank) is not int or rank < 0):
            raise ValueError(f"load(rank=) takes a saved rank (an int >= 0), not {rank!r}")
        if rank is not None and self._group.size > 1:
            raise ValueError(
                "load(rank=) reads one saved rank's view in one process; under "
                "torch.distributed every rank loads its own"
            )
        self._saver.wait_staged()
        result = self._recover(
            lambda s, e: self._load(e, None, True, None, rank, storage=s), step, False, False
        )
        if result.step is None:
            raise CheckpointNotFoundError("no committed checkpoint", path=self._storage.url)
        self.last_restore = result
        value, _ = result.value
        result.value = None
        return value

    def _recover(
        self,
        load: Callable[[Storage, Entry], Any],
        step: int | None,
        rollback: bool,
        fetch: bool = True,
    ) -> RestoreResult:
        """The newest step any level can deliver: the one recovery walk over the list
        (``LevelStack.recover``; a node-local level's step rebuilt from redundancy where a
        node lost it; the fastest level first for a step several hold); ``fetch``: a step a
        slower level served is copied into the node-local level."""
        return self._levels.recover(load, step, rollback=rollback, fetch=fetch)

    # ------------------------------------------------------------------ retention and gc
    def _retain(self, newest: int) -> None:
        """Persist thread, after ``newest`` committed: the levels' retention (the retired
        stop being checkpoints now; their files are deleted in the background) and, with
        shared levels, the flushes their schedules ask for."""
        self._committed = True
        self._levels.committed(newest)

    def gc(
        self, *, abandoned: bool = False, damaged: bool = False, dry_run: bool = False
    ) -> list[str]:
        """Remove debris of dead saves (and abandoned or damaged checkpoints when asked); saves in
        flight and pinned checkpoints are kept. Returns the names. Several ranks: rank 0 acts."""
        if not self._group.coordinator:
            return []
        done = self._catalog.collect(
            abandoned=abandoned, damaged=damaged, busy=self._saver.busy_directories, dry_run=dry_run
        )
        return [e.name for e, what in done if what in ("removed", "would remove")]


def _levels_of(
    root: Any,
    options: SaveOptions | None,
    knobs: dict[str, Any],
    topology: Mapping[int, str] | Sequence[str] | None,
    retention: RetentionPolicy | None,
) -> tuple[IOOptions, Callable[[Group], LevelStack]]:
    """The I/O options of ``root`` and how to open its levels once the group exists: a list
    of levels, or one root (a list of one)."""
    if isinstance(root, (list, tuple)):
        check_levels(split_memory(root)[1])
        io = options.io if options else IOOptions.from_env(**knobs)
        return io, lambda group: open_levels(
            root, group, io, topology=topology, retention=retention
        )
    if root is None:
        raise ValueError(
            "give a root: a directory, a Storage, or a list of levels "
            "[pitstop.Local(...), pitstop.Shared(...)]"
        )
    if topology is not None:
        raise ValueError("topology= places ranks on nodes for a list of levels; a root has none")
    inner, io = open_root(root, options.io if options else None, **knobs)
    return io, lambda group: open_levels(root, group, io, inner=inner, retention=retention)


def _deprecated(name: str) -> None:
    warnings.warn(
        f"ckpt.{name}() is deprecated: use ckpt.hooks.{name}()", DeprecationWarning, stacklevel=3
    )


def _legacy_arguments(
    root: Any, levels: Sequence[Local | Shared] | None, legacy: dict[str, Any]
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(the root, IOOptions knobs, SaveOptions flags) from the deprecated keywords: the
    option copies and ``levels=`` warn, and still work for this release."""
    unknown = sorted(set(legacy) - set(_LEGACY_SAVE) - set(_LEGACY_IO))
    if unknown:
        raise TypeError(f"CheckpointManager() got an unexpected keyword argument {unknown[0]!r}")
    if legacy:
        given = ", ".join(f"{k}=" for k in legacy)
        warnings.warn(
            f"CheckpointManager({given}) is deprecated: pass options=pitstop.SaveOptions(...) "
            "(I/O knobs: SaveOptions(io=pitstop.IOOptions(threads=, chunk_bytes=, direct=)))",
            DeprecationWarning,
            stacklevel=3,
        )
    if levels is not None:
        warnings.warn(
            "CheckpointManager(levels=[...]) is deprecated: pass the list of levels as the root, "
            "CheckpointManager([pitstop.Local(...), pitstop.Shared(...)])",
            DeprecationWarning,
            stacklevel=3,
        )
        if root is not None:
            raise ValueError("give a root or levels=, not both (levels= is deprecated)")
        root = list(levels)
    knobs = {_LEGACY_IO[k]: legacy.get(k) for k in _LEGACY_IO}
    flags = {k: legacy.get(k) for k in _LEGACY_SAVE}
    return root, knobs, flags


class ManagerHooks:
    """What integrations (Lightning, Hugging Face) and tools (``pitstop crashtest``, the CLI)
    reach of a manager beyond its public methods: ``ckpt.hooks``. Training thread.

    * ``reached(step)``: training finished ``step``. ``ckpt.step()`` calls it itself; a loop
      or integration that saves with ``save``/``async_save`` calls it once per step: it is
      where ``pitstop crashtest`` kills a run.
    * ``resumed(step)``: training goes on from ``step`` with its state back in place, random
      streams included (``restore`` calls it; an integration that loads with ``load`` and
      puts the state back later calls it once it has).
    * ``storage``, ``catalog``, ``identity``, ``levels``, ``group``: the root's storage, its
      catalog (statuses, pins, marks), the run's identity (run id, timeline), the levels
      (:class:`~pitstop.levels.stack.LevelStack`; one root is a list of one, whose
      ``flushers`` is empty) and
      pitstop's side group of the ranks (a null one in one process).
    """

    def __init__(self, manager: CheckpointManager) -> None:
        self._m = manager

    def reached(self, step: int) -> None:
        self._m._reached(step)

    def resumed(self, step: int) -> None:
        self._m._resumed(step)

    @property
    def storage(self) -> Storage:
        return self._m._storage

    @property
    def catalog(self) -> Catalog:
        return self._m._catalog

    @property
    def identity(self) -> RunIdentity:
        return self._m._identity

    @property
    def levels(self) -> LevelStack:
        return self._m._levels

    @property
    def group(self) -> Any:
        return self._m._group


def _finite_metrics(metrics: Mapping[str, float] | None, step: int) -> dict[str, float] | None:
    """The metrics a manifest can hold: a NaN or infinite one (a diverging loss, an AMP
    overflow: ordinary events) is left out with a warning naming it, never a failed save;
    one that is not a number is refused now, naming it, not in the background."""
    if not metrics:
        return None
    kept: dict[str, float] = {}
    for name, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"metrics[{name!r}] of step {step} is {type(value).__name__} {value!r}, not a "
                "number"
            ) from None
        if math.isfinite(number):
            kept[str(name)] = number
        else:
            _log.warning("metric %r of step %d is %s: the checkpoint is saved without it",
                         name, step, number, phase="plan")  # fmt: skip
    return kept
