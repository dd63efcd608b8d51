"""manifest.json: versioned JSON, integrity-checked, strict and bounded parse. No torch.

A checkpoint exists if and only if its manifest parses and validates. The manifest
lists every file of the checkpoint with its size and checksum, every stored tensor
(key path, dtype, shape, file, 4 KiB-aligned offset, length, segment checksums), the
lineage (run, timeline, parent step) and optional metrics. Format v2 adds
``integrity``: the checksum of the manifest's own canonical body, so that a flipped
bit anywhere in the metadata (a swapped key, a changed world size) is damage, found
before anything is loaded, and never a wrong value::

    {
      "format": "pitstop-checkpoint", "format_version": 2,
      "step": 1200, "created_unix_secs": 1763790000.5, "world_size": 1,
      "library": {"pitstop": "0.2.0", "torch": "2.13.0", "python": "3.11.7"},
      "topology": {"world_size": 1, "hosts": ["node-a"]},
      "lineage": {"run": "9c1e..", "timeline": "9c1e..", "parent": 1100},
      "metrics": {"loss": 0.31},
      "checksum": {"algorithm": "xxh3_64", "segment_bytes": 67108864},
      "files": [{"name": "rank-00000.bin", "rank": 0, "nbytes": 8192, "checksum": null},
                {"name": "objects-00000.json", "rank": 0, "nbytes": 310, "checksum": "9f.."}],
      "tensors": [{"key": "model/fc.weight", "rank": 0, "dtype": "float32", "shape": [4, 4],
                   "file": "rank-00000.bin", "offset": 0, "nbytes": 64, "checksum": ["a1.."]}],
      "integrity": {"algorithm": "xxh3_64", "manifest": "5be0.."}
    }

Format v3 (several ranks) adds, per tensor entry, ``global_shape`` and ``start`` when the
entry is a chunk of a larger tensor (the chunks of a key tile it exactly once) and
``owner`` when it is one rank's own value (RNG state, data position, a per-rank
tensor: one entry per rank under the same key); and per data file ``stream_nbytes``:
the file begins with that many bytes of the *replicated stream*, the layout one
process would write, cut into consecutive slices, one per rank in rank order, so that
reading every file's slice back to back rebuilds it. Everything else a rank writes
(its shards, its own values) follows its slice.

Parsing is linear in the manifest's size: no loop runs on a claimed number (chunk
overlap checks are pairwise only up to 64 chunks of one key, by row ranges beyond).
Version 1 (no integrity, no lineage) and 2 (one rank) manifests still load.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

from pitstop.errors import FormatVersionError, ManifestError
from pitstop.format.checksum import ALGORITHMS, get_checksum
from pitstop.format.jsonsafe import load_json
from pitstop.format.names import data_file_name, objects_file_name, validate_file_name
from pitstop.options import ALIGN_BYTES

__all__ = [
    "DTYPE_ITEMSIZE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FileEntry",
    "Lineage",
    "Manifest",
    "TensorEntry",
    "join_parts",
    "part_dumps",
    "seal",
    "segment_count",
]

FORMAT_NAME = "pitstop-checkpoint"
FORMAT_VERSION = 3

MAX_BYTES = 1 << 62
"""No size, offset or dimension in a manifest may exceed this (a claimed 2**70 is damage)."""
MAX_NDIM = 64
MAX_WORLD_SIZE = 1 << 24
MAX_PAIRWISE_CHUNKS = 64
"""A key cut into more chunks than this must be cut along its first dimension only."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}  # fmt: skip
"""Every dtype the format stores, with its size in bytes (torch's names without ``torch.``)."""


def segment_count(nbytes: int, segment_bytes: int) -> int:
    """Checksum segments of a tensor of ``nbytes`` (an empty tensor has one: the digest of b'')."""
    return max(1, -(-nbytes // segment_bytes))


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
    global_shape: tuple[int, ...] | None = None
    start: tuple[int, ...] | None = None
    owner: int | None = None

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this entry is (a chunk of)."""
        return self.shape if self.global_shape is None else self.global_shape

    @property
    def box_start(self) -> tuple[int, ...]:
        """Where this chunk starts in the whole tensor (zeros for a whole tensor)."""
        return self.start if self.start is not None else (0,) * len(self.shape)

    @property
    def is_whole(self) -> bool:
        return self.global_shape is None or self.global_shape == self.shape

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key,
            "rank": self.rank,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksum": list(self.checksum),
        }
        if self.global_shape is not None:
            out["global_shape"] = list(self.global_shape)
            out["start"] = list(self.box_start)
        if self.owner is not None:
            out["owner"] = self.owner
        return out


@dataclass(frozen=True)
class FileEntry:
    name: str
    rank: int
    nbytes: int
    checksum: str | None = None  # whole-file checksum (objects files); data files hash per tensor
    stream_nbytes: int | None = None  # data files of several ranks: the replicated slice's length

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "rank": self.rank,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        }
        if self.stream_nbytes is not None:
            out["stream_nbytes"] = self.stream_nbytes
        return out


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint comes from: the run (stable across restarts), the timeline (new
    after each rollback) and the step it continues (None for the first of a run)."""

    run: str
    timeline: str
    parent: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "timeline": self.timeline, "parent": self.parent}


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
    lineage: Lineage | None = None
    metrics: dict[str, float] = field(default_factory=dict)
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
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "step": self.step,
            "created_unix_secs": self.created_unix_secs,
            "world_size": self.world_size,
            "library": dict(self.library),
            "topology": dict(self.topology),
        }
        if self.lineage is not None:
            body["lineage"] = self.lineage.to_json()
        if self.metrics:
            body["metrics"] = dict(self.metrics)
        body["checksum"] = {
            "algorithm": self.checksum_algorithm,
            "segment_bytes": self.segment_bytes,
        }
        body["files"] = [f.to_json() for f in self.files]
        body["tensors"] = [t.to_json() for t in self.tensors]
        return body

    def dumps(self) -> bytes:
        """The manifest file's bytes, sealed with the checksum of its canonical body."""
        body = seal(self.to_json(), self.checksum_algorithm)
        return (json.dumps(body, indent=1, allow_nan=False) + "\n").encode()

    @classmethod
    def loads(cls, data: bytes | str, *, path: str | None = None) -> Manifest:
        """Parse and validate; every problem is a ManifestError naming the field, a manifest
        of a newer format a FormatVersionError."""
        raw = load_json(data, what="manifest.json", path=path, max_depth=8)
        return _parse(raw, path)


def part_dumps(manifest: Manifest, rank: int, plan: str) -> bytes:
    """One rank's part of a manifest of several ranks (the memory level seals one per rank
    and slot, no rank waiting for another): ``manifest`` lists only ``rank``'s files and
    tensors; ``part`` names the rank and the plan every part of the step must share. A part
    never parses as a manifest (its files are not every rank's); :func:`join_parts` makes
    one of every rank's parts."""
    body = manifest.to_json()
    body["part"] = {"rank": rank, "plan": plan}
    sealed = seal(body, manifest.checksum_algorithm)
    return (json.dumps(sealed, separators=(",", ":"), allow_nan=False) + "\n").encode()


_JOINED = ("format", "format_version", "step", "world_size", "checksum", "lineage")
"""Fields every part of one step must have alike."""


def join_parts(parts: list[bytes], *, path: str | None = None) -> Manifest:
    """The manifest of a step from every rank's part (rank order): each part's integrity is
    checked, they must agree on the step, world size, checksum settings, lineage and plan,
    and the joined manifest is validated like any (tiling, layout); ManifestError (naming
    the rank at fault) otherwise."""
    bodies = []
    for r, data in enumerate(parts):
        raw = load_json(data, what=f"manifest part of rank {r}", path=path, max_depth=8)
        if not isinstance(raw, dict) or not _check_integrity(raw, path):
            raise ManifestError(f"the manifest part of rank {r} has no integrity checksum",
                                path=path)  # fmt: skip
        part = raw.get("part")
        if not isinstance(part, dict) or part.get("rank") != r:
            raise ManifestError(f"the manifest part of rank {r} is not that rank's", path=path)
        bodies.append(raw)
    if not bodies:
        raise ManifestError("no manifest parts to join", path=path)
    first = bodies[0]
    if first.get("world_size") != len(bodies):
        raise ManifestError(
            f"{len(bodies)} manifest parts for a world of {first.get('world_size')!r}", path=path
        )
    for r, b in enumerate(bodies[1:], 1):
        for k in (*_JOINED, "part"):
            mine, theirs = b.get(k), first.get(k)
            if k == "part":
                mine, theirs = b[k].get("plan"), first[k].get("plan")
            if mine != theirs:
                raise ManifestError(
                    f"the manifest parts of ranks 0 and {r} disagree on {k}", path=path
                )
    body = {k: v for k, v in first.items() if k not in ("part", "integrity")}
    body["created_unix_secs"] = max(b.get("created_unix_secs", 0) for b in bodies)
    hosts = [h for b in bodies for h in (b.get("topology") or {}).get("hosts") or []]
    body["topology"] = {"world_size": len(bodies), "hosts": list(dict.fromkeys(hosts))}
    body["files"] = [f for r, b in enumerate(bodies) for f in _part_list(b, "files", r, path)]
    body["tensors"] = [t for r, b in enumerate(bodies) for t in _part_list(b, "tensors", r, path)]
    algorithm = (first.get("checksum") or {}).get("algorithm")
    joined = seal(body, algorithm if algorithm in ALGORITHMS else "xxh3_64")
    return Manifest.loads(json.dumps(joined, allow_nan=False), path=path)


def _part_list(body: dict[str, Any], key: str, rank: int, path: str | None) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise ManifestError(f"the manifest part of rank {rank} has no list of {key}", path=path)
    return value


def manifest_digest(manifest: Manifest) -> str:
    """What tells one copy of a step's manifest from another (the node-local level keeps one
    per node): a digest of its canonical bytes; two copies agree when their digests do."""
    return hashlib.blake2b(manifest.dumps(), digest_size=16).hexdigest()


def seal(body: dict[str, Any], algorithm: str = "xxh3_64") -> dict[str, Any]:
    """``body`` with its ``integrity`` field (re)computed. The checksum guards against damage,
    not forgery: whoever can rewrite a manifest can reseal it (tools and tests do)."""
    out = {k: v for k, v in body.items() if k != "integrity"}
    out["integrity"] = {
        "algorithm": algorithm,
        "manifest": get_checksum(algorithm)(_canonical(out)),
    }
    return out


def _canonical(body: dict[str, Any]) -> bytes:
    """The bytes the integrity checksum covers: the body without ``integrity``, keys sorted."""
    plain = {k: v for k, v in body.items() if k != "integrity"}
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _check_integrity(top: dict[str, Any], path: str | None) -> bool:
    """True if the body's checksum verifies, False if the manifest carries none we can check;
    raises ManifestError if it carries one and it does not match (damage)."""
    seal = top.get("integrity")
    if seal is None:
        return False
    if not isinstance(seal, dict) or not isinstance(seal.get("manifest"), str):
        raise ManifestError("manifest.integrity is malformed", path=path)
    algorithm = seal.get("algorithm")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        return False
    try:
        digest = get_checksum(algorithm)(_canonical(top))
    except (ValueError, TypeError) as e:
        raise ManifestError(f"manifest body cannot be checked: {e}", path=path) from None
    if digest != seal["manifest"]:
        raise ManifestError(
            f"manifest checksum {digest} != {seal['manifest']} recorded in it: the manifest is damaged",
            path=path,
        )
    return True


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

    def count(self, name: str, limit: int = MAX_BYTES) -> int:
        """A non-negative int no larger than ``limit``."""
        value = self.get(name, int)
        if value < 0 or value > limit:
            raise ManifestError(f"{self.where}.{name} = {value} is out of range", path=self.path)
        return int(value)


def _parse(raw: object, path: str | None) -> Manifest:
    top = _Fields(raw, "manifest", path)
    if top.obj.get("format") != FORMAT_NAME:
        raise ManifestError(
            f"not a pitstop manifest (format is {str(top.obj.get('format'))[:40]!r})", path=path
        )
    sealed = _check_integrity(top.obj, path)
    version = top.get("format_version", int)
    if version > FORMAT_VERSION:
        library = top.obj.get("library")
        writer = library.get("pitstop") if isinstance(library, dict) else None
        from pitstop._version import __version__

        raise FormatVersionError(
            f"checkpoint written by pitstop {str(writer)[:20] if writer else '?'} in format "
            f"{version}; this is pitstop {__version__}, which reads formats up to "
            f"{FORMAT_VERSION}: upgrade pitstop",
            path=path,
        )
    if version < 1:
        raise ManifestError(f"format_version {version} is not valid", path=path)
    if version >= 2 and not sealed:
        raise ManifestError(
            "manifest has no integrity checksum (required since format 2)", path=path
        )
    step = top.count("step")
    checksum = _Fields(top.get("checksum", dict), "manifest.checksum", path)
    algorithm = checksum.get("algorithm", str)
    if algorithm not in ALGORITHMS:
        raise ManifestError(f"unknown checksum algorithm {algorithm[:40]!r}", path=path, step=step)
    segment_bytes = checksum.count("segment_bytes")
    if segment_bytes <= 0 or segment_bytes % ALIGN_BYTES:
        raise ManifestError(
            f"manifest.checksum.segment_bytes must be a positive multiple of {ALIGN_BYTES}",
            path=path, step=step,
        )  # fmt: skip
    world_size = top.count("world_size", MAX_WORLD_SIZE)
    if world_size < 1:
        raise ManifestError("manifest.world_size must be >= 1", path=path, step=step)
    files = tuple(_parse_file(f, i, world_size, path) for i, f in enumerate(top.get("files", list)))
    _check_files(files, world_size, path, step)
    sizes = {f.name: f.nbytes for f in files}
    tensors = tuple(
        _parse_tensor(t, i, sizes, segment_bytes, path)
        for i, t in enumerate(top.get("tensors", list))
    )
    _check_chunks(tensors, world_size, path, step)
    _check_layout(tensors, files, path, step)
    created = top.get("created_unix_secs", (int, float))
    if not math.isfinite(created) or created < 0:
        raise ManifestError("manifest.created_unix_secs is not a valid time", path=path, step=step)
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
        lineage=_parse_lineage(top.get("lineage", dict, optional=True), path),
        metrics=_parse_metrics(top.get("metrics", dict, optional=True), path),
        format_version=version,
    )


def _parse_lineage(raw: dict[str, Any] | None, path: str | None) -> Lineage | None:
    if raw is None:
        return None
    f = _Fields(raw, "manifest.lineage", path)
    parent = f.get("parent", int, optional=True)
    if parent is not None and not 0 <= parent <= MAX_BYTES:
        raise ManifestError("manifest.lineage.parent is out of range", path=path)
    return Lineage(run=f.get("run", str), timeline=f.get("timeline", str), parent=parent)


def _parse_metrics(raw: dict[str, Any] | None, path: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in (raw or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ManifestError(f"manifest.metrics.{k[:40]} is not a finite number", path=path)
        out[k] = float(v)
    return out


def _check_files(
    files: tuple[FileEntry, ...], world_size: int, path: str | None, step: int
) -> None:
    """Each rank has exactly its data file and its objects file, under its own names."""
    names = {f.name for f in files}
    if len(names) != len(files):
        raise ManifestError("manifest.files names a file twice", path=path, step=step)
    for f in files:
        if f.name not in (data_file_name(f.rank), objects_file_name(f.rank)):
            raise ManifestError(
                f"file {f.name} is listed under rank {f.rank}", path=path, step=step
            )
        if f.name.endswith(".json") and f.checksum is None:
            raise ManifestError(f"objects file {f.name} has no checksum", path=path, step=step)
    if len(files) != 2 * world_size:
        raise ManifestError(
            f"manifest lists {len(files)} files for {world_size} ranks (a data and an objects "
            "file each)", path=path, step=step,
        )  # fmt: skip
    for rank in {f.rank for f in files}:
        if {data_file_name(rank), objects_file_name(rank)} - names:
            raise ManifestError(f"rank {rank} lacks its data or objects file", path=path, step=step)


def _check_chunks(
    tensors: tuple[TensorEntry, ...], world_size: int, path: str | None, step: int
) -> None:
    """A key is either one value for all ranks (its chunks tile its global shape exactly, with
    one dtype) or a per-rank value (``owner``: at most one entry per rank), never both."""
    shared: dict[str, list[TensorEntry]] = {}
    owned: set[tuple[str, int]] = set()
    for t in tensors:
        if t.owner is None:
            shared.setdefault(t.key, []).append(t)
        elif t.owner >= world_size or t.owner != t.rank:
            raise ManifestError(
                f"tensor {t.key!r} in the file of rank {t.rank} has owner rank {t.owner}",
                path=path, step=step,
            )  # fmt: skip
        elif (t.key, t.owner) in owned:
            raise ManifestError(f"manifest.tensors names {t.key!r} twice", path=path, step=step)
        else:
            owned.add((t.key, t.owner))
    both = {k for k, _ in owned} & shared.keys()
    if both:
        raise ManifestError(
            f"tensor {sorted(both)[0]!r} is both per-rank and shared", path=path, step=step
        )
    for key, chunks in shared.items():
        first = chunks[0]
        if len(chunks) == 1 and first.is_whole:
            continue
        problem = _tiling_problem(chunks)
        if problem:
            raise ManifestError(f"tensor {key!r}: {problem}", path=path, step=step)


def _tiling_problem(chunks: list[TensorEntry]) -> str | None:
    """Why ``chunks`` do not tile their tensor exactly once (None if they do)."""
    first = chunks[0]
    whole = first.whole_shape
    if any(c.dtype != first.dtype or c.whole_shape != whole for c in chunks):
        return "its chunks disagree on dtype or global shape"
    if sum(math.prod(c.shape) for c in chunks) != math.prod(whole):
        return "its chunks do not cover it exactly once"
    if len(chunks) <= MAX_PAIRWISE_CHUNKS:
        for a, b in itertools.combinations(chunks, 2):
            if (
                all(
                    sa < sb + nb and sb < sa + na
                    for sa, na, sb, nb in zip(
                        a.box_start, a.shape, b.box_start, b.shape, strict=True
                    )
                )
                and a.nbytes
                and b.nbytes
            ):
                return "two of its chunks overlap"
        return None
    if not whole or any(c.shape[1:] != whole[1:] or any(c.box_start[1:]) for c in chunks):
        return f"more than {MAX_PAIRWISE_CHUNKS} chunks that are not row ranges"
    rows = sorted((c.box_start[0], c.shape[0]) for c in chunks)
    if any(a0 + an > b0 for (a0, an), (b0, _) in itertools.pairwise(rows)):
        return "two of its chunks overlap"
    return None


def _check_layout(
    tensors: tuple[TensorEntry, ...], files: tuple[FileEntry, ...], path: str | None, step: int
) -> None:
    """Each tensor lies in its own rank's data file, no two overlap, and each data file is as
    long as its tensors (padded to 4 KiB), so a claimed size allocates nothing more."""
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
    streams = {f.name: f.stream_nbytes for f in files if f.stream_nbytes is not None}
    for t in tensors:
        cut = streams.get(t.file)
        if (
            cut is not None
            and t.nbytes  # an empty tensor occupies nothing: any offset will do
            and t.offset < cut
            and (t.offset + t.nbytes > cut or t.owner is not None)
        ):
            raise ManifestError(
                f"tensor {t.key!r} does not fit the replicated part of {t.file}",
                path=path,
                step=step,
            )
    ends: dict[str, int] = {}
    for t in tensors:
        ends[t.file] = max(ends.get(t.file, 0), t.offset + t.nbytes)
    for f in files:
        end = ends.get(f.name, 0)
        padded = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        if f.name.endswith(".bin") and f.nbytes != padded:
            raise ManifestError(
                f"{f.name} is said to hold {f.nbytes} bytes; its tensors end at {end} "
                f"(padded: {padded})", path=path, step=step,
            )  # fmt: skip


def _parse_file(raw: object, i: int, world_size: int, path: str | None) -> FileEntry:
    f = _Fields(raw, f"manifest.files[{i}]", path)
    entry = FileEntry(
        name=validate_file_name(f.get("name", str), path=path),
        rank=f.count("rank", world_size - 1),
        nbytes=f.count("nbytes"),
        checksum=f.get("checksum", str, optional=True),
        stream_nbytes=f.count("stream_nbytes") if f.obj.get("stream_nbytes") is not None else None,
    )
    if entry.stream_nbytes is not None and (
        entry.stream_nbytes > entry.nbytes or entry.stream_nbytes % ALIGN_BYTES
    ):
        raise ManifestError(
            f"manifest.files[{i}].stream_nbytes is not an aligned length inside the file", path=path
        )
    return entry


def _parse_shape(raw: list[Any], where: str, path: str | None) -> tuple[int, ...]:
    if len(raw) > MAX_NDIM or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_BYTES for d in raw
    ):
        raise ManifestError(f"{where} has an invalid shape {str(raw)[:80]}", path=path)
    return tuple(int(d) for d in raw)


def _parse_tensor(
    raw: object, i: int, sizes: dict[str, int], segment_bytes: int, path: str | None
) -> TensorEntry:
    t = _Fields(raw, f"manifest.tensors[{i}]", path)
    key = t.get("key", str)
    where = f"manifest.tensors[{i}] ({key[:80]})"
    dtype = t.get("dtype", str)
    if dtype not in DTYPE_ITEMSIZE:
        raise ManifestError(f"{where} has unknown dtype {dtype[:40]!r}", path=path)
    shape = _parse_shape(t.get("shape", list), where, path)
    file = validate_file_name(t.get("file", str), path=path)
    offset, nbytes = t.count("offset"), t.count("nbytes")
    if nbytes != math.prod(shape) * DTYPE_ITEMSIZE[dtype]:
        raise ManifestError(f"{where}: nbytes does not match dtype and shape", path=path)
    if offset % ALIGN_BYTES:
        raise ManifestError(f"{where}: offset {offset} is not 4 KiB-aligned", path=path)
    if file not in sizes:
        raise ManifestError(f"{where} names file {file!r}, not in manifest.files", path=path)
    if offset + nbytes > sizes[file]:
        raise ManifestError(f"{where} lies beyond the end of {file}", path=path)
    checksum = t.get("checksum", list)
    expected = segment_count(nbytes, segment_bytes)
    if len(checksum) != expected or not all(isinstance(c, str) for c in checksum):
        raise ManifestError(
            f"{where} has {len(checksum)} checksums, expected {expected}", path=path
        )
    global_shape = start = None
    if "global_shape" in t.obj:
        global_shape = _parse_shape(t.get("global_shape", list), where, path)
        start = _parse_shape(t.get("start", list), where, path)
        if (
            len(global_shape) != len(shape)
            or len(start) != len(shape)
            or any(s0 + n > g for s0, n, g in zip(start, shape, global_shape, strict=True))
        ):
            raise ManifestError(f"{where}: its chunk lies outside its global shape", path=path)
    owner = t.count("owner", MAX_WORLD_SIZE) if t.obj.get("owner") is not None else None
    return TensorEntry(
        key=key, dtype=dtype, shape=shape, file=file, offset=offset, nbytes=nbytes,
        checksum=tuple(checksum), rank=t.count("rank", MAX_WORLD_SIZE),
        global_shape=global_shape, start=start, owner=owner,
    )  # fmt: skip
