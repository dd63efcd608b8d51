"""Shared-memory slots: one slot file, mapped (:class:`Slot`), and the reservation of its
bytes. No torch.

Part of :mod:`pitstop.levels.shm` (which re-exports ``Slot`` and ``open_slot``). Every
byte of a slot is reserved with ``posix_fallocate`` before it is used (:func:`reserve`,
:func:`write_meta`): shared memory that is too small or full raises
:class:`pitstop.errors.ShmSpaceError` there (re-exported here and by ``levels.shm``), never
a SIGBUS at the first copy.

Call sequence: :class:`pitstop.levels.shm.SlotSet` creates and opens the slots of its
training process; readers (``SlotStorage``, the keeper) call :func:`open_slot`;
:func:`write_meta` is called by the holder of the slot's flock (exclusive).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os

from pitstop.errors import CheckpointError, ShmSpaceError
from pitstop.levels.shm_header import DATA_OFFSET, SlotHeader, parse_segment_name, read_header

__all__ = ["ShmSpaceError", "Slot", "open_slot", "reserve", "write_meta"]

_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23


def reserve(fd: int, offset: int, nbytes: int, path: str, limit: int | None) -> None:
    """Reserve the bytes now: ENOSPC here, not a SIGBUS at the first copy."""
    if limit is not None and offset + nbytes > limit:
        raise ShmSpaceError(
            f"shared memory for a {offset + nbytes}-byte slot exceeds the limit of {limit} "
            f"bytes: {path}",
            errno=errno.ENOSPC, path=path, phase="stage",
        )  # fmt: skip
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as e:
        free = _free_bytes(os.path.dirname(path))
        raise ShmSpaceError(
            f"cannot reserve {nbytes} bytes of shared memory for {path} "
            f"({e.strerror or e}; {free} bytes free in {os.path.dirname(path)}): give the "
            "memory level less state, more /dev/shm, or fewer slots",
            errno=e.errno, path=path, phase="stage",
        ) from e  # fmt: skip


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


class Slot:
    """One slot file, mapped. Arena-like (``view``, ``nbytes``, ``pinned``, ``close``): the
    engine stages into ``view`` exactly as into an arena."""

    def __init__(
        self,
        path: str,
        fd: int,
        index: int,
        data_bytes: int,
        *,
        writable: bool = True,
        populate: bool = True,
    ) -> None:
        self.path, self.fd, self.index, self.writable = path, fd, index, writable
        self.pinned = False
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm: mmap.mmap | None = mmap.mmap(
            fd, DATA_OFFSET + data_bytes, flags=mmap.MAP_SHARED, prot=prot
        )
        if writable and populate:  # staged into: every page mapped now, not at first copies
            self.populate(data_bytes)
        self.nbytes = data_bytes
        self.view = memoryview(self._mm)[DATA_OFFSET : DATA_OFFSET + data_bytes]

    @property
    def closed(self) -> bool:
        return self._mm is None

    def populate(self, nbytes: int, *, write: bool | None = None) -> None:
        """Map the first ``nbytes`` of the data region now (one call, not a fault a page),
        for writing (default: if the mapping is writable) or for reading."""
        write = self.writable if write is None else write
        advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
        if self._mm is not None and nbytes > 0:
            with contextlib.suppress(OSError, ValueError):  # kernels before 5.14: faults
                self._mm.madvise(advice, DATA_OFFSET, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)

    def header(self) -> SlotHeader | None:
        return read_header(self.fd)

    def try_lock(self, *, exclusive: bool) -> bool:
        """flock this slot's file (this process's own open file) without waiting."""
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._mm is None:
            return
        self.view.release()
        mm, self._mm = self._mm, None
        with contextlib.suppress(BufferError):  # a tensor still views it: goes with it
            mm.close()
        os.close(self.fd)

    def __repr__(self) -> str:
        return f"Slot({self.path!r}, nbytes={self.nbytes})"


def open_slot(
    path: str, *, job: str, rank: int, writable: bool = True, populate: bool = True
) -> Slot:
    """Map an existing slot file; its header must name ``job`` and ``rank`` (else
    CheckpointError: never another job's segment). ``populate=False``: pages are mapped as
    they are first touched (a reader that may touch only part of it)."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags)
    try:
        header = read_header(fd)
        if header is None or header.job != job or header.rank != rank:
            raise CheckpointError(
                f"{path} is not a slot of job {job} rank {rank}", path=path, phase="restore"
            )
        named = parse_segment_name(os.path.basename(path))
        if named is not None and named[2] is not None and named[2] != header.index:
            raise CheckpointError(  # renamed: the trainer and its keeper would disagree on
                # which slot is which (the name says one, the header another)
                f"{path} is named slot {named[2]} but its header says slot {header.index}",
                path=path, phase="restore",
            )  # fmt: skip
        return Slot(path, fd, header.index, header.data_bytes, writable=writable, populate=populate)
    except BaseException:
        os.close(fd)
        raise


def write_meta(slot: Slot, offset: int, data: bytes) -> None:
    """Append ``data`` at ``offset`` of the slot file, space reserved first (ENOSPC here)."""
    reserve(slot.fd, offset, max(len(data), 1), slot.path, None)
    view = memoryview(data)
    while view:
        n = os.pwrite(slot.fd, view, offset)
        view, offset = view[n:], offset + n
