"""copy_bytes (the stage's and the restore's copy) copies exactly what ``Tensor.copy_`` does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pitstop.engine.stage import copy_bytes

Make = Callable[[], torch.Tensor]

SOURCES: dict[str, Make] = {
    "float32": lambda: torch.randn(64, 33),
    "bfloat16": lambda: torch.randn(1000).to(torch.bfloat16),
    "bool": lambda: torch.rand(513) > 0.5,
    "int64 view with offset": lambda: torch.arange(100)[7:50],
    "transposed (not contiguous)": lambda: torch.randn(16, 8).t(),
    "strided rows": lambda: torch.randn(10, 10)[::2],
    "conjugate bit": lambda: torch.randn(12, dtype=torch.complex64).conj(),
    "negative bit": lambda: torch.randn(12, dtype=torch.complex64).conj().imag,
    "requires grad": lambda: torch.randn(5, 5, requires_grad=True),
    "empty": lambda: torch.empty(0, 3),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_copy_bytes_copies_what_copy_does(name: str) -> None:
    src = SOURCES[name]()
    want = torch.empty(src.shape, dtype=src.dtype)
    with torch.no_grad():
        want.copy_(src)
        dst = torch.full(src.shape, 0, dtype=src.dtype)
        copy_bytes(dst, src)
    assert torch.equal(dst, want)


def test_copy_bytes_into_a_slice_of_a_byte_buffer_and_across_dtypes() -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    src = torch.arange(100, dtype=torch.float32)
    copy_bytes(buffer[512 : 512 + 400].view(torch.float32), src)
    assert torch.equal(buffer[512:912].view(torch.float32), src)
    assert not buffer[:512].any() and not buffer[912:].any()
    ints = torch.zeros(100, dtype=torch.int64)
    copy_bytes(ints, src)  # another dtype: converted, as copy_ does
    assert torch.equal(ints, src.to(torch.int64))
