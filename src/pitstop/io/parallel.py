"""Parallel positional I/O between an aligned buffer and one file, O_DIRECT where allowed.

The buffer is laid out exactly as the file, so byte ``i`` of the buffer is byte
``i`` of the file and there is no serialization pass. The file is cut into
*extents* (aligned, at most about ``chunk_bytes`` each); worker threads of a
shared pool write or read disjoint extents with ``pwrite``/``preadv``, which
release the GIL, and call ``on_extent`` for each one (the engine hashes the
extent's checksum segments there, so hashing runs in parallel with I/O).

O_DIRECT bypasses the page cache; it needs aligned addresses, offsets and
lengths, which the arena and the 4 KiB layout give. Where a file system
refuses O_DIRECT (tmpfs, some network file systems) the file is written with
buffered I/O and fsync instead, and the fallback is logged once per device.

Call sequence: the engine's persist thread calls :func:`write_file` once per file; the
pool's threads run the extents. Reads go through a :class:`FileReader` (the restore
path's reader threads request pieces into their own buffers; :func:`read_file` reads
extents into a buffer laid out as the file). Nothing here is called from the training
thread.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from pitstop.errors import CheckpointIOError, CorruptCheckpointError, UnsafePathError
from pitstop.faults import killpoint
from pitstop.io.files import READ_FLAGS, check_regular
from pitstop.log import get_logger
from pitstop.options import ALIGN_BYTES, DirectMode

__all__ = ["Extent", "FileReader", "IOResult", "plan_extents", "read_file", "write_file"]

_log = get_logger("pitstop.io")
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_warned_devices: set[int] = set()
RAMP = 3
"""Extents before the first of full size (see :func:`plan_extents`)."""
_warn_lock = threading.Lock()


@dataclass(frozen=True)
class Extent:
    """Bytes [start, end) of a file and of its buffer, plus the segments hashed in it.

    ``segments`` are (start, length, tag) triples lying inside the extent; the
    tag lets the caller put each checksum where it belongs.
    """

    start: int
    end: int
    segments: tuple[tuple[int, int, object], ...] = ()

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class IOResult:
    nbytes: int
    secs: float
    direct: bool


def plan_extents(
    segments: Sequence[tuple[int, int, object]], file_bytes: int, chunk_bytes: int
) -> list[Extent]:
    """Pack sorted, non-overlapping segments into extents that tile [0, file_bytes).

    An extent grows until adding the next segment would take it past
    ``chunk_bytes`` (plus an eighth, so that a few small tensors beside large ones do not
    push every extent down by one large tensor); extent boundaries are 4 KiB-aligned, so
    every extent is a valid O_DIRECT request. Gaps (alignment padding) belong to the
    extent before. The first ``RAMP`` extents are smaller (an eighth, a quarter, a half of
    ``chunk_bytes``; never less than one segment): a save's first write waits for its
    extent to be copied into the arena, and starts that much sooner.
    """
    extents: list[Extent] = []
    start = 0
    group: list[tuple[int, int, object]] = []
    for seg in sorted(segments, key=lambda s: s[0]):
        seg_start = seg[0]
        ramp = chunk_bytes >> max(0, RAMP - len(extents))
        limit = max(ramp + ramp // 8, ALIGN_BYTES)
        if group and seg_start + seg[1] - start > limit:
            cut = seg_start - seg_start % ALIGN_BYTES
            if cut > start:
                extents.append(Extent(start, cut, tuple(group)))
                start, group = cut, []
        group.append(seg)
    if start < file_bytes or group:
        extents.append(Extent(start, max(file_bytes, start), tuple(group)))
    return extents


def _open(path: str, flags: int, direct: bool, dir_fd: int | None = None) -> int:
    return os.open(path, flags | (_O_DIRECT if direct else 0), 0o644, dir_fd=dir_fd)


def _note_fallback(path: str, err: OSError, dir_fd: int | None = None) -> None:
    try:
        dev = (
            os.fstat(dir_fd).st_dev
            if dir_fd is not None
            else os.stat(os.path.dirname(path) or ".").st_dev
        )
    except OSError:
        dev = -1
    with _warn_lock:
        if dev in _warned_devices:
            return
        _warned_devices.add(dev)
    _log.warning(
        "O_DIRECT refused for %s (%s); using buffered I/O + fsync on this file system",
        path,
        err.strerror,
        phase="persist",
    )


def _want_direct(mode: DirectMode) -> bool:
    return mode != "off" and _O_DIRECT != 0


def _run_extents(
    pool: Executor,
    extents: Sequence[Extent],
    job: Callable[[Extent], None],
    *,
    midpoint: str | None,
) -> None:
    """Run ``job`` on every extent in the pool; wait for all; raise the first error."""
    done_count = 0
    count_lock = threading.Lock()
    half = max(1, (len(extents) + 1) // 2)

    def run(extent: Extent) -> None:
        nonlocal done_count
        job(extent)
        if midpoint is not None:
            with count_lock:
                done_count += 1
                reached = done_count == half
            if reached:
                killpoint(midpoint)

    futures: list[Future[None]] = [pool.submit(run, e) for e in extents]
    first: BaseException | None = None
    for f in futures:  # wait for every one: no thread may still use the fd after close
        exc = f.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None:
        raise first


def _io_error(e: OSError, path: str, phase: str) -> CheckpointIOError:
    return CheckpointIOError(
        f"{phase} failed on {os.path.basename(path)}: {e.strerror or e}",
        errno=e.errno,
        path=path,
        phase=phase,
    )


def write_file(
    path: str,
    view: memoryview,
    extents: Sequence[Extent],
    *,
    pool: Executor,
    direct: DirectMode = "auto",
    fsync: bool = True,
    before_extent: Callable[[Extent], None] | None = None,
    on_extent: Callable[[Extent], None] | None = None,
    dir_fd: int | None = None,
) -> IOResult:
    """Write ``view[e.start:e.end]`` at ``e.start`` for every extent, in parallel, then fsync.
    In the writer thread, ``before_extent(e)`` runs before ``e`` is written and
    ``on_extent(e)`` (once per extent, even if a fallback writes it again) after.
    With ``dir_fd``, ``path`` is a name in that directory (held open by the writer, so a
    directory swapped for a symlink meanwhile is not followed); the file is never a symlink."""
    t0 = time.perf_counter()
    hashed: set[int] = set()
    hash_lock = threading.Lock()

    def hash_once(extent: Extent) -> None:
        # on a fallback the extents run again; their checksums are computed once
        if on_extent is None:
            return
        with hash_lock:
            if extent.start in hashed:
                return
            hashed.add(extent.start)
        on_extent(extent)

    def write_all(fd: int) -> None:
        def job(extent: Extent) -> None:
            if before_extent is not None:
                before_extent(extent)
            # the disk first: it starts as soon as the first extent is staged, and this
            # thread hashes while the other writers' requests are in flight
            _pwrite_all(fd, view[extent.start : extent.end], extent.start)
            hash_once(extent)

        _run_extents(pool, extents, job, midpoint="persist.mid")
        if fsync:
            os.fsync(fd)

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    used_direct = _with_fd(
        path, flags, direct, "persist", write_all,
        on_fallback=lambda p, e: _note_fallback(p, e, dir_fd), dir_fd=dir_fd,
    )  # fmt: skip
    total = sum(e.nbytes for e in extents)
    return IOResult(nbytes=total, secs=time.perf_counter() - t0, direct=used_direct)


def _with_fd(
    path: str,
    flags: int,
    direct: DirectMode,
    phase: str,
    body: Callable[[int], None],
    *,
    on_fallback: Callable[[str, OSError], None] | None = None,
    dir_fd: int | None = None,
) -> bool:
    """Open ``path`` (with O_DIRECT when wanted) and run ``body(fd)``; where the file system
    refuses O_DIRECT (EINVAL at open or at the first request) and ``direct`` is auto, run it
    again with buffered I/O. Returns whether O_DIRECT was used. OSErrors become
    CheckpointIOError named by ``phase``."""
    use_direct = _want_direct(direct)
    while True:
        try:
            fd = _open(path, flags, use_direct, dir_fd)
            try:
                body(fd)
            finally:
                os.close(fd)
            return use_direct
        except CheckpointIOError:
            raise
        except OSError as e:
            if use_direct and e.errno == errno.EINVAL and direct == "auto":
                if on_fallback is not None:
                    on_fallback(path, e)
                use_direct = False
                continue
            raise _io_error(e, path, phase) from e


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:  # pragma: no cover - pwrite reports errors by raising
            raise OSError(errno.EIO, "short write")
        data, offset = data[n:], offset + n


class FileReader:
    """Positional reads of one file, O_DIRECT where the file system accepts it (``direct``
    says whether requests must then be aligned: offsets, lengths and addresses to
    ``ALIGN_BYTES``). Safe to use from several threads at once. Where O_DIRECT is refused
    (at open, or with EINVAL at the first request) and ``mode`` is auto, the file is read
    buffered instead. With ``dir_fd``, ``path`` is a name in that open directory; a
    symbolic link is never followed and only a regular file is read."""

    def __init__(self, path: str, mode: DirectMode = "auto", *, dir_fd: int | None = None) -> None:
        self.path, self._mode, self._dir_fd = path, mode, dir_fd
        self._lock = threading.Lock()
        self.direct = _want_direct(mode)
        self._fd = self._open()

    def _open(self) -> int:
        while True:
            try:
                fd = _open(self.path, READ_FLAGS, self.direct, self._dir_fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafePathError(
                        f"{os.path.basename(self.path)} is a symbolic link: not followed",
                        path=self.path,
                    ) from None
                if self.direct and e.errno == errno.EINVAL and self._mode == "auto":
                    self.direct = False
                    continue
                raise _io_error(e, self.path, "restore") from e
            try:
                check_regular(os.fstat(fd), self.path)  # never read a FIFO or device
            except BaseException:
                os.close(fd)
                raise
            return fd

    def read_into(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` with the bytes at ``offset``; returns how many there were (fewer only
        at the end of the file)."""
        done = 0
        while done < len(out):
            fd = self._fd
            try:
                n = os.preadv(fd, [out[done:]], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and self.direct and self._mode == "auto":
                    self._buffered(fd)  # O_DIRECT refused at the first request
                    continue
                raise _io_error(e, self.path, "restore") from e
            if n == 0:
                break
            done += n
        return done

    def _buffered(self, fd: int) -> None:
        with self._lock:
            if self._fd != fd or not self.direct:
                return  # another thread switched already
            self.direct = False
            self._fd = self._open()
        _note_fallback(self.path, OSError(errno.EINVAL, "Invalid argument"), self._dir_fd)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_file(
    path: str,
    view: memoryview,
    extents: Sequence[Extent],
    *,
    pool: Executor,
    direct: DirectMode = "auto",
    on_extent: Callable[[Extent], None] | None = None,
    dir_fd: int | None = None,
) -> IOResult:
    """Read every extent of ``path`` into the same range of ``view``, in parallel (with
    ``dir_fd``: ``path`` is a name in that open directory)."""
    t0 = time.perf_counter()
    with FileReader(path, direct, dir_fd=dir_fd) as reader:

        def job(extent: Extent) -> None:
            if reader.read_into(extent.start, view[extent.start : extent.end]) < extent.nbytes:
                raise CorruptCheckpointError(
                    f"{os.path.basename(path)} ends before byte {extent.end}, its recorded size",
                    path=path,
                )
            if on_extent is not None:
                on_extent(extent)

        _run_extents(pool, extents, job, midpoint=None)
        used_direct = reader.direct
    total = sum(e.nbytes for e in extents)
    return IOResult(nbytes=total, secs=time.perf_counter() - t0, direct=used_direct)
