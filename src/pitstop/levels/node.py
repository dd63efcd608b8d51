"""NodeLevel: the node-local level of a list (``pitstop.Local``): one directory per node,
every rank's files protected across nodes by the level's redundancy strategy.

Call sequence (every rank; :class:`~pitstop.levels.stack.LevelStack` makes these calls)::

    node = NodeLevel(local, group, io, topology=...)   # training thread, collective
    node.replicate(directory, manifest)     # persist thread, inside each commit (NodeCommit)
    node.committed(step, identity)          # persist thread, after a commit: retention (leader)
    node.lists(group); node.held(words)     # the restart's survey (leaders list their node)
    node.serve(walk, load, s, ...)          # training thread, collective: step s made whole
                                            #   on every node (rebuilt), then loaded
    node.fetch(manifest, view, storage)     # training thread, collective: a step a slower
                                            #   level served, copied in and protected
    node.roll_back(s)                       # training thread, leaders: newer steps aside
    node.close()

The repair itself (verify, rebuild, room, manifest) is :mod:`pitstop.levels.repair`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pitstop.engine.catalog import Catalog, Entry, RunIdentity
from pitstop.engine.recovery import RestoreResult
from pitstop.errors import CheckpointError, CheckpointIOError, UnsupportedSetupError
from pitstop.faults import killpoint
from pitstop.format.manifest import Manifest
from pitstop.format.names import step_dir_name
from pitstop.levels.redundancy import Member
from pitstop.levels.repair import Repair
from pitstop.levels.spec import SERVING, Local, Placement, node_ids
from pitstop.levels.walk import Walk, left_by_rollback, serve_window
from pitstop.log import get_logger
from pitstop.options import IOOptions
from pitstop.policy import KeepLast
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import describe, gather
from pitstop.ranks.peers import make_link
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage
from pitstop.storage.retry import RetryingStorage

__all__ = ["NodeLevel"]

_log = get_logger("pitstop.levels")

View = dict[int, tuple[str, bool]]  # step -> (manifest digest or "", marked damaged)


class NodeLevel:
    """See the module docstring."""

    name = "local"
    exact = True  # a step serves as agreed across nodes, never a window

    def __init__(
        self,
        local: Local,
        group: Group,
        io: IOOptions,
        *,
        topology: Mapping[int, str] | Sequence[str] | None = None,
    ) -> None:
        self.group, self.local = group, local
        if topology is not None and len(topology) != group.size:
            raise ValueError(f"topology= names {len(topology)} ranks; the job has {group.size}")
        nodes = node_ids(topology, group.rank, lambda o: group.all_gather(o, "plan"))
        self.placement = Placement(nodes, local.redundancy, local.set_size)
        if self.placement.scheme != local.redundancy and group.coordinator:
            _log.warning(
                "redundancy=%r needs two nodes or more; every rank runs on node %r, so the "
                "local level keeps one copy (single; pitstop.Local(..., redundancy='single') "
                "says so and silences this)", local.redundancy, nodes[0], phase="plan",
            )  # fmt: skip
        self.node = nodes[group.rank]
        self.leader = self.placement.leaders[group.rank] == group.rank
        self.root = local.path_of(self.node)
        self._check_node_dirs(nodes)
        self.storage: Storage = RetryingStorage(LocalStorage(self.root, io))  # type: ignore[assignment]
        self.catalog = Catalog(self.storage)
        self.link = make_link(group)
        self.retention = KeepLast(local.keep_last)
        self.repair = Repair(self)

    def _check_node_dirs(self, nodes: list[str]) -> None:
        """Collective: every node's directory can be created, and no two nodes share one (a
        symlink, or a path without ``{node}``): two leaders would claim every step."""

        def probe() -> list[Any] | None:
            """Leader: the node's directory, created, as (host, device, inode)."""
            if not self.leader:
                return None
            try:
                os.makedirs(self.root, exist_ok=True)
                st = os.stat(self.root)
            except OSError as e:
                raise CheckpointIOError(
                    f"node {self.node}: {self.root}: {e.strerror or e}", path=self.root,
                    phase="plan",
                ) from e  # fmt: skip
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
    def leaders(self) -> tuple[int, ...]:
        return tuple(self.placement.leaders)

    def member(self, directory: str, manifest: Manifest, storage: Storage | None = None) -> Member:
        return Member(
            storage or self.storage, directory, manifest, self.placement, self.link,
            self.group.rank,
        )  # fmt: skip

    # ------------------------------------------------------------------ save
    def replicate(self, directory: str, manifest: bytes) -> None:
        """Persist thread, every rank, once every rank's files are durable: the redundancy."""
        m = self.member(directory, Manifest.loads(manifest, path=self.storage.url))
        killpoint("replicate.mid")
        try:
            m.placement.redundancy.protect(m)
        except CheckpointError as e:  # ENOSPC writing a partner copy is the replication's
            e.phase, e.step = "replicate", m.manifest.step
            raise

    def committed(self, step: int, identity: RunIdentity | None) -> None:
        """Persist thread, after ``step`` committed on this node: the level's retention (the
        node's leader)."""
        if identity is not None and self.leader:
            retired = self.catalog.retire(self.retention, newest=step, identity=identity)
            self.catalog.purge_later(retired)

    def describe(self) -> dict[str, Any] | None:
        """What ``levels.json`` says of the level (``pitstop ls`` reads it)."""
        return {
            "local": os.fspath(self.local.path), "redundancy": self.placement.scheme,
            "set_size": self.local.set_size, "keep_last": self.local.keep_last,
            "nodes": self.placement.nodes,
        }  # fmt: skip

    def levels_file(self) -> list[tuple[str, dict[str, Any]]]:
        """Where this rank writes ``levels.json`` for the level, and what it adds there."""
        return [(self.root, {"level": "local", "node": self.node})] if self.leader else []

    # ------------------------------------------------------------------ restart
    def prepare_survey(self) -> None:
        """Collective, before the restart's survey: nothing to do (``held`` compares nodes)."""

    def lists(self, group: Group) -> bool:
        return self.leader

    def held(self, words: list[Any], marks: list[dict[str, Any]]) -> tuple[set[int], list[View]]:
        """Every node's view, by leader rank (step -> the digest of the manifest its node
        holds, "" when it does not parse, and whether it is marked damaged; a step a rollback
        left is not one: the node lacks it), and the steps any node holds a manifest of."""
        left = left_by_rollback(marks)
        views = [
            {b[0]: (b[2], b[1] != "committed") for b in w if b[1] in SERVING and not left(b)}
            for w in words
        ]
        return {s for v in views for s, (digest, _) in v.items() if digest}, views

    def serve(
        self,
        walk: Walk,
        load: Callable[[Storage, Entry], Any],
        s: int,
        window: tuple[int | None, int] | None,
        views: list[View],
        rollback: bool,
    ) -> RestoreResult | None:
        """Collective: step ``s`` made whole on every node (rebuilt from redundancy where a
        node lost it), then loaded; None (``walk`` told why) when it cannot be."""
        choice = self.repair.ready_step(s, views)
        if isinstance(choice, str):
            walk.skipped.append((walk.label("local", step_dir_name(s)), choice))
            if self.group.coordinator:
                _log.warning("local %s: %s", step_dir_name(s), choice, phase="restore")
            return None
        result = serve_window(walk, self.group, "local", self.catalog, load, step=s)
        if result is not None:
            result.sources, result.repaired = choice.sources, choice.repaired
        return result

    def fetch(self, manifest: Manifest, views: list[View], storage: Storage) -> None:
        """After a restore from a slower level (``storage``): see ``Repair.fetch``."""
        self.repair.fetch(manifest, views, storage)

    def close(self) -> None:
        try:
            self.catalog.close()
        finally:
            self.link.close()
