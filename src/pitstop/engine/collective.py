"""The collective parts of a save of several ranks: describing what a rank holds, agreeing
on an outcome, and the two-round commit through the store.

Call sequence (every rank, the same saves in the same order)::

    items = local_items(flat)                          # training thread, in async_save
    agree(gather(group, outcome, "plan"), ...)         # training thread: all ok, or all fail
    result = commit_together(group, storage, d, seq, write, manifest)   # persist thread

``commit_together``: rank 0 creates the step directory and posts ``prepared``; every
rank writes its files and posts its outcome (a :class:`~pitstop.ranks.outcome.Outcome`:
its result, or its error); rank 0 gathers them, commits one manifest if all succeeded
(aborts the directory otherwise) and posts the outcome (ok, or every failed rank's), which
every other rank waits for: one whose own part failed too, which then raises its own error
with the others' failures added. Every word in the store is outcomes in their bytes
(``pitstop.ranks.outcome.dumps``).

With ``nodes`` (a :class:`NodeCommit`: the ranks write to one storage per node, the
node-local level of :mod:`pitstop.levels`) the leader of each node (its lowest rank)
creates and later commits that node's directory, and two rounds come between: rank 0
posts the manifest; every rank runs ``nodes.replicate`` (partner copies, parity) and
posts that it is done; rank 0 posts ``nodes.decide()``'s word once every rank is, and
only then does each leader write the manifest into its node's directory (and tell its
node's other ranks, which return only then: committed on their node). A kill before
that leaves no manifest on any node; a kill during it leaves some nodes committed, which
is enough: their manifest proves that every rank's files and redundancy were complete. Only the store is used: the background threads never
issue collectives on a process group. A rank that dies or hangs makes the others fail
after ``dist_timeout_secs`` with DistributedCheckpointError naming it; nothing is
committed unless every rank's files are durable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pitstop.engine.persist import PersistResult, result_from_json, result_to_json
from pitstop.format.codec import dtype_name
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import Outcome, agree, dumps, loads, outcomes_of
from pitstop.ranks.sharding import LocalItem
from pitstop.state.dtensor import local_box
from pitstop.state.tree import Flat
from pitstop.storage.base import Storage

__all__ = ["NodeCommit", "commit_together", "local_items"]


@dataclass(frozen=True)
class NodeCommit:
    """How a save whose ranks write to one storage per node commits (see the module
    docstring). ``leaders[r]``: the rank that creates and commits rank r's node directory.
    ``replicate(directory, manifest)``: every rank's persist thread, once every rank's files
    are durable. ``decide()``: rank 0, once every rank replicated: a JSON value that every
    rank's ``decided(value)`` receives before the commit (whether to flush this step)."""

    leaders: tuple[int, ...]
    replicate: Callable[[str, bytes], None]
    decide: Callable[[], Any]
    decided: Callable[[Any], None]


def local_items(flat: Flat, *, overlap: bool) -> list[LocalItem]:
    """What this rank holds, for the global plan (``ranks.sharding.assign``)."""
    out = []
    for key, t in flat.tensors.items():
        deferrable = overlap and key in flat.deferrable
        name = dtype_name(t.dtype, key=key)
        if key in flat.dtensors:
            local, global_shape, start = local_box(t)
            out.append(
                LocalItem(
                    key, name, t.element_size(), tuple(local.shape), "dtensor", deferrable,
                    global_shape, start,
                )
            )  # fmt: skip
        else:
            kind = "shared" if key in flat.shared else "own"
            out.append(LocalItem(key, name, t.element_size(), tuple(t.shape), kind, deferrable))
    return out


def _heard(
    group: Group, key: str, phase: str, source: int, what: str, mine: Outcome | None = None
) -> Outcome:
    """Rank ``source``'s word at ``key``: its ok outcome, or raise. A rank whose own part
    failed (``mine``) raises its own error, with the failures the word names added (and if the
    word never comes, its own error as it is); the others raise one naming every failed
    rank."""
    try:
        word = group.read(key, phase)
    except BaseException:
        if mine is not None and mine.error is not None:
            raise mine.error from None
        raise
    outcomes = loads(word, source, phase)
    if mine is not None and mine.failed:  # in the word too, without its exception
        outcomes = [o for o in outcomes if o.rank != mine.rank] + [mine]
    agree(outcomes, group.rank, what)
    return outcomes[0]


def _gathered(group: Group, key: str, phase: str, mine: Outcome) -> list[Outcome]:
    """Coordinator: every rank's word under ``key`` (rank order), its own (``mine``, with its
    exception) in its place."""
    words = group.collect(key, phase)
    out = [loads(w, r, phase)[0] for r, w in enumerate(words)]
    out[group.rank] = mine
    return out


def _decide(
    group: Group, key: str, phase: str, outcomes: list[Outcome], what: str, ok: Callable[[], Any]
) -> Any:
    """Coordinator: post the failed outcomes at ``key`` and raise (its own error, or one
    naming every failed rank), or post ``ok()``'s value as its ok outcome and return it; an
    error of ``ok()`` is posted as the coordinator's (or, for a rank that did not report,
    that rank's) outcome and raised."""
    failed = [o for o in outcomes if o.failed]
    if failed:
        group.post(key, dumps(failed))
        agree(outcomes, group.rank, what)
    try:
        value = ok()
    except BaseException as e:
        group.post(key, dumps(outcomes_of(e, group.rank, phase)))
        raise
    group.post(key, dumps([Outcome.ok(group.rank, phase, value)]))
    return value


def commit_together(
    group: Group,
    storage: Storage,
    directory: str,
    seq: int | str,
    write: Callable[[], PersistResult],
    manifest: Callable[[list[PersistResult], list[str]], bytes],
    nodes: NodeCommit | None = None,
) -> PersistResult:
    """Write this rank's part and commit the checkpoint with every other rank (see above).
    A rank whose part failed raises its own error once rank 0 has heard every rank (the
    others' failures added to it); the others raise a DistributedCheckpointError naming
    every failed rank with its message."""
    key, what = f"save/{seq}", f"save of {directory}"
    leader = nodes.leaders[group.rank] if nodes is not None else 0
    token = _prepare(group, storage, directory, key, leader)
    result: PersistResult | None = None
    try:
        if group.rank != leader:  # into the very directory the leader created, or not at all
            storage.join(directory, str(token))
        try:
            result = write()
        finally:
            if group.rank != leader:
                storage.leave(directory)
        mine = Outcome.ok(group.rank, "persist", result_to_json(result))
    except BaseException as e:
        mine = Outcome.of(e, group.rank, "persist")
        if not isinstance(e, Exception) and not group.coordinator:  # interrupted: at once
            group.post(f"{key}/result/{group.rank}", dumps([mine]))
            raise
    told = f"{key}/commit" if nodes is None else f"{key}/manifest"
    if group.coordinator:
        try:
            data = _coordinate(group, storage, directory, key, mine, manifest, nodes is None)
        except BaseException:
            if mine.error is not None:  # the others were told; this rank (one process: the
                raise mine.error from None  # only one) raises what it met, as all that failed
            raise
    else:
        group.post(f"{key}/result/{group.rank}", dumps([mine]))
        heard = _heard(group, told, "commit", 0, what, mine)
        data = str(heard.value).encode("latin-1") if nodes is not None else b""
    assert result is not None
    if nodes is not None:
        _commit_nodes(group, storage, directory, key, data, nodes, leader)
    return result


def _prepare(group: Group, storage: Storage, directory: str, key: str, leader: int) -> str:
    """The leader creates the step directory and posts its token; the others read it."""
    prepared = f"{key}/prepared" if leader == 0 else f"{key}/prepared/{leader}"
    if group.rank != leader:
        return str(_heard(group, prepared, "plan", leader, f"save of {directory}").value)
    try:
        token = storage.prepare(directory)
    except BaseException as e:
        group.post(prepared, dumps([Outcome.of(e, group.rank, "plan")]))
        raise
    group.post(prepared, dumps([Outcome.ok(group.rank, "plan", token)]))
    return token


def _commit_nodes(
    group: Group, storage: Storage, directory: str, key: str, manifest: bytes,
    nodes: NodeCommit, leader: int,
) -> None:  # fmt: skip
    """Every rank: replicate; rank 0: decide once all did; leaders: commit their node's copy."""
    what = f"save of {directory}"
    try:
        nodes.replicate(directory, manifest)
        mine = Outcome.ok(group.rank, "replicate")
    except BaseException as e:
        mine = Outcome.of(e, group.rank, "replicate")
    group.post(f"{key}/replicated/{group.rank}", dumps([mine]))
    if group.coordinator:
        try:
            if mine.error is not None:  # at once: the others learn it from the decision
                raise mine.error
            outcomes = _gathered(group, f"{key}/replicated", "replicate", mine)
        except BaseException as e:
            group.post(f"{key}/decided", dumps(outcomes_of(e, 0, "replicate")))
            raise
        _decide(group, f"{key}/decided", "replicate", outcomes, what, nodes.decide)
    nodes.decided(_heard(group, f"{key}/decided", "replicate", 0, what, mine).value)
    done = f"{key}/committed/{leader}"  # the node's word: a rank returns once its node holds it
    waiting = any(lead == leader and r != leader for r, lead in enumerate(nodes.leaders))
    if group.rank == leader:
        try:
            storage.commit(directory, manifest)
        except BaseException as e:
            if waiting:
                group.post(done, dumps([Outcome.of(e, group.rank, "commit")]))
            raise
        if waiting:
            group.post(done, dumps([Outcome.ok(group.rank, "commit")]))
    else:
        _heard(group, done, "commit", leader, f"{what} (its node's leader, rank {leader})")


def _coordinate(
    group: Group,
    storage: Storage,
    directory: str,
    key: str,
    mine: Outcome,
    manifest: Callable[[list[PersistResult], list[str]], bytes],
    commit: bool,
) -> bytes:
    """Rank 0: gather every rank's result, commit (or, for ``NodeCommit``, post the manifest)
    or abort, and tell everyone. Returns the manifest."""
    group.post(f"{key}/result/0", dumps([mine]))
    told = f"{key}/commit" if commit else f"{key}/manifest"
    try:
        outcomes = _gathered(group, f"{key}/result", "persist", mine)
    except BaseException as e:  # a rank that did not report: named by the group
        group.post(told, dumps(outcomes_of(e, 0, "persist")))
        raise
    out: list[bytes] = []

    def build() -> str | None:
        results = [result_from_json(o.value) for o in outcomes]
        hosts = sorted({str(o.value.get("host")) for o in outcomes})
        out.append(manifest(results, hosts))
        if commit:
            storage.commit(directory, out[0])
            return None
        return out[0].decode("latin-1")  # the manifest's bytes, as they are, in JSON

    _decide(group, told, "commit", outcomes, f"save of {directory}", build)
    return out[0]
