"""payload: a rank's files as one stream of bytes, read, checked and written piece by piece.

A rank's *payload* (:class:`Layout`) is its files end to end, each at a 4 KiB-aligned offset
(the padding between them zeros): the unit the multi-level copies move. It is cut into
*pieces* (``Layout.pieces``: none longer than a piece, none across two files), the same on
every rank that computes them from the same manifest.

Call sequence (one thread, the copy's *stager*: see :mod:`pitstop.engine.transfer`)::

    reader = Reader(storage, directory, layout)   # reads ranges of the payload from files
    reader.read(start, buf); reader.close()
    checker = Checker(manifest, files)            # fed the payload's bytes in order
    checker.feed(start, buf)                      # raises CorruptCheckpointError at a mismatch
    checker.finish()
    sink = FileSink(storage, directory, layout, pieces, slots=3)   # starts its writer thread
    sink.put(k, fill)                             # piece k, filled in place in its ring
    error = sink.close()                          # every file durable, or the first error

The sink's writer thread writes each file whose size is a multiple of 4 KiB with
``Storage.write_data`` (its extents the pieces; O_DIRECT where the storage writes so; the
storage's writer threads start on a piece as soon as it is staged, and its place in the
ring is free again once it is written) and gathers any other file (an objects file:
metadata, bounded by ``IOOptions.max_metadata_bytes``) to write it whole with
``write_object``. The ring (:class:`~pitstop.engine.stage.Ring`, the save's) is all the
memory the sink holds.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from pitstop.engine.stage import Ring, arena_tensor
from pitstop.engine.verify import check_empty, segments_of
from pitstop.errors import CheckpointIOError, CorruptCheckpointError
from pitstop.format.checksum import get_checksum, get_hasher
from pitstop.format.manifest import FileEntry, Manifest
from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent
from pitstop.options import ALIGN_BYTES
from pitstop.storage.base import DataReader, Storage

__all__ = ["Checker", "FileSink", "Fill", "Layout", "Reader", "align", "zero"]

Fill = Callable[[memoryview], None]
"""``fill(buf)``: write the bytes of one piece into ``buf`` (its length is the piece's)."""


def align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


_ZEROS = memoryview(bytes(1 << 20))


def zero(view: memoryview) -> None:
    """Fill ``view`` with zeros (no buffer of its size is allocated)."""
    for at in range(0, len(view), len(_ZEROS)):
        n = min(len(_ZEROS), len(view) - at)
        view[at : at + n] = _ZEROS[:n]


@dataclass(frozen=True)
class Layout:
    """Files end to end at 4 KiB-aligned offsets: ``files`` are (name, nbytes, at)."""

    files: tuple[tuple[str, int, int], ...]

    @classmethod
    def of(cls, files: Iterable[tuple[str, int]]) -> Layout:
        """``files`` (name, nbytes) laid out in the order given."""
        out, at = [], 0
        for name, nbytes in files:
            out.append((name, nbytes, at))
            at += align(nbytes)
        return cls(tuple(out))

    @property
    def nbytes(self) -> int:
        """The payload's length, padding included."""
        return sum(align(n) for _, n, _ in self.files)

    def pieces(self, piece: int) -> list[Extent]:
        """The payload cut into pieces of at most ``piece`` bytes (a multiple of 4 KiB), none
        across two files; an empty file has none."""
        return [
            Extent(lo, min(lo + piece, at + align(nbytes)))
            for _, nbytes, at in self.files
            for lo in range(at, at + align(nbytes), piece)
        ]

    def count(self, piece: int) -> int:
        """How many pieces ``pieces(piece)`` cuts."""
        return sum(-(-align(nbytes) // piece) for _, nbytes, _ in self.files)


class Reader:
    """Ranges of a payload read from ``storage``'s files in ``directory``: each file's part
    straight into the caller's buffer (aligned requests, so O_DIRECT where the storage reads
    so), zeros for the padding and past the last file. A file shorter than the layout says
    is damage (CorruptCheckpointError)."""

    def __init__(self, storage: Storage, directory: str, layout: Layout) -> None:
        self.storage, self.directory, self.layout = storage, directory, layout
        self._starts = [at for _, _, at in layout.files]
        self._open: dict[str, DataReader] = {}

    def read(self, start: int, out: memoryview) -> None:
        """Bytes ``start``.. of the payload into ``out`` (``start`` a multiple of 4 KiB)."""
        end, at = start + len(out), start
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while at < end:
            if i >= len(self.layout.files) or at < self.layout.files[i][2]:
                stop = end if i >= len(self.layout.files) else min(end, self.layout.files[i][2])
                zero(out[at - start : stop - start])
                at = stop
                continue
            name, nbytes, base = self.layout.files[i]
            stop = min(end, base + align(nbytes))
            if at < stop:
                self._read_file(name, nbytes, at - base, out[at - start : stop - start])
                at = stop
            i += 1

    def _read_file(self, name: str, nbytes: int, offset: int, out: memoryview) -> None:
        """Bytes ``offset``.. of file ``name`` into ``out``, zeros past ``nbytes``."""
        want = max(0, min(len(out), nbytes - offset))
        if want:
            reader = self._open.get(name)
            if reader is None:
                reader = self._open[name] = self.storage.open_data(self.directory, name)
            span = len(out) if reader.direct else want  # aligned: within the padding
            got = reader.read_into(offset, out[:span])  # short only at the end of the file
            if got < want:
                raise CorruptCheckpointError(
                    f"{name} ends at byte {offset + got}, before its recorded size {nbytes}",
                    path=f"{self.storage.url}/{self.directory}/{name}", phase="verify",
                )  # fmt: skip
        zero(out[want:])

    def close(self) -> None:
        for reader in self._open.values():
            with contextlib.suppress(Exception):
                reader.close()
        self._open.clear()


class Checker:
    """The checksums of ``manifest`` over a payload of its ``files`` (each with its offset in
    the payload): every tensor's segments and an objects file's whole-file digest, checked on
    the bytes fed in payload order, each piece once."""

    def __init__(self, manifest: Manifest, files: Sequence[tuple[FileEntry, int]]) -> None:
        self._checksum = get_checksum(manifest.checksum_algorithm)
        self._new = get_hasher(manifest.checksum_algorithm)
        checks: list[tuple[int, int, str, str]] = []  # (start, length, digest, what)
        problems: list[str] = []
        for f, at in files:
            entries = [t for t in manifest.tensors if t.file == f.name]
            check_empty(manifest, entries, problems)
            for s, n, t, j in segments_of(entries, manifest.segment_bytes):
                checks.append((at + s, n, t.checksum[j], f"{f.name}: tensor {t.key!r} segment {j}"))
            if f.checksum is not None:
                checks.append((at, f.nbytes, f.checksum, f.name))
        self._checks = sorted(checks)
        self._i, self._pos = 0, 0
        self._hasher: Any = None
        self._what = "; ".join(problems)

    def feed(self, start: int, data: memoryview) -> None:
        """The next bytes of the payload, from ``start``; CorruptCheckpointError at the
        first checksum that differs."""
        if self._what:
            raise CorruptCheckpointError(self._what, phase="verify")
        if start != self._pos:
            raise ValueError(f"bytes fed out of order: {start}, expected {self._pos}")
        end = self._pos = start + len(data)
        while self._i < len(self._checks):
            s, n, want, what = self._checks[self._i]
            if s >= end:
                return
            lo, hi = max(s, start), min(s + n, end)
            if self._hasher is None and lo == s and hi == s + n:
                digest = self._checksum(data[lo - start : hi - start])
            else:
                self._hasher = self._hasher or self._new()
                self._hasher.update(data[lo - start : hi - start])
                if s + n > end:
                    return  # goes on in the next piece
                digest, self._hasher = self._hasher.hexdigest(), None
            if digest != want:
                raise CorruptCheckpointError(f"{what}: checksum mismatch", phase="verify")
            self._i += 1

    def finish(self) -> None:
        """Every checksum was checked (the payload was fed to its end)."""
        if self._what:
            raise CorruptCheckpointError(self._what, phase="verify")
        if self._i < len(self._checks):
            raise CorruptCheckpointError(f"{self._checks[self._i][3]}: never read", phase="verify")


class _FailFast(Executor):
    """The storage's writer pool for one sink: a request that fails fails the sink at once
    (a stager waiting for room in the ring would otherwise wait for the failed piece)."""

    def __init__(self, pool: Executor, on_error: Callable[[BaseException], None]) -> None:
        self._pool, self._on_error = pool, on_error

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = self._pool.submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        error = future.exception()
        if error is not None:
            self._on_error(error)


class _Shifted:
    """A file's bytes where the ring stages them (``view[a:b]`` of the file)."""

    def __init__(self, ring: Ring, at: int) -> None:
        self._ring, self._at = ring, at

    def __getitem__(self, key: slice) -> memoryview:
        return self._ring[slice(key.start + self._at, key.stop + self._at)]


class FileSink:
    """Writes a payload's files into ``directory`` of ``storage`` as its pieces are staged,
    through a ring of ``slots`` pieces (see the module docstring)."""

    def __init__(
        self, storage: Storage, directory: str, layout: Layout, pieces: Sequence[Extent],
        *, slots: int,
    ) -> None:  # fmt: skip
        self.storage, self.directory, self.layout = storage, directory, layout
        self.pieces = list(pieces)
        largest = max((e.nbytes for e in self.pieces), default=ALIGN_BYTES)
        total = sum(e.nbytes for e in self.pieces)  # a small payload: no more than it
        self._arena = Arena(max(largest, min(max(1, slots) * largest, total)))
        self._ring: Ring | None = Ring(
            tuple(self.pieces), arena_tensor(self._arena), self._arena.view
        )
        self._starts = [e.start for e in self.pieces]
        self._released: set[int] = set()
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._request_error: BaseException | None = None  # a write request's, as it failed
        self._pool = ThreadPoolExecutor(storage.io.threads, thread_name_prefix="pitstop-copy")
        self._thread = threading.Thread(target=self._write_all, name="pitstop-copy", daemon=True)
        self._thread.start()

    @property
    def ring(self) -> Ring:
        assert self._ring is not None, "the sink is closed"
        return self._ring

    def put(self, k: int, fill: Fill) -> None:
        """Stager: wait until piece ``k``'s place in the ring is free, ``fill`` it there,
        hand it to the writers. Raises the sink's first error once it failed."""
        e = self.pieces[k]
        try:
            self.ring.stage(k, lambda _: fill(self.ring[e.start : e.end]))
        except BaseException as err:
            if self._request_error is not None:  # a write request failed (several may, each
                self._thread.join()  # with its own error): the storage's own error
            raise self.error or err from None  # (CheckpointIOError, named by file) once the
            # writer thread has it

    def fail(self, error: BaseException) -> None:
        """No more pieces will come: the writers stop (the files stay as they are)."""
        with self._lock:
            if self.error is None:
                self.error = error
        self.ring.fail(error)

    def _request_failed(self, error: BaseException) -> None:
        """A writer thread's request failed: nothing waits for the ring any more (the piece
        it wrote is never released); the writer thread raises the storage's error."""
        with self._lock:
            if self._request_error is None:
                self._request_error = error
        self.ring.fail(error)

    def close(self) -> BaseException | None:
        """Wait for the writer thread (every file durable, or a failure); free the ring.
        The first error, if any."""
        self._thread.join()
        self._pool.shutdown(wait=True)
        self._ring = None
        self._arena.close()
        return self.error

    # ------------------------------------------------------------------ writer thread
    def _write_all(self) -> None:
        try:
            for name, nbytes, at in self.layout.files:
                lo = bisect.bisect_left(self._starts, at)
                hi = bisect.bisect_left(self._starts, at + align(nbytes))
                if nbytes and nbytes % ALIGN_BYTES == 0:
                    self._write_data(name, at, range(lo, hi))
                else:
                    self._gather(name, nbytes, at, range(lo, hi))
        except BaseException as e:
            self.fail(e)

    def _write_data(self, name: str, at: int, ks: range) -> None:
        extents = [Extent(self.pieces[k].start - at, self.pieces[k].end - at) for k in ks]

        def before(e: Extent) -> None:  # a request again (a retry, a fallback to buffered
            k = bisect.bisect_right(self._starts, e.start + at) - 1  # I/O): its bytes are gone
            if k in self._released:
                raise CheckpointIOError(
                    f"{name}: bytes {e.start}-{e.end} cannot be written again: they streamed "
                    "through (O_DIRECT refused after the first request, or a retried write)",
                    path=f"{self.storage.url}/{self.directory}/{name}", phase="persist",
                )  # fmt: skip
            self.ring.wait_staged(self.pieces[k])

        def after(e: Extent) -> None:
            k = bisect.bisect_right(self._starts, e.start + at) - 1
            self._released.add(k)
            self.ring.release(self.pieces[k])

        self.storage.write_data(
            self.directory, name, cast(memoryview, _Shifted(self.ring, at)), extents,
            pool=_FailFast(self._pool, self._request_failed), before_extent=before,
            on_extent=after,
        )  # fmt: skip

    def _gather(self, name: str, nbytes: int, at: int, ks: range) -> None:
        buf = bytearray(nbytes)
        for k in ks:
            e = self.pieces[k]
            self.ring.wait_staged(e)
            n = min(e.end, at + nbytes) - e.start
            if n > 0:
                buf[e.start - at : e.start - at + n] = self.ring[e.start : e.start + n]
            self.ring.release(e)
        self.storage.write_object(self.directory, name, memoryview(buf))
