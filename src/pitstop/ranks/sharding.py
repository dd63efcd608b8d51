"""Who writes what: the global plan of a save of several ranks, as plain data (no torch).

Call sequence: every rank describes what it holds (:class:`LocalItem` per tensor), the
descriptions are all-gathered on the training thread, and every rank runs
:func:`assign` on the same input, so all ranks hold the same plan without a broadcast.

* **Replicated** tensors (``kind="shared"``: module and optimizer tensors that every
  rank holds with the same key, dtype and shape, as under DDP) are laid out once, as
  one process would write them (the *stream*: each at a 4 KiB-aligned offset), and the
  stream is cut into one consecutive slice per rank (``mode="split"``) or given whole
  to rank 0 (``mode="root"``). Cuts fall on 4 KiB boundaries that are row boundaries
  of the tensor they cut, so each piece is a range of rows and reading the slices back
  to back rebuilds the stream exactly.
* **Sharded** tensors (DTensor boxes) are written by their owner; a box that several
  ranks hold (a replicated mesh dimension) by the lowest of them.
* Everything else is the rank's **own** value (RNG state, data position, loose
  tensors, or a "shared" key the ranks do not all hold alike), written by that rank.

A rank's data file is its stream slice followed by its sharded and own pieces. Eager
items (what a forward pass may change: buffers, RNG state) come before deferrable ones
(parameters and optimizer state) in the stream and in each rank's own part. One process
is a world of one: its stream is the whole replicated state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pitstop.options import ALIGN_BYTES

__all__ = ["LocalItem", "Piece", "RankLayout", "assign"]


@dataclass(frozen=True)
class LocalItem:
    """One tensor a rank holds (``shape``: its local shape; for a DTensor its box)."""

    key: str
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    kind: str  # "shared" | "own" | "dtensor"
    deferrable: bool = False
    global_shape: tuple[int, ...] | None = None
    start: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class Piece:
    """What one rank writes: all of a local tensor, a range of its rows, or a DTensor's
    local box (``local``), at ``offset`` of the rank's data file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    deferrable: bool
    rows: tuple[int, int] | None = None
    local: bool = False
    global_shape: tuple[int, ...] | None = None
    start: tuple[int, ...] | None = None
    owner: int | None = None


@dataclass(frozen=True)
class RankLayout:
    pieces: tuple[Piece, ...]
    file_bytes: int
    stream_nbytes: int


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _replicated(ranks: list[list[LocalItem]]) -> list[LocalItem]:
    """Rank 0's shared items that every rank holds alike, in rank 0's order."""
    others = [{i.key: i for i in items if i.kind == "shared"} for items in ranks[1:]]
    out = []
    for item in ranks[0]:
        if item.kind != "shared":
            continue
        if all(
            (o := held.get(item.key)) is not None and (o.dtype, o.shape) == (item.dtype, item.shape)
            for held in others
        ):
            out.append(item)
    return out


def _cut(target: int, items: list[tuple[int, LocalItem]], total: int) -> int:
    """The valid cut nearest ``target``: an item's start or padded end, or a row boundary
    inside it that is 4 KiB-aligned."""
    for idx, (off, item) in enumerate(items):
        end = items[idx + 1][0] if idx + 1 < len(items) else total
        if not off <= target < end:
            continue
        n = item.nbytes
        if len(item.shape) >= 1 and item.shape[0] > 1 and n:
            row = n // item.shape[0]
            unit = (ALIGN_BYTES // math.gcd(row, ALIGN_BYTES)) * row
            cut = off + round((target - off) / unit) * unit
            return end if cut >= off + n else cut
        return off if target - off < end - target else end
    return total


def _stream_pieces(placed: list[tuple[int, LocalItem]], a: int, b: int) -> list[Piece]:
    out = []
    for off, item in placed:
        n = item.nbytes
        lo, hi = max(off, a), min(off + n, b)
        if not n or lo >= hi:
            continue
        if lo == off and hi == off + n:
            out.append(Piece(item.key, item.dtype, item.shape, off - a, n, item.deferrable))
            continue
        row = n // item.shape[0]
        r0, r1 = (lo - off) // row, (hi - off) // row
        out.append(
            Piece(
                item.key, item.dtype, (r1 - r0, *item.shape[1:]), lo - a, hi - lo,
                item.deferrable, rows=(r0, r1), global_shape=item.shape,
                start=(r0,) + (0,) * (len(item.shape) - 1),
            )
        )  # fmt: skip
    return out


def assign(ranks: list[list[LocalItem]], mode: str = "split") -> list[RankLayout]:
    """Every rank's layout (see the module docstring); ``ranks[r]`` is what rank r holds."""
    world = len(ranks)
    # eager items first (in the stream and in each rank's own part): a save staged through a
    # ring smaller than the file stalls only until they are staged
    replicated = sorted(_replicated(ranks), key=lambda i: i.deferrable)
    placed: list[tuple[int, LocalItem]] = []
    offset = 0
    for item in replicated:
        if item.nbytes:
            placed.append((offset, item))
            offset = _align(offset + item.nbytes)
    total = offset
    cuts = [0]
    for r in range(1, world):
        target = total if mode == "root" else total * r // world
        cuts.append(max(cuts[-1], _cut(target, placed, total)))
    cuts.append(total)
    names = {i.key for i in replicated}
    boxes: set[tuple[str, tuple[int, ...] | None, tuple[int, ...]]] = set()
    layouts = []
    for r, items in enumerate(ranks):
        pieces = _stream_pieces(placed, cuts[r], cuts[r + 1])
        end = cuts[r + 1] - cuts[r]
        if r == 0:  # empty replicated tensors: one zero-length piece
            pieces += [
                Piece(i.key, i.dtype, i.shape, 0, 0, i.deferrable)
                for i in replicated
                if not i.nbytes
            ]
        for item in sorted(items, key=lambda i: i.deferrable):
            if item.key in names:
                continue
            box = (item.key, item.start, item.shape)
            if item.kind == "dtensor":
                if box in boxes:
                    continue  # a replicated mesh dimension: a lower rank writes it
                boxes.add(box)
            owner = None if item.kind == "dtensor" else r
            pieces.append(
                Piece(
                    item.key, item.dtype, item.shape, end, item.nbytes,
                    item.deferrable, local=item.kind == "dtensor",
                    global_shape=item.global_shape, start=item.start, owner=owner,
                )
            )  # fmt: skip
            if item.nbytes:
                end = _align(end + item.nbytes)
        layouts.append(RankLayout(tuple(pieces), end, cuts[r + 1] - cuts[r]))
    return layouts
