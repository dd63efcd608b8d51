"""plan: the frozen layout of one save, cached while shapes do not change.

Every stored tensor gets a 4 KiB-aligned offset in the rank's data file; the
host arena has exactly this layout, so the arena *is* the file. Tensors are
hashed in segments of ``segment_bytes``, and segments are packed into extents
(one I/O request each) of about ``chunk_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pitstop.format.checksum import segments
from pitstop.format.codec import dtype_name
from pitstop.io.arena import align_up
from pitstop.io.parallel import Extent, plan_extents
from pitstop.options import ALIGN_BYTES

__all__ = ["PlanCache", "PlanItem", "SavePlan", "make_plan"]


@dataclass(frozen=True)
class PlanItem:
    key: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    deferrable: bool


@dataclass(frozen=True)
class SavePlan:
    """Where each tensor goes. ``signature`` identifies plans that can share an arena."""

    items: tuple[PlanItem, ...]
    file_bytes: int
    segment_bytes: int
    extents: tuple[Extent, ...]
    signature: tuple[object, ...]

    def segment_count(self, index: int) -> int:
        item = self.items[index]
        return sum(1 for _ in segments(item.offset, item.nbytes, self.segment_bytes))


def _signature(
    tensors: dict[str, torch.Tensor], deferrable: set[str], chunk_bytes: int
) -> tuple[object, ...]:
    layout = [(key, t.dtype, tuple(t.shape), key in deferrable) for key, t in tensors.items()]
    return (chunk_bytes, *layout)


def make_plan(tensors: dict[str, torch.Tensor], deferrable: set[str], chunk_bytes: int) -> SavePlan:
    items: list[PlanItem] = []
    offset = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        items.append(
            PlanItem(
                key=key,
                dtype=t.dtype,
                dtype_name=dtype_name(t.dtype, key=key),
                shape=tuple(t.shape),
                offset=offset,
                nbytes=nbytes,
                deferrable=key in deferrable,
            )
        )
        offset = align_up(offset + max(nbytes, 0), ALIGN_BYTES)
    file_bytes = max(offset, 0)
    segs = [  # empty tensors have one empty segment, hashed without I/O
        (start, length, (i, j))
        for i, item in enumerate(items)
        for j, (start, length) in enumerate(segments(item.offset, item.nbytes, chunk_bytes))
        if length
    ]
    extents = plan_extents(segs, file_bytes, chunk_bytes) if file_bytes else []
    return SavePlan(
        items=tuple(items),
        file_bytes=file_bytes,
        segment_bytes=chunk_bytes,
        extents=tuple(extents),
        signature=_signature(tensors, deferrable, chunk_bytes),
    )


class PlanCache:
    """Returns the previous plan while the state's keys, dtypes and shapes are unchanged."""

    def __init__(self) -> None:
        self._plan: SavePlan | None = None
        self.misses = 0

    def get(
        self, tensors: dict[str, torch.Tensor], deferrable: set[str], chunk_bytes: int
    ) -> SavePlan:
        if self._plan is not None and self._plan.signature == _signature(
            tensors, deferrable, chunk_bytes
        ):
            return self._plan
        self.misses += 1
        self._plan = make_plan(tensors, deferrable, chunk_bytes)
        return self._plan
