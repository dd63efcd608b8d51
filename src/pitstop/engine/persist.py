"""persist and commit: write the arena and the objects file, then the manifest.

Call sequence (persist thread of the saver; io pool threads run the extents)::

    result = persist(storage, directory, plan, view, objects, ...)   # every writing rank
    commit(storage, directory, manifest_for(...))                      # coordinator

Every checksum segment is hashed while its extent is being written: as a writer thread
starts an extent (its bytes staged), it hands the extent to a hashing thread and issues
the write, so the disk always has every writer's request in flight (hashing in the
writer, after its write, left the disk one request short for the hash's time: 15 % of the
writers' time at 1.2 GB here) and the last extent's hash ends before its write does. The
objects file is written beside the data file too, once the first extent starts. Every
stored byte is covered and no extra pass reads the arena.
"""

from __future__ import annotations

import platform
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch

from pitstop._version import __version__
from pitstop.engine.plan import SavePlan
from pitstop.engine.stage import Ring
from pitstop.faults import killpoint
from pitstop.format.checksum import get_checksum
from pitstop.format.manifest import FileEntry, Lineage, Manifest, TensorEntry
from pitstop.format.names import data_file_name, objects_file_name
from pitstop.format.objects import encode_objects
from pitstop.io.parallel import Extent
from pitstop.log import get_logger
from pitstop.storage.base import Storage

__all__ = [
    "PersistResult",
    "encode_objects",
    "manifest_for",
    "persist",
    "result_from_json",
    "result_to_json",
]


_log = get_logger("pitstop.engine")
_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass(frozen=True)
class PersistResult:
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    nbytes: int
    write_secs: float
    direct: bool


class _FailFast(Executor):
    """The writer pool as the storage sees it during one persist: every job it runs that
    raises (a failed write of an extent, whatever the storage) calls ``on_failure`` at once.
    Through a ring, the stager and the other writers wait for the place of the failed
    extent, which is never released: the ring must fail when the write does, not when the
    storage's call returns (it waits for those very writers). Shutting it down is the
    owner's business, not the storage's."""

    def __init__(self, inner: Executor, on_failure: Callable[[BaseException], None]) -> None:
        self._inner, self._on_failure = inner, on_failure

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        future = self._inner.submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self._on_failure(future.exception())  # type: ignore[arg-type]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class _Beside:
    """The work of one persist that runs beside its writer threads: hashing each extent
    while it is written, and writing the objects file. Its two threads are started from a
    writer thread (a thread inherits its creator's lowered priority on Linux), and run
    nothing that waits on the writers or the stager, so :meth:`close` always returns.

    ``after_extent`` (a ring's release) runs once an extent is both written and hashed;
    ``on_failure`` (a ring's fail) as soon as a hash fails."""

    def __init__(
        self,
        view: memoryview,
        algorithm: str,
        after_extent: Callable[[Extent], None] | None,
        write_objects: Callable[[], None],
        on_failure: Callable[[BaseException], None] | None = None,
        hash_after: Callable[[], None] | None = None,
        extents: int = 0,
        on_hashed: Callable[[dict[object, str]], None] | None = None,
    ) -> None:
        self._view, self._after, self._on_failure = view, after_extent, on_failure
        self._hash_after = hash_after
        self._left, self._on_hashed = extents, on_hashed  # extents still to hash
        self._hasher = get_checksum(algorithm)
        self._write_objects = write_objects
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="pitstop-hash")
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._objects: Future[None] | None = None
        self._hashed: set[int] = set()
        self._done: dict[int, int] = {}  # extent start -> parts done (written, hashed)
        self.sums: dict[object, str] = {}

    def start(self, extent: Extent) -> None:
        """Writer thread, once ``extent`` is staged and before it is written."""
        with self._lock:
            if self._objects is None:  # after write_data began: its storage call comes first
                self._objects = self._pool.submit(self._write_objects)
            if extent.start in self._hashed:
                return  # written again (a fallback to buffered I/O): hashed once
            self._hashed.add(extent.start)
            self._futures.append(self._pool.submit(self._hash, extent))

    def _hash(self, extent: Extent) -> None:
        try:
            if self._hash_after is not None:
                self._hash_after()
            view = self._view
            local = {tag: self._hasher(view[s : s + n]) for s, n, tag in extent.segments}
            with self._lock:
                self.sums.update(local)
                self._left -= 1
                sums = dict(self.sums) if self._left == 0 else None
            if sums is not None and self._on_hashed is not None:
                self._all_hashed(sums)
        except BaseException as e:  # the stager and the writers stop now, not after the write
            if self._on_failure is not None:
                self._on_failure(e)
            raise
        finally:  # a ring must not wait for ever for a place whose hash failed
            self._part_done(extent)

    def _all_hashed(self, sums: dict[object, str]) -> None:
        """The last extent's hash thread, while that extent may still be written: every
        checksum is known (``on_hashed`` may build the manifest meanwhile; it only ever
        saves time, so what it raises is dropped)."""
        assert self._on_hashed is not None
        try:
            self._on_hashed(sums)
        except Exception as e:
            _log.debug("work ahead of the commit failed (done after the write): %r", e)

    def written(self, extent: Extent) -> None:
        """Writer thread, once ``extent`` is written (once per extent)."""
        self._part_done(extent)

    def _part_done(self, extent: Extent) -> None:
        with self._lock:
            parts = self._done[extent.start] = self._done.get(extent.start, 0) + 1
        if parts == 2 and self._after is not None:
            self._after(extent)

    def finish(self) -> None:
        """Persist thread, once the data file is durable: the objects file too (written
        now if no extent started it) and every hash; raises the first error."""
        with self._lock:
            if self._objects is None:
                self._objects = self._pool.submit(self._write_objects)
            futures = [self._objects, *self._futures]
        for f in futures:
            f.result()

    def close(self) -> None:
        """Wait until nothing runs any more (whatever the outcome)."""
        self._pool.shutdown(wait=True)


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
    on_failure: Callable[[BaseException], None] | None = None,
    hash_after: Callable[[], None] | None = None,
    on_hashed: Callable[[tuple[FileEntry, ...], tuple[TensorEntry, ...]], None] | None = None,
) -> PersistResult:
    """Write this rank's data and objects files durably into ``directory`` (prepared by the
    commit's coordinator: :func:`pitstop.engine.collective.commit_together`); return their
    manifest entries.

    ``before_extent`` runs in the writer thread before an extent is written (the saver
    waits there for the extent's tensors to be copied into the arena); the extent is then
    hashed in a thread of its own while it is written, and once both are done
    ``after_extent`` runs (its bytes in ``view`` may be reused). With ``hash_after``
    (a stage job's ``wait_copied``; never with a ring, whose places wait for the hashes),
    hashing starts once it returns: while the copy into the arena runs, the hashes would
    take the other core and leave the writer threads none to issue their next requests
    (here a raw O_DIRECT write beside a copy alone or a hash alone lost 0-3 %, beside
    both 10-13 %); the writes keep going meanwhile and the backlog takes a few
    milliseconds at 16 GB/s. Storage calls come in
    the same order as ever: ``write_data``, then ``write_object`` (which runs beside the
    data's writes once the first extent starts).

    ``on_failure`` runs as soon as the write or the hash of an extent fails, in the thread
    that failed (by default, when ``view`` is a :class:`~pitstop.engine.stage.Ring`, its
    ``fail``: the stager and the writers waiting for a place of the ring stop at once, and
    the first error is the one raised). A storage that writes the file again after a
    failed request (the O_DIRECT fallback) cannot do so through a failed ring: that save
    fails with the request's error.

    ``on_hashed(files, tensors)`` runs once every checksum is known, in the thread of the
    last hash, usually while the last extents are still being written: the manifest entries
    this persist returns, so that the manifest can be built and checked meanwhile instead
    of after the data file is durable (10-15 ms of a 1.2 GB save here)."""
    if on_failure is None and isinstance(view, Ring):
        on_failure = view.fail
    if on_failure is not None:
        pool = _FailFast(pool, on_failure)
    hasher = get_checksum(algorithm)
    data_name = data_file_name(rank)
    objects_name = objects_file_name(rank)
    beside = _Beside(
        view,
        algorithm,
        after_extent,
        lambda: storage.write_object(directory, objects_name, objects),
        on_failure,
        hash_after,
        len(plan.extents),
        None if on_hashed is None else lambda sums: on_hashed(*entries(sums)),
    )

    def entries(sums: dict[object, str]) -> tuple[tuple[FileEntry, ...], tuple[TensorEntry, ...]]:
        return _entries(plan, sums, objects, hasher, rank)

    def start(extent: Extent) -> None:
        if before_extent is not None:
            before_extent(extent)
        beside.start(extent)

    t0 = time.perf_counter()
    try:
        result = storage.write_data(
            directory,
            data_name,
            view[: plan.file_bytes],
            plan.extents,
            pool=pool,
            before_extent=start,
            on_extent=beside.written,
        )
        killpoint("persist.after_data")
        beside.finish()
    finally:
        beside.close()
    files, tensors = entries(beside.sums)
    return PersistResult(
        files=files,
        tensors=tensors,
        nbytes=plan.file_bytes + len(objects),
        write_secs=time.perf_counter() - t0,
        direct=result.direct,
    )


def _entries(
    plan: SavePlan, sums: dict[object, str], objects: bytes, hasher: Callable[[bytes], str],
    rank: int,
) -> tuple[tuple[FileEntry, ...], tuple[TensorEntry, ...]]:  # fmt: skip
    """The manifest entries of one rank's files and tensors, from the segments' checksums."""
    data_name = data_file_name(rank)
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
        FileEntry(
            name=objects_file_name(rank), rank=rank, nbytes=len(objects),
            checksum=hasher(objects),
        ),
    )  # fmt: skip
    return files, tensors


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
