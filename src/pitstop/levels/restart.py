"""Restart of a multi-level job: the newest step either level can deliver, rebuilt where
the local level lost pieces of it. The restore half of
:class:`~pitstop.levels.stack.LevelStack`, which inherits :class:`Restarts`.

``recover``: every node's leader lists the steps whose manifest its node holds,
with the manifest's digest; the shared level's steps come from rank 0's scan. Steps are
tried newest first over both levels, the local level first for a step both hold.

A local step: its manifest is the one the most nodes hold (ties: the lowest rank's) that
parses and fits the world size; every rank verifies its own member files, the partner copy
or parity block its node keeps (every checksum; parity also names its manifest), and the
ranks agree on what is lost. The step is recoverable when every lost rank has a whole
partner copy (``partner``), or its XOR set lost no other member and every survivor's parity
is whole (``xor``); ``single`` needs nothing lost. Then each node whose manifest is
missing, different, unreadable or marked gets room (a spare's directory is created), the
lost files are rebuilt and verified, the redundancy is rewritten if any piece of it was
missing or bad, and those nodes get the agreed manifest. Each of these steps ends in an
gather of every rank's outcome (``pitstop.ranks.outcome``: its result or its error): a rank
never fails alone; any error means "try older", and says every failed rank's message.

The shared level is tried with ``recover`` over a window: from the step at hand down to
(not including) the next local candidate, so it never serves an older step than the local
level could. A step it served is fetched into the local level (``fetch``) and protected.
A rollback then sets aside the newer steps of both levels (``Catalog.start_timeline``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pitstop.engine.catalog import Catalog, Entry
from pitstop.engine.recovery import RestoreResult, recover
from pitstop.engine.transfer import copy_files
from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    PartialRestoreError,
)
from pitstop.format.manifest import Manifest, manifest_digest
from pitstop.format.names import step_dir_name
from pitstop.levels.flush import FlushTarget
from pitstop.levels.redundancy import (
    Member,
    verify_own,
)
from pitstop.levels.spec import SERVING, Placement, manifest_order
from pitstop.log import get_logger
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import attempt, describe, gather
from pitstop.storage.base import Storage

__all__ = ["LocalChoice", "Restarts"]

_log = get_logger("pitstop.levels")


@dataclass
class LocalChoice:
    """What ``_ready_step`` made ready: ``step`` whole on every node; bytes by source; what
    was rebuilt or rewritten."""

    step: int
    sources: dict[str, int] = field(default_factory=dict)
    repaired: list[str] = field(default_factory=list)


@dataclass
class _Walk:
    """A restore's way down the candidates of both levels: what was skipped and why, and
    whether a failed attempt wrote into the live state."""

    skipped: list[tuple[str, str]] = field(default_factory=list)
    overwritten: bool = False

    def nothing(self, step: int | None, where: str) -> RestoreResult:
        """No level delivered: an empty result when there was nothing, else the error."""
        reasons = "; ".join(f"{name}: {why}" for name, why in self.skipped)
        if self.overwritten:
            raise PartialRestoreError(
                "no checkpoint could be restored and the live state was partly overwritten: "
                f"do not train from it ({reasons})", path=where, phase="restore",
            )  # fmt: skip
        if step is not None:
            raise CheckpointNotFoundError(
                f"no level can deliver step {step}" + (f" ({reasons})" if reasons else ""),
                step=step, path=where, phase="restore",
            )  # fmt: skip
        if self.skipped:
            raise CorruptCheckpointError(
                f"no checkpoint on any level could be restored ({reasons})", path=where,
                phase="restore",
            )  # fmt: skip
        return RestoreResult()


class Restarts:
    """The restart methods of LevelStack (see the module docstring); the attributes are the
    stack's."""

    group: Group
    placement: Placement
    node: str
    leader: bool
    local_storage: Storage
    local_catalog: Catalog
    targets: list[FlushTarget]
    _newest: tuple[int, Manifest] | None

    def member(self, directory: str, manifest: Manifest, storage: Storage | None = None) -> Member:
        raise NotImplementedError

    def recover(
        self,
        load: Callable[[Storage, Entry], Any],
        step: int | None = None,
        *,
        rollback: bool = False,
        fetch: bool = True,
    ) -> RestoreResult:
        """Collective: load the newest step (or ``step``) that either level can deliver, the
        local level first for a step both hold (see the module docstring). ``rollback``: the
        newer steps of both levels are set aside; ``fetch``: a step the shared level served
        is copied into the local level (``load()`` leaves the levels as they are)."""
        t0 = time.perf_counter()
        views, held, unlisted = self._survey()
        local = {s for v in views for s, (digest, _) in v.items() if digest}
        candidates = sorted(local.union(*held), reverse=True)
        if step is not None:
            candidates = [s for s in candidates if s == step]
        walk = _Walk()
        result = None
        covered = [math.inf] * len(self.targets)  # a level's steps above it were tried
        for i, s in enumerate(candidates):
            if s in local:
                result = self._from_local(load, s, views, walk)
            for j, t in enumerate(self.targets):
                if result is not None or s not in held[j] or s > covered[j]:
                    continue
                # a shared level falls back by itself, down to the next step another level
                # holds (only ``s`` when a slower level holds it too): it never serves an
                # older step than another level could
                others = local.union(*(h for k, h in enumerate(held) if k != j))
                if any(s in h for h in held[j + 1 :]) or step is not None:
                    floor: int | None = s - 1
                else:
                    floor = next((c for c in candidates[i + 1 :] if c in others), None)
                covered[j] = floor if floor is not None else -math.inf
                window = (floor, s)
                result = self._load(walk, t.name, t.catalog, load, window=window)
                if result is not None and result.manifest is not None:
                    result.level, result.sources = t.name, {t.name: result.manifest.nbytes}
                    if fetch:
                        view = views[self.placement.leaders[self.group.rank]]
                        self.fetch(result.manifest, view, t.storage)
            if result is not None:
                break
        if result is None and unlisted:
            raise CheckpointIOError(
                f"no level could deliver a checkpoint, and {'; '.join(unlisted)}: it may hold "
                "the newest one, so this restart does not start from scratch (restore again "
                "once the level is back; remove the level from the list to give it up)",
                path=self.local_storage.url, phase="restore",
            )  # fmt: skip
        if result is None:
            return walk.nothing(step, self.local_storage.url)
        assert result.step is not None
        if rollback:
            result.set_aside += self._roll_back(result.step)
            self._newest = None  # a step this process committed may be set aside now
        for j, t in enumerate(self.targets):  # a level that lacks the step gets the next one
            t.since, t.last_secs, t.due = 0, time.monotonic(), result.step not in held[j]
        result.skipped = walk.skipped + result.skipped
        result.secs = time.perf_counter() - t0
        return result

    def _survey(self) -> tuple[list[dict[int, tuple[str, bool]]], list[set[int]], list[str]]:
        """Collective: every node's view, by leader rank (step -> the digest of the manifest
        its node holds, "" when it does not parse, and whether it is marked damaged; a step a
        rollback left is not one: the node lacks it) and the steps committed on each shared
        level (rank 0's scans). The rollback marks found on any node or on any shared level
        apply to all: a rollback killed half-way, having marked one level only, still holds
        everywhere (the steps it left are no candidates)."""
        local = _brief(self.local_catalog.scan()) if self.leader else []
        shared: list[list[tuple[Any, ...]]] = [[] for _ in self.targets]
        unlisted: list[str] = []
        for j, t in enumerate(self.targets if self.group.coordinator else []):
            try:
                shared[j] = _brief(t.catalog.scan())
            except CheckpointError as e:
                _log.warning("the %s level cannot be listed: %s", t.name, e, phase="restore")
                unlisted.append(f"the {t.name} level ({t.storage.url}) cannot be listed: {e}")
        words = self.group.all_gather((local, shared, unlisted), "restore")
        marks = [
            b[5] for w in words for part in [w[0], *w[1]] for b in part if b[5] is not None
        ]  # fmt: skip

        def left(b: tuple[Any, ...]) -> bool:
            return any(
                isinstance(m.get("after"), int) and b[0] > m["after"]
                and m.get("run") == b[3] and m.get("timeline") == b[4]
                for m in marks
            )  # fmt: skip

        views = [
            {b[0]: (b[2], b[1] != "committed") for b in w[0] if b[1] in SERVING and not left(b)}
            for w in words
        ]
        held = [
            {b[0] for w in words for b in w[1][j] if b[1] == "committed" and not left(b)}
            for j in range(len(self.targets))
        ]
        return views, held, words[0][2]

    def _from_local(
        self,
        load: Callable[[Storage, Entry], Any],
        s: int,
        views: list[dict[int, tuple[str, bool]]],
        walk: _Walk,
    ) -> RestoreResult | None:
        choice = self._ready_step(s, views)
        if isinstance(choice, str):
            walk.skipped.append((f"local {step_dir_name(s)}", choice))
            if self.group.coordinator:
                _log.warning("local %s: %s", step_dir_name(s), choice, phase="restore")
            return None
        result = self._load(walk, "local", self.local_catalog, load, step=s)
        if result is not None:
            result.level, result.sources = "local", choice.sources
            result.repaired = choice.repaired
        return result

    def _load(
        self,
        walk: _Walk,
        level: str,
        catalog: Catalog,
        load: Callable[[Storage, Entry], Any],
        **kw: Any,
    ) -> RestoreResult | None:
        """``recover`` on one level; None (and ``walk`` told why) when nothing loaded."""
        try:
            result = recover(
                catalog, lambda e: load(catalog.storage, e), group=self.group,
                overwritten=walk.overwritten, raise_if_none=False, **kw,
            )  # fmt: skip
        except CheckpointNotFoundError as e:
            walk.skipped.append((level, str(e)))
            return None
        result.skipped = [(f"{level} {name}", why) for name, why in result.skipped]
        if result.step is None:
            walk.skipped += result.skipped
            walk.overwritten = result.overwritten
            return None
        return result

    def _ready_step(self, s: int, views: list[dict[int, tuple[str, bool]]]) -> LocalChoice | str:
        """Collective: step ``s`` whole on every node, from the manifest the most nodes hold
        (ties: the lowest rank's) that this job can use; the reason when it cannot be."""
        leaders = sorted(set(self.placement.leaders))
        digests = {n: views[n].get(s, ("", False))[0] for n in leaders}
        order = manifest_order(list(digests.values()))
        reasons = []
        for digest in order:
            src = min(n for n in leaders if digests[n] == digest)
            raw = self.group.all_gather(
                self._manifest_bytes(s) if self.group.rank == src else None, "restore"
            )[src]
            why = _unusable(raw, s, digest, self.group.size)
            if isinstance(why, str):
                reasons.append(why)
                continue
            stale = [n for n in leaders if views[n].get(s) != (digest, False)]
            out = self._rebuild_step(self.member(step_dir_name(s), why), stale)
            if not isinstance(out, str):
                return out
            reasons.append(out)
        return "; ".join(reasons) or "no node holds a manifest that parses"

    def _manifest_bytes(self, s: int) -> bytes | None:
        try:
            return self.local_storage.read_manifest(step_dir_name(s))
        except CheckpointError:
            return None

    def _rebuild_step(self, m: Member, stale: list[int]) -> LocalChoice | str:
        """Collective: verify every rank's files and redundancy of ``m``, rebuild what is lost,
        make each node's directory hold the agreed manifest (``stale``: the leaders of the
        nodes whose manifest is missing, differs or is marked), protect again where anything
        was repaired."""
        s, red = m.manifest.step, self.placement.redundancy
        fix = self.group.rank in stale
        verified = gather(self.group, lambda: [verify_own(m), red.held_ok(m)], "restore")
        failed = describe(verified, "verify")
        if failed is not None:
            return failed
        words = [o.value for o in verified]
        lost = {r for r, w in enumerate(words) if not w[0]}
        if not self.placement.recoverable(lost, [w[1] for w in words]):
            return (
                f"cannot be rebuilt (ranks {sorted(lost)} lost their files; redundancy {red.name})"
            )
        repaired = [f"rank {r}" for r in sorted(lost)]
        held = {"copy": "partner copy", "parity": "parity"}.get(red.holds or "")
        repaired += [f"{held} on rank {r}" for r, w in enumerate(words) if not w[1]]
        room, error = self._rooms(m.directory, fix)
        if error is not None:
            return error

        def rebuild_here() -> dict[str, int]:
            got = red.rebuild(m, lost)
            if self.group.rank in lost and not verify_own(m):
                raise CorruptCheckpointError(
                    f"rank {self.group.rank}'s files were rebuilt but fail their checksums",
                    step=s, phase="restore",
                )  # fmt: skip
            return got

        rebuilt = gather(self.group, rebuild_here, "restore")
        failed = describe(rebuilt, "rebuild")
        if failed is not None:
            if room is True:
                self.local_storage.abort(m.directory)
            return failed
        gots = [o.value for o in rebuilt]
        failed = self._protect_again(m) if repaired else None
        if failed is not None:  # the step is whole; its redundancy is not (said, reported)
            repaired = [r if r.startswith("rank") else f"{r} (not rewritten)" for r in repaired]
        repaired += [f"manifest on node {self.placement.nodes[n]}" for n in stale]
        self._take_manifest(m, fix)
        if repaired and self.group.coordinator:
            _log.warning(
                "step %d: repaired on the local level: %s", s, ", ".join(repaired), phase="restore"
            )
        sources = {"own": sum(f.nbytes for f in m.manifest.files if f.rank not in lost)}
        for g in gots:
            for k, v in g.items():
                sources[k] = sources.get(k, 0) + v
        return LocalChoice(s, sources, repaired)

    def _rooms(self, directory: str, fix: bool) -> tuple[bool, str | None]:
        """Collective: ``_make_room`` where this node's copy needs fixing; whether this rank
        created the directory, and every failed rank's error (a directory this rank created
        is aborted again)."""
        rooms = gather(self.group, lambda: self._make_room(directory) if fix else False, "restore")
        room = rooms[self.group.rank].value is True  # every node's directory is there
        error = describe(rooms, "make room")
        if error is not None and room:
            self.local_storage.abort(directory)
        return room, error

    def _take_manifest(self, m: Member, fix: bool) -> None:
        """Collective: the agreed manifest into this node's directory where it was fixed (a
        failure is said: that node lacks the step until the next restart mends it); returns
        once every node holds the step."""

        def take() -> None:
            if fix:
                self.local_storage.commit(m.directory, m.manifest.dumps())

        mine = gather(self.group, take, "restore")[self.group.rank]
        if mine.failed:
            _log.warning("node %s could not take the manifest of %s: %s", self.node,
                         m.directory, mine.text, phase="restore")  # fmt: skip

    def _make_room(self, directory: str) -> bool:
        """Leader: ``directory`` exists on this node without a manifest or a marker, ready
        for the agreed manifest (a differing or marked one is removed: its files were
        verified against the agreed one). True if it had to be created."""
        kind = self.local_storage.entry_kind(directory)
        if kind == "missing":
            self.local_storage.prepare(directory)
            return True
        if kind != "dir":
            raise CheckpointExistsError(
                f"{directory} on node {self.node} is a {kind}, not a directory: not touched",
                path=f"{self.local_storage.url}/{directory}", phase="restore",
            )  # fmt: skip
        self.local_storage.uncommit(directory)
        for marker in ("damaged", "abandoned"):
            self.local_storage.unmark(directory, marker)
        return False

    def _protect_again(self, m: Member) -> str | None:
        """Write the redundancy again (a spare node gets its copies, a bad copy or parity is
        rewritten). A failure leaves the step restorable, less protected: said and returned
        (every rank alike), not raised."""
        error = describe(
            gather(self.group, lambda: m.placement.redundancy.protect(m), "restore"), "protect"
        )
        if error is not None and self.group.coordinator:
            _log.warning("%s: redundancy not re-established: %s", m.directory, error,
                         phase="restore")  # fmt: skip
        return error

    def _roll_back(self, s: int) -> list[str]:
        """Set aside the steps newer than ``s`` on every level: the next saves' step names are
        free, and no later restart resumes the abandoned timeline. Leaders on the local
        level, rank 0 on the shared ones; a failure is said, never a lone rank's error. The
        names, as ``<node>:<name>`` and ``<level>:<name>`` (``shared:<name>``)."""
        parts = [(self.local_catalog, self.node)] if self.leader else []
        if self.group.coordinator:
            parts += [(t.catalog, t.name) for t in self.targets]
        out: list[str] = []
        for catalog, where in parts:
            moved = attempt(partial(_roll_back, catalog, s), self.group.rank, "restore")
            if moved.failed:
                _log.warning("the steps after %d stay on %s: %s", s, where, moved.text,
                             phase="restore")  # fmt: skip
            else:
                out += [f"{where}:{name}" for name in moved.value]
        names = sorted({n for part in self.group.all_gather(out, "restore") for n in part})
        if names and self.group.coordinator:
            _log.warning("a new timeline starts at step %d; set aside: %s", s,
                         ", ".join(names), phase="restore")  # fmt: skip
        return names

    def fetch(
        self, manifest: Manifest, view: dict[int, tuple[str, bool]], storage: Storage
    ) -> None:
        """After a restore from a shared level (``storage``): copy the step into the local
        level where a node lacks it (or holds another manifest of it: ``view``, this node's
        from the survey) and protect it there, so that the next failure restarts from the
        local level. Collective; a failure is logged (the restore itself succeeded)."""
        if manifest.world_size != self.group.size:
            return
        name = step_dir_name(manifest.step)
        m = self.member(name, manifest)
        fix = self.leader and view.get(manifest.step) != (manifest_digest(manifest), False)
        source = self.member(name, manifest, storage)
        room, error = self._rooms(name, fix)
        errors = [error] if error is not None else []

        def copy_here() -> None:  # streamed through bounded buffers, checked on the way
            if not verify_own(m):
                copy_files(source.storage, m.storage, name, manifest, self.group.rank, "restore")

        if not errors:
            copied = describe(gather(self.group, copy_here, "restore"), "copy")
            errors = [copied] if copied is not None else []
        if errors:
            if room is True:
                self.local_storage.abort(name)
            if self.group.coordinator:
                _log.warning("step %d stays on %s only: %s", manifest.step, storage.url,
                             errors[0], phase="restore")  # fmt: skip
            return
        self._protect_again(m)
        self._take_manifest(m, fix)


def _brief(entries: list[Entry]) -> list[tuple[Any, ...]]:
    """What a restore needs to know of each step directory with a manifest, small enough to
    all-gather: (step, status, manifest digest or "", run, timeline, rollback mark)."""
    out = []
    for e in entries:
        if e.is_step_dir and e.step is not None and e.status in _WITH_MANIFEST:
            lineage = e.manifest.lineage if e.manifest is not None else None
            digest = manifest_digest(e.manifest) if e.manifest is not None else ""
            run, timeline = (lineage.run, lineage.timeline) if lineage else (None, None)
            mark = e.rollback if isinstance(e.rollback, dict) else None
            out.append((e.step, e.status, digest, run, timeline, mark))
    return out


_WITH_MANIFEST = (*SERVING, "abandoned")  # a step directory with a manifest


def _unusable(raw: bytes | None, s: int, digest: str, world_size: int) -> Manifest | str:
    """The manifest a node sent for step ``s``, or why the local level cannot serve it."""
    if raw is None:
        return "the manifest could not be read"
    try:
        manifest = Manifest.loads(raw, path=step_dir_name(s))
    except CheckpointError as e:
        return f"manifest: {e}"
    if manifest.step != s or manifest_digest(manifest) != digest:
        return "the manifest changed while it was read"
    if manifest.world_size != world_size:
        return (
            f"saved by {manifest.world_size} ranks, this job has {world_size}: the local level "
            "serves only the world size that wrote it (the shared level reshards)"
        )
    return manifest


def _roll_back(catalog: Catalog, s: int) -> list[str]:
    """Set aside the steps of ``catalog`` newer than ``s``: a rollback marker first where
    ``s`` is committed (``Catalog.start_timeline``), else each one."""
    entries = catalog.scan()
    here = next((e for e in entries if e.step == s and e.status == "committed"), None)
    if here is not None and here.is_step_dir:
        return catalog.start_timeline(here, entries, set())
    out = []
    for e in entries:
        if e.is_step_dir and e.step is not None and e.step > s and e.status in _WITH_MANIFEST:
            name = catalog.set_aside(e, "damaged" if e.status == "damaged" else "abandoned")
            if name is not None:
                out.append(name)
    return out
