"""verify: every file present and regular, every size right, every checksum equal. No torch.

Call sequence: the restore path (training thread) calls :func:`read_objects` and
:func:`read_verified` to read a checkpoint into a buffer and check it in one pass;
``pitstop verify`` calls :func:`verify_checkpoint`, which checks every real size
before it allocates its buffer. The io pool's threads read extents and hash their
segments in parallel. Every problem found is evidence of damage; an I/O error is
raised as the CheckpointIOError it is (after the storage's retries).
"""

from __future__ import annotations

import threading
import time
import typing
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.checksum import get_checksum, segments
from pitstop.format.manifest import Manifest, TensorEntry
from pitstop.format.names import objects_file_name
from pitstop.format.objects import check_state_tree, parse_objects
from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent, plan_extents
from pitstop.storage.base import Storage

__all__ = [
    "VerifyReport",
    "check_sizes",
    "raise_problems",
    "read_objects",
    "read_verified",
    "verify_checkpoint",
]


@dataclass
class VerifyReport:
    step: int
    problems: list[str] = field(default_factory=list)
    nbytes: int = 0
    secs: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def check_sizes(storage: Storage, directory: str, manifest: Manifest, problems: list[str]) -> None:
    """Every file of the manifest exists as a regular file of the recorded size."""
    for f in manifest.files:
        try:
            size = storage.file_size(directory, f.name)
        except CorruptCheckpointError as e:
            problems.append(f"{f.name}: {e.message}")
            continue
        if size != f.nbytes:
            problems.append(
                f"{f.name}: {size} bytes on storage, manifest says {f.nbytes} (truncated or overwritten)"
            )


def read_objects(
    storage: Storage, directory: str, manifest: Manifest, rank: int, problems: list[str]
) -> Any:
    """The validated tree of ``rank``'s objects file; None (and a line in ``problems``) if it
    is missing, of the wrong size or checksum, or not a valid objects file."""
    name = objects_file_name(rank)
    try:
        entry = manifest.file(name)
        data = storage.read_object(directory, name)
    except KeyError:
        problems.append(f"manifest lists no {name}")
        return None
    except CorruptCheckpointError as e:
        problems.append(f"{name}: {e.message}")
        return None
    if len(data) != entry.nbytes:
        problems.append(f"{name}: {len(data)} bytes, manifest says {entry.nbytes}")
        return None
    digest = get_checksum(manifest.checksum_algorithm)(data)
    if digest != entry.checksum:
        problems.append(f"{name}: checksum {digest} != {entry.checksum} in the manifest")
        return None
    keys = {t.key for t in manifest.tensors if t.owner in (None, rank)}
    try:
        tree = parse_objects(data, name=name, tensor_keys=keys, path=f"{storage.url}/{directory}")
        check_state_tree(tree, name=name)
        return tree
    except CorruptCheckpointError as e:
        problems.append(e.message)
        return None


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
    region: tuple[int, int] | None = None,
) -> int:
    """Read data ``file`` (or bytes ``region`` of it) into ``view`` at the file's own offsets
    and check every segment of the tensors in it.

    The caller has checked the file's real size (:func:`check_sizes`). Appends a line per
    problem to ``problems``; returns the bytes read. ``on_bytes(n)`` is called from the
    reader threads as each extent is checked (for progress reports).
    """
    entry = manifest.file(file)
    lo, hi = region if region is not None else (0, entry.nbytes)
    if hi <= lo:
        return 0
    tensors = [
        t
        for t in manifest.tensors
        if t.file == file and lo <= t.offset and t.offset + t.nbytes <= hi
    ]
    hasher = get_checksum(manifest.checksum_algorithm)
    segs: list[tuple[int, int, object]] = []
    for t in tensors:
        for j, (start, length) in enumerate(segments(t.offset, t.nbytes, manifest.segment_bytes)):
            if length:
                segs.append((start, length, (t, j)))
    results: dict[tuple[str, int], str | None] = {}  # a retried read overwrites its results
    lock = threading.Lock()

    def on_extent(extent: Extent) -> None:
        for start, length, tag in extent.segments:
            t, j = typing.cast("tuple[TensorEntry, int]", tag)
            digest = hasher(view[start : start + length])
            bad = None
            if digest != t.checksum[j]:
                bad = f"{file}: tensor {t.key!r} segment {j} (bytes {start}-{start + length}) checksum mismatch"
            with lock:
                results[(t.key, j)] = bad
        if on_bytes is not None:
            on_bytes(extent.nbytes)

    extents = plan_extents(
        [(a - lo, n, tag) for a, n, tag in segs], hi - lo, storage.io.read_chunk_bytes
    )
    if lo:
        extents = [
            Extent(e.start + lo, e.end + lo, tuple((a + lo, n, tag) for a, n, tag in e.segments))
            for e in extents
        ]
    try:
        storage.read_data(directory, file, view, extents, pool=pool, on_extent=on_extent)
    except CorruptCheckpointError as e:
        problems.append(f"{file}: {e.message}")
        return 0
    empty = hasher(b"")
    bad = sorted(b for b in results.values() if b)
    bad += [
        f"{file}: empty tensor {t.key!r} has a wrong checksum"
        for t in tensors
        if t.nbytes == 0 and t.checksum != (empty,)
    ]
    problems.extend(bad)
    return hi - lo


@contextmanager
def _own_buffer(nbytes: int) -> Iterator[memoryview]:
    try:
        arena = Arena(nbytes)
    except (OSError, MemoryError) as e:
        raise CheckpointError(f"cannot allocate {nbytes} bytes to verify into: {e}") from e
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
    """Check every file and every checksum of one checkpoint, reading it in full. Sizes are
    checked before a buffer is allocated, so a manifest's claims allocate nothing."""
    t0 = time.perf_counter()
    report = VerifyReport(step=manifest.step)
    check_sizes(storage, directory, manifest, report.problems)
    if report.problems:
        report.secs = time.perf_counter() - t0
        return report
    for rank in sorted({f.rank for f in manifest.files}):
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


def raise_problems(problems: list[str], *, step: int, path: str) -> None:
    """Raise CorruptCheckpointError listing ``problems``, if any."""
    if problems:
        raise CorruptCheckpointError("; ".join(problems), step=step, path=path, phase="verify")
