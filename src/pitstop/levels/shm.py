"""Shared-memory slots: memory checkpoints that outlive the training process (not the node).

A job's rank owns a *slot set* under ``/dev/shm``: at least two slot files and one owner
lock file, all named after the job's token (two jobs on one node never open each other's
segments; the header repeats the token and it is checked)::

    pitstop-mem-<job>-r00000.lock     held (flock, shared) by the training process and its
                                      keeper while they live; owner host/pid/boot id in it
    pitstop-mem-<job>-r00000-s0       slot 0: [header A][header B][.. 2 MiB][data][meta]
    pitstop-mem-<job>-r00000-s1       slot 1

A slot's *data region* starts at ``DATA_OFFSET`` (2 MiB, so the region can be huge-page
aligned) and is laid out byte for byte as the rank's data file (tensors at 4 KiB-aligned
offsets): the staging arena lives in it (:class:`Slot` has the ``view``/``nbytes`` of an
:class:`pitstop.io.arena.Arena`), so the arena *is* the memory checkpoint. After the data
comes the *meta region*: the staging record (the plan as JSON, see
:func:`pitstop.levels.memory.record_for`), the objects file, and after sealing the
manifest. A committed slot is a complete checkpoint in pitstop's format.

The header (magic, version, job token, rank, owner host/pid/boot id, state, step,
generation, sizes) is written to two pages alternately, each sealed by a CRC; a reader
takes the valid page with the higher sequence number, so a header torn by a crash reads as
the state before it (a torn commit reads as not committed). States::

    empty -> staging -> staged -> committed -> staging (reused) ...

``staging``: bytes are being copied in (the training process holds the slot file's flock
exclusively). ``staged``: a consistent snapshot, not yet hashed. ``committed``: every
checksum recorded and the manifest written (``seal``). The newest committed slot is never
reused while another one is free; a slot that a reader pins (flock shared: the keeper
persisting it, a restore reading it) is never staged into.

Call sequence (training thread; the keeper in its own process)::

    slots = SlotSet.create(job, data_bytes=n, count=2)   # fallocate: no SIGBUS later
    slot = slots.begin(step)                             # None: every other slot is busy
    ... copy into slot.view (engine.stage) ...
    slots.staged(slot, record, objects)                  # the snapshot is consistent
    seal(slot) / keeper.request_seal(slot.index)         # hashes, manifest, commit
    slots.close(unlink=True)

    remove_stale(directory)                              # any process: dead jobs' segments
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import re
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, replace
from typing import Any

from pitstop.errors import CheckpointError, CheckpointIOError, CorruptCheckpointError
from pitstop.format.checksum import get_checksum, segments
from pitstop.format.manifest import FileEntry, Lineage, Manifest, TensorEntry
from pitstop.format.names import data_file_name, objects_file_name
from pitstop.options import ALIGN_BYTES

__all__ = [
    "COMMITTED",
    "DATA_OFFSET",
    "EMPTY",
    "PREFIX",
    "SHM_DIR",
    "STAGED",
    "STAGING",
    "ShmSpaceError",
    "Slot",
    "SlotHeader",
    "SlotSet",
    "boot_id",
    "hold_job_lock",
    "iter_slots",
    "lock_name",
    "manifest_of",
    "new_job_token",
    "open_slot",
    "read_header",
    "read_meta",
    "remove_job",
    "remove_stale",
    "seal",
    "segment_names",
    "slot_name",
    "write_header",
]

SHM_DIR = "/dev/shm"
PREFIX = "pitstop-mem-"
MAGIC = b"PITSTOPM"
HEADER_VERSION = 1
HEADER_PAGE = 4096
DATA_OFFSET = 2 << 20
EMPTY, STAGING, STAGED, COMMITTED = "empty", "staging", "staged", "committed"
_STATES = (EMPTY, STAGING, STAGED, COMMITTED)
_HEAD = struct.Struct("<8sIII")  # magic, version, body length, crc32 of version+length+body
_JOB = re.compile(r"[A-Za-z0-9_]{1,64}")
_NAME = re.compile(r"pitstop-mem-([A-Za-z0-9_]{1,64})-r([0-9]{5,})(?:-s([0-9]+)|\.lock)")
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23


class ShmSpaceError(CheckpointIOError):
    """Shared memory is too small or full for a slot (found at allocation, never a SIGBUS)."""


def new_job_token() -> str:
    """A fresh job token (a launcher passes the same one to every restart of a job)."""
    return os.urandom(8).hex()


def boot_id() -> str:
    """This boot's id (a segment of another boot is stale whatever its pid says)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _check_job(job: str) -> str:
    if not _JOB.fullmatch(job):
        raise ValueError(f"job token {job!r}: 1-64 letters, digits or underscores")
    return job


def slot_name(job: str, rank: int, index: int) -> str:
    return f"{PREFIX}{_check_job(job)}-r{rank:05d}-s{index}"


def lock_name(job: str, rank: int) -> str:
    return f"{PREFIX}{_check_job(job)}-r{rank:05d}.lock"


def segment_names(directory: str, job: str) -> list[str]:
    """Every segment (slots and lock files, any rank) of ``job`` under ``directory``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if (m := _NAME.fullmatch(n)) and m.group(1) == job)


# ---------------------------------------------------------------------- header
@dataclass(frozen=True)
class SlotHeader:
    """One slot's state. ``gen`` orders commits across the set (newest: highest);
    ``seq`` orders header writes of this slot (which of the two pages is current)."""

    job: str
    rank: int
    index: int
    host: str
    pid: int
    boot: str
    state: str = EMPTY
    step: int | None = None
    gen: int = 0
    seq: int = 0
    data_bytes: int = 0  # capacity of the data region
    file_bytes: int = 0  # length of the data file staged in it
    meta_offset: int = 0
    record_bytes: int = 0
    objects_bytes: int = 0
    manifest_bytes: int = 0
    meta_crc: int = 0  # crc32 of record + objects (+ manifest once committed)

    def encode(self) -> bytes:
        body = json.dumps(asdict(self), separators=(",", ":")).encode()
        if _HEAD.size + len(body) > HEADER_PAGE:
            raise ValueError("slot header too long")
        crc = zlib.crc32(struct.pack("<II", HEADER_VERSION, len(body)) + body)
        raw = _HEAD.pack(MAGIC, HEADER_VERSION, len(body), crc) + body
        return raw.ljust(HEADER_PAGE, b"\0")


def _decode(page: bytes) -> SlotHeader | None:
    """The header in ``page``, or None if it is not a whole, sealed one."""
    if len(page) < _HEAD.size:
        return None
    magic, version, length, crc = _HEAD.unpack_from(page)
    if magic != MAGIC or version != HEADER_VERSION or length > HEADER_PAGE - _HEAD.size:
        return None
    body = page[_HEAD.size : _HEAD.size + length]
    if zlib.crc32(struct.pack("<II", version, length) + body) != crc:
        return None
    try:
        header = SlotHeader(**json.loads(body))
    except (ValueError, TypeError):
        return None
    return header if header.state in _STATES else None


def read_header(fd: int, *, retries: int = 3) -> SlotHeader | None:
    """The current header of the slot file ``fd`` (the valid page with the higher ``seq``);
    None if neither page is valid (a read racing a write is retried first)."""
    for attempt in range(retries):
        pages = [_decode(os.pread(fd, HEADER_PAGE, i * HEADER_PAGE)) for i in range(2)]
        valid = [h for h in pages if h is not None]
        if valid:
            return max(valid, key=lambda h: h.seq)
        if attempt + 1 < retries:
            time.sleep(0.001)
    return None


def write_header(fd: int, header: SlotHeader) -> None:
    """Write ``header`` over the older page (its ``seq`` picks the page)."""
    data = header.encode()
    if os.pwrite(fd, data, (header.seq % 2) * HEADER_PAGE) != len(data):
        raise CheckpointIOError("short write of a slot header", errno=errno.EIO, phase="stage")


# ---------------------------------------------------------------------- slots
def _fallocate(fd: int, offset: int, nbytes: int, path: str, limit: int | None) -> None:
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
        return Slot(path, fd, header.index, header.data_bytes, writable=writable, populate=populate)
    except BaseException:
        os.close(fd)
        raise


def _owner(job: str) -> dict[str, Any]:
    return {"job": job, "host": socket.gethostname(), "pid": os.getpid(), "boot": boot_id()}


def hold_job_lock(directory: str, job: str, rank: int) -> int:
    """Open (creating) the job's lock file and hold it shared; returns the fd (closing it
    lets go). Retries if a cleanup removed the file meanwhile."""
    path = os.path.join(directory, lock_name(job, rank))
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise CheckpointError(f"cannot hold {path}", path=path, phase="stage")


class SlotSet:
    """The slots of one job's rank on this node (see the module docstring)."""

    def __init__(self, directory: str, job: str, rank: int, slots: list[Slot], lock_fd: int):
        self.directory, self.job, self.rank = directory, job, rank
        self.slots, self._lock_fd = slots, lock_fd
        self._owner = _owner(job)

    @classmethod
    def create(
        cls,
        job: str,
        *,
        data_bytes: int,
        count: int = 2,
        rank: int = 0,
        directory: str = SHM_DIR,
        limit_bytes: int | None = None,
    ) -> SlotSet:
        """Allocate ``count`` (>= 2) empty slots of ``data_bytes`` each (rounded up to 4 KiB);
        ShmSpaceError if shared memory cannot hold them (``limit_bytes``: a budget for the
        whole set, below what /dev/shm has). Existing segments of ``job`` are replaced."""
        if count < 2:
            raise ValueError("a slot set needs at least 2 slots")
        size = max(ALIGN_BYTES, -(-data_bytes // ALIGN_BYTES) * ALIGN_BYTES)
        lock_fd = hold_job_lock(directory, job, rank)
        os.pwrite(lock_fd, json.dumps(_owner(job)).encode().ljust(512), 0)
        slots: list[Slot] = []
        try:
            for i in range(count):
                path = os.path.join(directory, slot_name(job, rank, i))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    budget = None if limit_bytes is None else limit_bytes - i * (DATA_OFFSET + size)
                    _fallocate(fd, 0, DATA_OFFSET + size, path, budget)
                    o = _owner(job)
                    head = SlotHeader(job, rank, i, o["host"], o["pid"], o["boot"], data_bytes=size)
                    write_header(fd, head)
                    slots.append(Slot(path, fd, i, size))
                except BaseException:
                    os.close(fd)
                    os.unlink(path)
                    raise
        except BaseException:
            for s in slots:
                s.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(s.path)
            os.close(lock_fd)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, lock_name(job, rank)))
            raise
        return cls(directory, job, rank, slots, lock_fd)

    @classmethod
    def attach(cls, job: str, *, rank: int = 0, directory: str = SHM_DIR) -> SlotSet | None:
        """The existing slots of ``job`` (a restarted training process); None if there are
        none. A staged snapshot newer than every committed one is sealed first
        (:meth:`seal_pending`)."""
        paths = []
        for name in segment_names(directory, job):
            m = _NAME.fullmatch(name)
            if m is not None and m.group(3) is not None and int(m.group(2)) == rank:
                paths.append(os.path.join(directory, name))
        if not paths:
            return None
        lock_fd = hold_job_lock(directory, job, rank)
        os.pwrite(lock_fd, json.dumps(_owner(job)).encode().ljust(512), 0)  # adopted: ours now
        slots: list[Slot] = []
        try:
            for p in paths:  # a slot without a valid header (torn twice) is left out
                with contextlib.suppress(FileNotFoundError, CheckpointError):
                    slots.append(open_slot(p, job=job, rank=rank))
        except BaseException:
            for s in slots:
                s.close()
            os.close(lock_fd)
            raise
        slots.sort(key=lambda s: s.index)
        found = cls(directory, job, rank, slots, lock_fd)
        found.seal_pending()
        return found

    def seal_pending(self) -> list[SlotHeader]:
        """Seal every staged snapshot newer than the newest committed one (left by a trainer
        that died before its keeper sealed it, or that had no keeper): it is the newest
        consistent state, and until it is sealed ``begin`` must not overwrite it."""
        newest = self.newest()
        top = newest[1].gen if newest is not None else -1
        done = []
        for slot, head in zip(self.slots, self.headers(), strict=True):
            if head is not None and head.state == STAGED and head.gen > top:
                with contextlib.suppress(CorruptCheckpointError):  # damaged: never committed
                    sealed = seal(slot)
                    if sealed is not None:
                        done.append(sealed)
        return done

    def headers(self) -> list[SlotHeader | None]:
        return [s.header() for s in self.slots]

    def newest(self, state: str = COMMITTED) -> tuple[Slot, SlotHeader] | None:
        """The slot in ``state`` with the highest generation."""
        found = [(s, h) for s, h in zip(self.slots, self.headers(), strict=True) if h]
        found = [(s, h) for s, h in found if h.state == state]
        return max(found, key=lambda sh: sh[1].gen) if found else None

    def begin(self, step: int) -> Slot | None:
        """A slot to stage ``step`` into, held exclusively, its header ``staging``: never the
        newest committed one, never one a reader pins, never a staged snapshot newer than
        every committed one (it awaits its seal: overwritten, a crash in the copy would
        fall back two steps). None when no slot is free: the caller skips this memory
        checkpoint (the keeper's sealing throttles how often one is taken)."""
        heads = self.headers()
        newest = self.newest()
        top = newest[1].gen if newest is not None else -1
        gen = max((h.gen for h in heads if h is not None), default=0) + 1
        order = sorted(
            (
                i
                for i in range(len(self.slots))
                if (newest is None or self.slots[i] is not newest[0])
                and not (_state(heads[i]) == STAGED and _gen(heads[i]) > top)
            ),
            key=lambda i: (_state(heads[i]) == COMMITTED, _gen(heads[i])),
        )  # empty, torn, older staged first; then the oldest committed
        for i in order:
            slot = self.slots[i]
            if not slot.try_lock(exclusive=True):
                continue
            now = self.newest()  # the keeper may have sealed it since the look above
            if now is not None and now[0] is slot:
                slot.unlock()
                continue
            head = slot.header() or SlotHeader(self.job, self.rank, slot.index, "", 0, "")
            o = self._owner
            write_header(slot.fd, replace(
                head, host=o["host"], pid=o["pid"], boot=o["boot"], state=STAGING, step=step,
                gen=gen, seq=head.seq + 1, data_bytes=slot.nbytes, file_bytes=0,
                record_bytes=0, objects_bytes=0, manifest_bytes=0, meta_crc=0,
            ))  # fmt: skip
            return slot
        return None

    def staged(self, slot: Slot, record: bytes, objects: bytes, file_bytes: int) -> None:
        """The snapshot in ``slot`` is consistent: write its record and objects after the
        data, mark it ``staged`` and let go of it (the keeper or :func:`seal` commits it)."""
        if file_bytes > slot.nbytes:
            raise CheckpointError(f"{file_bytes} bytes do not fit a {slot.nbytes}-byte slot")
        head = slot.header()
        assert head is not None and head.state == STAGING, head
        meta_offset = DATA_OFFSET + slot.nbytes
        _write_meta(slot, meta_offset, record + objects)
        write_header(slot.fd, replace(
            head, state=STAGED, seq=head.seq + 1, file_bytes=file_bytes, meta_offset=meta_offset,
            record_bytes=len(record), objects_bytes=len(objects),
            meta_crc=zlib.crc32(record + objects),
        ))  # fmt: skip
        slot.unlock()

    def abandon(self, slot: Slot) -> None:
        """A staging that failed: the slot is empty again and let go."""
        head = slot.header()
        if head is not None:
            write_header(slot.fd, replace(head, state=EMPTY, step=None, seq=head.seq + 1))
        slot.unlock()

    def close(self, *, unlink: bool = False) -> None:
        """Unmap; ``unlink``: remove the job's segments of this rank (the memory checkpoints
        are gone)."""
        for s in self.slots:
            s.close()
        if unlink:
            for s in self.slots:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(s.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, lock_name(self.job, self.rank)))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _gen(h: SlotHeader | None) -> int:
    return -1 if h is None else h.gen


def _state(h: SlotHeader | None) -> str:
    return EMPTY if h is None else h.state


def _write_meta(slot: Slot, offset: int, data: bytes) -> None:
    """Append ``data`` at ``offset`` of the slot file, space reserved first (ENOSPC here)."""
    _fallocate(slot.fd, offset, max(len(data), 1), slot.path, None)
    view = memoryview(data)
    while view:
        n = os.pwrite(slot.fd, view, offset)
        view, offset = view[n:], offset + n


# ---------------------------------------------------------------------- seal and read
def read_meta(slot: Slot, head: SlotHeader) -> tuple[bytes, bytes, bytes]:
    """(record, objects, manifest) of a staged or committed slot; CorruptCheckpointError if
    they do not match the header's CRC."""
    n = head.record_bytes + head.objects_bytes + head.manifest_bytes
    raw = os.pread(slot.fd, n, head.meta_offset)
    if len(raw) != n or zlib.crc32(raw) != head.meta_crc:
        raise CorruptCheckpointError(
            f"the metadata of slot {slot.index} (step {head.step}) is damaged",
            step=head.step, path=slot.path, phase="verify",
        )  # fmt: skip
    a, b = head.record_bytes, head.record_bytes + head.objects_bytes
    return raw[:a], raw[a:b], raw[b:]


def seal(slot: Slot, *, pool: Executor | None = None, hold: bool = False) -> SlotHeader | None:
    """Commit a staged slot: hash every checksum segment of its data, write the manifest
    after its objects, then flip the header to ``committed`` (one sealed page write). The
    keeper calls it (or the training process, without a keeper). Returns the committed
    header, or None if the slot is not staged or another process holds it. ``hold``: the
    caller already holds the slot's flock exclusively."""
    if not hold and not slot.try_lock(exclusive=True):
        return None
    try:
        head = slot.header()
        if head is None or head.state != STAGED:
            return None
        record, objects, _ = read_meta(slot, head)
        manifest = manifest_of(json.loads(record), slot.view, objects, pool=pool)
        data = manifest.dumps()
        Manifest.loads(data, path=slot.path)  # what no reader would accept is never committed
        at = head.meta_offset + head.record_bytes + head.objects_bytes
        _write_meta(slot, at, data)
        committed = replace(
            head, state=COMMITTED, seq=head.seq + 1, manifest_bytes=len(data),
            meta_crc=zlib.crc32(record + objects + data),
        )  # fmt: skip
        write_header(slot.fd, committed)
        return committed
    finally:
        if not hold:
            slot.unlock()


def _hash_all(
    view: memoryview, spans: list[tuple[int, int]], algorithm: str, pool: Executor | None
) -> list[str]:
    fn = get_checksum(algorithm)
    if pool is None:
        return [fn(view[a : a + n]) for a, n in spans]
    return list(pool.map(lambda s: fn(view[s[0] : s[0] + s[1]]), spans))


def manifest_of(
    record: dict[str, Any], view: memoryview, objects: bytes, *, pool: Executor | None = None
) -> Manifest:
    """The manifest of a staged snapshot: its record (the plan) plus the checksum of every
    segment of ``view`` and of ``objects``."""
    algorithm, seg = record["algorithm"], record["segment_bytes"]
    rank, file_bytes = record["rank"], record["file_bytes"]
    items = record["items"]
    spans = [
        span
        for it in items
        for span in segments(it["offset"], it["nbytes"], seg)
        if it["nbytes"]
    ]  # fmt: skip
    sums = iter(_hash_all(view, spans, algorithm, pool))
    empty = get_checksum(algorithm)(b"")
    data_name = data_file_name(rank)
    tensors = tuple(
        TensorEntry(
            key=it["key"], dtype=it["dtype"], shape=tuple(it["shape"]), file=data_name,
            offset=it["offset"], nbytes=it["nbytes"],
            checksum=(empty,) if not it["nbytes"] else tuple(
                next(sums) for _ in segments(it["offset"], it["nbytes"], seg)
            ),
            rank=rank, global_shape=_tup(it.get("global_shape")), start=_tup(it.get("start")),
            owner=it.get("owner"),
        )
        for it in items
    )  # fmt: skip
    files = (
        FileEntry(data_name, rank, file_bytes, stream_nbytes=record.get("stream_nbytes")),
        FileEntry(objects_file_name(rank), rank, len(objects), get_checksum(algorithm)(objects)),
    )
    lineage = record.get("lineage")
    return Manifest(
        step=record["step"], created_unix_secs=record["created"],
        world_size=record["world_size"], checksum_algorithm=algorithm, segment_bytes=seg,
        files=files, tensors=tensors, library=record.get("library", {}),
        topology={"world_size": record["world_size"], "hosts": record.get("hosts", [])},
        lineage=Lineage(**lineage) if lineage else None, metrics=record.get("metrics", {}),
    )  # fmt: skip


def _tup(v: Any) -> tuple[int, ...] | None:
    return None if v is None else tuple(int(x) for x in v)


# ---------------------------------------------------------------------- cleanup
def _jobs(directory: str) -> dict[tuple[str, int], list[str]]:
    """Segments under ``directory`` by (job, rank)."""
    out: dict[tuple[str, int], list[str]] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            m = _NAME.fullmatch(name)
            if m is not None:
                out.setdefault((m.group(1), int(m.group(2))), []).append(name)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(directory: str, job: str, rank: int, names: list[str]) -> Callable[[], None] | None:
    """If the segments of (job, rank) belong to no living process, a function that removes
    them (it must be called at once: it holds the job's lock until it is done)."""
    path = os.path.join(directory, lock_name(job, rank))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = -1
    if fd >= 0:  # the lock says it: flocks die with their holders (pids are reused)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # a living training process or keeper holds it
    else:  # no lock file (removed by hand, or a crash while creating): the slots' owners say
        for name in names:
            with contextlib.suppress(OSError):
                sfd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    h = read_header(sfd, retries=1)
                finally:
                    os.close(sfd)
                if h is not None and h.boot == boot_id() and _pid_alive(h.pid):
                    return None

    def remove() -> None:
        try:
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
        finally:
            if fd >= 0:
                os.close(fd)

    return remove


def remove_stale(directory: str = SHM_DIR, *, keep: str | None = None) -> list[str]:
    """Remove the segments of every job whose processes are all dead: nobody holds its lock
    file (flocks die with their holders, in any boot), or, without a lock file, its slots'
    owner pid is gone or was written in another boot. ``keep``: a job token never touched.
    Returns the names removed."""
    removed: list[str] = []
    for (job, rank), names in sorted(_jobs(directory).items()):
        if job == keep:
            continue
        remove = _stale(directory, job, rank, names)
        if remove is not None:
            remove()
            removed += sorted(names)
    return removed


def remove_job(directory: str, job: str) -> list[str]:
    """Remove every segment of ``job`` (its keeper, at the end of the job)."""
    names = segment_names(directory, job)
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    return names


def iter_slots(directory: str, job: str, rank: int) -> Iterator[str]:
    """Paths of the slot files of (job, rank)."""
    for name in segment_names(directory, job):
        m = _NAME.fullmatch(name)
        if m is not None and m.group(3) is not None and int(m.group(2)) == rank:
            yield os.path.join(directory, name)
