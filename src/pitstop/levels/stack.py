"""LevelStack: the node-local level, its redundancy and the shared level, for one manager.

Call sequence (every rank; the manager makes these calls)::

    stack = LevelStack(local, shared, group, io, topology=...)   # training thread, collective
    saver = Saver(stack.local_storage, ..., nodes=stack.node_commit())
      replicate / decide / decided                   # persist thread, inside each commit
    stack.committed(step, identity)                  # persist thread, after the local commit:
                                                     #   local retention, maybe a flush
    result = stack.recover(load, step, rollback=..., fetch=...)   # training thread,
                                                     #   collective: see below
    stack.flush()                                    # training thread: the newest step this
                                                     #   process committed, now (close too)
    stack.close()

Restart (``recover``, ``fetch``): :mod:`pitstop.levels.restart`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from pitstop.engine.catalog import Catalog, RunIdentity
from pitstop.engine.collective import NodeCommit
from pitstop.errors import (
    CheckpointError,
    CheckpointIOError,
    UnsupportedSetupError,
)
from pitstop.faults import killpoint
from pitstop.format.manifest import Manifest
from pitstop.format.names import LEVELS_FILE, step_dir_name
from pitstop.levels.flush import Flusher, FlushRecord, FlushTarget
from pitstop.levels.redundancy import (
    Member,
)
from pitstop.levels.restart import Restarts
from pitstop.levels.spec import Local, Placement, Shared, level_names, node_ids
from pitstop.log import get_logger
from pitstop.options import IOOptions
from pitstop.policy import KeepLast, RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import describe, gather
from pitstop.ranks.peers import make_link
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage, object_url, open_root
from pitstop.storage.retry import RetryingStorage

__all__ = ["LevelStack"]

_log = get_logger("pitstop.levels")


class LevelStack(Restarts):
    """See the module docstring."""

    def __init__(
        self,
        local: Local,
        shared: Sequence[Shared],
        group: Group,
        io: IOOptions,
        *,
        topology: Mapping[int, str] | Sequence[str] | None = None,
        shared_retention: RetentionPolicy | None = None,
    ) -> None:
        self.group, self.local = group, local
        if topology is not None and len(topology) != group.size:
            raise ValueError(f"topology= names {len(topology)} ranks; the job has {group.size}")
        nodes = node_ids(topology, group.rank, lambda o: group.all_gather(o, "plan"))
        self.placement = Placement(nodes, local.redundancy, local.set_size)
        if self.placement.scheme != local.redundancy and group.coordinator:
            _log.warning(
                "redundancy=%r needs two nodes or more; every rank runs on node %r, so the "
                "local level keeps one copy (single)", local.redundancy, nodes[0], phase="plan",
            )  # fmt: skip
        self.node = nodes[group.rank]
        self.leader = self.placement.leaders[group.rank] == group.rank
        root = local.path_of(self.node)
        inners = [open_root(level.path, io)[0] for level in shared]  # (a URL's client, first)
        self._check_node_dirs(root, nodes)
        self.local_storage: Storage = RetryingStorage(LocalStorage(root, io))  # type: ignore[assignment]
        self.local_catalog = Catalog(self.local_storage)
        self.link = make_link(group)
        self.targets: list[FlushTarget] = []
        for level, name, inner in zip(shared, level_names(shared), inners):
            storage: Storage = RetryingStorage(inner)  # type: ignore[assignment]
            target = FlushTarget(
                name, level, storage, Catalog(storage),
                Flusher(self.local_catalog, storage, group.channel(), name=name),
                level.make_schedule(),
                KeepLast(level.keep_last) if level.keep_last is not None else shared_retention,
            )  # fmt: skip
            target.flusher.on_done = partial(self.flushed, target)
            self.targets.append(target)
        self.identity: RunIdentity | None = None
        self._flush: set[str] = set()  # rank 0's word for the step being committed
        self._manifest: Manifest | None = None  # of the step being committed
        self._newest: tuple[int, Manifest] | None = None  # committed by this process
        self._write_levels_file()

    def _check_node_dirs(self, root: str, nodes: list[str]) -> None:
        """Collective: every node's directory can be created, and no two nodes share one (a
        symlink, or a path without ``{node}``): two leaders would claim every step."""

        def probe() -> list[Any] | None:
            """Leader: the node's directory, created, as (host, device, inode)."""
            if not self.leader:
                return None
            try:
                os.makedirs(root, exist_ok=True)
                st = os.stat(root)
            except OSError as e:
                raise CheckpointIOError(
                    f"node {self.node}: {root}: {e.strerror or e}", path=root, phase="plan"
                ) from e
            return [socket.gethostname(), st.st_dev, st.st_ino]

        outcomes = gather(self.group, probe, "plan")
        error = describe(outcomes, "creating the node directories")
        if error is not None:
            raise UnsupportedSetupError(f"the local level cannot be used: {error}", phase="plan")
        seen: dict[tuple[Any, ...], str] = {}
        for r, w in enumerate(o.value for o in outcomes):
            if w is None:
                continue
            other = seen.setdefault(tuple(w), nodes[r])
            if other != nodes[r]:
                raise UnsupportedSetupError(
                    f"nodes {other!r} and {nodes[r]!r} share one local directory "
                    f"({self.local.path!s}): put {{node}} in the path of pitstop.Local, and "
                    "give each node a directory of its own (not a symlink to another's)",
                    phase="plan",
                )  # fmt: skip

    @property
    def storage(self) -> Storage:
        """Where saves commit: this node's directory of the local level."""
        return self.local_storage

    @property
    def catalog(self) -> Catalog:
        return self.local_catalog

    def bind(self, identity: RunIdentity) -> None:
        """Collective: the run's identity, one run id for every rank (the node leaders and
        rank 0 apply retention to it)."""
        identity.run = identity.timeline = self.group.broadcast(identity.run, "plan")
        self.identity = identity

    # ------------------------------------------------------------------ save
    def node_commit(self) -> NodeCommit:
        return NodeCommit(self.placement.leaders, self._replicate, self._decide, self._decided)

    def member(self, directory: str, manifest: Manifest, storage: Storage | None = None) -> Member:
        return Member(
            storage or self.local_storage, directory, manifest, self.placement, self.link,
            self.group.rank,
        )  # fmt: skip

    def _replicate(self, directory: str, manifest: bytes) -> None:
        m = self.member(directory, Manifest.loads(manifest, path=self.local_storage.url))
        self._manifest = m.manifest  # for the flush: a co-located leader may commit later
        killpoint("replicate.mid")
        try:
            m.placement.redundancy.protect(m)
        except CheckpointError as e:  # ENOSPC writing a partner copy is the replication's
            e.phase, e.step = "replicate", m.manifest.step
            raise

    @property
    def flushers(self) -> list[Flusher]:
        """The flusher of every level after the local one, in the order of the list."""
        return [t.flusher for t in self.targets]

    @property
    def flusher(self) -> Flusher | None:
        """The first shared level's flusher (None without one)."""
        return self.targets[0].flusher if self.targets else None

    def _decide(self) -> dict[str, Any]:
        """Rank 0, once every rank replicated: which levels get this step? Each level's
        schedule decides on the local commits and seconds since its last flush; a level
        with two flushes still queued is put off (the flush never holds training up: the
        next commit is flushed instead). After a restart the first commit goes to every
        level that lacks the restored step."""
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
        """Persist thread, after ``step`` committed on the local level: flush it to the
        levels rank 0 named (pinned first), then local retention on the node's leader."""
        manifest, self._manifest = self._manifest, None
        if manifest is not None:
            self._newest = (step, manifest)
        flush, self._flush = self._flush, set()
        for t in self.targets:
            if t.name in flush and manifest is not None:
                self._submit(t, step, manifest)
        if self.identity is not None and self.leader:
            retired = self.local_catalog.retire(
                KeepLast(self.local.keep_last), newest=step, identity=self.identity
            )
            self.local_catalog.purge_later(retired)

    def _submit(self, target: FlushTarget, step: int, manifest: Manifest) -> None:
        target.flushed = step
        target.flusher.submit(self.member(step_dir_name(step), manifest))

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
        identity, policy = self.identity, target.retention
        if record.ok and self.group.coordinator and identity is not None and policy is not None:
            retired = target.catalog.retire(policy, newest=record.step, identity=identity)
            target.catalog.purge_later(retired)

    # ------------------------------------------------------------------ misc
    def _write_levels_file(self) -> None:
        """levels.json under every node's directory and each shared root: ``pitstop ls``.
        ``shared``/``every`` name the first shared level (a shared root's own file: that
        level); ``levels`` lists every level after the local one."""
        doc = {
            "local": os.fspath(self.local.path), "redundancy": self.placement.scheme,
            "set_size": self.local.set_size, "keep_last": self.local.keep_last,
            "shared": self.targets[0].storage.url if self.targets else None,
            "every": self.targets[0].level.described_every() if self.targets else None,
            "levels": [
                {"name": t.name, "url": t.storage.url, "every": t.level.described_every()}
                for t in self.targets
            ],
            "nodes": self.placement.nodes,
        }  # fmt: skip
        files: list[tuple[str, dict[str, Any]]] = [
            (self.local.path_of(self.node), {"level": "local", "node": self.node})
        ]
        files = files if self.leader else []
        for t in self.targets if self.group.coordinator else []:
            if isinstance(t.level.path, (str, os.PathLike)) and object_url(t.level.path) is None:
                own = {"level": "shared", "shared": t.storage.url,
                       "every": t.level.described_every()}  # fmt: skip
                files.append((os.fspath(t.level.path), own))
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
            self.local_catalog.close()
            for t in self.targets:
                t.catalog.close()
            self.link.close()
