"""Sealing a staged slot: hash every checksum segment, write the manifest after the
objects file, flip the header to ``committed``. No torch.

Part of :mod:`pitstop.levels.shm` (which re-exports ``seal``, ``manifest_of`` and
``read_meta``).

Call sequence: the keeper's seal threads (or the training process, without a keeper)
call :func:`seal`, which takes the slot's flock exclusively; readers call
:func:`read_meta` on a slot they pinned.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from pitstop.errors import CorruptCheckpointError
from pitstop.format.checksum import get_checksum, segments
from pitstop.format.manifest import FileEntry, Lineage, Manifest, TensorEntry, part_dumps
from pitstop.format.names import data_file_name, objects_file_name
from pitstop.levels.shm_header import COMMITTED, STAGED, SlotHeader, write_header
from pitstop.levels.shm_slot import Slot, write_meta

__all__ = ["commit_copy", "manifest_of", "read_meta", "seal"]


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
        plan = json.loads(record)
        manifest = manifest_of(plan, slot.view, objects, pool=pool)
        if manifest.world_size > 1:  # one rank's part: joined with the others' at a restart
            data = part_dumps(manifest, plan["rank"], str(plan.get("plan", "")))
        else:
            data = manifest.dumps()
            Manifest.loads(data, path=slot.path)  # what no reader would accept: never committed
        return _commit(slot, head, record + objects, data)
    finally:
        if not hold:
            slot.unlock()


def commit_copy(slot: Slot, manifest: bytes) -> SlotHeader | None:
    """Commit a staged slot that holds a copy of another slot (a partner copy, a restart's
    rebuild from one) with that slot's manifest (or part) as it was sealed: no hashing here;
    every checksum is verified when it is read. None if the slot is not staged or another
    process holds it."""
    if not slot.try_lock(exclusive=True):
        return None
    try:
        head = slot.header()
        if head is None or head.state != STAGED:
            return None
        record, objects, _ = read_meta(slot, head)
        return _commit(slot, head, record + objects, manifest)
    finally:
        slot.unlock()


def _commit(slot: Slot, head: SlotHeader, before: bytes, manifest: bytes) -> SlotHeader:
    """Write ``manifest`` after the record and objects (``before``), then flip the header."""
    write_meta(slot, head.meta_offset + len(before), manifest)
    committed = replace(
        head, state=COMMITTED, seq=head.seq + 1, manifest_bytes=len(manifest),
        meta_crc=zlib.crc32(before + manifest),
    )  # fmt: skip
    write_header(slot.fd, committed)
    return committed


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
