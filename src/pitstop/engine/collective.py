"""The collective parts of a save of several ranks: describing what a rank holds, agreeing
on an outcome, and the two-round commit through the store.

Call sequence (every rank, the same saves in the same order)::

    items = local_items(flat)                          # training thread, in async_save
    agree(group.all_gather(word, "plan"), ...)         # training thread: all ok, or all fail
    result = commit_together(group, storage, d, seq, write, manifest)   # persist thread

``commit_together``: rank 0 creates the step directory and posts ``prepared``; every
rank writes its files and posts its result (or its error); rank 0 gathers them, commits
one manifest if all succeeded (aborts the directory otherwise) and posts the outcome,
which every other rank waits for.

With ``nodes`` (a :class:`NodeCommit`: the ranks write to one storage per node, the
node-local level of :mod:`pitstop.multilevel`) the leader of each node (its lowest rank)
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

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pitstop.engine.persist import PersistResult, result_from_json, result_to_json
from pitstop.errors import CheckpointError, DistributedCheckpointError
from pitstop.format.codec import dtype_name
from pitstop.ranks.group import Group
from pitstop.ranks.sharding import LocalItem
from pitstop.state.dtensor import local_box
from pitstop.state.tree import Flat
from pitstop.storage.base import Storage

__all__ = ["NodeCommit", "agree", "commit_together", "local_items"]


_MANIFEST = b"manifest:"  # rank 0's word that carries the manifest (an error word is JSON)


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


def agree(words: list[tuple[str, str]], mine: BaseException | None, phase: str, rank: int) -> None:
    """After an all-gather of ``("ok", ...)`` / ``("error", text)``: raise this rank's own
    error, or a DistributedCheckpointError naming the ranks that failed."""
    failed = [r for r, w in enumerate(words) if w[0] != "ok"]
    if not failed:
        return
    if mine is not None:
        raise mine
    raise DistributedCheckpointError(
        f"{phase} failed on rank(s) {failed}: {words[failed[0]][1]}",
        ranks=failed, rank=rank, phase=phase,
    )  # fmt: skip


def _error_word(e: BaseException, default_phase: str, ranks: list[int] | None = None) -> bytes:
    """What a rank posts instead of its result: the error, its phase, and (the coordinator's
    word) the ranks that failed."""
    phase = e.phase if isinstance(e, CheckpointError) and e.phase else default_phase
    word: dict[str, Any] = {"error": f"{type(e).__name__}: {e}"[:2000], "phase": phase}
    if ranks is not None:
        word["ranks"] = ranks
    return json.dumps(word).encode()


def _failure(word: bytes, source: str, step_dir: str, rank: int) -> DistributedCheckpointError:
    try:
        raw = json.loads(word)
        text, phase = str(raw.get("error")), str(raw.get("phase") or "commit")
        ranks = [int(r) for r in raw.get("ranks", [])]
    except (ValueError, TypeError, AttributeError):
        text, phase, ranks = repr(word[:200]), "commit", []
    return DistributedCheckpointError(
        f"save of {step_dir} failed ({source}): {text}", ranks=ranks, rank=rank, phase=phase
    )


def commit_together(
    group: Group,
    storage: Storage,
    directory: str,
    seq: int | str,
    write: Callable[[], PersistResult],
    manifest: Callable[[list[PersistResult], list[str]], bytes],
    nodes: NodeCommit | None = None,
) -> PersistResult:
    """Write this rank's part and commit the checkpoint with every other rank (see above)."""
    key = f"save/{seq}"
    leader = nodes.leaders[group.rank] if nodes is not None else 0
    prepared = f"{key}/prepared" if leader == 0 else f"{key}/prepared/{leader}"
    if group.rank == leader:
        try:
            token = storage.prepare(directory)
        except BaseException as e:
            group.post(prepared, _error_word(e, "plan", [group.rank]))
            raise
        group.post(prepared, json.dumps({"ok": token}).encode())
    else:
        word = group.read(prepared, "plan")
        try:
            token = json.loads(word)["ok"]
        except (ValueError, KeyError, TypeError):
            why = f"rank {leader} could not create it"
            raise _failure(word, why, directory, group.rank) from None
    result: PersistResult | None = None
    mine: BaseException | None = None  # this rank's own failure: it raises that, not the round's
    try:
        if group.rank != leader:  # into the very directory the leader created, or not at all
            storage.join(directory, str(token))
        try:
            result = write()
        finally:
            if group.rank != leader:
                storage.leave(directory)
        report = json.dumps({"ok": result_to_json(result)}).encode()
    except BaseException as e:
        mine, report = e, _error_word(e, "persist")
        if not group.coordinator:
            group.post(f"{key}/result/{group.rank}", report)
            raise
    if group.coordinator:
        try:
            data = _coordinate(group, storage, directory, key, report, manifest, nodes is None)
        except BaseException:
            if mine is not None:  # the others were told; this rank (one process: the only
                raise mine from None  # one) raises what it met, as every failing rank does
            raise
    else:
        group.post(f"{key}/result/{group.rank}", report)
        word = group.read(f"{key}/commit" if nodes is None else f"{key}/manifest", "commit")
        if word != b"ok" and not (nodes is not None and word.startswith(_MANIFEST)):
            raise _failure(word, "reported by rank 0", directory, group.rank)
        data = word[len(_MANIFEST) :] if nodes is not None else b""  # the manifest rank 0 sent
    assert result is not None
    if nodes is not None:
        _commit_nodes(group, storage, directory, key, data, nodes, leader)
    return result


def _commit_nodes(
    group: Group, storage: Storage, directory: str, key: str, manifest: bytes,
    nodes: NodeCommit, leader: int,
) -> None:  # fmt: skip
    """Every rank: replicate; rank 0: decide once all did; leaders: commit their node's copy."""
    failure: BaseException | None = None
    try:
        nodes.replicate(directory, manifest)
        mine = b"ok"
    except BaseException as e:
        failure, mine = e, _error_word(e, "replicate", [group.rank])
    group.post(f"{key}/replicated/{group.rank}", mine)
    if group.coordinator:
        try:
            if failure is not None:
                raise failure
            words = group.collect(f"{key}/replicated", "replicate")
            failed = [r for r, w in enumerate(words) if w != b"ok"]
            if failed:
                raise _failure(words[failed[0]], f"rank(s) {failed}", directory, 0)
            group.post(f"{key}/decided", json.dumps({"ok": nodes.decide()}).encode())
        except BaseException as e:
            ranks = e.ranks if isinstance(e, DistributedCheckpointError) else [0]
            group.post(f"{key}/decided", _error_word(e, "replicate", ranks))
            raise
    elif failure is not None:
        raise failure
    word = group.read(f"{key}/decided", "replicate")
    try:
        decision = json.loads(word)["ok"]
    except (ValueError, KeyError, TypeError):
        raise _failure(word, "reported by rank 0", directory, group.rank) from None
    nodes.decided(decision)
    done = f"{key}/committed/{leader}"  # the node's word: a rank returns once its node holds it
    waiting = any(lead == leader and r != leader for r, lead in enumerate(nodes.leaders))
    if group.rank == leader:
        try:
            storage.commit(directory, manifest)
        except BaseException as e:
            if waiting:
                group.post(done, _error_word(e, "commit", [group.rank]))
            raise
        if waiting:
            group.post(done, b"ok")
    else:
        word = group.read(done, "commit")
        if word != b"ok":
            raise _failure(word, f"its node's leader, rank {leader}", directory, group.rank)


def _coordinate(
    group: Group,
    storage: Storage,
    directory: str,
    key: str,
    own: bytes,
    manifest: Callable[[list[PersistResult], list[str]], bytes],
    commit: bool,
) -> bytes:
    """Rank 0: gather every rank's result, commit (or, for ``NodeCommit``, post the manifest)
    or abort, and tell everyone. Returns the manifest."""
    group.post(f"{key}/result/0", own)
    try:
        reports: list[dict[str, Any]] = [
            json.loads(r) for r in group.collect(f"{key}/result", "persist")
        ]
        failed = [r for r, rep in enumerate(reports) if "ok" not in rep]
        if failed:
            first = reports[failed[0]]
            raise DistributedCheckpointError(
                f"rank(s) {failed} failed in phase {first.get('phase')}: {first.get('error')}",
                ranks=failed, rank=0, phase=str(first.get("phase") or "persist"),
            )  # fmt: skip
        results = [result_from_json(rep["ok"]) for rep in reports]
        hosts = sorted({str(rep["ok"].get("host")) for rep in reports})
        data = manifest(results, hosts)
        if commit:
            storage.commit(directory, data)
    except BaseException as e:
        ranks = e.ranks if isinstance(e, DistributedCheckpointError) else [0]
        word = _error_word(e, "commit", ranks)
        group.post(f"{key}/commit" if commit else f"{key}/manifest", word)
        raise
    group.post(
        f"{key}/commit" if commit else f"{key}/manifest", b"ok" if commit else _MANIFEST + data
    )
    return data
