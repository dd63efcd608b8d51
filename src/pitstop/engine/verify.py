"""verify: every file present, every size right, every checksum equal. No torch.

Call sequence: the restore path (training thread) calls :func:`read_verified`
to read a checkpoint into a buffer and check it in one pass; ``pitstop verify``
calls :func:`verify_checkpoint`, which brings its own buffer. The io pool's
threads read extents and hash their segments in parallel.
"""

from __future__ import annotations

import json
import threading
import typing
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pitstop.errors import CheckpointError
from pitstop.format.checksum import get_checksum, segments
from pitstop.format.manifest import Manifest, TensorEntry
from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent, plan_extents
from pitstop.storage.base import Storage

__all__ = ["VerifyReport", "read_objects", "read_verified", "verify_checkpoint"]


@dataclass
class VerifyReport:
    step: int
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    secs: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def read_objects(
    storage: Storage, directory: str, manifest: Manifest, rank: int, problems: list[str]
) -> Any:
    """The tree of ``rank``'s objects file, checked against its size and checksum; None on a problem."""
    name = f"objects-{rank:05d}.json"
    try:
        entry = manifest.file(name)
    except KeyError:
        problems.append(f"manifest lists no {name}")
        return None
    try:
        data = storage.read_object(directory, name)
    except CheckpointError as e:
        problems.append(f"{name}: {e.message}")
        return None
    if len(data) != entry.nbytes:
        problems.append(f"{name}: {len(data)} bytes, manifest says {entry.nbytes}")
        return None
    digest = get_checksum(manifest.checksum_algorithm)(data)
    if digest != entry.checksum:
        problems.append(f"{name}: checksum {digest} != {entry.checksum} in the manifest")
        return None
    try:
        doc = json.loads(data)
    except ValueError as e:
        problems.append(f"{name}: not valid JSON ({e})")
        return None
    if not isinstance(doc, dict) or doc.get("format") != "pitstop-objects" or "tree" not in doc:
        problems.append(f"{name}: not a pitstop objects file")
        return None
    return doc["tree"]


def _tensors_by_file(manifest: Manifest) -> dict[str, list[TensorEntry]]:
    out: dict[str, list[TensorEntry]] = {
        f.name: [] for f in manifest.files if f.name.endswith(".bin")
    }
    for t in manifest.tensors:
        out.setdefault(t.file, []).append(t)
    return out


def read_verified(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    file: str,
    view: memoryview,
    *,
    pool: Executor,
    problems: list[str],
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Read data ``file`` into ``view`` (at the file's own offsets) and check every segment.

    Appends a line per problem to ``problems``; returns the bytes read. ``on_bytes(n)`` is
    called from the reader threads as each extent is checked (for progress reports).
    """
    entry = manifest.file(file)
    try:
        size = storage.file_size(directory, file)
    except CheckpointError as e:
        problems.append(f"{file}: {e.message}")
        return 0
    if size != entry.nbytes:
        problems.append(
            f"{file}: {size} bytes on storage, manifest says {entry.nbytes} (truncated or overwritten)"
        )
        return 0
    if entry.nbytes == 0:
        return 0
    tensors = _tensors_by_file(manifest).get(file, [])
    hasher = get_checksum(manifest.checksum_algorithm)
    segs: list[tuple[int, int, object]] = []
    for t in tensors:
        for j, (start, length) in enumerate(segments(t.offset, t.nbytes, manifest.segment_bytes)):
            if length:
                segs.append((start, length, (t, j)))
    bad: list[str] = []
    lock = threading.Lock()

    def on_extent(extent: Extent) -> None:
        for start, length, tag in extent.segments:
            t, j = typing.cast("tuple[TensorEntry, int]", tag)
            digest = hasher(view[start : start + length])
            if digest != t.checksum[j]:
                with lock:
                    bad.append(
                        f"{file}: tensor {t.key!r} segment {j} (bytes {start}-{start + length}) checksum mismatch"
                    )
        if on_bytes is not None:
            on_bytes(extent.nbytes)

    extents = plan_extents(segs, entry.nbytes, storage.io.read_chunk_bytes)
    try:
        storage.read_data(directory, file, view, extents, pool=pool, on_extent=on_extent)
    except CheckpointError as e:
        problems.append(f"{file}: {e.message}")
        return 0
    empty = hasher(b"")
    for t in tensors:
        if t.nbytes == 0 and t.checksum != (empty,):
            bad.append(f"{file}: empty tensor {t.key!r} has a wrong checksum")
    problems.extend(sorted(bad))
    return entry.nbytes


@contextmanager
def _own_buffer(nbytes: int) -> Iterator[memoryview]:
    arena = Arena(nbytes)
    try:
        yield arena.view
    finally:
        arena.close()


def verify_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    *,
    threads: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every file and every checksum of one checkpoint, reading it in full."""
    import time

    t0 = time.perf_counter()
    report = VerifyReport(step=manifest.step)
    ranks = sorted({f.rank for f in manifest.files})
    for rank in ranks:
        read_objects(storage, directory, manifest, rank, report.problems)
    data_files = [f for f in manifest.files if f.name.endswith(".bin")]
    largest = max((f.nbytes for f in data_files), default=0)
    with (
        ThreadPoolExecutor(
            threads or storage.io.threads, thread_name_prefix="pitstop-verify"
        ) as pool,
        _own_buffer(largest) as view,
    ):
        for f in data_files:
            report.nbytes += read_verified(
                storage, directory, manifest, f.name, view,
                pool=pool, problems=report.problems, on_bytes=on_bytes,
            )  # fmt: skip
    report.secs = time.perf_counter() - t0
    return report
