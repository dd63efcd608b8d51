"""manifest.json of format v1: versioned JSON, strict parse. Importable without torch.

A checkpoint exists if and only if its manifest parses. The manifest lists every
file of the checkpoint and every stored tensor: key path, dtype, shape, file,
4 KiB-aligned offset, length and the checksums of its segments. It is written
last, and is readable with ``cat`` and ``jq``::

    {
      "format": "pitstop-checkpoint", "format_version": 1,
      "step": 1200, "created_unix_secs": 1763790000.5, "world_size": 1,
      "library": {"pitstop": "0.1.0", "torch": "2.13.0", "python": "3.11.7"},
      "topology": {"world_size": 1, "hosts": ["node-a"]},
      "checksum": {"algorithm": "xxh3_64", "segment_bytes": 67108864},
      "files": [{"name": "rank-00000.bin", "rank": 0, "nbytes": 8192, "checksum": null},
                {"name": "objects-00000.json", "rank": 0, "nbytes": 310, "checksum": "9f.."}],
      "tensors": [{"key": "model/fc.weight", "rank": 0, "dtype": "float32", "shape": [4, 4],
                   "file": "rank-00000.bin", "offset": 0, "nbytes": 64, "checksum": ["a1.."]}]
    }
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pitstop.errors import FormatVersionError, ManifestError
from pitstop.format.checksum import ALGORITHMS, segments
from pitstop.format.names import data_file_name, validate_file_name
from pitstop.options import ALIGN_BYTES

__all__ = [
    "DTYPE_ITEMSIZE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "TensorEntry",
]

FORMAT_NAME = "pitstop-checkpoint"
FORMAT_VERSION = 1

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}  # fmt: skip
"""Every dtype format v1 stores, with its size in bytes (torch's names without ``torch.``)."""


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    checksum: tuple[str, ...]
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "rank": self.rank,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksum": list(self.checksum),
        }


@dataclass(frozen=True)
class FileEntry:
    name: str
    rank: int
    nbytes: int
    checksum: str | None = None  # whole-file checksum (objects files); data files hash per tensor

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rank": self.rank,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class Manifest:
    step: int
    created_unix_secs: float
    world_size: int
    checksum_algorithm: str
    segment_bytes: int
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    library: dict[str, str] = field(default_factory=dict)
    topology: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Bytes of all files of the checkpoint."""
        return sum(f.nbytes for f in self.files)

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "created_unix_secs": self.created_unix_secs,
            "world_size": self.world_size,
            "library": dict(self.library),
            "topology": dict(self.topology),
            "checksum": {"algorithm": self.checksum_algorithm, "segment_bytes": self.segment_bytes},
            "files": [f.to_json() for f in self.files],
            "tensors": [t.to_json() for t in self.tensors],
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def loads(cls, data: bytes | str, *, path: str | None = None) -> Manifest:
        """Parse and validate; every problem is a ManifestError naming the field."""
        try:
            raw = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}", path=path) from None
        return _parse(raw, path)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


class _Fields:
    """Typed access to one JSON object, naming the offending field on error."""

    def __init__(self, obj: object, where: str, path: str | None) -> None:
        if not isinstance(obj, dict):
            raise ManifestError(f"{where} must be a JSON object", path=path)
        self.obj, self.where, self.path = obj, where, path

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if name not in self.obj:
            if optional:
                return None
            raise ManifestError(f"{self.where} has no field {name!r}", path=self.path)
        value = self.obj[name]
        bad_bool = isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,)
        )
        if bad_bool or not isinstance(value, kind):
            if optional and value is None:
                return None
            raise ManifestError(
                f"{self.where}.{name} has the wrong type ({type(value).__name__})", path=self.path
            )
        return value

    def nonneg(self, name: str) -> int:
        value = self.get(name, int)
        if value < 0:
            raise ManifestError(f"{self.where}.{name} is negative", path=self.path)
        return int(value)


def _parse(raw: object, path: str | None) -> Manifest:
    top = _Fields(raw, "manifest", path)
    if top.get("format", str) != FORMAT_NAME:
        raise ManifestError(
            f"not a pitstop manifest (format is {top.obj.get('format')!r})", path=path
        )
    version = top.get("format_version", int)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"checkpoint has format version {version}; this pitstop reads up to "
            f"{FORMAT_VERSION}: upgrade pitstop",
            path=path,
        )
    if version < 1:
        raise ManifestError(f"format_version {version} is not valid", path=path)
    step = top.nonneg("step")
    checksum = _Fields(top.get("checksum", dict), "manifest.checksum", path)
    algorithm = checksum.get("algorithm", str)
    if algorithm not in ALGORITHMS:
        raise ManifestError(f"unknown checksum algorithm {algorithm!r}", path=path, step=step)
    segment_bytes = checksum.nonneg("segment_bytes")
    if segment_bytes <= 0 or segment_bytes % ALIGN_BYTES:
        raise ManifestError(
            f"manifest.checksum.segment_bytes must be a positive multiple of {ALIGN_BYTES}",
            path=path,
            step=step,
        )
    files = tuple(_parse_file(f, i, path) for i, f in enumerate(top.get("files", list)))
    sizes = {f.name: f.nbytes for f in files}
    if len(sizes) != len(files):
        raise ManifestError("manifest.files names a file twice", path=path, step=step)
    tensors = tuple(
        _parse_tensor(t, i, sizes, segment_bytes, path)
        for i, t in enumerate(top.get("tensors", list))
    )
    if len({t.key for t in tensors}) != len(tensors):
        raise ManifestError("manifest.tensors names a key twice", path=path, step=step)
    _check_layout(tensors, path, step)
    created = top.get("created_unix_secs", (int, float))
    if not math.isfinite(created):
        raise ManifestError("manifest.created_unix_secs is not finite", path=path, step=step)
    world_size = top.nonneg("world_size")
    if world_size < 1:
        raise ManifestError("manifest.world_size must be >= 1", path=path, step=step)
    return Manifest(
        step=step,
        created_unix_secs=float(created),
        world_size=world_size,
        checksum_algorithm=algorithm,
        segment_bytes=segment_bytes,
        files=files,
        tensors=tensors,
        library={str(k): str(v) for k, v in top.get("library", dict).items()},
        topology=top.get("topology", dict),
        format_version=version,
    )


def _check_layout(tensors: tuple[TensorEntry, ...], path: str | None, step: int) -> None:
    """Each tensor lies in its own rank's data file, and no two overlap."""
    for t in tensors:
        if t.file != data_file_name(t.rank):
            raise ManifestError(
                f"tensor {t.key!r} of rank {t.rank} lies in {t.file}, not in {data_file_name(t.rank)}",
                path=path, step=step,
            )  # fmt: skip
    by_position = sorted((t for t in tensors if t.nbytes), key=lambda t: (t.file, t.offset))
    for a, b in itertools.pairwise(by_position):
        if a.file == b.file and a.offset + a.nbytes > b.offset:
            raise ManifestError(f"tensors {a.key!r} and {b.key!r} overlap", path=path, step=step)


def _parse_file(raw: object, i: int, path: str | None) -> FileEntry:
    f = _Fields(raw, f"manifest.files[{i}]", path)
    return FileEntry(
        name=validate_file_name(f.get("name", str), path=path),
        rank=f.nonneg("rank"),
        nbytes=f.nonneg("nbytes"),
        checksum=f.get("checksum", str, optional=True),
    )


def _parse_tensor(
    raw: object, i: int, sizes: dict[str, int], segment_bytes: int, path: str | None
) -> TensorEntry:
    t = _Fields(raw, f"manifest.tensors[{i}]", path)
    where = f"manifest.tensors[{i}]"
    key = t.get("key", str)
    dtype = t.get("dtype", str)
    if dtype not in DTYPE_ITEMSIZE:
        raise ManifestError(f"{where} ({key}) has unknown dtype {dtype!r}", path=path)
    shape_raw = t.get("shape", list)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape_raw):
        raise ManifestError(f"{where} ({key}) has an invalid shape {shape_raw!r}", path=path)
    shape = tuple(int(d) for d in shape_raw)
    file = validate_file_name(t.get("file", str), path=path)
    offset, nbytes = t.nonneg("offset"), t.nonneg("nbytes")
    if nbytes != math.prod(shape) * DTYPE_ITEMSIZE[dtype]:
        raise ManifestError(f"{where} ({key}): nbytes does not match dtype and shape", path=path)
    if offset % ALIGN_BYTES:
        raise ManifestError(f"{where} ({key}): offset {offset} is not 4 KiB-aligned", path=path)
    if file not in sizes:
        raise ManifestError(
            f"{where} ({key}) names file {file!r}, not in manifest.files", path=path
        )
    if offset + nbytes > sizes[file]:
        raise ManifestError(f"{where} ({key}) lies beyond the end of {file}", path=path)
    checksum = t.get("checksum", list)
    expected = sum(1 for _ in segments(offset, nbytes, segment_bytes))
    if len(checksum) != expected or not all(isinstance(c, str) for c in checksum):
        raise ManifestError(
            f"{where} ({key}) has {len(checksum)} checksums, expected {expected}", path=path
        )
    return TensorEntry(
        key=key, dtype=dtype, shape=shape, file=file, offset=offset, nbytes=nbytes,
        checksum=tuple(checksum), rank=t.nonneg("rank"),
    )  # fmt: skip
