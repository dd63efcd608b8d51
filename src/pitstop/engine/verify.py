"""verify: every file present and regular, every size right, every checksum equal. No torch.

Call sequence: the restore path (training thread) calls :func:`read_objects`, then
:func:`stream_verified` per data file: reader threads read pieces of the file into a
few reused aligned buffers (:class:`ReadBuffers`), hash each checksum segment and hand
the verified bytes on (the caller copies them where they belong). A reader that holds
the file's bytes in memory (a memory slot) offers them with the optional ``data_view()``
hook (:func:`data_view_of`): the reader threads then hash each segment where it lies and
hand on that very view, with no read buffer between; ``pitstop verify``
calls :func:`verify_checkpoint`: the same reads with nowhere to deliver to, after every
real size is checked. Every problem found is evidence of damage; an I/O error is
raised as the CheckpointIOError it is (after the storage's retries).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.checksum import get_checksum, get_hasher, segments
from pitstop.format.manifest import Manifest, TensorEntry
from pitstop.format.names import objects_file_name
from pitstop.format.objects import check_state_tree, parse_objects
from pitstop.io.arena import Arena
from pitstop.options import ALIGN_BYTES
from pitstop.storage.base import DataReader, Storage

__all__ = [
    "ReadBuffers",
    "VerifyReport",
    "check_empty",
    "check_sizes",
    "data_view_of",
    "raise_problems",
    "read_buffers",
    "read_objects",
    "segments_of",
    "stream_verified",
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


def check_sizes(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    problems: list[str],
    names: set[str] | None = None,
) -> None:
    """Every file of the manifest (or those in ``names``) exists as a regular file of the
    recorded size."""
    for f in manifest.files:
        if names is not None and f.name not in names:
            continue
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


Seg = tuple[int, int, TensorEntry, int]
"""A checksum segment: (file offset, length, its tensor entry, its index in the entry)."""

Deliver = Callable[[TensorEntry, int, memoryview], None]
"""``deliver(entry, lo, data)``: bytes ``lo``..``lo+len(data)`` of ``entry`` (a reader thread;
the view is valid only during the call)."""

Place = Callable[[TensorEntry], "memoryview | None"]
"""``place(entry)``: where ``entry``'s bytes may be read straight to, with no read buffer
between: a writable view of its own, at least ``entry.nbytes`` rounded up to ALIGN_BYTES
long and starting at an ALIGN_BYTES-aligned address, that nobody uses before the read is
verified (a fresh tensor that a restore hands over only if every segment verified); or
None: through a read buffer and ``deliver``."""

_GAP_BYTES = 1 << 20  # a read does not span more than this of bytes nobody asked for


def segments_of(entries: Iterable[TensorEntry], segment_bytes: int) -> list[Seg]:
    """The non-empty checksum segments of ``entries``, in file order."""
    out = [
        (start, length, t, j)
        for t in entries
        for j, (start, length) in enumerate(segments(t.offset, t.nbytes, segment_bytes))
        if length
    ]
    return sorted(out, key=lambda s: s[0])


class ReadBuffers:
    """``count`` aligned read buffers of ``nbytes`` (allocated as first needed, so a small
    checkpoint takes little) and as many reader threads: all the host memory a streaming
    read uses, whatever the size of the checkpoint. Close it when done."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.count = max(1, count)
        self.nbytes = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        self.pool = ThreadPoolExecutor(self.count, thread_name_prefix="pitstop-read")
        started = threading.Barrier(self.count + 1)
        for _ in range(self.count):  # every thread now: once reads run, starting one is slow
            self.pool.submit(started.wait)
        started.wait()
        self._free: list[Arena] = []
        self._all: list[Arena] = []
        self._lock = threading.Condition()
        self._warming = 0  # buffers being allocated by warm(): counted against ``count``

    def warm(self, n: int) -> None:
        """Allocate (and so first-touch) ``n`` buffers of full size now, in the background,
        while the caller goes on preparing the read (the restore's objects file, its check
        pass): a restarted process then issues its first reads at once instead of after
        faulting in 16 MiB per reader thread (20-40 ms here, 6 threads on 2 cores)."""
        with self._lock:
            n = max(0, min(n, self.count - len(self._all) - self._warming))
            self._warming += n
        for _ in range(n):
            self.pool.submit(self._warm_one)

    def _warm_one(self) -> None:
        arena: Arena | None = None
        try:
            arena = Arena(self.nbytes)
        except (OSError, MemoryError):
            pass  # a read allocates its own then, and says why if it cannot
        finally:
            with self._lock:
                self._warming -= 1
                if arena is not None:
                    self._all.append(arena)
                    self._free.append(arena)
                self._lock.notify_all()

    @contextmanager
    def buffer(self, need: int | None = None) -> Iterator[memoryview]:
        """A free buffer of at least ``need`` bytes (default and at most ``nbytes``), as
        small as one that fits (a reader thread; there is one per thread, so none waits).
        A new one is only as large as asked: its pages are touched for the first time, at
        0.7-0.85 GB/s here, so many short reads at once take short buffers."""
        size = self.nbytes if need is None else min(self.nbytes, _aligned(max(need, 1)))
        small: Arena | None = None
        with self._lock:
            # while warm() allocates, the first readers wait for its buffers rather than
            # first-touch more at once (which delays every first read; at most count buffers)
            self._lock.wait_for(lambda: not self._warming or bool(self._free))
            fits = [a for a in self._free if a.nbytes >= size]
            arena = min(fits, key=lambda a: a.nbytes) if fits else None
            if arena is not None:
                self._free.remove(arena)
            elif self._free:  # none fits: one too small makes room (at most count buffers)
                small = self._free.pop()
                self._all.remove(small)
        if small is not None:
            small.close()
        if arena is None:
            try:
                arena = Arena(size)
            except (OSError, MemoryError) as e:
                raise CheckpointError(
                    f"cannot allocate a {self.nbytes}-byte read buffer: {e}", phase="restore"
                ) from e
            with self._lock:
                self._all.append(arena)
        try:
            yield arena.view
        finally:
            with self._lock:
                self._free.append(arena)
                self._lock.notify_all()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self._lock:
            for arena in self._all:
                arena.close()
            self._all.clear()
            self._free.clear()

    def __enter__(self) -> ReadBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _aligned(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def read_buffers(storage: Storage, total: int, count: int | None = None) -> ReadBuffers:
    """Read buffers for reading ``total`` bytes from ``storage``: ``io.read_buffers`` (or
    ``count``) of ``io.read_chunk_bytes`` each, smaller when the checkpoint is."""
    return ReadBuffers(
        count or storage.io.read_buffers, min(storage.io.read_chunk_bytes, max(total, 1))
    )


def _tasks(segs: list[Seg], unit: int) -> list[tuple[int, int, list[Seg]]]:
    """Group segments into reads of at most ``unit`` bytes: (start, end, segments). A
    segment longer than ``unit`` is a task of its own, read in pieces."""
    tasks: list[tuple[int, int, list[Seg]]] = []
    group: list[Seg] = []
    start = end = 0
    for seg in segs:
        s, n = seg[0], seg[1]
        if group and (s + n - start > unit or s - end > _GAP_BYTES):
            tasks.append((start, end, group))
            group = []
        if not group:
            start = s - s % ALIGN_BYTES
        group.append(seg)
        end = s + n
        if end - start > unit:  # one long segment alone
            tasks.append((start, end, group))
            group = []
    if group:
        tasks.append((start, end, group))
    return tasks


def data_view_of(reader: DataReader) -> memoryview | None:
    """The bytes of ``reader``'s file in place, if it offers them; else None.

    The hook is optional and found by name, so no other reader changes: a DataReader whose
    file already lies in this process's memory (:class:`pitstop.levels.memory.SlotStorage`'s
    reader of a shared-memory slot) may define ``data_view() -> memoryview | None``: the
    whole file, one byte per item, as long as the file; valid until ``close()`` and not
    written meanwhile (the caller holds the checkpoint's pin, and the owner stages into no
    pinned checkpoint). None means "read me" (through ``read_into``). Consumers of the view
    only read it."""
    hook = getattr(reader, "data_view", None)
    if hook is None:
        return None
    view = hook()
    return None if view is None else memoryview(view).cast("B")


def stream_verified(
    reader: DataReader,
    manifest: Manifest,
    file: str,
    segs: list[Seg],
    *,
    buffers: ReadBuffers,
    problems: list[str],
    deliver: Deliver | None = None,
    on_bytes: Callable[[int], None] | None = None,
    place: Place | None = None,
) -> int:
    """Read the segments ``segs`` of data ``file`` through ``buffers`` and check each one's
    checksum; each verified segment is handed to ``deliver``, except those of an entry that
    ``place`` gives a view for: read straight into it and checked there (no buffer, no copy;
    a restore's fresh tensors, which a restarted process would otherwise first-touch twice). A segment longer than a buffer
    is hashed and handed on piece by piece, so its pieces land before its digest is known
    (a caller that delivers into live state must say so when the read fails).

    Requests are at most one buffer long, ``buffers.count`` of them in flight. A line per
    problem goes to ``problems``; after the first, nothing more is read or delivered. An I/O
    error is raised once every request in flight has ended. Returns the bytes checked.

    A reader that offers its bytes in place (:func:`data_view_of`) is not read: the reader
    threads of ``buffers`` hash each segment where it lies, whole, and hand ``deliver`` a
    view of the reader's own memory once its checksum matched (no read buffer is used, and
    no byte is handed on before its segment verified).
    """
    in_place = data_view_of(reader)
    if in_place is not None:
        return _stream_in_place(
            in_place, manifest, file, segs, buffers=buffers, problems=problems,
            deliver=deliver, on_bytes=on_bytes,
        )  # fmt: skip
    hasher = get_checksum(manifest.checksum_algorithm)
    new_hasher = get_hasher(manifest.checksum_algorithm)
    unit = buffers.nbytes
    lock = threading.Lock()

    def problem(text: str) -> None:
        with lock:
            problems.append(text)

    def read(buf: memoryview, at: int, need: int) -> bool:
        span = -(-need // ALIGN_BYTES) * ALIGN_BYTES if reader.direct else need
        got = reader.read_into(at, buf[: min(span, len(buf))])
        if got < need:
            problem(f"{file} ends at byte {at + got}, before its recorded size")
            return False
        return True

    def mismatch(seg: Seg) -> None:
        s, n, t, j = seg
        problem(f"{file}: tensor {t.key!r} segment {j} (bytes {s}-{s + n}) checksum mismatch")

    def run_placed(seg: Seg, dest: memoryview) -> None:
        s, n, t, j = seg
        if problems:
            return
        lo = s - t.offset
        if not read(dest[lo:], s, n):
            return
        if hasher(dest[lo : lo + n]) != t.checksum[j]:
            mismatch(seg)
        elif on_bytes is not None:
            on_bytes(n)

    def run(task: tuple[int, int, list[Seg]]) -> None:
        start, end, group = task
        if problems:
            return  # the outcome is known: stop reading
        with buffers.buffer(end - start) as buf:
            if end - start > unit:  # one long segment, in pieces
                s, n, t, j = group[0]
                h, at = new_hasher(), s
                while at < s + n:
                    m = min(unit, s + n - at)
                    if problems or not read(buf, at, m):
                        return
                    h.update(buf[:m])
                    if deliver is not None:
                        deliver(t, at - t.offset, buf[:m])
                    at += m
                if h.hexdigest() != t.checksum[j]:
                    mismatch(group[0])
            else:
                if not read(buf, start, end - start):
                    return
                for seg in group:
                    s, n, t, j = seg
                    data = buf[s - start : s - start + n]
                    if hasher(data) != t.checksum[j]:
                        mismatch(seg)
                    elif deliver is not None and not problems:
                        deliver(t, s - t.offset, data)
        if on_bytes is not None:
            on_bytes(sum(seg[1] for seg in group))

    placed, buffered = _placed(segs, place, ALIGN_BYTES if reader.direct else 1)
    futures = [buffers.pool.submit(run_placed, seg, dest) for seg, dest in placed]
    futures += [buffers.pool.submit(run, task) for task in _tasks(buffered, unit)]
    _wait_all(futures)
    return sum(n for _, n, _, _ in segs)


def _placed(
    segs: list[Seg], place: Place | None, align: int
) -> tuple[list[tuple[Seg, memoryview]], list[Seg]]:
    """The segments to read straight into their entry's place (with it), and the others."""
    if place is None:
        return [], segs
    where: dict[int, memoryview | None] = {}
    placed: list[tuple[Seg, memoryview]] = []
    buffered: list[Seg] = []
    for seg in segs:
        t = seg[2]
        if id(t) not in where:
            view = place(t)
            span = -(-t.nbytes // align) * align
            where[id(t)] = view if view is not None and len(view) >= span else None
        dest = where[id(t)]
        if dest is None:
            buffered.append(seg)
        else:
            placed.append((seg, dest))
    return placed, buffered


def _wait_all(futures: list[Future[None]]) -> None:
    """Wait for every request (each ends before the caller may close the reader); then
    raise the first error, if any."""
    first: BaseException | None = None
    for f in futures:
        error = f.exception()
        if error is not None and first is None:
            first = error
    if first is not None:
        raise first


def _stream_in_place(
    view: memoryview,
    manifest: Manifest,
    file: str,
    segs: list[Seg],
    *,
    buffers: ReadBuffers,
    problems: list[str],
    deliver: Deliver | None,
    on_bytes: Callable[[int], None] | None,
) -> int:
    """:func:`stream_verified` over bytes that are already in memory: each task (segments
    grouped as the buffered path reads them) hashes its segments in ``view`` and hands
    each verified one on as a slice of ``view``. Same problems, same messages."""
    hasher = get_checksum(manifest.checksum_algorithm)
    lock = threading.Lock()

    def problem(text: str) -> None:
        with lock:
            problems.append(text)

    def run(group: list[Seg]) -> None:
        if problems:
            return  # the outcome is known: stop hashing
        for s, n, t, j in group:
            if s + n > len(view):
                problem(f"{file} ends at byte {len(view)}, before its recorded size")
                return
            data = view[s : s + n]
            if hasher(data) != t.checksum[j]:
                problem(
                    f"{file}: tensor {t.key!r} segment {j} (bytes {s}-{s + n}) checksum mismatch"
                )
            elif deliver is not None and not problems:
                deliver(t, s - t.offset, data)
        if on_bytes is not None:
            on_bytes(sum(seg[1] for seg in group))

    tasks = _tasks(segs, buffers.nbytes)
    futures = [buffers.pool.submit(run, group) for _, _, group in tasks]
    _wait_all(futures)
    return sum(n for _, n, _, _ in segs)


def check_empty(manifest: Manifest, entries: Iterable[TensorEntry], problems: list[str]) -> None:
    """An empty tensor has no bytes to read; its checksum must be that of nothing."""
    empty = get_checksum(manifest.checksum_algorithm)(b"")
    problems.extend(
        f"{t.file}: empty tensor {t.key!r} has a wrong checksum"
        for t in entries
        if t.nbytes == 0 and t.checksum != (empty,)
    )


def verify_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    *,
    threads: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every file and every checksum of one checkpoint, reading it in full through a
    few read buffers (``threads`` of them; host memory does not grow with the checkpoint).
    Every real size is checked before anything is read."""
    t0 = time.perf_counter()
    report = VerifyReport(step=manifest.step)
    check_sizes(storage, directory, manifest, report.problems)
    if report.problems:
        report.secs = time.perf_counter() - t0
        return report
    for rank in sorted({f.rank for f in manifest.files}):
        read_objects(storage, directory, manifest, rank, report.problems)
    data_files = [f for f in manifest.files if f.name.endswith(".bin")]
    total = max((f.nbytes for f in data_files), default=0)
    with read_buffers(storage, total, threads) as buffers:
        for f in data_files:
            entries = [t for t in manifest.tensors if t.file == f.name]
            check_empty(manifest, entries, report.problems)
            try:
                with contextlib.closing(storage.open_data(directory, f.name)) as reader:
                    report.nbytes += stream_verified(
                        reader, manifest, f.name, segments_of(entries, manifest.segment_bytes),
                        buffers=buffers, problems=report.problems, on_bytes=on_bytes,
                    )  # fmt: skip
            except CorruptCheckpointError as e:
                report.problems.append(f"{f.name}: {e.message}")
    report.secs = time.perf_counter() - t0
    return report


def raise_problems(problems: list[str], *, step: int, path: str) -> None:
    """Raise CorruptCheckpointError listing ``problems``, if any."""
    if problems:
        raise CorruptCheckpointError("; ".join(problems), step=step, path=path, phase="verify")
