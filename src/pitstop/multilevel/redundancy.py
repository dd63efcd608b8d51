"""Redundancy of the node-local level: partner copies and XOR parity, written and rebuilt.

Call sequence (every rank, the same calls in the same order)::

    protect(member)                     # persist thread, after every rank's files are
                                        #   durable, before any node commits (NodeCommit)
    payload, got = rebuild(member, lost, placement)   # training thread, at restore: the
                                        #   member files of the ranks in ``lost``

A rank's *payload* is its member files (its data and objects files of the step), each at a
4 KiB-aligned offset, in name order: the same bytes on every node that keeps them.

``partner``: rank r sends its payload to ``placement.partner_holder(r)``, which keeps it as
``partner-<name>`` files next to its own. ``xor``: in a set of N members, a payload padded to
``(N-1) * B`` is cut into N-1 blocks, one for each other member; member k keeps
``P_k = XOR of the blocks the others cut for k`` in ``xor-<k>.bin`` (with its description and
checksum in ``xor-<k>.json``), so the set stores N/(N-1) of its data. A lost member x is
rebuilt block by block: ``block(x -> k) = P_k XOR block(j -> k) for every other j``: every
survivor sends x what it holds of each k, x xors them.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace
from typing import Any

import torch

from pitstop.engine.verify import verify_checkpoint
from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.checksum import get_checksum
from pitstop.format.manifest import FileEntry, Manifest, manifest_digest
from pitstop.format.names import parity_file_names, partner_copy_name
from pitstop.io.arena import Arena
from pitstop.log import get_logger
from pitstop.multilevel.levels import Placement
from pitstop.options import ALIGN_BYTES
from pitstop.ranks.peers import PeerLink
from pitstop.storage.base import Storage
from pitstop.storage.wrap import StorageWrapper

__all__ = [
    "Member", "protect", "read_payload", "rebuild", "verify_copy", "verify_own", "verify_parity",
    "verify_payload",
]  # fmt: skip

_PARITY_VERSION = 1
_log = get_logger("pitstop.multilevel")


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass
class Member:
    """One rank's view of one step on its node: where it reads and writes, and with whom."""

    storage: Storage
    directory: str
    manifest: Manifest
    placement: Placement
    link: PeerLink
    rank: int

    def files(self, rank: int | None = None) -> list[tuple[FileEntry, int]]:
        """``rank``'s member files and their offsets in its payload."""
        r = self.rank if rank is None else rank
        out, at = [], 0
        for f in sorted((f for f in self.manifest.files if f.rank == r), key=lambda f: f.name):
            out.append((f, at))
            at += _align(f.nbytes)
        return out

    def payload_bytes(self, rank: int | None = None) -> int:
        return sum(_align(f.nbytes) for f, _ in self.files(rank))

    def block_bytes(self) -> int:
        members = self.placement.xor_set(self.rank)
        largest = max(self.payload_bytes(r) for r in members)
        return _align(-(-largest // (len(members) - 1)))


def _read(storage: Storage, directory: str, name: str, out: memoryview) -> None:
    """Fill ``out`` (aligned) with file ``name``; a short file is damage."""
    with contextlib.closing(storage.open_data(directory, name)) as reader:
        at = 0
        while at < len(out):
            n = reader.read_into(at, out[at:])
            if n <= 0:
                break
            at += n


def read_payload(m: Member, rank: int | None = None, copy: bool = False) -> tuple[Arena, int]:
    """``rank``'s payload (its files, or the partner copies of them) read from this node."""
    total = m.payload_bytes(rank)
    arena = Arena(max(total, ALIGN_BYTES))
    for f, at in m.files(rank):
        name = partner_copy_name(f.name) if copy else f.name
        _read(m.storage, m.directory, name, arena.view[at : at + _align(f.nbytes)])
    return arena, total


def write_payload(m: Member, rank: int, data: memoryview, copy: bool) -> None:
    for f, at in m.files(rank):
        name = partner_copy_name(f.name) if copy else f.name
        m.storage.write_object(m.directory, name, data[at : at + f.nbytes])


def _u8(view: memoryview) -> torch.Tensor:
    return (
        torch.frombuffer(view, dtype=torch.uint8)
        if len(view)
        else torch.empty(0, dtype=torch.uint8)
    )


# ---------------------------------------------------------------------- save
def protect(m: Member) -> int:
    """Write this rank's share of the step's redundancy (see the module docstring); the
    bytes it received."""
    scheme = m.placement.scheme
    if scheme == "single":
        return 0
    arena, total = read_payload(m)
    try:
        if scheme == "partner":
            return _protect_partner(m, arena, total)
        return _protect_xor(m, arena)
    finally:
        arena.close()


def _protect_partner(m: Member, arena: Arena, total: int) -> int:
    src, dst = m.placement.partner_source(m.rank), m.placement.partner_holder(m.rank)
    theirs = m.payload_bytes(src)
    inbox = Arena(max(theirs, ALIGN_BYTES))
    try:
        m.link.exchange(
            [(dst, _u8(arena.view[:total]))], [(src, _u8(inbox.view[:theirs]))], "replicate"
        )
        write_payload(m, src, inbox.view, copy=True)
    finally:
        inbox.close()
    return theirs


def _blocks(m: Member, arena_view: memoryview, block: int, rank: int) -> dict[int, memoryview]:
    """``rank``'s padded payload cut into one block for each other member of its set."""
    others = [k for k in m.placement.xor_set(rank) if k != rank]
    return {k: arena_view[i * block : (i + 1) * block] for i, k in enumerate(others)}


def _padded(view: memoryview, total: int, block: int, n: int) -> Arena:
    out = Arena(block * (n - 1))
    out.view[:total] = view[:total]
    return out


def _protect_xor(m: Member, arena: Arena) -> int:
    members = m.placement.xor_set(m.rank)
    block = m.block_bytes()
    total = m.payload_bytes()
    padded = _padded(arena.view, total, block, len(members))
    others = [k for k in members if k != m.rank]
    inbox = Arena(block * len(others))
    try:
        mine = _blocks(m, padded.view, block, m.rank)
        recvs = [(j, _u8(inbox.view[i * block : (i + 1) * block])) for i, j in enumerate(others)]
        m.link.exchange([(k, _u8(mine[k])) for k in others], recvs, "replicate")
        parity = torch.zeros(block, dtype=torch.uint8)
        for _, t in recvs:
            parity.bitwise_xor_(t)
        _write_parity(m, members, block, parity)
    finally:
        padded.close()
        inbox.close()
    return block * len(others)


def _write_parity(m: Member, members: list[int], block: int, parity: torch.Tensor) -> None:
    data_name, meta_name = parity_file_names(m.rank)
    data = memoryview(parity.numpy().data).cast("B")
    algorithm = m.manifest.checksum_algorithm
    meta = {
        "version": _PARITY_VERSION, "step": m.manifest.step, "set": members,
        "manifest": manifest_digest(m.manifest),
        "block_bytes": block, "algorithm": algorithm, "checksum": get_checksum(algorithm)(data),
    }  # fmt: skip
    m.storage.write_object(m.directory, data_name, data)
    m.storage.write_object(m.directory, meta_name, json.dumps(meta).encode())


# ---------------------------------------------------------------------- verify
class _Copies(StorageWrapper):
    """This node's partner copies, seen under the names of the files they copy."""

    def _call(self, name: str, fn: Any) -> Any:
        if name in ("file_size", "read_object", "open_data"):
            return lambda d, f, *a, **k: fn(d, partner_copy_name(f), *a, **k)
        return fn


def _verify_rank(storage: Storage, m: Member, rank: int) -> bool:
    sub = replace(m.manifest, files=tuple(f for f, _ in m.files(rank)))  # its files only
    try:
        report = verify_checkpoint(storage, m.directory, sub, threads=1)
        if report.problems:
            _log.info(
                "rank %d, step %d: %s",
                rank,
                m.manifest.step,
                "; ".join(report.problems[:3]),
                phase="verify",
            )
        return report.ok
    except CheckpointError:  # missing directory, unreadable file: this copy is lost
        return False


class _Payload:
    """A rank's payload in memory, seen as the files it holds (to verify before a copy)."""

    def __init__(self, m: Member, view: memoryview) -> None:
        self.url, self.io = f"{m.storage.url}/{m.directory} (in memory)", m.storage.io
        self._files = {f.name: view[at : at + f.nbytes] for f, at in m.files()}
        self.direct = False

    def file_size(self, directory: str, name: str) -> int:
        return len(self._files[name])

    def read_object(self, directory: str, name: str) -> bytes:
        return bytes(self._files[name])

    def open_data(self, directory: str, name: str) -> _Payload:
        self._open = self._files[name]
        return self

    def read_into(self, offset: int, out: memoryview) -> int:
        piece = self._open[offset : offset + len(out)]
        out[: len(piece)] = piece
        return len(piece)

    def close(self) -> None:
        pass


def verify_payload(m: Member, view: memoryview) -> bool:
    """This rank's payload, read into ``view``, passes every checksum of the manifest."""
    return _verify_rank(_Payload(m, view), m, m.rank)  # type: ignore[arg-type]


def verify_own(m: Member) -> bool:
    """This rank's member files are all here, whole, every checksum right."""
    return _verify_rank(m.storage, m, m.rank)


def verify_copy(m: Member) -> bool:
    """The partner copy this node keeps (of ``partner_source``) is whole and right."""
    return _verify_rank(_Copies(m.storage), m, m.placement.partner_source(m.rank))  # type: ignore[arg-type]


def verify_parity(m: Member) -> bool:
    """This rank's parity block describes this step (its very manifest) and set and matches
    its checksum."""
    data_name, meta_name = parity_file_names(m.rank)
    try:
        meta = json.loads(m.storage.read_object(m.directory, meta_name))
        block = m.block_bytes()
        if (
            not isinstance(meta, dict) or meta.get("step") != m.manifest.step
            or meta.get("manifest") != manifest_digest(m.manifest)
            or meta.get("set") != m.placement.xor_set(m.rank) or meta.get("block_bytes") != block
            or m.storage.file_size(m.directory, data_name) != block
        ):  # fmt: skip
            return False
        arena = Arena(block)
        try:
            _read(m.storage, m.directory, data_name, arena.view)
            digest = get_checksum(str(meta.get("algorithm")))(arena.view[:block])
        finally:
            arena.close()
        return bool(digest == meta.get("checksum"))
    except (CorruptCheckpointError, ValueError, KeyError, TypeError, OSError):
        return False


# ---------------------------------------------------------------------- rebuild
def rebuild(m: Member, lost: set[int]) -> dict[str, int]:
    """Rebuild the member files of the ranks in ``lost`` (each recoverable: the caller
    checked) into their nodes; every rank takes part. Bytes received, by source."""
    if not lost:
        return {}
    if m.placement.scheme == "partner":
        return _rebuild_partner(m, lost)
    return _rebuild_xor(m, lost)


def _rebuild_partner(m: Member, lost: set[int]) -> dict[str, int]:
    sends, recvs, got = [], [], 0
    keep: list[tuple[Arena, int]] = []
    try:
        source = m.placement.partner_source(m.rank)
        if source in lost:  # this node keeps the copy of a lost rank: send it
            arena, total = read_payload(m, source, copy=True)
            keep.append((arena, total))
            sends.append((source, _u8(arena.view[:total])))
        if m.rank in lost:
            total = m.payload_bytes()
            inbox = Arena(max(total, ALIGN_BYTES))
            keep.append((inbox, total))
            recvs.append((m.placement.partner_holder(m.rank), _u8(inbox.view[:total])))
        m.link.exchange(sends, recvs, "restore")
        if m.rank in lost:
            write_payload(m, m.rank, keep[-1][0].view, copy=False)
            got = keep[-1][1]
    finally:
        for arena, _ in keep:
            arena.close()
    return {"partner": got}


def _rebuild_xor(m: Member, lost: set[int]) -> dict[str, int]:
    members = m.placement.xor_set(m.rank)
    gone = [x for x in members if x in lost]
    if not gone:
        return {}
    (x,) = gone  # the caller checked: one per set
    block = m.block_bytes()
    others = [k for k in members if k != x]
    span = block * len(others)
    if m.rank != x:  # what this survivor holds of each k != x, in x's block order
        out = Arena(span)
        own, total = read_payload(m)
        padded = _padded(own.view, total, block, len(members))
        own.close()
        try:
            mine = _blocks(m, padded.view, block, m.rank)
            for i, k in enumerate(others):
                dst = out.view[i * block : (i + 1) * block]
                if k == m.rank:
                    _read(m.storage, m.directory, parity_file_names(m.rank)[0], dst)
                else:
                    dst[:] = mine[k]
            m.link.exchange([(x, _u8(out.view[:span]))], [], "restore")
        finally:
            padded.close()
            out.close()
        return {}
    inbox = Arena(span * len(others))
    result = Arena(span)
    try:
        recvs = [(j, _u8(inbox.view[i * span : (i + 1) * span])) for i, j in enumerate(others)]
        m.link.exchange([], recvs, "restore")
        acc = _u8(result.view[:span])
        acc.zero_()
        for _, t in recvs:
            acc.bitwise_xor_(t)
        write_payload(m, m.rank, result.view, copy=False)
        return {"parity": span * len(others)}
    finally:
        inbox.close()
        result.close()
