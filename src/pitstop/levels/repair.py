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

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from pitstop.engine.collective import NodeCommit, commit_together
from pitstop.engine.persist import PersistResult
from pitstop.engine.transfer import copy_files
from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.manifest import Manifest, manifest_digest
from pitstop.format.names import step_dir_name
from pitstop.levels.redundancy import Member, verify_own
from pitstop.levels.spec import manifest_order
from pitstop.log import get_logger
from pitstop.ranks.outcome import Outcome, attempt, describe, gather
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
        self._rounds = 0  # repair rounds: every rank runs the same ones in the same order

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
        """Collective: verify every rank's files and redundancy of ``m``, then one commit
        round (:meth:`_rewrite`) that rebuilds what is lost, writes the redundancy again
        where anything was repaired and gives the agreed manifest to the nodes in ``stale``
        (the leaders of the nodes whose manifest is missing, differs or is marked)."""
        s, red, g = m.manifest.step, self.n.placement.redundancy, self.n.group
        verified = gather(g, lambda: [verify_own(m), red.held_ok(m)], "restore")
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

        def rebuild_here() -> dict[str, int]:
            got = red.rebuild(m, lost)
            if g.rank in lost and not verify_own(m):
                raise CorruptCheckpointError(
                    f"rank {g.rank}'s files were rebuilt but fail their checksums",
                    step=s, phase="restore",
                )  # fmt: skip
            return got

        gots, failed, unprotected = self._rewrite(m, stale, rebuild_here, protect=bool(repaired))
        if failed is not None:
            return failed
        if unprotected is not None:  # the step is whole; its redundancy is not (said)
            repaired = [r if r.startswith("rank") else f"{r} (not rewritten)" for r in repaired]
        repaired += [f"manifest on node {self.n.placement.nodes[n]}" for n in stale]
        if repaired and g.coordinator:
            _log.warning(
                "step %d: repaired on the local level: %s", s, ", ".join(repaired), phase="restore"
            )
        sources = {"own": sum(f.nbytes for f in m.manifest.files if f.rank not in lost)}
        for got in gots:
            for k, v in got.items():
                sources[k] = sources.get(k, 0) + v
        return LocalChoice(s, sources, repaired)

    def _rewrite(
        self, m: Member, stale: list[int], write: Callable[[], dict[str, int]], *, protect: bool
    ) -> tuple[list[dict[str, int]], str | None, str | None]:
        """Collective: the save's commit round (``engine.collective.commit_together``) for a
        step that exists: the leaders of ``stale`` ready their node's directory in place,
        every rank runs ``write`` (a rebuild or a copy; bytes by source), the redundancy is
        written again (``protect``; a failure leaves the step restorable, less protected),
        and the stale nodes commit the agreed manifest. Returns every rank's ``write``
        result, why the round failed before any node committed (None: it did not; a node
        that could not take the manifest is said, and lacks the step until the next restart
        mends it), and why the redundancy was not rewritten."""
        g = self.n.group
        got: dict[str, int] = {}
        reached: list[str | None] = []  # the round reached the commit; the protection's error

        def write_() -> PersistResult:
            got.update(write())
            return PersistResult((), (), 0, 0.0, False)

        def replicate(directory: str, manifest: bytes) -> None:
            error = None
            if protect:
                done = attempt(partial(m.placement.redundancy.protect, m), g.rank, "replicate")
                error = done.text if done.failed else None
            reached.append(error)

        leaders = sorted(set(self.n.placement.leaders))
        nodes = NodeCommit(
            tuple(self.n.placement.leaders), replicate, repair=True,
            keep=frozenset(n for n in leaders if n not in stale),
        )  # fmt: skip
        self._rounds += 1
        data = m.manifest.dumps()
        try:
            commit_together(
                g, self.n.storage, m.directory, f"repair-{m.manifest.step}-{self._rounds}",
                write_, lambda results, hosts: data, nodes,
            )  # fmt: skip
            mine = Outcome.ok(g.rank, "restore", [got, reached[0]])
        except Exception as e:
            mine = Outcome.of(e, g.rank, "restore", value=[got, reached[0]] if reached else None)
        outcomes = gather(g, mine, "restore")
        if any(o.value is None for o in outcomes):  # failed before the commit: try older
            self.n.storage.abort(m.directory)
            return [], describe([o for o in outcomes if o.failed], "repair") or "failed", None
        if outcomes[g.rank].failed:
            _log.warning("node %s could not take the manifest of %s: %s", self.n.node,
                         m.directory, outcomes[g.rank].text, phase="restore")  # fmt: skip
        unprotected = next((o.value[1] for o in outcomes if o.value[1] is not None), None)
        if unprotected is not None and g.coordinator:
            _log.warning("%s: redundancy not re-established: %s", m.directory, unprotected,
                         phase="restore")  # fmt: skip
        return [dict(o.value[0]) for o in outcomes], None, unprotected

    def fetch(
        self, manifest: Manifest, views: list[dict[int, tuple[str, bool]]], storage: Storage
    ) -> None:
        """After a restore from a slower level (``storage``): copy the step into the local
        level where a node lacks it (or holds another manifest of it: ``views``, every
        node's from the survey) and protect it there, so that the next failure restarts from
        the local level. Collective; a failure is logged (the restore itself succeeded)."""
        if manifest.world_size != self.n.group.size:
            return
        name, s = step_dir_name(manifest.step), manifest.step
        m = self.n.member(name, manifest)
        digest = manifest_digest(manifest)
        stale = [n for n in sorted(set(self.n.placement.leaders))
                 if views[n].get(s) != (digest, False)]  # fmt: skip

        def copy_here() -> dict[str, int]:  # streamed through bounded buffers, checked
            if verify_own(m):
                return {}
            return {"copied": copy_files(storage, m.storage, name, manifest, m.rank, "restore")}

        _, failed, _ = self._rewrite(m, stale, copy_here, protect=True)
        if failed is not None and self.n.group.coordinator:
            _log.warning("step %d stays on %s only: %s", s, storage.url, failed, phase="restore")


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
