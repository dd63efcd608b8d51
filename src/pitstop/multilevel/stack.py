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

Restart (``recover``, ``fetch``): :mod:`pitstop.multilevel.restart`.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
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
from pitstop.log import get_logger
from pitstop.multilevel.flush import Flusher, FlushRecord
from pitstop.multilevel.levels import Local, Placement, Shared, node_ids
from pitstop.multilevel.redundancy import (
    Member,
    protect,
)
from pitstop.multilevel.restart import Restarts
from pitstop.options import IOOptions
from pitstop.policy import KeepLast, RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import describe, gather
from pitstop.ranks.peers import make_link
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage, open_root
from pitstop.storage.retry import RetryingStorage

__all__ = ["LevelStack"]

_log = get_logger("pitstop.multilevel")


class LevelStack(Restarts):
    """See the module docstring."""

    def __init__(
        self,
        local: Local,
        shared: Shared | None,
        group: Group,
        io: IOOptions,
        *,
        topology: Mapping[int, str] | Sequence[str] | None = None,
        shared_retention: RetentionPolicy | None = None,
    ) -> None:
        self.group, self.local, self.shared = group, local, shared
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
        self._check_node_dirs(root, nodes)
        self.local_storage: Storage = RetryingStorage(LocalStorage(root, io))  # type: ignore[assignment]
        self.local_catalog = Catalog(self.local_storage)
        self.link = make_link(group)
        self.shared_storage: Storage | None = None
        self.shared_catalog: Catalog | None = None
        self.flusher: Flusher | None = None
        self.shared_retention = shared_retention
        if shared is not None:
            inner, _ = open_root(shared.path, io)
            shared_storage: Storage = RetryingStorage(inner)  # type: ignore[assignment]
            self.shared_storage = shared_storage
            self.shared_catalog = Catalog(shared_storage)
            self.flusher = Flusher(
                self.local_catalog, shared_storage, group.channel(), on_done=self.flushed
            )
        self.identity: RunIdentity | None = None
        self._every = shared.every if shared is not None else 0
        self._since_flush = 0  # rank 0: local commits since the last flush
        self._flush = False  # rank 0's word for the step being committed
        self._manifest: Manifest | None = None  # of the step being committed
        self._newest: tuple[int, Manifest] | None = None  # committed by this process
        self._flushed = -1  # the newest step this process submitted to the flusher
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
            protect(m)
        except CheckpointError as e:  # ENOSPC writing a partner copy is the replication's
            e.phase, e.step = "replicate", m.manifest.step
            raise

    def _decide(self) -> dict[str, Any]:
        """Rank 0, once every rank replicated: flush this step? Once ``every`` local commits
        were not flushed, unless two flushes are already queued (the flush never holds
        training up: the next commit is flushed instead). After a restart the first commit
        is flushed unless the restored step is on the shared level."""
        if self.flusher is None:
            return {"flush": False}
        self._since_flush += 1
        due = self._since_flush >= self._every
        flush = due and self.flusher.pending < 2
        if flush:
            self._since_flush = 0
        elif due:
            _log.warning("flush put off: two flushes are still queued", phase="flush")
        return {"flush": flush}

    def _decided(self, word: Any) -> None:
        self._flush = bool(isinstance(word, dict) and word.get("flush"))

    def committed(self, step: int) -> None:
        """Persist thread, after ``step`` committed on the local level: flush it if rank 0
        said so (pinned first), then local retention on the node's leader."""
        manifest, self._manifest = self._manifest, None
        if manifest is not None:
            self._newest = (step, manifest)
        if self._flush and self.flusher is not None and manifest is not None:
            self._flush = False
            self._submit(step, manifest)
        if self.identity is not None and self.leader:
            retired = self.local_catalog.retire(
                KeepLast(self.local.keep_last), newest=step, identity=self.identity
            )
            self.local_catalog.purge_later(retired)

    def _submit(self, step: int, manifest: Manifest) -> None:
        assert self.flusher is not None
        self._flushed = step
        self.flusher.submit(self.member(step_dir_name(step), manifest))

    def flush(self) -> FlushRecord | None:
        """Training thread, every rank, no save in flight: flush the newest step this
        process committed now, unless it was flushed already; wait for it. Its record (None:
        nothing to flush). Every rank decides alike: they committed the same steps."""
        newest = self._newest
        if self.flusher is None or newest is None or newest[0] <= self._flushed:
            return None
        self._submit(*newest)
        self.flusher.drain()
        return next((r for r in reversed(self.flusher.records) if r.step == newest[0]), None)

    def flushed(self, record: FlushRecord) -> None:
        """Flush thread, rank 0: shared retention after a flush committed."""
        catalog, identity, policy = self.shared_catalog, self.identity, self.shared_retention
        ready = catalog is not None and identity is not None and policy is not None
        if record.ok and self.group.coordinator and ready:
            catalog.purge_later(catalog.retire(policy, newest=record.step, identity=identity))  # type: ignore[union-attr,arg-type]

    # ------------------------------------------------------------------ misc
    def _write_levels_file(self) -> None:
        """levels.json under every node's directory and the shared root: ``pitstop ls``."""
        doc = {
            "local": os.fspath(self.local.path), "redundancy": self.placement.scheme,
            "set_size": self.local.set_size, "keep_last": self.local.keep_last,
            "shared": self.shared_storage.url if self.shared_storage else None,
            "every": self.shared.every if self.shared else None,
            "nodes": self.placement.nodes,
        }  # fmt: skip
        targets = [(self.local.path_of(self.node), {"level": "local", "node": self.node})]
        targets = targets if self.leader else []
        shared = self.shared.path if self.shared is not None else None
        if isinstance(shared, (str, os.PathLike)) and self.group.coordinator:
            targets.append((os.fspath(shared), {"level": "shared"}))
        for root, which in targets:
            try:
                os.makedirs(root, exist_ok=True)
                tmp = os.path.join(root, f".{LEVELS_FILE}.{os.getpid()}")
                with open(tmp, "wb") as f:
                    f.write(json.dumps({**which, **doc}, indent=1).encode())
                os.replace(tmp, os.path.join(root, LEVELS_FILE))
            except OSError as e:
                _log.warning("could not write %s under %s: %s", LEVELS_FILE, root, e, phase="plan")

    def close(self) -> None:
        try:
            if self.flusher is not None:
                self.flusher.close()
        finally:
            self.local_catalog.close()
            if self.shared_catalog is not None:
                self.shared_catalog.close()
            self.link.close()
