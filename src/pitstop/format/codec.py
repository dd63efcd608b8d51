"""Tensor <-> bytes: dtype names and typed views of a byte buffer. Imports torch."""

from __future__ import annotations

import torch

from pitstop.errors import UnsupportedValueError
from pitstop.format.manifest import DTYPE_ITEMSIZE

__all__ = ["dtype_from_name", "dtype_name", "tensor_view"]

_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in DTYPE_ITEMSIZE
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype, *, key: str = "?") -> str:
    """The format's name of ``dtype``; raises naming ``key`` for dtypes format v1 cannot hold."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"tensor {key!r} has dtype {dtype}, which pitstop cannot store"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedValueError(
            f"dtype {name!r} is not available in this torch build"
        ) from None


def tensor_view(
    buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` viewing ``buffer`` (uint8, 1-D) at ``offset``.

    ``offset`` is 4 KiB-aligned, so the view is aligned for every dtype.
    """
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return buffer[offset : offset + nbytes].view(dtype).view(shape)
