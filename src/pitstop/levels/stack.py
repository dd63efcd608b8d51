"""LevelStack: the list of levels of one manager. ``CheckpointManager("ckpts")`` is a list of
one (:class:`~pitstop.levels.root.RootLevel`); ``CheckpointManager([pitstop.Local(...),
pitstop.Shared(...), ...])`` starts with the node-local level
(:class:`~pitstop.levels.node.NodeLevel`) or with a shared one, then the levels each save is
flushed to on their own schedules (:class:`~pitstop.levels.flush.FlushTarget`).

Call sequence (every rank; the manager makes these calls)::

    stack = open_levels(root, group, io, topology=..., retention=...)   # training thread,
                                                     #   collective
    stack.bind(identity)                             # collective: one run id
    saver = Saver(stack.storage, ..., nodes=stack.node_commit())
      replicate / decide / decided                   # persist thread, inside each commit:
                                                     #   the first level's redundancy; rank 0
                                                     #   names the levels this step goes to
    stack.committed(step)                            # persist thread, after the commit: the
                                                     #   flushes rank 0 named, the first
                                                     #   level's retention
    result = stack.recover(load, step, rollback=..., fetch=...)   # training thread,
                                                     #   collective: :mod:`.restart`
    stack.flush()                                    # training thread: the newest step this
                                                     #   process committed, now (close too)
    stack.close()

Every save is the same transaction whatever the list (``engine.collective.commit_together``
with the first level's leaders: rank 0 for a plain level, each node's lowest rank for the
node-local one); every flush too, on the flush thread of each level after the first.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from pitstop.engine.catalog import Catalog, RunIdentity
from pitstop.engine.collective import NodeCommit
from pitstop.engine.recovery import RestoreResult
from pitstop.format.manifest import Manifest
from pitstop.format.names import LEVELS_FILE, step_dir_name
from pitstop.levels.flush import Flusher, FlushJob, FlushRecord, FlushTarget
from pitstop.levels.memory_level import MemoryLevel
from pitstop.levels.node import NodeLevel
from pitstop.levels.restart import Restart
from pitstop.levels.root import RootLevel
from pitstop.levels.spec import Local, Shared, check_levels, level_names, split_memory
from pitstop.log import get_logger
from pitstop.options import IOOptions
from pitstop.policy import KeepLast, RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.storage.base import Storage
from pitstop.storage.local import object_url, open_root
from pitstop.storage.retry import RetryingStorage

__all__ = ["LevelStack", "open_levels"]

_log = get_logger("pitstop.levels")

First = NodeLevel | RootLevel


def open_levels(
    root: Any,
    group: Group,
    io: IOOptions,
    *,
    inner: Storage | None = None,
    topology: Mapping[int, str] | Sequence[str] | None = None,
    retention: RetentionPolicy | None = None,
) -> LevelStack:
    """Collective: the levels of ``root`` (a list of levels; else one root, whose opened
    storage is ``inner``). ``retention``: the manager's, for the root and for the levels
    without a ``keep_last`` of their own."""
    if inner is not None:
        return LevelStack(RootLevel(inner, group, retention), [], group)
    memory_spec, root = split_memory(root)
    first_spec, shared = check_levels(root)
    inners = [open_root(level.path, io)[0] for level in shared]  # (a URL's client, first)
    names = level_names([first_spec, *shared] if isinstance(first_spec, Shared) else shared)
    first: First
    if isinstance(first_spec, Local):
        first = NodeLevel(first_spec, group, io, topology=topology)
    else:
        storage, _ = open_root(first_spec.path, io)
        keep = KeepLast(first_spec.keep_last) if first_spec.keep_last is not None else retention
        first = RootLevel(storage, group, keep, name=names.pop(0))
    targets = []
    for spec, name, inner_ in zip(shared, names, inners):
        storage_: Storage = RetryingStorage(inner_)  # type: ignore[assignment]
        keep = KeepLast(spec.keep_last) if spec.keep_last is not None else retention
        flusher = Flusher(first.catalog, storage_, group.channel(), name=name)
        targets.append(
            FlushTarget(name, spec, storage_, group, flusher, spec.make_schedule(), keep)
        )
    memory = (
        MemoryLevel(memory_spec, group, io, first.storage, topology=topology)
        if memory_spec
        else None
    )
    return LevelStack(first, targets, group, memory=memory)


class LevelStack:
    """See the module docstring."""

    def __init__(
        self,
        first: First,
        targets: Sequence[FlushTarget],
        group: Group,
        *,
        memory: MemoryLevel | None = None,
    ) -> None:
        self.group, self.first, self.targets = group, first, list(targets)
        self.memory = memory  # before the first: snapshots in memory, written to the first
        for t in self.targets:
            t.flusher.on_done = partial(self.flushed, t)
        self.identity: RunIdentity | None = None
        self._flush: set[str] = set()  # rank 0's word for the step being committed
        self._manifest: Manifest | None = None  # of the step being committed
        self._newest: tuple[int, Manifest] | None = None  # committed by this process
        self._write_levels_file()

    @property
    def storage(self) -> Storage:
        """Where saves commit: the first level (this node's directory of a node-local one)."""
        return self.first.storage

    @property
    def catalog(self) -> Catalog:
        return self.first.catalog

    @property
    def levels(self) -> list[Any]:
        """Every level, fastest first (the memory level, the first, the flushed ones)."""
        memory = [self.memory] if self.memory is not None and self.memory.listed else []
        return [*memory, self.first, *self.targets]

    def bind(self, identity: RunIdentity) -> None:
        """Collective: the run's identity, one run id for every rank (the node leaders and
        rank 0 apply retention to it)."""
        identity.run = identity.timeline = self.group.broadcast(identity.run, "plan")
        self.identity = identity

    # ------------------------------------------------------------------ save
    def node_commit(self) -> NodeCommit:
        return NodeCommit(self.first.leaders, self._replicate, self._decide, self._decided)

    def _replicate(self, directory: str, manifest: bytes) -> None:
        self._manifest = Manifest.loads(manifest, path=self.storage.url) if self.targets else None
        self.first.replicate(directory, manifest)

    @property
    def flushers(self) -> list[Flusher]:
        """The flusher of every level after the first, in the order of the list."""
        return [t.flusher for t in self.targets]

    @property
    def flusher(self) -> Flusher | None:
        """The first flushed level's flusher (None without one)."""
        return self.targets[0].flusher if self.targets else None

    def _decide(self) -> dict[str, Any]:
        """Rank 0, once every rank replicated: which levels get this step? Each level's
        schedule decides on the commits and seconds since its last flush; a level with two
        flushes still queued is put off (the flush never holds training up: the next commit
        is flushed instead). After a restart the first commit goes to every level that lacks
        the restored step."""
        step = self._manifest.step if self._manifest is not None else -1
        out = []
        for t in self.targets:
            t.since += 1
            due = t.schedule.decide(t.context(step)) or t.due
            if due and t.flusher.pending < 2:
                t.since, t.last_secs, t.due = 0, time.monotonic(), False
                out.append(t.name)
            elif due:
                t.due = True
                _log.warning("flush to the %s level put off: two flushes are still queued",
                             t.name, phase="flush")  # fmt: skip
        return {"flush": out}

    def _decided(self, word: Any) -> None:
        names = word.get("flush") if isinstance(word, dict) else None
        self._flush = {str(n) for n in names} if isinstance(names, list) else set()

    def committed(self, step: int) -> None:
        """Persist thread, after ``step`` committed on the first level: flush it to the
        levels rank 0 named (pinned first), then the first level's retention."""
        manifest, self._manifest = self._manifest, None
        if manifest is not None:
            self._newest = (step, manifest)
        flush, self._flush = self._flush, set()
        for t in self.targets:
            if t.name in flush and manifest is not None:
                self._submit(t, step, manifest)
        self.first.committed(step, self.identity)

    def _submit(self, target: FlushTarget, step: int, manifest: Manifest) -> None:
        target.flushed = step
        job = FlushJob(self.storage, step_dir_name(step), manifest, self.group.rank)
        target.flusher.submit(job)

    def flush(self) -> FlushRecord | None:
        """Training thread, every rank, no save in flight: flush the newest step this
        process committed now to every level that was not given it yet; wait. The record
        of the first level whose flush failed, else of the last level flushed (None:
        nothing to flush). Every rank decides alike: they committed the same steps."""
        newest = self._newest
        if newest is None:
            return None

        def done(t: FlushTarget) -> bool:
            return any(r.step == newest[0] for r in t.flusher.records)

        todo = [t for t in self.targets if newest[0] > t.flushed or not done(t)]
        for t in todo:
            if newest[0] > t.flushed:
                self._submit(t, *newest)
        records = []
        for t in todo:  # a flush of it already under way (its schedule's) waited for too
            t.flusher.drain()
            got = next((r for r in reversed(t.flusher.records) if r.step == newest[0]), None)
            if got is not None:
                records.append(got)
        return next((r for r in records if not r.ok), records[-1] if records else None)

    def flush_records(self) -> list[FlushRecord]:
        """Every level's recent flush records, oldest first."""
        out = [r for t in self.targets for r in t.flusher.records]
        return sorted(out, key=lambda r: r.step)

    def flushed(self, target: FlushTarget, record: FlushRecord) -> None:
        """Flush thread of ``target``, rank 0: that level's retention after a flush committed."""
        if record.ok:
            target.committed(record.step, self.identity)

    # ------------------------------------------------------------------ restart
    def recover(
        self,
        load: Any,
        step: int | None = None,
        *,
        rollback: bool = False,
        fetch: bool = True,
    ) -> RestoreResult:
        """Collective: the one recovery walk over the list (:mod:`pitstop.levels.restart`)."""
        commits_to = 1 if self.memory is not None and self.memory.listed else 0
        result = Restart(self.group, self.levels, commits_to=commits_to).recover(
            load, step, rollback=rollback, fetch=fetch
        )
        if rollback:
            self._newest = None  # a step this process committed may be set aside now
            if self.memory is not None and self.memory.listed and result.step is not None:
                # staged ones too, and those a keeper pins (off: another process's, untouched)
                result.set_aside += self.memory.drop_after(result.step)
            if result.step is not None:
                result.timeline = self._new_timeline(bool(result.set_aside))
        return result

    def _new_timeline(self, set_aside: bool) -> str | None:
        """Collective after a rollback restore: the timeline every rank's next steps carry.
        New (the coordinator's draw) when any rank set a step aside (memory snapshots differ
        by rank: one rank may drop a step another never took), else None (the restored one
        goes on). Drawn per rank, the ranks' memory parts of later steps disagreed on lineage
        and were never joined."""
        fresh = uuid.uuid4().hex[:16]
        if self.group.size == 1:
            return fresh if set_aside else None
        votes = self.group.all_gather((set_aside, fresh), "restore")
        return votes[0][1] if any(v[0] for v in votes) else None

    # ------------------------------------------------------------------ misc
    def _write_levels_file(self) -> None:
        """levels.json under every node's directory and each shared root: ``pitstop ls``.
        ``shared``/``every`` name the first flushed level (a shared root's own file: that
        level); ``levels`` lists every level after the first."""
        first = self.first.describe()
        if first is None:
            return  # a plain first level: each level reads as a root
        t0 = self.targets[0] if self.targets else None
        doc = {
            **first,
            "shared": t0.storage.url if t0 else None,
            "every": t0.spec.described_every() if t0 else None,
            "levels": [
                {"name": t.name, "url": t.storage.url, "every": t.spec.described_every()}
                for t in self.targets
            ],
        }  # fmt: skip
        files = self.first.levels_file()
        for t in self.targets if self.group.coordinator else []:
            if isinstance(t.spec.path, (str, os.PathLike)) and object_url(t.spec.path) is None:
                own = {"level": "shared", "shared": t.storage.url,
                       "every": t.spec.described_every()}  # fmt: skip
                files.append((os.fspath(t.spec.path), own))
        for root, which in files:
            try:
                os.makedirs(root, exist_ok=True)
                tmp = os.path.join(root, f".{LEVELS_FILE}.{os.getpid()}")
                with open(tmp, "wb") as f:
                    f.write(json.dumps({**doc, **which}, indent=1).encode())
                os.replace(tmp, os.path.join(root, LEVELS_FILE))
            except OSError as e:
                _log.warning("could not write %s under %s: %s", LEVELS_FILE, root, e, phase="plan")

    def close(self) -> None:
        try:
            for t in self.targets:
                t.flusher.close()
        finally:
            for level in [*([self.memory] if self.memory else []), self.first, *self.targets]:
                level.close()
