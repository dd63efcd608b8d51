"""Shared-memory slots: names, constants and the sealed header. No torch.

Part of :mod:`pitstop.levels.shm` (which re-exports every public name here): the segment
names of a job (``pitstop-mem-<job>-r<rank>-s<index>``, ``...-r<rank>.lock``) and the
slot header, written to two pages alternately, each sealed by a CRC (``write_header``);
``read_header`` takes the valid page with the higher ``seq``, so a write torn by a crash
reads as the state before it.

Call sequence: any thread of the training process or the keeper; ``write_header`` only by
the holder of the slot file's flock (exclusive), or by its creator.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import time
import zlib
from dataclasses import asdict, dataclass

from pitstop.errors import CheckpointIOError

__all__ = [
    "COMMITTED",
    "DATA_OFFSET",
    "EMPTY",
    "HEADER_PAGE",
    "HEADER_VERSION",
    "JOB_TOKEN",
    "MAGIC",
    "PREFIX",
    "SHM_DIR",
    "STAGED",
    "STAGING",
    "SlotHeader",
    "boot_id",
    "job_token",
    "lock_name",
    "new_job_token",
    "parse_segment_name",
    "read_header",
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
JOB_TOKEN = re.compile(r"[A-Za-z0-9_]{1,64}")  # what a job token may be
_NAME = re.compile(r"pitstop-mem-([A-Za-z0-9_]{1,64})-r([0-9]{5,})(?:-s([0-9]+)|\.lock)")


def new_job_token() -> str:
    """A fresh job token (a launcher passes the same one to every restart of a job)."""
    return os.urandom(8).hex()


def job_token(next_url: str) -> str:
    """The memory level's default job token: the same for every restart of a job that
    writes to the same next level (its path) as the same user, and distinct for two jobs
    that do not (``pitstop ls`` finds a directory's memory snapshots by it)."""
    key = f"{os.getuid() if hasattr(os, 'getuid') else 0}:{next_url}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def boot_id() -> str:
    """This boot's id (a segment of another boot is stale whatever its pid says)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _check_job(job: str) -> str:
    if not JOB_TOKEN.fullmatch(job):
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
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if (m := _NAME.fullmatch(n)) and m.group(1) == job)


def parse_segment_name(name: str) -> tuple[str, int, int | None] | None:
    """(job, rank, slot index) of a segment name (index None: the lock file); None if
    ``name`` is no segment of pitstop's."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    return m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3))


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
