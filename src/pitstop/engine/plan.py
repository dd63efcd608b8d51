"""plan: the frozen layout of one save, cached while shapes do not change.

Every world size, one process included, plans with :func:`pitstop.ranks.sharding.assign`
(eager items first); :func:`plan_from_layout` turns a rank's part into its plan.

Every stored tensor gets a 4 KiB-aligned offset in the rank's data file; the
host arena has exactly this layout, so the arena *is* the file. Tensors are
hashed in segments of ``segment_bytes`` (at most 16 MiB, so a reader checks each in one
read buffer), and segments are packed into extents (one write request each) of about
``chunk_bytes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pitstop.format.checksum import segments
from pitstop.format.codec import dtype_from_name
from pitstop.io.parallel import Extent, plan_extents
from pitstop.options import SEGMENT_BYTES
from pitstop.ranks.sharding import RankLayout

__all__ = ["PlanCache", "PlanItem", "SavePlan", "plan_from_layout"]


@dataclass(frozen=True)
class PlanItem:
    key: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    deferrable: bool
    rows: tuple[int, int] | None = None  # a range of the source's rows (replicated, split)
    local: bool = False  # the source is a DTensor's local tensor
    global_shape: tuple[int, ...] | None = None
    start: tuple[int, ...] | None = None
    owner: int | None = None

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the live ``tensor`` this item stores."""
        if self.local:
            tensor = tensor.to_local()  # type: ignore[attr-defined]
        if self.rows is not None:
            tensor = tensor.narrow(0, self.rows[0], self.rows[1] - self.rows[0])
        return tensor


@dataclass(frozen=True)
class SavePlan:
    """Where each tensor goes. ``signature`` identifies plans that can share an arena;
    ``stream_nbytes`` (several ranks) is the length of this rank's replicated slice."""

    items: tuple[PlanItem, ...]
    file_bytes: int
    segment_bytes: int
    extents: tuple[Extent, ...]
    signature: tuple[object, ...]
    stream_nbytes: int | None = None

    def recut(self, chunk_bytes: int) -> SavePlan:
        """The same layout written in requests of about ``chunk_bytes`` (a checksum segment
        is never cut): a save staged through a ring smaller than its extents."""
        segs = [tag for e in self.extents for tag in e.segments]
        extents = plan_extents(segs, self.file_bytes, chunk_bytes) if self.file_bytes else []
        return dataclasses.replace(self, extents=tuple(extents))

    def segment_count(self, index: int) -> int:
        item = self.items[index]
        return sum(1 for _ in segments(item.offset, item.nbytes, self.segment_bytes))


def plan_from_layout(
    layout: RankLayout, chunk_bytes: int, signature: tuple[object, ...]
) -> SavePlan:
    """This rank's plan from its part of the global plan (``ranks.sharding.assign``)."""
    items = [
        PlanItem(
            key=p.key, dtype=dtype_from_name(p.dtype), dtype_name=p.dtype, shape=p.shape,
            offset=p.offset, nbytes=p.nbytes, deferrable=p.deferrable, rows=p.rows,
            local=p.local, global_shape=p.global_shape, start=p.start, owner=p.owner,
        )
        for p in layout.pieces
    ]  # fmt: skip
    return _finish(items, layout.file_bytes, chunk_bytes, signature, layout.stream_nbytes)


def _finish(
    items: list[PlanItem],
    file_bytes: int,
    chunk_bytes: int,
    signature: tuple[object, ...],
    stream_nbytes: int | None = None,
) -> SavePlan:
    segment_bytes = min(chunk_bytes, SEGMENT_BYTES)
    segs = [  # empty tensors have one empty segment, hashed without I/O
        (start, length, (i, j))
        for i, item in enumerate(items)
        for j, (start, length) in enumerate(segments(item.offset, item.nbytes, segment_bytes))
        if length
    ]
    extents = plan_extents(segs, file_bytes, chunk_bytes) if file_bytes else []
    return SavePlan(
        items=tuple(items),
        file_bytes=file_bytes,
        segment_bytes=segment_bytes,
        extents=tuple(extents),
        signature=signature,
        stream_nbytes=stream_nbytes,
    )


class PlanCache:
    """The previous plan, while every rank's keys, dtypes and shapes (its ``signature``) are
    unchanged."""

    def __init__(self) -> None:
        self._plan: SavePlan | None = None
        self.misses = 0

    def cached(self, signature: tuple[object, ...]) -> SavePlan | None:
        """The previous plan if it was made for ``signature``."""
        return self._plan if self._plan is not None and self._plan.signature == signature else None

    @property
    def newest(self) -> SavePlan | None:
        """The previous plan, whatever its signature."""
        return self._plan

    def put(self, plan: SavePlan) -> SavePlan:
        self.misses += 1
        self._plan = plan
        return plan
