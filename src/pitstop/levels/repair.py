"""Repair of the node-local level at restart: a step made whole on every node before it is
loaded, and a step a slower level served copied in. The node-level half of the one recovery
walk (:mod:`pitstop.levels.restart`); :class:`~pitstop.levels.node.NodeLevel` owns one.

``ready_step``: the step's manifest is the one the most nodes hold (ties: the lowest rank's)
that parses and fits the world size; every rank verifies its own member files, the partner
copy or parity block its node keeps (every checksum; parity also names its manifest), and the
ranks agree on what is lost. The step is recoverable when the level's redundancy strategy
says so (``Placement.recoverable``). Then each node whose manifest is missing, different,
unreadable or marked gets room (a spare's directory is created), the lost files are rebuilt
and verified, the redundancy is rewritten if any piece of it was missing or bad, and those
nodes get the agreed manifest. Each of these steps ends in a gather of every rank's outcome
(``pitstop.ranks.outcome``: its result or its error): a rank never fails alone; any error
means "try older", and says every failed rank's message.

``fetch``: after a slower level served a step, it is copied into every node that lacks it
(streamed through bounded buffers, checked on the way) and protected there, so the next
failure restarts from the local level.

Call sequence (training thread, every rank, collective)::

    choice = Repair(node).ready_step(s, views)    # LocalChoice, or why not (str)
    Repair(node).fetch(manifest, view, storage)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pitstop.engine.transfer import copy_files
from pitstop.errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from pitstop.format.manifest import Manifest, manifest_digest
from pitstop.format.names import step_dir_name
from pitstop.levels.redundancy import Member, verify_own
from pitstop.levels.spec import manifest_order
from pitstop.log import get_logger
from pitstop.ranks.outcome import describe, gather
from pitstop.storage.base import Storage

if TYPE_CHECKING:
    from pitstop.levels.node import NodeLevel

__all__ = ["LocalChoice", "Repair"]

_log = get_logger("pitstop.levels")


@dataclass
class LocalChoice:
    """What ``ready_step`` made ready: ``step`` whole on every node; bytes by source; what
    was rebuilt or rewritten."""

    step: int
    sources: dict[str, int] = field(default_factory=dict)
    repaired: list[str] = field(default_factory=list)


class Repair:
    """See the module docstring."""

    def __init__(self, node: NodeLevel) -> None:
        self.n = node

    def ready_step(self, s: int, views: list[dict[int, tuple[str, bool]]]) -> LocalChoice | str:
        """Collective: step ``s`` whole on every node, from the manifest the most nodes hold
        (ties: the lowest rank's) that this job can use; the reason when it cannot be."""
        leaders = sorted(set(self.n.placement.leaders))
        digests = {n: views[n].get(s, ("", False))[0] for n in leaders}
        order = manifest_order(list(digests.values()))
        reasons = []
        for digest in order:
            src = min(n for n in leaders if digests[n] == digest)
            raw = self.n.group.all_gather(
                self._manifest_bytes(s) if self.n.group.rank == src else None, "restore"
            )[src]
            why = _unusable(raw, s, digest, self.n.group.size)
            if isinstance(why, str):
                reasons.append(why)
                continue
            stale = [n for n in leaders if views[n].get(s) != (digest, False)]
            out = self._rebuild_step(self.n.member(step_dir_name(s), why), stale)
            if not isinstance(out, str):
                return out
            reasons.append(out)
        return "; ".join(reasons) or "no node holds a manifest that parses"

    def _manifest_bytes(self, s: int) -> bytes | None:
        try:
            return self.n.storage.read_manifest(step_dir_name(s))
        except CheckpointError:
            return None

    def _rebuild_step(self, m: Member, stale: list[int]) -> LocalChoice | str:
        """Collective: verify every rank's files and redundancy of ``m``, rebuild what is lost,
        make each node's directory hold the agreed manifest (``stale``: the leaders of the
        nodes whose manifest is missing, differs or is marked), protect again where anything
        was repaired."""
        s, red = m.manifest.step, self.n.placement.redundancy
        fix = self.n.group.rank in stale
        verified = gather(self.n.group, lambda: [verify_own(m), red.held_ok(m)], "restore")
        failed = describe(verified, "verify")
        if failed is not None:
            return failed
        words = [o.value for o in verified]
        lost = {r for r, w in enumerate(words) if not w[0]}
        if not self.n.placement.recoverable(lost, [w[1] for w in words]):
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
            if self.n.group.rank in lost and not verify_own(m):
                raise CorruptCheckpointError(
                    f"rank {self.n.group.rank}'s files were rebuilt but fail their checksums",
                    step=s, phase="restore",
                )  # fmt: skip
            return got

        rebuilt = gather(self.n.group, rebuild_here, "restore")
        failed = describe(rebuilt, "rebuild")
        if failed is not None:
            if room is True:
                self.n.storage.abort(m.directory)
            return failed
        gots = [o.value for o in rebuilt]
        failed = self._protect_again(m) if repaired else None
        if failed is not None:  # the step is whole; its redundancy is not (said, reported)
            repaired = [r if r.startswith("rank") else f"{r} (not rewritten)" for r in repaired]
        repaired += [f"manifest on node {self.n.placement.nodes[n]}" for n in stale]
        self._take_manifest(m, fix)
        if repaired and self.n.group.coordinator:
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
        rooms = gather(
            self.n.group, lambda: self._make_room(directory) if fix else False, "restore"
        )
        room = rooms[self.n.group.rank].value is True  # every node's directory is there
        error = describe(rooms, "make room")
        if error is not None and room:
            self.n.storage.abort(directory)
        return room, error

    def _take_manifest(self, m: Member, fix: bool) -> None:
        """Collective: the agreed manifest into this node's directory where it was fixed (a
        failure is said: that node lacks the step until the next restart mends it); returns
        once every node holds the step."""

        def take() -> None:
            if fix:
                self.n.storage.commit(m.directory, m.manifest.dumps())

        mine = gather(self.n.group, take, "restore")[self.n.group.rank]
        if mine.failed:
            _log.warning("node %s could not take the manifest of %s: %s", self.n.node,
                         m.directory, mine.text, phase="restore")  # fmt: skip

    def _make_room(self, directory: str) -> bool:
        """Leader: ``directory`` exists on this node without a manifest or a marker, ready
        for the agreed manifest (a differing or marked one is removed: its files were
        verified against the agreed one). True if it had to be created."""
        kind = self.n.storage.entry_kind(directory)
        if kind == "missing":
            self.n.storage.prepare(directory)
            return True
        if kind != "dir":
            raise CheckpointExistsError(
                f"{directory} on node {self.n.node} is a {kind}, not a directory: not touched",
                path=f"{self.n.storage.url}/{directory}", phase="restore",
            )  # fmt: skip
        self.n.storage.uncommit(directory)
        for marker in ("damaged", "abandoned"):
            self.n.storage.unmark(directory, marker)
        return False

    def _protect_again(self, m: Member) -> str | None:
        """Write the redundancy again (a spare node gets its copies, a bad copy or parity is
        rewritten). A failure leaves the step restorable, less protected: said and returned
        (every rank alike), not raised."""
        error = describe(
            gather(self.n.group, lambda: m.placement.redundancy.protect(m), "restore"), "protect"
        )
        if error is not None and self.n.group.coordinator:
            _log.warning("%s: redundancy not re-established: %s", m.directory, error,
                         phase="restore")  # fmt: skip
        return error

    def fetch(
        self, manifest: Manifest, view: dict[int, tuple[str, bool]], storage: Storage
    ) -> None:
        """After a restore from a shared level (``storage``): copy the step into the local
        level where a node lacks it (or holds another manifest of it: ``view``, this node's
        from the survey) and protect it there, so that the next failure restarts from the
        local level. Collective; a failure is logged (the restore itself succeeded)."""
        if manifest.world_size != self.n.group.size:
            return
        name = step_dir_name(manifest.step)
        m = self.n.member(name, manifest)
        fix = self.n.leader and view.get(manifest.step) != (manifest_digest(manifest), False)
        source = self.n.member(name, manifest, storage)
        room, error = self._rooms(name, fix)
        errors = [error] if error is not None else []

        def copy_here() -> None:  # streamed through bounded buffers, checked on the way
            if not verify_own(m):
                copy_files(source.storage, m.storage, name, manifest, self.n.group.rank, "restore")

        if not errors:
            copied = describe(gather(self.n.group, copy_here, "restore"), "copy")
            errors = [copied] if copied is not None else []
        if errors:
            if room is True:
                self.n.storage.abort(name)
            if self.n.group.coordinator:
                _log.warning("step %d stays on %s only: %s", manifest.step, storage.url,
                             errors[0], phase="restore")  # fmt: skip
            return
        self._protect_again(m)
        self._take_manifest(m, fix)


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
