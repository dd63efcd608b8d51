"""Checksums over every stored byte. Importable without torch.

``xxh3_64`` (package xxhash, a dependency) is the default: 16 GB/s on one core
here, so writer threads hash what they write at a fraction of the disk's time.
``crc32c`` (package crc32c) and the stdlib's ``crc32`` are accepted where
xxhash is missing. A checkpoint records its algorithm; verifying it needs that
algorithm, and a missing one is named with the package that provides it.

A tensor's bytes are hashed in *segments* of at most ``segment_bytes`` so that
parallel writers and readers hash disjoint pieces without a shared stream. A reader
whose buffers are smaller than a segment hashes it piece by piece with
:func:`get_hasher` (same digest as the one-shot function).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

from pitstop.errors import MissingExtraError

__all__ = [
    "ALGORITHMS",
    "Checksum",
    "Hasher",
    "default_algorithm",
    "get_checksum",
    "get_hasher",
    "segments",
]

Checksum = Callable[[memoryview | bytes], str]


class Hasher:
    """An incremental digest: ``update`` with consecutive pieces, then ``hexdigest``."""

    def __init__(self, step: Callable[[memoryview | bytes, int], int], width: int) -> None:
        self._step, self._width, self._value = step, width, 0

    def update(self, data: memoryview | bytes) -> None:
        self._value = self._step(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:0{self._width}x}"


class _Xxh3Hasher:
    def __init__(self) -> None:
        import xxhash

        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return f"{self._h.intdigest():016x}"


ALGORITHMS: dict[str, str] = {
    "xxh3_64": "xxhash",
    "crc32c": "crc32c",
    "crc32": "(stdlib)",
}


def _xxh3_64() -> Checksum:
    import xxhash

    fn = xxhash.xxh3_64_intdigest
    return lambda data: f"{fn(data):016x}"


def _crc32c() -> Checksum:
    import crc32c

    fn = crc32c.crc32c
    return lambda data: f"{fn(data):08x}"


def _crc32() -> Checksum:
    return lambda data: f"{zlib.crc32(data):08x}"


_FACTORIES: dict[str, Callable[[], Checksum]] = {
    "xxh3_64": _xxh3_64,
    "crc32c": _crc32c,
    "crc32": _crc32,
}
_cache: dict[str, Checksum] = {}


def get_checksum(algorithm: str) -> Checksum:
    """The hex-digest function of ``algorithm``; raises if its package is missing."""
    if algorithm in _cache:
        return _cache[algorithm]
    factory = _FACTORIES.get(algorithm)
    if factory is None:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {', '.join(_FACTORIES)}"
        )
    try:
        fn = factory()
    except ImportError:
        raise MissingExtraError(
            f"checksum {algorithm!r} needs the package {ALGORITHMS[algorithm]!r}: "
            f"pip install {ALGORITHMS[algorithm]}"
        ) from None
    _cache[algorithm] = fn
    return fn


def get_hasher(algorithm: str) -> Callable[[], Hasher | _Xxh3Hasher]:
    """A factory of incremental hashers of ``algorithm`` (checked like :func:`get_checksum`)."""
    get_checksum(algorithm)  # unknown or missing: the same errors
    if algorithm == "xxh3_64":
        return _Xxh3Hasher
    if algorithm == "crc32c":
        import crc32c

        return lambda: Hasher(lambda data, value: crc32c.crc32c(data, value), 8)
    return lambda: Hasher(lambda data, value: zlib.crc32(data, value), 8)


def default_algorithm() -> str:
    """The fastest algorithm whose package is installed."""
    for name in _FACTORIES:
        try:
            get_checksum(name)
        except MissingExtraError:
            continue
        return name
    return "crc32"  # pragma: no cover - zlib is always there


def segments(offset: int, nbytes: int, segment_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, length) of each checksum segment of the byte range [offset, offset+nbytes)."""
    if nbytes == 0:
        yield offset, 0
        return
    start = offset
    end = offset + nbytes
    while start < end:
        length = min(segment_bytes, end - start)
        yield start, length
        start += length
