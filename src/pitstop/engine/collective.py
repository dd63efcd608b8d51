"""The collective parts of a save of several ranks: describing what a rank holds, agreeing
on an outcome, and the commit round through the store: one transaction for every save and
every copy between levels, whatever the topology.

Call sequence (every rank, the same saves in the same order)::

    items = local_items(flat)                          # training thread, in async_save
    agree(gather(group, outcome, "plan"), ...)         # training thread: all ok, or all fail
    result = commit_together(group, storage, d, seq, write, manifest, nodes)   # persist thread

``commit_together``, with ``nodes`` (a :class:`NodeCommit`) saying who leads each rank's
directory: one directory for every rank (a root, a shared level, a flush:
``NodeCommit.single``: rank 0 leads), or one per node (the node-local level of
:mod:`pitstop.levels`: each node's lowest rank). Each leader creates its directory and posts
``prepared``; every rank writes its files into it and posts its outcome (a
:class:`~pitstop.ranks.outcome.Outcome`: its result, or its error); rank 0 gathers them
and posts the manifest (or every failed rank's outcome: all raise); every rank runs
``nodes.replicate`` (partner copies, parity; nothing for one copy) and posts that it is
done; rank 0 posts ``nodes.decide()``'s word once every rank is, and only then does each
leader write the manifest into its directory (and tell the other ranks it leads, which
return only then: committed). A kill before that leaves no manifest anywhere; a kill during
it leaves some nodes committed, which is enough: their manifest proves that every rank's
files and redundancy were complete. Every word in the store is outcomes in their bytes
(``pitstop.ranks.outcome.dumps``). Only the store is used: the background threads never
issue collectives on a process group. A rank that dies or hangs makes the others fail
after ``dist_timeout_secs`` with DistributedCheckpointError naming it; nothing is
committed unless every rank's files are durable. One process runs the same rounds on the
null group, in-process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pitstop.engine.persist import PersistResult, result_from_json, result_to_json
from pitstop.errors import CheckpointExistsError
from pitstop.format.codec import dtype_name
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import Outcome, agree, dumps, loads, outcomes_of
from pitstop.ranks.sharding import LocalItem
from pitstop.state.dtensor import local_box
from pitstop.state.tree import Flat
from pitstop.storage.base import Storage

__all__ = ["NodeCommit", "commit_together", "local_items"]


def _nothing(directory: str, manifest: bytes) -> None:
    pass


def _no_word() -> None:
    return None


def _ignore(word: Any) -> None:
    pass


@dataclass(frozen=True)
class NodeCommit:
    """How a save whose ranks write to one storage per node commits (see the module
    docstring). ``leaders[r]``: the rank that creates and commits rank r's node directory.
    ``replicate(directory, manifest)``: every rank's persist thread, once every rank's files
    are durable. ``decide()``: rank 0, once every rank replicated: a JSON value that every
    rank's ``decided(value)`` receives before the commit (whether to flush this step)."""

    leaders: tuple[int, ...]
    replicate: Callable[[str, bytes], None]
    decide: Callable[[], Any] = _no_word
    decided: Callable[[Any], None] = _ignore
    repair: bool = False
    """A restart's repair: each leader readies the step's existing directory in place (created
    if missing; else its manifest and damage or abandon markers removed: its files were
    verified against the agreed manifest) instead of creating a new one."""
    keep: frozenset[int] = frozenset()
    """Leaders whose node already holds the step as agreed: they neither ready nor commit it."""

    @classmethod
    def single(cls, size: int) -> NodeCommit:
        """One directory for every rank: rank 0 leads; nothing to replicate or decide."""
        return cls((0,) * size, _nothing)


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
    nodes: NodeCommit,
) -> PersistResult:
    """Write this rank's part and commit the checkpoint with every other rank (see above).
    A rank whose part failed raises its own error once rank 0 has heard every rank (the
    others' failures added to it); the others raise a DistributedCheckpointError naming
    every failed rank with its message."""
    key, what = f"save/{seq}", f"save of {directory}"
    leader = nodes.leaders[group.rank]
    token = _prepare(group, storage, directory, key, leader, nodes)
    joins = group.rank != leader and bool(token)
    result: PersistResult | None = None
    try:
        if joins:  # into the very directory the leader created, or not at all
            storage.join(directory, token)
        try:
            result = write()
        finally:
            if joins:
                storage.leave(directory)
        mine = Outcome.ok(group.rank, "persist", result_to_json(result))
    except BaseException as e:
        mine = Outcome.of(e, group.rank, "persist")
        if not isinstance(e, Exception) and not group.coordinator:  # interrupted: at once
            group.post(f"{key}/result/{group.rank}", dumps([mine]))
            raise
    if group.coordinator:
        try:
            data = _coordinate(group, key, directory, mine, manifest)
        except BaseException:
            if mine.error is not None:  # the others were told; this rank (one process: the
                raise mine.error from None  # only one) raises what it met, as all that failed
            raise
    else:
        group.post(f"{key}/result/{group.rank}", dumps([mine]))
        heard = _heard(group, f"{key}/manifest", "commit", 0, what, mine)
        data = str(heard.value).encode("latin-1")
    assert result is not None
    _commit_nodes(group, storage, directory, key, data, nodes, leader)
    return result


def _prepare(
    group: Group, storage: Storage, directory: str, key: str, leader: int, nodes: NodeCommit
) -> str:
    """Each leader readies its directory and posts its token; every rank hears every
    leader's word before any rank writes (a node that cannot make room fails every rank at
    once); the token of this rank's leader."""
    if group.rank == leader:
        try:
            token = _room(storage, directory, nodes, leader)
        except BaseException as e:
            group.post(_prepared(key, leader), dumps([Outcome.of(e, group.rank, "plan")]))
            raise
        group.post(_prepared(key, leader), dumps([Outcome.ok(group.rank, "plan", token)]))
    tokens = {
        lead: str(_heard(group, _prepared(key, lead), "plan", lead, f"save of {directory}").value)
        for lead in sorted(set(nodes.leaders))
        if lead != group.rank
    }  # fmt: skip
    return token if group.rank == leader else tokens[leader]


def _prepared(key: str, leader: int) -> str:
    return f"{key}/prepared" if leader == 0 else f"{key}/prepared/{leader}"


def _room(storage: Storage, directory: str, nodes: NodeCommit, leader: int) -> str:
    """Leader: ``directory`` ready for this round's files; its token ("" for a directory
    readied in place: the others write into it without joining)."""
    if leader in nodes.keep:
        return ""
    if not nodes.repair:
        return storage.prepare(directory)
    kind = storage.entry_kind(directory)
    if kind == "missing":
        return storage.prepare(directory)
    if kind != "dir":
        raise CheckpointExistsError(
            f"{directory} is a {kind}, not a directory: not touched",
            path=f"{storage.url}/{directory}", phase="restore",
        )  # fmt: skip
    storage.uncommit(directory)
    for marker in ("damaged", "abandoned"):
        storage.unmark(directory, marker)
    return ""


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
            if leader not in nodes.keep:
                storage.commit(directory, manifest)
        except BaseException as e:
            if waiting:
                group.post(done, dumps([Outcome.of(e, group.rank, "commit")]))
            raise
        if waiting:
            group.post(done, dumps([Outcome.ok(group.rank, "commit")]))
    else:
        _heard(
            group, done, "commit", leader, f"{what} (rank {leader}, which commits its directory)"
        )


def _coordinate(
    group: Group,
    key: str,
    directory: str,
    mine: Outcome,
    manifest: Callable[[list[PersistResult], list[str]], bytes],
) -> bytes:
    """Rank 0: gather every rank's result, build the manifest and post it (or every failed
    rank's outcome). Returns the manifest."""
    group.post(f"{key}/result/0", dumps([mine]))
    told = f"{key}/manifest"
    try:
        outcomes = _gathered(group, f"{key}/result", "persist", mine)
    except BaseException as e:  # a rank that did not report: named by the group
        group.post(told, dumps(outcomes_of(e, 0, "persist")))
        raise
    out: list[bytes] = []

    def build() -> str:
        results = [result_from_json(o.value) for o in outcomes]
        hosts = sorted({str(o.value.get("host")) for o in outcomes})
        out.append(manifest(results, hosts))
        return out[0].decode("latin-1")  # the manifest's bytes, as they are, in JSON

    _decide(group, told, "commit", outcomes, f"save of {directory}", build)
    return out[0]
