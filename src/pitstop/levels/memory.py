"""The memory level's building blocks: stage a state into a shared-memory slot, read a
committed slot back as a checkpoint.

Slots (:mod:`pitstop.levels.shm`) hold a rank's data file byte for byte; this module puts
the engine's pieces around them:

* :func:`record_for` — a save plan as the JSON record a slot carries while ``staged``
  (what :func:`pitstop.levels.shm.seal` needs to write the manifest without torch).
* :func:`stage_into` — plan, stage (the engine's copy, straight into the slot: no second
  copy), record: the synchronous form that tests and benchmarks use; the manager's saver
  is to use the same three steps with its cached plan and deferred copies.
* :class:`SlotStorage` — the committed slots of a job as a read-only
  :class:`pitstop.storage.base.Storage`: each committed slot is a step directory holding
  ``manifest.json``, ``rank-00000.bin`` (the data region) and ``objects-00000.json``, so
  the catalog, :func:`pitstop.engine.recovery.recover`, ``verify_checkpoint`` and
  :func:`pitstop.engine.restore.load_entry` read it unchanged; a flipped byte is a
  CorruptCheckpointError like on any level, and the next candidate (the other slot, or the
  next level) is tried.
* :func:`restore_from_memory` — ``recover`` over a SlotStorage into a live state.

Call sequence (training thread)::

    slots = SlotSet.attach(job) or SlotSet.create(job, data_bytes=plan.file_bytes)
    slot = stage_into(slots, step, state)          # staged; None: no slot free
    seal(slot) or keeper.request_seal(slot.index)  # committed
    ...
    storage = SlotStorage(SHM_DIR, job)            # a restarted process
    result = restore_from_memory(storage, state)   # newest committed slot that verifies
    storage.close()
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from pitstop._version import __version__
from pitstop.engine.catalog import Catalog, Entry
from pitstop.engine.collective import local_items
from pitstop.engine.persist import encode_objects
from pitstop.engine.plan import SavePlan, plan_from_layout
from pitstop.engine.recovery import RestoreResult, recover
from pitstop.engine.restore import load_entry
from pitstop.engine.stage import arena_tensor, stage
from pitstop.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedSetupError,
)
from pitstop.format.checksum import default_algorithm
from pitstop.format.jsonsafe import load_json
from pitstop.format.manifest import Lineage
from pitstop.format.markers import MAX_MARKER_BYTES
from pitstop.format.names import (
    data_file_name,
    objects_file_name,
    parse_aside_dir,
    step_dir_name,
)
from pitstop.io.locks import DirLock
from pitstop.io.parallel import Extent, IOResult
from pitstop.levels.shm import (
    COMMITTED,
    EMPTY,
    PREFIX,
    Slot,
    SlotHeader,
    SlotSet,
    iter_slots,
    open_slot,
    read_header,
    read_meta,
    write_header,
)
from pitstop.log import get_logger
from pitstop.options import IOOptions, SaveOptions
from pitstop.ranks.group import Group
from pitstop.ranks.sharding import assign
from pitstop.state.tree import Flat, flatten

__all__ = ["SlotStorage", "plan_state", "record_for", "restore_from_memory", "stage_into"]

_log = get_logger("pitstop.levels")


def record_for(
    plan: SavePlan,
    step: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    algorithm: str | None = None,
    lineage: Lineage | None = None,
    metrics: Mapping[str, float] | None = None,
    library: Mapping[str, str] | None = None,
) -> bytes:
    """The record of a staged slot: the plan's items and what the manifest needs besides
    the checksums (``library``: the versions the manifest names; the training process
    knows torch's). ``plan``: what tells the job's plans apart (several ranks: every rank's
    part of a step must name the same one)."""
    items = [
        {
            "key": it.key, "dtype": it.dtype_name, "shape": list(it.shape), "offset": it.offset,
            "nbytes": it.nbytes, "global_shape": _list(it.global_shape), "start": _list(it.start),
            "owner": it.owner,
        }
        for it in plan.items
    ]  # fmt: skip
    record = {
        "step": step, "rank": rank, "world_size": world_size,
        "algorithm": algorithm or default_algorithm(), "segment_bytes": plan.segment_bytes,
        "file_bytes": plan.file_bytes, "stream_nbytes": plan.stream_nbytes, "items": items,
        "plan": plan_id(plan),
        "library": dict(library or {"pitstop": __version__}), "hosts": [socket.gethostname()],
        "lineage": lineage.to_json() if lineage is not None else None,
        "metrics": dict(metrics or {}), "created": time.time(),
    }  # fmt: skip
    return json.dumps(record, separators=(",", ":")).encode()


def plan_id(plan: SavePlan) -> str:
    """A short digest of the plan's signature (every rank's layout): the same on every rank
    of one plan."""
    return hashlib.blake2b(repr(plan.signature).encode(), digest_size=8).hexdigest()


def _list(v: tuple[int, ...] | None) -> list[int] | None:
    return None if v is None else list(v)


def plan_state(
    state: Mapping[str, Any], options: SaveOptions | None = None
) -> tuple[Flat, SavePlan]:
    """Flatten ``state`` and lay it out as one process's data file (what the saver does on
    the null group, uncached)."""
    options = options or SaveOptions.from_env()
    flat = flatten(state, allow_pickle=options.allow_pickle)
    items = local_items(flat, overlap=False)
    layout = assign([items], options.replicated)[0]
    return flat, plan_from_layout(layout, options.io.chunk_bytes, ("memory",))


def stage_into(
    slots: SlotSet,
    step: int,
    state: Mapping[str, Any],
    *,
    options: SaveOptions | None = None,
    lineage: Lineage | None = None,
    metrics: Mapping[str, float] | None = None,
    copier: Executor | None = None,
) -> Slot | None:
    """Copy ``state`` into a free slot of ``slots`` and mark it staged (not yet committed:
    :func:`pitstop.levels.shm.seal` or the keeper does that). None: no slot is free. Raises
    if the state does not fit a slot."""
    flat, plan = plan_state(state, options)
    slot = slots.begin(step)
    if slot is None:
        return None
    try:
        if plan.file_bytes > slot.nbytes:
            raise UnsupportedSetupError(
                f"the state needs {plan.file_bytes} bytes; the memory slots hold {slot.nbytes}",
                step=step, path=slot.path, phase="stage",
            )  # fmt: skip
        own = copier is None
        pool = copier or ThreadPoolExecutor(1, thread_name_prefix="pitstop-stage")
        try:
            buffer = arena_tensor(typing.cast(Any, slot))
            job = stage(flat, plan, buffer, overlap=False, copier=pool)
            job.wait_copied()
            del buffer
        finally:
            if own:
                pool.shutdown(wait=True)
        library = {"pitstop": __version__, "torch": sys.modules["torch"].__version__}
        record = record_for(
            plan, step, rank=slots.rank, lineage=lineage, metrics=metrics, library=library
        )
        slots.staged(slot, record, encode_objects(flat.tree, rank=slots.rank), plan.file_bytes)
    except BaseException:
        slots.abandon(slot)
        raise
    return slot


# ---------------------------------------------------------------------- reading
def _address(buf: memoryview) -> int:
    probe = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


class _SlotReader:
    """A DataReader over a slot's data region: no I/O. It offers the data file in place
    (``data_view``, the hook of :func:`pitstop.engine.verify.data_view_of`), so the restore
    hashes each segment in the slot and copies it straight into its tensor; ``read_into``
    (memory copies that release the GIL, ``ctypes.memmove``) serves a caller that wants
    the bytes in its own buffer."""

    direct = False

    def __init__(self, view: memoryview, nbytes: int) -> None:
        self._view, self._nbytes = view, nbytes
        self._base = _address(view) if nbytes else 0

    def read_into(self, offset: int, out: memoryview) -> int:
        n = max(0, min(len(out), self._nbytes - offset))
        if n:
            ctypes.memmove(_address(out), self._base + offset, n)
        return n

    def data_view(self) -> memoryview:
        """The data file, in place: the slot's own memory, valid until the storage closes
        and unchanged while the step is pinned. Consumers only read it; it is handed out
        writable only because ``torch.frombuffer`` warns about a read-only buffer."""
        return self._view[: self._nbytes]

    def close(self) -> None:
        pass


class SlotStorage:
    """The committed slots of (``job``, ``rank``) under ``directory`` as a read-only
    Storage: one step directory per committed slot. Pins (``lock``) take the slot file's
    flock shared, so the training process never stages into a slot being read; markers
    (``damaged``) are kept in this object, never written into a slot."""

    def __init__(
        self, directory: str, job: str, *, rank: int = 0, io: IOOptions | None = None
    ) -> None:
        self.directory, self.job, self.rank = directory, job, rank
        self.url = os.path.join(directory, f"{PREFIX}{job}-r{rank:05d}")
        self.io = io if io is not None else IOOptions.from_env()
        self._slots: list[Slot] = []
        self._seen: dict[str, tuple[int, int]] = {}  # path -> (dev, inode) of the slots opened
        self._bad: dict[str, tuple[int, int]] = {}  # slot files that could not be opened
        self._refresh()
        self._marks: dict[str, dict[str, str]] = {}
        self.joined: dict[str, tuple[int, bytes]] | None = None
        """Several ranks: the steps every rank holds a part of (name -> the gen of this rank's
        slot, the joined manifest); only they are listed (``MemoryLevel.prepare_survey``)."""

    def _refresh(self) -> None:
        """Open the job's slots as they are now: slots made (or remade larger) since the last
        look are opened, removed ones closed (the training process makes its slots at its
        first save, after this storage may have been opened for the restore)."""
        try:
            paths = list(iter_slots(self.directory, self.job, self.rank))
        except OSError:  # not a directory, unreadable: no memory snapshots
            paths = []
        keep: list[Slot] = []
        for s in self._slots:
            try:
                same = s.path in paths and _ident(os.stat(s.path)) == _ident(os.fstat(s.fd))
            except FileNotFoundError:
                same = False
            if same:
                keep.append(s)
            else:
                self._seen.pop(s.path, None)
                s.close()
        self._slots = keep
        for path in paths:
            if path in self._seen:
                continue
            try:
                ident = _ident(os.lstat(path))
            except OSError:
                continue
            if self._bad.get(path) == ident:
                continue  # said before, unchanged
            try:
                # mapped writable only so that its address can be taken (and a rollback can
                # drop a snapshot: its header); the data is never written here
                slot = open_slot(path, job=self.job, rank=self.rank, populate=False)
            except FileNotFoundError:
                continue
            except (OSError, ValueError, CheckpointError) as e:  # no valid header (torn
                # twice), truncated, a symlink, not ours to open: holds no checkpoint
                _log.warning("memory slot %s skipped: %s", path, e, phase="restore")
                self._bad[path] = ident
                continue
            self._seen[path] = _ident(os.fstat(slot.fd))
            self._slots.append(slot)

    def close(self) -> None:
        for s in self._slots:
            s.close()
        self._slots.clear()
        self._seen.clear()

    def __enter__(self) -> SlotStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ slots by step
    def _committed(self) -> dict[str, tuple[Slot, SlotHeader]]:
        out: dict[str, tuple[Slot, SlotHeader]] = {}
        for s in self._slots:
            h = read_header(s.fd)
            if h is None or h.state != COMMITTED or h.step is None:
                continue
            name = step_dir_name(h.step)
            if name not in out or out[name][1].gen < h.gen:
                out[name] = (s, h)
        if self.joined is not None:  # several ranks: the joined steps, in the same slot still
            out = {n: v for n, v in out.items() if self.joined.get(n, (-1,))[0] == v[1].gen}
        return out

    def slot_of(self, directory: str) -> tuple[Slot, SlotHeader]:
        """The committed slot that holds ``directory`` and its header (CheckpointNotFoundError
        if none does)."""
        return self._find(directory)

    def parts(self) -> dict[str, tuple[int, bytes]]:
        """Every committed slot's step: (its gen, its manifest part as sealed), the slots whose
        metadata is damaged left out (several ranks: what ``MemoryLevel.prepare_survey``
        gathers)."""
        self._refresh()
        self.joined = None
        out = {}
        for name, (slot, head) in self._committed().items():
            try:
                out[name] = (head.gen, read_meta(slot, head)[2])
            except CheckpointError as e:
                _log.warning("memory %s skipped: %s", name, e, phase="restore")
        return out

    def _find(self, directory: str) -> tuple[Slot, SlotHeader]:
        found = self._committed().get(directory)
        if found is None:
            raise CheckpointNotFoundError(
                f"{directory} is in no committed memory slot", path=f"{self.url}/{directory}"
            )
        return found

    def _meta(self, directory: str) -> tuple[Slot, SlotHeader, bytes, bytes]:
        slot, head = self._find(directory)
        _, objects, manifest = read_meta(slot, head)
        return slot, head, objects, manifest

    # ------------------------------------------------------------------ listing
    def entries(self) -> list[str]:
        self._refresh()
        return sorted(self._committed())

    def entry_kind(self, name: str) -> str:
        return "dir" if name in self._committed() else "missing"

    def has_manifest(self, directory: str) -> bool:
        return directory in self._committed()

    def mtime(self, directory: str) -> float:
        return time.time()

    # ------------------------------------------------------------------ read
    def read_manifest(self, directory: str) -> bytes:
        manifest = self._meta(directory)[3]
        return manifest if self.joined is None else self.joined[directory][1]

    def read_object(self, directory: str, name: str) -> bytes:
        if name != objects_file_name(self.rank):
            raise CorruptCheckpointError(f"{name} is missing", path=f"{self.url}/{directory}")
        return self._meta(directory)[2]

    def file_size(self, directory: str, name: str) -> int:
        _, head, objects, _ = self._meta(directory)
        if name == data_file_name(self.rank):
            return head.file_bytes
        if name == objects_file_name(self.rank):
            return len(objects)
        raise CorruptCheckpointError(f"{name} is missing", path=f"{self.url}/{directory}")

    def open_data(self, directory: str, name: str) -> _SlotReader:
        slot, head = self._find(directory)
        if name != data_file_name(self.rank):
            raise CorruptCheckpointError(f"{name} is missing", path=f"{self.url}/{directory}")
        slot.populate(head.file_bytes, write=False)  # only the slot read, its data file
        return _SlotReader(slot.view, head.file_bytes)

    def data_view(self, directory: str) -> memoryview:
        """The committed data file of ``directory``, in place (read-only; pin it first)."""
        slot, head = self._find(directory)
        return slot.view[: head.file_bytes].toreadonly()

    def lock(self, directory: str, *, exclusive: bool) -> DirLock | None:
        """A pin: the slot's flock, shared; ``exclusive``: held alone (a rollback dropping
        it). None if another process holds it (being staged into, sealed or written out)."""
        slot, _ = self._find(directory)
        fd = os.open(slot.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # being staged into: it is no longer what the scan saw
        st = os.fstat(fd)
        return DirLock(fd, (st.st_dev, st.st_ino), exclusive, False)

    # ------------------------------------------------------------------ markers
    def mark(self, directory: str, kind: str, text: str) -> None:
        self._marks.setdefault(directory, {})[kind] = text

    def read_markers(self, directory: str) -> dict[str, Any]:
        return {
            k: load_json(v.encode()[:MAX_MARKER_BYTES], what=k, path=f"{self.url}/{directory}")
            for k, v in self._marks.get(directory, {}).items()
        }

    def unmark(self, directory: str, kind: str) -> None:
        self._marks.get(directory, {}).pop(kind, None)

    # ------------------------------------------------------------------ writes: refused
    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise UnsupportedSetupError(
            "a memory slot is written by staging, not through Storage", path=self.url
        )

    def prepare(self, directory: str) -> str:
        return typing.cast(str, self._refuse())

    def join(self, directory: str, token: str) -> None:
        self._refuse()

    def leave(self, directory: str) -> None:
        pass

    def write_data(
        self,
        directory: str,
        name: str,
        view: memoryview,
        extents: Sequence[Extent],
        *,
        pool: Executor,
        before_extent: Callable[[Extent], None] | None = None,
        on_extent: Callable[[Extent], None] | None = None,
    ) -> IOResult:
        return typing.cast(IOResult, self._refuse())

    def write_object(self, directory: str, name: str, data: bytes | memoryview) -> None:
        self._refuse()

    def commit(self, directory: str, manifest: bytes) -> None:
        self._refuse()

    def abort(self, directory: str) -> None:
        pass

    def uncommit(self, directory: str) -> None:
        self._refuse()

    def remove(self, directory: str) -> None:
        self._refuse()

    def rename(self, src: str, dst: str) -> None:
        """Setting a snapshot aside (a rollback, or damage) drops it: its slot is empty
        again (a slot has no other name to move it to). The caller holds it exclusively
        (``lock``); any other rename is refused."""
        aside = parse_aside_dir(dst)
        if aside is None or aside[0] not in ("abandoned", "damaged"):
            self._refuse()
        slot, head = self._find(src)
        write_header(slot.fd, replace(head, state=EMPTY, step=None, seq=head.seq + 1))
        self._marks.pop(src, None)


def _ident(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _NullSaver:
    """What ``load_entry`` needs of a saver: the group (one process)."""

    group = Group()


def restore_from_memory(
    storage: SlotStorage,
    state: Mapping[str, Any] | None,
    *,
    step: int | None = None,
    allow_pickle: bool = False,
) -> RestoreResult:
    """Load the newest committed slot that verifies (or ``step``) into ``state`` (None: the
    saved state as fresh objects, in ``result.value[0]``); a damaged slot is skipped for the
    older one. Returns a result without a step when no slot could be loaded (the caller
    goes on to the next level); never rolls anything back."""
    catalog = Catalog(storage)

    def load(entry: Entry) -> Any:
        return load_entry(
            storage, entry, state, saver=typing.cast(Any, _NullSaver), allow_pickle=allow_pickle
        )

    try:
        result = recover(catalog, load, step=step, raise_if_none=False)
    finally:
        catalog.close()
    result.level = "memory"
    return result
