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

This module holds the slot set (allocation, ``begin`` / ``staged`` / ``abandon``, the
owner's lock file) and re-exports the rest: names and the header (:mod:`.shm_header`),
one mapped slot (:mod:`.shm_slot`), sealing (:mod:`.shm_seal`), stale-segment cleanup
(:mod:`.shm_clean`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import zlib
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from pitstop.errors import CheckpointError, CorruptCheckpointError, ShmSpaceError
from pitstop.levels.shm_clean import iter_slots, remove_job, remove_stale
from pitstop.levels.shm_header import (
    COMMITTED,
    DATA_OFFSET,
    EMPTY,
    HEADER_PAGE,
    PREFIX,
    SHM_DIR,
    STAGED,
    STAGING,
    SlotHeader,
    boot_id,
    job_token,
    lock_name,
    new_job_token,
    read_header,
    segment_names,
    slot_name,
    write_header,
)
from pitstop.levels.shm_seal import commit_copy, manifest_of, read_meta, seal
from pitstop.levels.shm_slot import Slot, open_slot, reserve, write_meta
from pitstop.options import ALIGN_BYTES

__all__ = [
    "COMMITTED",
    "DATA_OFFSET",
    "EMPTY",
    "HEADER_PAGE",
    "META_RESERVE",
    "PREFIX",
    "SHM_DIR",
    "STAGED",
    "STAGING",
    "ShmSpaceError",
    "Slot",
    "SlotHeader",
    "SlotSet",
    "boot_id",
    "commit_copy",
    "hold_job_lock",
    "iter_slots",
    "job_token",
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


META_RESERVE = 4 << 20  # room reserved after each slot's data for its record, objects and
# manifest (larger metadata is reserved when written)


class SlotSet:
    """The slots of one job's rank on this node (see the module docstring)."""

    def __init__(self, directory: str, job: str, rank: int, slots: list[Slot], lock_fd: int):
        self.directory, self.job, self.rank = directory, job, rank
        self.slots, self._lock_fd = slots, lock_fd
        self._owner = _owner(job)
        self._begun: set[int] = set()  # slots this process is staging into (begin, not yet
        # staged or abandoned): its own flock does not keep its own begin out

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
                budget = None if limit_bytes is None else limit_bytes - i * _whole(size)
                slots.append(_new_slot(directory, job, rank, i, size, budget))
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

    def grow(
        self, data_bytes: int, *, busy: Collection[int] = (), limit_bytes: int | None = None
    ) -> int:
        """Make the slots smaller than ``data_bytes`` anew at that size (empty), except those
        that hold the only copy of a step a restart needs (the newest committed snapshot,
        and a staged one newer than it, awaiting its seal), those in ``busy`` (the caller's:
        being written to the next level) or pinned by a reader: they are made larger in a
        later call, once a newer snapshot superseded them. Returns how many slots are large
        enough now. ShmSpaceError (``limit_bytes``: the whole set's budget) if shared memory
        cannot hold a larger one: the slots kept are intact, the one being made is gone."""
        size = max(ALIGN_BYTES, -(-data_bytes // ALIGN_BYTES) * ALIGN_BYTES)
        heads = self.headers()
        newest = self.newest()
        top = newest[1].gen if newest is not None else -1
        keep = set(busy) | self._begun | ({newest[0].index} if newest is not None else set())
        keep |= {s.index for s, h in zip(self.slots, heads, strict=True)
                 if _state(h) == STAGED and _gen(h) > top}  # fmt: skip
        for i, slot in enumerate(self.slots):
            if slot.nbytes >= size or slot.index in keep or not slot.try_lock(exclusive=True):
                continue
            others = sum(_whole(x.nbytes) for x in self.slots if x is not slot)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slot.path)  # (a keeper that mapped it maps the new file next time)
            slot.close()
            self.slots = [x for x in self.slots if x is not slot]
            budget = None if limit_bytes is None else limit_bytes - others
            self.slots.insert(
                i, _new_slot(self.directory, self.job, self.rank, slot.index, size, budget)
            )
        return sum(x.nbytes >= size for x in self.slots)

    @classmethod
    def attach(cls, job: str, *, rank: int = 0, directory: str = SHM_DIR) -> SlotSet | None:
        """The existing slots of ``job`` (a restarted training process); None if there are
        none. A staged snapshot newer than every committed one is sealed first
        (:meth:`seal_pending`)."""
        paths = list(iter_slots(directory, job, rank))
        if not paths:
            return None
        lock_fd = hold_job_lock(directory, job, rank)
        os.pwrite(lock_fd, json.dumps(_owner(job)).encode().ljust(512), 0)  # adopted: ours now
        slots: list[Slot] = []
        try:
            for p in paths:  # a slot without a valid header (torn twice), truncated, a
                # symlink or not ours to open is left out (made anew if too few remain)
                with contextlib.suppress(OSError, ValueError, CheckpointError):
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

    def seal_pending(self, wait_secs: float = 30.0) -> list[SlotHeader]:
        """Seal every staged snapshot newer than the newest committed one (left by a trainer
        that died before its keeper sealed it, or that had no keeper): it is the newest
        consistent state, and until it is sealed ``begin`` must not overwrite it. One that
        another process holds (the dead trainer's keeper, still hashing it) is waited for,
        up to ``wait_secs``: read before, the restart would resume from an older step."""
        newest = self.newest()
        top = newest[1].gen if newest is not None else -1
        done = []
        deadline = time.monotonic() + wait_secs
        for slot, head in zip(self.slots, self.headers(), strict=True):
            if head is None or head.state != STAGED or head.gen <= top:
                continue
            with contextlib.suppress(CorruptCheckpointError):  # damaged: never committed
                while (sealed := seal(slot)) is None and time.monotonic() < deadline:
                    now = slot.header()
                    if now is None or now.state != STAGED:  # sealed by its holder
                        sealed = now if now is not None and now.state == COMMITTED else None
                        break
                    time.sleep(0.01)
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

    def begin(self, step: int, *, avoid: Collection[int] = (), nbytes: int = 0) -> Slot | None:
        """A slot to stage ``step`` into, held exclusively, its header ``staging``: never the
        newest committed one, never one a reader pins, never the newest staged snapshot
        when it is newer than every committed one (it awaits its seal: overwritten, a crash
        in the copy would fall back two steps; an older staged one is superseded by it and
        may be taken, so a keeper slow to seal does not make the level skip snapshots),
        never one whose index is in ``avoid`` (the caller's: a slot it asked the keeper to
        write to the next level), never one smaller than ``nbytes``. None when no slot is
        free: the caller skips this memory checkpoint."""
        heads = self.headers()
        newest = self.newest()
        top = newest[1].gen if newest is not None else -1
        gen = max((h.gen for h in heads if h is not None), default=0) + 1
        staged = [_gen(h) for h in heads if _state(h) == STAGED and _gen(h) > top]
        top_staged = max(staged, default=None)  # awaits its seal: kept
        order = sorted(
            (
                i
                for i in range(len(self.slots))
                if (newest is None or self.slots[i] is not newest[0])
                and not (_state(heads[i]) == STAGED and _gen(heads[i]) == top_staged)
                and self.slots[i].index not in avoid
                and self.slots[i].index not in self._begun
                and self.slots[i].nbytes >= nbytes
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
            self._begun.add(slot.index)
            return slot
        return None

    @property
    def staging(self) -> int:
        """How many slots this process is staging into (begun, not yet staged or abandoned)."""
        return len(self._begun)

    def staged(self, slot: Slot, record: bytes, objects: bytes, file_bytes: int) -> None:
        """The snapshot in ``slot`` is consistent: write its record and objects after the
        data, mark it ``staged`` and let go of it (the keeper or :func:`seal` commits it)."""
        if file_bytes > slot.nbytes:
            raise CheckpointError(f"{file_bytes} bytes do not fit a {slot.nbytes}-byte slot")
        head = slot.header()
        assert head is not None and head.state == STAGING, head
        meta_offset = DATA_OFFSET + slot.nbytes
        write_meta(slot, meta_offset, record + objects)
        write_header(slot.fd, replace(
            head, state=STAGED, seq=head.seq + 1, file_bytes=file_bytes, meta_offset=meta_offset,
            record_bytes=len(record), objects_bytes=len(objects),
            meta_crc=zlib.crc32(record + objects),
        ))  # fmt: skip
        self._begun.discard(slot.index)
        slot.unlock()

    def abandon(self, slot: Slot) -> None:
        """A staging that failed: the slot is empty again and let go."""
        head = slot.header()
        if head is not None:
            write_header(slot.fd, replace(head, state=EMPTY, step=None, seq=head.seq + 1))
        self._begun.discard(slot.index)
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


def _whole(data_bytes: int) -> int:
    """A slot file's bytes: its header, data and the metadata's room (reserved too: a shared
    memory that fills later fails no save at its staged() write)."""
    return DATA_OFFSET + data_bytes + META_RESERVE


def _new_slot(
    directory: str, job: str, rank: int, index: int, size: int, budget: int | None
) -> Slot:
    """An empty slot file of ``size`` data bytes (one of that name is replaced), its space
    reserved (ShmSpaceError beyond ``budget`` or what shared memory has: nothing is left)."""
    path = os.path.join(directory, slot_name(job, rank, index))
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        reserve(fd, 0, _whole(size), path, budget)
        o = _owner(job)
        write_header(fd, SlotHeader(job, rank, index, o["host"], o["pid"], o["boot"],
                                    data_bytes=size))  # fmt: skip
        return Slot(path, fd, index, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


def _gen(h: SlotHeader | None) -> int:
    return -1 if h is None else h.gen


def _state(h: SlotHeader | None) -> str:
    return EMPTY if h is None else h.state
