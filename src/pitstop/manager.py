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

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pitstop.engine.catalog import Catalog, Entry, RunIdentity
from pitstop.engine.handle import SaveHandle
from pitstop.engine.recovery import RestoreResult, recover
from pitstop.engine.restore import load_entry
from pitstop.engine.saver import Saver
from pitstop.errors import CheckpointNotFoundError
from pitstop.log import get_logger
from pitstop.loop import LoopDriver, StepResult
from pitstop.multilevel.flush import FlushRecord
from pitstop.multilevel.levels import Local, Shared
from pitstop.multilevel.stack import LevelStack
from pitstop.options import IOOptions, SaveOptions
from pitstop.policy import CheckFreq, CheckpointPolicy, KeepLast, RetentionPolicy
from pitstop.probe import CrashProbe
from pitstop.profiler import ProfileStats
from pitstop.ranks import make_group
from pitstop.state.keys import KeyMap
from pitstop.storage.base import Storage
from pitstop.storage.local import open_root
from pitstop.storage.retry import RetryingStorage

__all__ = ["CheckpointManager"]

_log = get_logger("pitstop")


class CheckpointManager:
    """Saves, restores and retires the checkpoints of one training job.

    ``root`` is a directory (or a :class:`~pitstop.storage.Storage`). ``keep_last=n`` keeps
    the newest n committed checkpoints of this run; ``retention=`` takes any retention policy
    (``KeepLast(3) | KeepEvery(secs=3600) | KeepBest("loss")``); neither keeps everything.
    ``allow_pickle`` lets values that JSON cannot hold be stored, and loaded, as pickles.
    Other knobs live in :class:`~pitstop.options.SaveOptions` or their keyword shortcuts.

    ``levels=[pitstop.Local("/local/{node}", redundancy="partner"), pitstop.Shared(path,
    every=10)]`` instead of ``root``: every save to node-local storage, protected across
    nodes, every 10th flushed to the shared level (:mod:`pitstop.multilevel`);
    ``keep_last``/``retention`` then apply to the shared level, ``Local(keep_last=2)`` to
    the local one. ``topology=`` (rank -> node id) places ranks on nodes; without it
    ``PITSTOP_NODE`` or the hostname does.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage | None = None,
        keep_last: int | None = None,
        *,
        levels: Sequence[Local | Shared] | None = None,
        topology: Mapping[int, str] | Sequence[str] | None = None,
        retention: RetentionPolicy | None = None,
        options: SaveOptions | None = None,
        allow_pickle: bool | None = None,
        max_in_flight: int | None = None,
        overlap: bool | None = None,
        io_threads: int | None = None,
        chunk_bytes: int | None = None,
        direct_io: str | None = None,
        policy: CheckpointPolicy | None = None,
        replicated: str | None = None,
        dist_timeout_secs: float | None = None,
    ) -> None:
        if keep_last is not None and retention is not None:
            raise ValueError("give keep_last= or retention=, not both")
        self.retention = KeepLast(keep_last) if keep_last is not None else retention
        knobs = {"threads": io_threads, "chunk_bytes": chunk_bytes, "direct": direct_io}
        if isinstance(root, (list, tuple)):
            raise ValueError(
                "a root is one directory or Storage; levels go in "
                "CheckpointManager(levels=[pitstop.Local(...), pitstop.Shared(...)])"
            )
        if (root is None) == (levels is None):
            raise ValueError(
                "give a root directory or levels=[pitstop.Local(...), ...], one of them"
            )
        if levels is not None:
            local, shared = _levels(levels)
            io = options.io if options else IOOptions.from_env(**knobs)
        else:
            if topology is not None:
                raise ValueError("topology= places ranks on nodes for levels=; a root has none")
            inner, io = open_root(root, options.io if options else None, **knobs)
        flags = {
            "allow_pickle": allow_pickle, "max_in_flight": max_in_flight, "overlap": overlap,
            "replicated": replicated, "dist_timeout_secs": dist_timeout_secs,
        }  # fmt: skip
        self.options = SaveOptions.resolve(options, io, **flags)
        self.group = make_group(self.options.dist_timeout_secs)  # collective under torchrun
        self.levels: LevelStack | None = None
        if levels is not None:
            self.levels = LevelStack(
                local, shared, self.group, io, topology=topology, shared_retention=self.retention
            )
            self.storage = self.levels.local_storage
            self.catalog = self.levels.local_catalog
        else:
            self.storage = RetryingStorage(inner)  # type: ignore[assignment]
            self.catalog = Catalog(self.storage)
        nodes = self.levels.node_commit() if self.levels is not None else None
        self._saver = Saver(
            self.storage, self.options, on_commit=self._retain, group=self.group, nodes=nodes
        )
        self._loop = LoopDriver(self, self._saver, policy if policy is not None else CheckFreq())
        self.identity = RunIdentity()
        if self.levels is not None:  # node leaders apply retention: one run id for all ranks
            self.identity.run = self.identity.timeline = self.group.broadcast(
                self.identity.run, "plan"
            )
            self.levels.identity = self.identity
        self.last_restore: RestoreResult | None = None
        self._probe = CrashProbe.from_env(self.latest_step)  # None unless crashtest runs us
        if self._probe is not None:  # crashtest's resume point is a checkpoint
            self._loop.policy = self._probe.resume_point(self._loop.policy)
        self._committed = False  # a checkpoint of this root committed (or was restored)
        self._closed = False

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage.url!r}, retention={self.retention!r})"

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
        if not self.identity.checked_root:
            self.identity.checked_root = True
            self.catalog.warn_other_runs(self.identity)
        lineage = self.identity.lineage_for(step)
        if self._probe is not None:
            self._probe.saved(step, state)
        return self._saver.async_save(step, state, lineage=lineage, metrics=metrics)

    def save(
        self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, float] | None = None
    ) -> SaveHandle:
        """Save ``state`` as ``step``; durable, committed and retention applied when it returns."""
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
        return self.levels.flush() if self.levels is not None else None

    def close(self, *, flush: bool = True) -> None:
        """Wait for saves in flight, flush the newest checkpoint to the shared level if it is
        not there yet (``flush=False``, or leaving a ``with`` block on an exception: not),
        and release memory and threads. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._loop.restore_signals()
        try:
            self._saver.close()
            if flush and self.levels is not None:
                record = self.levels.flush()
                if record is not None and not record.ok:
                    _log.warning("the newest checkpoint stays on the local level only",
                                 phase="flush")  # fmt: skip
        finally:
            if self.levels is not None:
                self.levels.close()
            else:
                self.catalog.close()
            self.group.close()

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
        ``async_save``. Returns SAVED (truthy), SKIPPED or REFUSED (also warned and counted in
        ``stats().refused_saves``). After a ``save_on_signal`` signal: save, SystemExit.
        ``last=True`` at the last step of training: the policy is not asked (SKIPPED), the
        final state is saved by ``save_final`` once the end-of-training work is done."""
        if last:
            self.reached(step)
            return StepResult.SKIPPED
        result = self._loop.step(step, state, loss=loss, epoch=epoch, epoch_end=epoch_end)
        self.reached(step)
        return result

    def reached(self, step: int) -> None:
        """Training finished ``step``. ``step()`` calls this itself; a loop (or integration)
        that saves with ``save``/``async_save`` calls it once per step: it is where
        ``pitstop crashtest`` kills a run (at a random step, once a checkpoint committed)."""
        if self._probe is None:
            return
        if not self._committed and self.latest_step() is not None:
            self._committed = True
        self._probe.reached(step, self._committed)

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
        return [e.step for e in self.catalog.committed() if e.step is not None]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def entries(self) -> list[Entry]:
        """Everything under the root with its status (committed, damaged, abandoned, ...)."""
        return self.catalog.scan()

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
        self.resumed(result.step)
        return result.step

    def resumed(self, step: int) -> None:
        """Training goes on from ``step``, its state back in place, random streams included.
        ``restore`` calls this itself; an integration that loads with ``load`` and puts the
        state back later (Lightning's RNG streams) calls it once it has: ``pitstop crashtest``
        records the generators here to tell a faulty restore from draws outside the state."""
        self._committed = True
        if self._probe is not None:
            self._probe.restored(step)

    def _adopt(self, result: RestoreResult) -> None:
        """Continue the restored checkpoint's run (its retention is ours now) and timeline."""
        assert result.step is not None
        self.identity.adopt(result.manifest, result.step, new_timeline=bool(result.set_aside))
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
            storage or self.storage, entry, state, saver=self._saver, allow_pickle=self.options.allow_pickle,
            strict=strict, key_map=key_map, view_rank=rank,
        )  # fmt: skip

    def load(self, step: int | None = None, *, rank: int | None = None) -> Any:
        """The saved state as fresh objects (Statefuls as state dicts); falls back like restore.
        ``rank`` (one process only): the values that saved rank kept for itself (RNG streams,
        data position) instead of rank 0's; the shared tensors are the same for every rank."""
        if rank is not None and (type(rank) is not int or rank < 0):
            raise ValueError(f"load(rank=) takes a saved rank (an int >= 0), not {rank!r}")
        if rank is not None and self.group.size > 1:
            raise ValueError(
                "load(rank=) reads one saved rank's view in one process; under "
                "torch.distributed every rank loads its own"
            )
        self._saver.wait_staged()
        result = self._recover(
            lambda s, e: self._load(e, None, True, None, rank, storage=s), step, False, False
        )
        if result.step is None:
            raise CheckpointNotFoundError("no committed checkpoint", path=self.storage.url)
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
        """One level: ``recover``. Several: ``LevelStack.recover``, the newest step any level
        can deliver (the local level's, rebuilt from redundancy where a node lost it, first
        for a step both hold); ``fetch``: a step the shared level served is copied into the
        local level."""
        if self.levels is None:
            return recover(
                self.catalog, lambda e: load(self.storage, e), step=step, rollback=rollback,
                group=self.group,
            )  # fmt: skip
        return self.levels.recover(load, step, rollback=rollback, fetch=fetch)

    # ------------------------------------------------------------------ retention and gc
    def _retain(self, newest: int) -> None:
        """Persist thread, after ``newest`` committed: apply the retention policy to this run
        (the retired ones stop being checkpoints now; their files are deleted in the background).
        Several levels: the local level's own retention and the flush (``LevelStack``)."""
        self._committed = True
        if self.levels is not None:
            self.levels.committed(newest)
            return
        if self.retention is not None and self.group.coordinator:
            retired = self.catalog.retire(self.retention, newest=newest, identity=self.identity)
            self.catalog.purge_later(retired)

    def gc(
        self, *, abandoned: bool = False, damaged: bool = False, dry_run: bool = False
    ) -> list[str]:
        """Remove debris of dead saves (and abandoned or damaged checkpoints when asked); saves in
        flight and pinned checkpoints are kept. Returns the names. Several ranks: rank 0 acts."""
        if not self.group.coordinator:
            return []
        done = self.catalog.collect(
            abandoned=abandoned, damaged=damaged, busy=self._saver.busy_directories, dry_run=dry_run
        )
        return [e.name for e, what in done if what in ("removed", "would remove")]


def _levels(levels: Sequence[Local | Shared]) -> tuple[Local, Shared | None]:
    """The one Local level and at most one Shared level of ``levels=``."""
    local = [lv for lv in levels if isinstance(lv, Local)]
    shared = [lv for lv in levels if isinstance(lv, Shared)]
    others = [lv for lv in levels if not isinstance(lv, (Local, Shared))]
    if others or len(local) != 1 or len(shared) > 1:
        raise ValueError(
            "levels= takes one pitstop.Local(...) and at most one pitstop.Shared(...), got "
            f"{list(levels)!r}"
        )
    return local[0], (shared[0] if shared else None)
