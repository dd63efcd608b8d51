"""persist and commit: write the arena and the objects file, then the manifest.

Call sequence (persist thread of the saver; io pool threads run the extents)::

    result = persist(storage, directory, plan, view, objects, ...)   # every writing rank
    commit(storage, directory, manifest_for(...))                      # coordinator

The writer threads hash each checksum segment of an extent just before they
write it, so every stored byte is covered and no extra pass reads the arena.
"""

from __future__ import annotations

import platform
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from pitstop._version import __version__
from pitstop.engine.plan import SavePlan
from pitstop.faults import killpoint
from pitstop.format.checksum import get_checksum
from pitstop.format.manifest import FileEntry, Lineage, Manifest, TensorEntry
from pitstop.format.names import data_file_name, objects_file_name
from pitstop.format.objects import encode_objects
from pitstop.io.parallel import Extent
from pitstop.storage.base import Storage

__all__ = [
    "PersistResult",
    "encode_objects",
    "manifest_for",
    "persist",
    "result_from_json",
    "result_to_json",
]


@dataclass(frozen=True)
class PersistResult:
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    nbytes: int
    write_secs: float
    direct: bool


def persist(
    storage: Storage,
    directory: str,
    plan: SavePlan,
    view: memoryview,
    objects: bytes,
    *,
    algorithm: str,
    pool: Executor,
    rank: int = 0,
    before_extent: Callable[[Extent], None] | None = None,
    after_extent: Callable[[Extent], None] | None = None,
) -> PersistResult:
    """Write this rank's data and objects files durably into ``directory`` (prepared by the
    commit's coordinator: :func:`pitstop.engine.collective.commit_together`); return their
    manifest entries.

    ``before_extent`` runs in the writer thread before an extent is written (the saver
    waits there for the extent's tensors to be copied into the arena); the extent is
    hashed after its write is done, while the other writers' requests are in flight, and
    then ``after_extent`` runs (its bytes in ``view`` may be reused)."""
    hasher = get_checksum(algorithm)
    sums: dict[tuple[int, int], str] = {}
    lock = threading.Lock()

    def on_extent(extent: Extent) -> None:
        local = {
            tag: hasher(view[start : start + length]) for start, length, tag in extent.segments
        }
        with lock:
            sums.update(local)  # type: ignore[arg-type]
        if after_extent is not None:
            after_extent(extent)

    data_name = data_file_name(rank)
    t0 = time.perf_counter()
    result = storage.write_data(
        directory,
        data_name,
        view[: plan.file_bytes],
        plan.extents,
        pool=pool,
        before_extent=before_extent,
        on_extent=on_extent,
    )
    killpoint("persist.after_data")
    objects_name = objects_file_name(rank)
    storage.write_object(directory, objects_name, objects)
    empty = hasher(b"")
    tensors = tuple(
        TensorEntry(
            key=item.key,
            dtype=item.dtype_name,
            shape=item.shape,
            file=data_name,
            offset=item.offset,
            nbytes=item.nbytes,
            checksum=(empty,)
            if item.nbytes == 0
            else tuple(sums[(i, j)] for j in range(plan.segment_count(i))),
            rank=rank,
            global_shape=item.global_shape,
            start=item.start,
            owner=item.owner,
        )
        for i, item in enumerate(plan.items)
    )
    files = (
        FileEntry(
            name=data_name, rank=rank, nbytes=plan.file_bytes, stream_nbytes=plan.stream_nbytes
        ),
        FileEntry(name=objects_name, rank=rank, nbytes=len(objects), checksum=hasher(objects)),
    )
    return PersistResult(
        files=files,
        tensors=tensors,
        nbytes=plan.file_bytes + len(objects),
        write_secs=time.perf_counter() - t0,
        direct=result.direct,
    )


def result_to_json(result: PersistResult) -> dict[str, Any]:
    """One rank's result as JSON, for the coordinator (see :func:`result_from_json`)."""
    return {
        "files": [f.to_json() for f in result.files],
        "tensors": [t.to_json() for t in result.tensors],
        "nbytes": result.nbytes,
        "write_secs": result.write_secs,
        "direct": result.direct,
        "host": socket.gethostname(),
    }


def _tuple(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def result_from_json(raw: dict[str, Any]) -> PersistResult:
    """The coordinator's copy of a rank's result (the manifest built from it is validated
    by ``Manifest.loads`` before it is committed)."""
    files = tuple(
        FileEntry(
            name=f["name"], rank=f["rank"], nbytes=f["nbytes"], checksum=f["checksum"],
            stream_nbytes=f.get("stream_nbytes"),
        )
        for f in raw["files"]
    )  # fmt: skip
    tensors = tuple(
        TensorEntry(
            key=t["key"], dtype=t["dtype"], shape=tuple(t["shape"]), file=t["file"],
            offset=t["offset"], nbytes=t["nbytes"], checksum=tuple(t["checksum"]), rank=t["rank"],
            global_shape=_tuple(t.get("global_shape")), start=_tuple(t.get("start")),
            owner=t.get("owner"),
        )
        for t in raw["tensors"]
    )  # fmt: skip
    return PersistResult(files, tensors, raw["nbytes"], raw["write_secs"], raw["direct"])


def manifest_for(
    step: int,
    results: list[PersistResult],
    *,
    algorithm: str,
    segment_bytes: int,
    world_size: int,
    lineage: Lineage | None = None,
    metrics: dict[str, float] | None = None,
    hosts: list[str] | None = None,
) -> Manifest:
    return Manifest(
        step=step,
        created_unix_secs=time.time(),
        world_size=world_size,
        checksum_algorithm=algorithm,
        segment_bytes=segment_bytes,
        files=tuple(f for r in results for f in r.files),
        tensors=tuple(t for r in results for t in r.tensors),
        library={
            "pitstop": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        topology={"world_size": world_size, "hosts": hosts or [socket.gethostname()]},
        lineage=lineage,
        metrics=dict(metrics or {}),
    )
