"""LevelStack: the node-local level, its redundancy and the shared level, for one manager.

Call sequence (every rank; the manager makes these calls)::

    stack = LevelStack(local, shared, group, io, topology=...)   # training thread, collective
    saver = Saver(stack.local_storage, ..., nodes=stack.node_commit())
      replicate / decide / decided                   # persist thread, inside each commit
    stack.committed(step, identity)                  # persist thread, after the local commit:
                                                     #   local retention, maybe a flush
    choice = stack.restore_local(step)               # training thread, collective: the newest
                                                     #   local step every rank can have, rebuilt
                                                     #   and re-protected; None if none
    stack.fetch(entry)                               # after a restore from the shared level:
                                                     #   into the local level, protected
    stack.close()

Restart (``restore_local``): every rank lists the steps committed on its node; candidates
are the steps committed on any node, newest first. For a candidate, the manifest comes from
a node that has it; every rank verifies its own member files, the partner copy or parity
block its node keeps (every checksum), and the ranks agree on what is lost. The step is
recoverable when every lost rank has a whole partner copy (``partner``), or its XOR set
lost no other member and every survivor's parity is whole (``xor``); ``single`` needs
nothing lost. Then the lost files are rebuilt, verified, the redundancy rewritten if any
piece of it was missing or bad (a spare node gets its partner copy and parity), and the
manifest written on every node that lacks it. Newer local steps that could not be
recovered are set aside (abandoned), so the steps the run takes next are free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pitstop.engine.catalog import Catalog, Entry, RunIdentity
from pitstop.engine.collective import NodeCommit
from pitstop.errors import CheckpointError
from pitstop.faults import killpoint
from pitstop.format.manifest import Manifest
from pitstop.format.names import LEVELS_FILE, step_dir_name
from pitstop.log import get_logger
from pitstop.multilevel.flush import Flusher, FlushRecord
from pitstop.multilevel.levels import Local, Placement, Shared, node_ids
from pitstop.multilevel.redundancy import (
    Member,
    protect,
    read_payload,
    rebuild,
    verify_copy,
    verify_own,
    verify_parity,
    write_payload,
)
from pitstop.options import IOOptions
from pitstop.policy import KeepLast, RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.ranks.peers import make_link
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage, open_root
from pitstop.storage.retry import RetryingStorage

__all__ = ["LevelStack", "LocalChoice"]

_log = get_logger("pitstop.multilevel")


@dataclass
class LocalChoice:
    """What ``restore_local`` made ready: ``step`` on every node; bytes received by source;
    the local steps set aside because they could not be recovered."""

    step: int
    sources: dict[str, int] = field(default_factory=dict)
    set_aside: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)


class LevelStack:
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
        self.local_storage: Storage = RetryingStorage(LocalStorage(local.path_of(self.node), io))  # type: ignore[assignment]
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
        self._commits = 0
        self._flush = False  # rank 0's word for the step being committed
        self._manifest: Manifest | None = None  # of the step being committed
        self._write_levels_file()

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
        protect(m)

    def _decide(self) -> dict[str, Any]:
        """Rank 0, once every rank replicated: flush this step? Every ``every``-th local
        commit, unless two flushes are already queued (the flush never holds training up)."""
        self._commits += 1
        flush = (
            self.flusher is not None and self.shared is not None
            and self._commits % self.shared.every == 0 and self.flusher.pending < 2
        )  # fmt: skip
        due = self.shared is not None and self._commits % self.shared.every == 0
        if due and not flush:
            _log.warning("flush skipped: two flushes are still queued", phase="flush")
        return {"flush": flush}

    def _decided(self, word: Any) -> None:
        self._flush = bool(isinstance(word, dict) and word.get("flush"))

    def committed(self, step: int) -> None:
        """Persist thread, after ``step`` committed on the local level: flush it if rank 0
        said so (pinned first), then local retention on the node's leader."""
        manifest, self._manifest = self._manifest, None
        if self._flush and self.flusher is not None and manifest is not None:
            self._flush = False
            self.flusher.submit(self.member(step_dir_name(step), manifest))
        if self.identity is not None and self.leader:
            retired = self.local_catalog.retire(
                KeepLast(self.local.keep_last), newest=step, identity=self.identity
            )
            self.local_catalog.purge_later(retired)

    def flushed(self, record: FlushRecord) -> None:
        """Flush thread, rank 0: shared retention after a flush committed."""
        catalog, identity, policy = self.shared_catalog, self.identity, self.shared_retention
        ready = catalog is not None and identity is not None and policy is not None
        if record.ok and self.group.coordinator and ready:
            catalog.purge_later(catalog.retire(policy, newest=record.step, identity=identity))  # type: ignore[union-attr,arg-type]

    # ------------------------------------------------------------------ restore
    def restore_local(self, step: int | None = None) -> LocalChoice | None:
        """Collective: the newest local step (or ``step``) every rank can have (see above)."""
        mine = {e.step: e for e in self.local_catalog.committed() if e.step is not None}
        lists = self.group.all_gather(sorted(mine), "restore")
        candidates = sorted({s for steps in lists for s in steps}, reverse=True)
        if step is not None:
            candidates = [s for s in candidates if s == step]
        newest = candidates[0] if candidates else None
        for s in candidates:
            choice = self._try_step(s, mine, lists)
            if choice is not None:
                if newest is not None and s != newest:
                    choice.set_aside = self._set_aside_newer(s)
                return choice
        return None

    def _manifest_of(
        self, s: int, mine: dict[int, Entry], lists: list[list[int]]
    ) -> Manifest | None:
        src = next(r for r, steps in enumerate(lists) if s in steps)
        entry = mine.get(s)
        data = (
            entry.manifest.dumps() if self.group.rank == src and entry and entry.manifest else None
        )
        raw = self.group.all_gather(data, "restore")[src]
        try:
            manifest = Manifest.loads(raw, path=f"{self.local_storage.url}/{step_dir_name(s)}")
        except CheckpointError:
            return None
        return manifest if manifest.world_size == self.group.size else None

    def _try_step(
        self, s: int, mine: dict[int, Entry], lists: list[list[int]]
    ) -> LocalChoice | None:
        manifest = self._manifest_of(s, mine, lists)
        if manifest is None:
            return None
        m = self.member(step_dir_name(s), manifest)
        scheme = self.placement.scheme
        word = (
            verify_own(m),
            verify_copy(m) if scheme == "partner" else True,
            verify_parity(m) if scheme == "xor" else True,
        )
        words = self.group.all_gather(word, "restore")
        lost = {r for r, w in enumerate(words) if not w[0]}
        if not self.placement.recoverable(lost, [w[1] for w in words], [w[2] for w in words]):
            _log.warning(
                "step %d cannot be rebuilt on the local level (ranks %s lost their files; "
                "redundancy %s); trying older", s, sorted(lost), scheme, phase="restore",
            )  # fmt: skip
            return None
        repaired = [f"rank {r}" for r in sorted(lost)]
        repaired += [f"partner copy on rank {r}" for r, w in enumerate(words) if not w[1]]
        repaired += [f"parity on rank {r}" for r, w in enumerate(words) if not w[2]]
        self._ensure_dir(m, mine.get(s) is not None)
        got = rebuild(m, lost)
        if self.group.rank in lost and not verify_own(m):
            raise CheckpointError(
                f"rank {self.group.rank}'s files of step {s} were rebuilt but fail their checksums",
                step=s, phase="restore",
            )  # fmt: skip
        self._settle(m, protect_again=bool(repaired), committed_here=s in mine)
        if repaired and self.group.coordinator:
            _log.warning(
                "step %d: repaired on the local level: %s", s, ", ".join(repaired), phase="restore"
            )
        sources = {"own": sum(f.nbytes for f in manifest.files if f.rank not in lost)}
        for w in self.group.all_gather(got, "restore"):
            for k, v in w.items():
                sources[k] = sources.get(k, 0) + v
        return LocalChoice(s, sources, [], repaired)

    def _ensure_dir(self, m: Member, committed_here: bool) -> None:
        """The step directory exists on every node (a spare node's is created)."""
        if (
            not committed_here
            and self.leader
            and self.local_storage.entry_kind(m.directory) == "missing"
        ):
            self.local_storage.prepare(m.directory)
        self.group.all_gather(None, "restore")

    def _set_aside_newer(self, s: int) -> list[str]:
        out = []
        if self.leader:
            for e in self.local_catalog.committed():
                if e.step is not None and e.step > s:
                    name = self.local_catalog.set_aside(e, "abandoned")
                    if name is not None:
                        out.append(e.name)
        return out

    def fetch(self, entry: Entry) -> None:
        """After a restore from the shared level: copy ``entry`` into the local level where a
        node lacks it and protect it there, so that the next failure restarts from the local
        level. Collective; a failure is logged (the restore itself succeeded)."""
        manifest = entry.manifest
        if (
            manifest is None
            or manifest.world_size != self.group.size
            or self.shared_storage is None
        ):
            return
        m = self.member(entry.name, manifest)
        there = self.local_storage.entry_kind(entry.name) != "missing"
        committed = there and self.local_storage.has_manifest(entry.name)
        self._ensure_dir(m, there)
        error = None
        if not (there and verify_own(m)):
            try:
                arena, _ = read_payload(self.member(entry.name, manifest, self.shared_storage))
                try:
                    write_payload(m, self.group.rank, arena.view, copy=False)
                finally:
                    arena.close()
            except CheckpointError as e:
                error = str(e)
        errors = [e for e in self.group.all_gather(error, "restore") if e]
        if errors:
            _log.warning("step %d stays on the shared level only: %s", manifest.step, errors[0],
                         phase="restore")  # fmt: skip
            return
        self._settle(m, protect_again=True, committed_here=committed)

    def _settle(self, m: Member, *, protect_again: bool, committed_here: bool) -> None:
        """Every rank's files are in place: write the redundancy again if asked (a spare
        node gets its copies; a bad copy or parity is rewritten), the manifest on each node
        that lacks it, and wait until every node holds the step."""
        if protect_again:
            protect(m)
        if self.leader and not committed_here:
            self.local_storage.commit(m.directory, m.manifest.dumps())
        self.group.all_gather(None, "restore")

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
        data = json.dumps(doc, indent=1).encode()
        targets = [self.local.path_of(self.node)] if self.leader else []
        shared = self.shared.path if self.shared is not None else None
        if isinstance(shared, (str, os.PathLike)) and self.group.coordinator:
            targets.append(os.fspath(shared))
        for root in targets:
            try:
                os.makedirs(root, exist_ok=True)
                tmp = os.path.join(root, f".{LEVELS_FILE}.{os.getpid()}")
                with open(tmp, "wb") as f:
                    f.write(data)
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
