"""Redundancy of the node-local level: the byte work of the strategies of
:class:`pitstop.levels.spec.Redundancy` (partner copies and XOR parity, written, checked
and rebuilt).

Call sequence (every rank, the same calls in the same order), through the job's strategy
``red = placement.redundancy``::

    red.protect(member)                 # persist thread, after every rank's files are
                                        #   durable, before any node commits (NodeCommit);
                                        #   the training thread at restart (protect again)
    verify_own(m), red.held_ok(m)       # training thread, at restart (verify_copy or
                                        #   verify_parity: what this node holds for others)
    got = red.rebuild(member, lost)     # training thread, at restart: the member files of
                                        #   the ranks in ``lost``; bytes received by source

A rank's *payload* is its member files (its data and objects files of the step), each at a
4 KiB-aligned offset, in name order: the same bytes on every node that keeps them.

``partner``: rank r sends its payload to ``placement.partner_holder(r)``, which keeps it as
``partner-<name>`` files next to its own. ``xor``: in a set of N members, a payload padded to
``(N-1) * B`` is cut into N-1 blocks, one for each other member; member k keeps
``P_k = XOR of the blocks the others cut for k`` in ``xor-<k>.bin`` (with its description and
checksum in ``xor-<k>.json``), so the set stores N/(N-1) of its data. A lost member x is
rebuilt block by block: ``block(x -> k) = P_k XOR block(j -> k) for every other j``: every
survivor sends x what it holds of each k, x xors them.

Every byte moves through :func:`pitstop.engine.transfer.transfer`: in rounds of pieces of
bounded size (``piece_bytes``; every rank takes the same number of rounds, those with
nothing to do in a round take part in none of its exchanges), read from the files and
written with ``Storage.write_data`` as they come, what a rank receives checked against the
manifest (a partner copy, a rebuilt file) or hashed into its parity's checksum on the way.
Host memory stays within ``copy_budget`` whatever the size of the payloads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property, partial
from typing import Any

from pitstop.engine.payload import Checker, Layout, Reader, align
from pitstop.engine.transfer import Round, Target, payloads, piece_bytes, transfer
from pitstop.engine.verify import verify_checkpoint
from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.checksum import get_hasher
from pitstop.format.manifest import FileEntry, Manifest, manifest_digest
from pitstop.format.names import parity_file_names, partner_copy_name
from pitstop.io.parallel import Extent
from pitstop.levels.spec import Placement
from pitstop.log import get_logger
from pitstop.ranks.peers import PeerLink
from pitstop.storage.base import Storage
from pitstop.storage.wrap import StorageWrapper

__all__ = [
    "Member", "protect_partner", "protect_xor", "rebuild_partner", "rebuild_xor", "verify_copy",
    "verify_own", "verify_parity",
]  # fmt: skip

_PARITY_VERSION = 1
_log = get_logger("pitstop.levels")


@dataclass
class Member:
    """One rank's view of one step on its node: where it reads and writes, and with whom."""

    storage: Storage
    directory: str
    manifest: Manifest
    placement: Placement
    link: PeerLink
    rank: int

    @cached_property
    def _payloads(self) -> dict[int, list[tuple[FileEntry, int]]]:
        return payloads(self.manifest)

    def files(self, rank: int | None = None) -> list[tuple[FileEntry, int]]:
        """``rank``'s member files and their offsets in its payload."""
        return self._payloads.get(self.rank if rank is None else rank, [])

    def payload_bytes(self, rank: int | None = None) -> int:
        return sum(align(f.nbytes) for f, _ in self.files(rank))

    def block_bytes(self, rank: int | None = None) -> int:
        """The parity block of ``rank``'s XOR set (default: this rank's)."""
        members = self.placement.xor_set(self.rank if rank is None else rank)
        largest = max(self.payload_bytes(r) for r in members)
        return align(-(-largest // (len(members) - 1)))

    def layout(self, rank: int | None = None, copy: bool = False) -> Layout:
        """``rank``'s payload as files of this node (``copy``: the partner copies of them)."""
        name: Callable[[str], str] = partner_copy_name if copy else str
        return Layout.of((name(f.name), f.nbytes) for f, _ in self.files(rank))

    def reader(self, rank: int | None = None, copy: bool = False) -> Reader:
        return Reader(self.storage, self.directory, self.layout(rank, copy))

    def rounds(self, piece: int, ranks: list[int]) -> int:
        """How many rounds a transfer of the payloads of ``ranks`` takes: every rank computes
        the same, so that every rank takes the same number of rounds."""
        return max((self.layout(r).count(piece) for r in ranks), default=0)


def _padded(rounds: list[Round], count: int) -> list[Round]:
    """``rounds`` and empty ones up to ``count`` (no exchange: nothing to wait for)."""
    return rounds + [Round()] * (count - len(rounds))


def _parity_layout(rank: int, block: int) -> Layout:
    return Layout.of([(parity_file_names(rank)[0], block)])


# ---------------------------------------------------------------------- save
def protect_partner(m: Member) -> int:
    """Round t: this rank sends piece t of its payload to its partner holder and receives
    piece t of its partner source's, written as ``partner-<name>`` and checked."""
    src, dst = m.placement.partner_source(m.rank), m.placement.partner_holder(m.rank)
    piece = piece_bytes(m.storage.io, 1)
    mine = m.layout().pieces(piece)
    theirs = m.layout(src, copy=True)
    pieces = theirs.pieces(piece)
    reader = m.reader()
    try:
        rounds = []
        for t in range(max(len(mine), len(pieces))):
            e = mine[t] if t < len(mine) else None
            sends = ((dst, e.nbytes, partial(reader.read, e.start)),) if e else ()
            rounds.append(Round(sends, (src,), t) if t < len(pieces) else Round(sends))
        count = m.rounds(piece, list(range(len(m.placement.nodes))))
        checker = Checker(m.manifest, m.files(src))
        transfer(
            _padded(rounds, count), pieces, target=Target(m.storage, m.directory, theirs),
            link=m.link, check=checker.feed, phase="replicate",
        )  # fmt: skip
        checker.finish()
    finally:
        reader.close()
    return m.payload_bytes(src)


def _xor_buffers(m: Member) -> int:
    """Buffers besides the ring in an XOR transfer: sends and receives of the largest set."""
    n = max(len(s) for s in m.placement.sets)
    return max(1, 2 * n - 3)


def protect_xor(m: Member) -> int:
    """Round t: this rank sends piece t of each block it cuts for the others and XORs their
    pieces t for it into piece t of its parity block, hashed on the way."""
    members = m.placement.xor_set(m.rank)
    others = [k for k in members if k != m.rank]
    block = m.block_bytes()
    piece = piece_bytes(m.storage.io, _xor_buffers(m))
    layout = _parity_layout(m.rank, block)
    pieces = layout.pieces(piece)
    count = max(-(-m.block_bytes(r) // piece) for r in range(len(m.placement.nodes)))
    digest = get_hasher(m.manifest.checksum_algorithm)()
    reader = m.reader()
    try:
        rounds = [
            Round(
                sends=tuple(
                    (k, e.nbytes, partial(reader.read, i * block + e.start))
                    for i, k in enumerate(others)
                ),
                recvs=tuple(others),
                piece=t,
            )
            for t, e in enumerate(pieces)
        ]
        transfer(
            _padded(rounds, count), pieces, target=Target(m.storage, m.directory, layout),
            link=m.link, check=lambda _, data: digest.update(data), phase="replicate",
        )  # fmt: skip
    finally:
        reader.close()
    _write_parity_meta(m, members, block, digest.hexdigest())
    return block * len(others)


def _write_parity_meta(m: Member, members: list[int], block: int, checksum: str) -> None:
    meta = {
        "version": _PARITY_VERSION, "step": m.manifest.step, "set": members,
        "manifest": manifest_digest(m.manifest),
        "block_bytes": block, "algorithm": m.manifest.checksum_algorithm, "checksum": checksum,
    }  # fmt: skip
    m.storage.write_object(m.directory, parity_file_names(m.rank)[1], json.dumps(meta).encode())


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


def verify_own(m: Member) -> bool:
    """This rank's member files are all here, whole, every checksum right."""
    return _verify_rank(m.storage, m, m.rank)


def verify_copy(m: Member) -> bool:
    """The partner copy this node keeps (of ``partner_source``) is whole and right."""
    return _verify_rank(_Copies(m.storage), m, m.placement.partner_source(m.rank))  # type: ignore[arg-type]


def verify_parity(m: Member) -> bool:
    """This rank's parity block describes this step (its very manifest) and set and matches
    its checksum (read through the transfer's bounded buffers)."""
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
        digest = get_hasher(str(meta.get("algorithm")))()
        layout = _parity_layout(m.rank, block)
        pieces = layout.pieces(piece_bytes(m.storage.io, 0))
        reader = Reader(m.storage, m.directory, layout)
        try:
            rounds = [
                Round(piece=k, local=partial(reader.read, e.start)) for k, e in enumerate(pieces)
            ]
            transfer(rounds, pieces, check=lambda _, data: digest.update(data), phase="verify")
        finally:
            reader.close()
        return bool(digest.hexdigest() == meta.get("checksum"))
    except (CorruptCheckpointError, ValueError, KeyError, TypeError, OSError):
        return False


# ---------------------------------------------------------------------- rebuild
def rebuild_partner(m: Member, lost: set[int]) -> dict[str, int]:
    """Round t: the holder of a lost rank's partner copy sends piece t of it; the lost rank
    writes it as its own files."""
    piece = piece_bytes(m.storage.io, 1)
    source, holder = m.placement.partner_source(m.rank), m.placement.partner_holder(m.rank)
    copy = m.reader(source, copy=True) if source in lost else None
    out = copy.layout.pieces(piece) if copy is not None else []
    layout = m.layout()
    pieces = layout.pieces(piece) if m.rank in lost else []
    try:
        rounds = []
        for t in range(max(len(out), len(pieces))):
            e = out[t] if t < len(out) else None
            sends = ((source, e.nbytes, partial(copy.read, e.start)),) if e and copy else ()
            rounds.append(Round(sends, (holder,), t) if t < len(pieces) else Round(sends))
        got = _receive(m, layout, pieces, _padded(rounds, m.rounds(piece, sorted(lost))))
    finally:
        if copy is not None:
            copy.close()
    return {"partner": got}


def _receive(m: Member, layout: Layout, pieces: list[Extent], rounds: list[Round]) -> int:
    """Run ``rounds``; what this rank receives (``pieces`` of its own ``layout``) becomes its
    files, checked against the manifest. The bytes received."""
    if not pieces:
        return transfer(rounds, pieces, link=m.link, phase="restore")
    checker = Checker(m.manifest, m.files())
    got = transfer(
        rounds, pieces, target=Target(m.storage, m.directory, layout), link=m.link,
        check=checker.feed, phase="restore",
    )  # fmt: skip
    checker.finish()
    return got


def rebuild_xor(m: Member, lost: set[int]) -> dict[str, int]:
    """Round t: every survivor of a lost rank x's set sends piece t of what it holds of x's
    blocks (its parity for its own, its own block for each other member: x's order); x
    XORs them into piece t of its payload."""
    members = m.placement.xor_set(m.rank)
    gone = [x for x in members if x in lost]
    piece = piece_bytes(m.storage.io, _xor_buffers(m))
    count = m.rounds(piece, sorted(lost))
    if not gone:  # this set lost nothing: its rounds are empty (the other sets' go on)
        transfer(_padded([], count), [], link=m.link, phase="restore")
        return {}
    (x,) = gone  # the caller checked: one per set
    pieces = m.layout(x).pieces(piece)
    if m.rank == x:
        others = tuple(k for k in members if k != x)
        rounds = [Round(recvs=others, piece=t) for t in range(len(pieces))]
        return {"parity": _receive(m, m.layout(), pieces, _padded(rounds, count))}
    span = _Span(m, x)
    try:
        rounds = [Round(sends=((x, e.nbytes, partial(span.read, e.start)),)) for e in pieces]
        transfer(_padded(rounds, count), [], link=m.link, phase="restore")
    finally:
        span.close()
    return {}


class _Span:
    """What a survivor holds of a lost member x's blocks, in x's block order: its parity
    block for its own place, the block it cut for each other member."""

    def __init__(self, m: Member, x: int) -> None:
        members = m.placement.xor_set(m.rank)
        self.block = m.block_bytes()
        self.order = [k for k in members if k != x]  # x's blocks
        self.mine = [k for k in members if k != m.rank]  # this rank's blocks
        self.rank = m.rank
        self.own = m.reader()
        self.parity = Reader(m.storage, m.directory, _parity_layout(m.rank, self.block))

    def read(self, start: int, out: memoryview) -> None:
        at, end = start, start + len(out)
        while at < end:
            i, within = divmod(at, self.block)
            stop = min(end, (i + 1) * self.block)
            part = out[at - start : stop - start]
            k = self.order[i]
            if k == self.rank:
                self.parity.read(within, part)
            else:
                self.own.read(self.mine.index(k) * self.block + within, part)
            at = stop

    def close(self) -> None:
        self.own.close()
        self.parity.close()
