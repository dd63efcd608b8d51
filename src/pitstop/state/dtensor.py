"""DTensor, seen from pitstop: which box of the global tensor a rank holds, and copying a
saved global tensor into a live one (DTensor or plain). torch.distributed.tensor is
imported only when a DTensor is actually met.

Call sequence: ``flatten`` (training thread) asks :func:`is_dtensor` and
:func:`local_box` when it meets a tensor; the restorer copies with :func:`copy_into`.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["copy_into", "is_dtensor", "local_box", "unsupported_placement"]


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it if unused)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


def unsupported_placement(t: torch.Tensor) -> str | None:
    """Why DTensor ``t`` cannot be stored by its owners (a partial sum), or None."""
    for p in t.placements:  # type: ignore[attr-defined]
        if p.is_partial():
            return f"has a Partial placement ({p}); reduce it (t.redistribute) before saving"
    return None


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, start of the local box in the global tensor)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    global_shape = tuple(int(d) for d in t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(
        t.shape,
        t.device_mesh,  # type: ignore[attr-defined]
        t.placements,  # type: ignore[attr-defined]
    )
    local = t.to_local()  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(
            f"DTensor local shape {tuple(local.shape)} is not the expected {tuple(local_shape)}"
        )
    return local, global_shape, tuple(int(o) for o in offset)


def copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    """``target.copy_(saved)``; a DTensor target takes its own box of the global ``saved``."""
    if not is_dtensor(target):
        target.copy_(saved)
        return
    local, _, start = local_box(target)
    box = saved
    for dim, (s0, n) in enumerate(zip(start, local.shape, strict=True)):
        box = box.narrow(dim, s0, n)
    local.copy_(box)
