"""Checkpoints in an object store (``s3://bucket/run``, ``gs://``, ``az://``, ``memory://``,
or any URL fsspec knows): the step-directory lifecycle of :class:`Storage` written on the
narrow byte-level client of :mod:`pitstop.storage.clients`.

Layout under the URL's prefix (the names of the on-disk format, as object keys)::

    step-0000000100/.owner                     the save's claim (a token), put if absent
    step-0000000100/objects-00000.json         whole objects
    step-0000000100/rank-00000.bin/<offset>    a data file, as parts: one object per extent
                                               (at most ``part_bytes``), named by its byte
                                               offset as 16 hex digits
    step-0000000100/manifest.json              put if absent, last: the commit

Why parts, not multipart uploads: each part is one plain PUT, visible in a listing, so a job
killed mid-upload leaves only objects under an uncommitted prefix, which ``gc`` sees and
removes: never an invisible open multipart upload that bills the user until a lifecycle
rule aborts it. Parts upload in parallel (the engine's writer pool) straight from the staged
buffer and are read back with parallel ranged GETs into the engine's bounded buffers.

Commit: data and objects first, then the manifest with a conditional put (``If-None-Match``):
a committed manifest is never replaced, a prefix without one is never a candidate. Retention
deletes the manifest first, then the rest. There are no locks on an object store: a pin or a
hold always succeeds, and a reader of a step that retention deletes meanwhile fails with a
clear error (one job per prefix; ``gc`` of a prefix in use keeps debris younger than its
``min_age``). Two jobs saving the same step of one prefix at once is a misuse the conditional
commit and the checksums catch (one commits, a mixed checkpoint fails verification), not one
it prevents.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafePathError,
    UnsupportedSetupError,
)
from pitstop.faults import killpoint
from pitstop.format.jsonsafe import load_json
from pitstop.format.manifest import Manifest
from pitstop.format.markers import MAX_MARKER_BYTES, Unreadable
from pitstop.format.names import MANIFEST, MARKERS, OWNER_FILE, aside_dir_name, parse_step_dir
from pitstop.io.locks import pid_alive
from pitstop.io.parallel import Extent, IOResult, _run_extents
from pitstop.options import IOOptions
from pitstop.storage.aside import aside_kind
from pitstop.storage.clients import (
    ObjectClient,
    ObjectExists,
    ObjectMissing,
    make_client,
    split_url,
)

__all__ = ["ObjectStorage", "object_store_io", "step_url"]

PART_BYTES = 16 * 1024 * 1024
_LISTING_SECS = 2.0


def _checked_url(url: str) -> str:
    """``url`` without a trailing slash; refused if its key prefix is not one literal path:
    ``?``, ``#`` or ``%`` (a query, a fragment, an escape: clients drop or decode them, so two
    "different" runs would share a prefix), empty, ``.`` or ``..`` segments."""
    scheme, rest = split_url(url)
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.rstrip("/")
    bad = [c for c in "?#%" if c in rest]
    segments = prefix.split("/") if prefix else []
    if bad or not bucket or any(seg in ("", ".", "..") for seg in segments):
        why = (
            f"it holds {' '.join(repr(c) for c in bad)}" if bad
            else "it names no bucket" if not bucket
            else "its path has an empty, '.' or '..' segment"
        )  # fmt: skip
        raise UnsupportedSetupError(
            f"{url}: {why}; give {scheme}://bucket/prefix with a plain prefix (letters, digits, "
            "'-', '_', '.', '/' between names)",
            path=url, phase="plan",
        )  # fmt: skip
    return f"{scheme}://{bucket}/{prefix}" if prefix else f"{scheme}://{bucket}"


OBJECT_STORE_THREADS = 8
"""Writer threads for an object store unless told otherwise: each holds one request in flight,
and a store's throughput comes from many requests at once (a disk's from a few)."""
OBJECT_STORE_CHUNK_BYTES = 16 * 1024 * 1024
"""Extent size for an object store unless told otherwise (a part is at most ``part_bytes``,
also 16 MiB): a state of tens of MB is several requests in parallel, not one
(benchmarks/object_store.py: 16 MiB parts saved 1.5-2x faster than 64 MiB ones)."""


def object_store_io(io: IOOptions | None, **knobs: object) -> IOOptions:
    """``io`` (or the environment's, with ``knobs``) with an object store's defaults where a
    disk's were left: 8 writer threads, 16 MiB extents."""
    io = io or IOOptions.from_env(**knobs)
    if (
        io.threads == IOOptions.threads
        and knobs.get("threads") is None
        and not os.environ.get("PITSTOP_IO_THREADS")
    ):
        io = dataclasses.replace(io, threads=OBJECT_STORE_THREADS)
    if (
        io.chunk_bytes == IOOptions.chunk_bytes
        and knobs.get("chunk_bytes") is None
        and not os.environ.get("PITSTOP_CHUNK_BYTES")
    ):
        io = dataclasses.replace(io, chunk_bytes=OBJECT_STORE_CHUNK_BYTES)
    return io


def step_url(url: str) -> tuple[str, str | None]:
    """``(root, step)`` of a URL that names one committed step under a root
    (``s3://b/run/step-0000000100``), else ``(url, None)``: how ``load`` and the CLI read a
    URL given where a root or a checkpoint may go."""
    url = url.rstrip("/")
    parent, _, last = url.rpartition("/")
    if parse_step_dir(last) is None or "://" not in parent or parent.endswith(":/"):
        return url, None
    return (parent, last) if ObjectStorage(parent).has_manifest(last) else (url, None)


def _owner_alive(owner: dict[str, Any] | None) -> bool | None:
    """Whether the process that claimed a step is alive: known only on its own host."""
    if owner is None or owner.get("host") != socket.gethostname():
        return None
    pid = owner.get("pid")
    if type(pid) is not int or pid <= 0:
        return None
    return pid_alive(pid)


class _NoLock:
    """What ``lock`` returns on an object store, which has none: held, by nobody else."""

    fd = -1
    exclusive = False

    def __init__(self) -> None:
        self.on_release: Callable[[], None] | None = None

    def release(self) -> None:
        if self.on_release is not None:
            self.on_release()
            self.on_release = None

    def __enter__(self) -> _NoLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ObjectStorage:
    """A prefix of an object store; each checkpoint is a "directory" of objects under it.

    ``ObjectStorage("s3://bucket/run1")`` takes credentials, region and endpoint from the
    environment as the client reads it (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...);
    ``options`` are the client's own settings (obstore's config keys such as ``endpoint``,
    ``region``, ``access_key_id``; fsspec's ``storage_options``), never logged or written
    anywhere. ``client``: ``"obstore"`` (the default where it covers the scheme) or
    ``"fsspec"``. See the module docstring for the layout and the commit rule."""

    renames_in_place = False  # a rename copies every byte: retention deletes in place
    locks = False  # no pins or holds: gc keeps debris a while (see mtime)

    def __init__(
        self,
        url: str,
        io: IOOptions | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        client: str | None = None,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.url = _checked_url(url)
        self.io = io if io is not None else object_store_io(None)
        self.part_bytes = int(part_bytes)
        if self.part_bytes < 4096:
            raise ValueError(f"part_bytes must be at least 4096, got {part_bytes!r}")
        self.client: ObjectClient = make_client(self.url, options, client)
        self._tokens: dict[str, str] = {}  # directories this storage prepared -> token
        self._tokens_lock = threading.Lock()
        self._top: tuple[float, list[str], list[str]] | None = None  # a listing, briefly kept

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ------------------------------------------------------------------ names and errors
    def _key(self, directory: str, name: str | None = None) -> str:
        if not directory or "/" in directory or directory in (".", ".."):
            raise UnsafePathError(
                f"{directory!r} is not a name directly under the root", path=self.url
            )
        if name is not None and (not name or "/" in name or name in (".", "..")):
            raise UnsafePathError(f"{name!r} is not a file name", path=self.url)
        return f"{directory}/{name}" if name is not None else f"{directory}/"

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _io(self, e: OSError, what: str, key: str, phase: str) -> CheckpointIOError:
        return CheckpointIOError(
            f"cannot {what}: {e.strerror or e}", errno=e.errno or errno.EREMOTEIO,
            path=self._where(key), phase=phase,
        )  # fmt: skip

    # ------------------------------------------------------------------ listing
    def _list_top(self, fresh: bool) -> tuple[list[str], list[str]]:
        """The top level; ``entry_kind`` right after ``entries`` reuses its listing (one LIST
        per scan, not one per entry), anything that writes forgets it."""
        top = self._top
        if not fresh and top is not None and time.monotonic() - top[0] < _LISTING_SECS:
            return top[1], top[2]
        try:
            dirs, files = self.client.list_dirs()
        except OSError as e:
            raise self._io(e, f"list {self.url}", "", "restore") from e
        self._top = (time.monotonic(), dirs, files)
        return dirs, files

    def _changed(self) -> None:
        self._top = None

    def check(self) -> None:
        """One LIST of the prefix: a bucket that does not exist, or credentials it refuses,
        fail here (when the manager is built), not at the first save or flush."""
        self._list_top(fresh=True)

    def entries(self) -> list[str]:
        dirs, files = self._list_top(fresh=True)
        return sorted(set(dirs) | set(files))

    def entry_kind(self, name: str) -> str:
        dirs, files = self._list_top(fresh=False)
        return "dir" if name in dirs else "file" if name in files else "missing"

    def _objects(self, directory: str, phase: str = "restore") -> list[Any]:
        key = self._key(directory)
        try:
            return self.client.scan(key)
        except OSError as e:
            raise self._io(e, f"list {directory}", key, phase) from e

    def _exists(self, key: str, phase: str) -> bool:
        try:
            self.client.head(key)
        except ObjectMissing:
            return False
        except OSError as e:
            raise self._io(e, f"look up {key}", key, phase) from e
        return True

    def has_manifest(self, directory: str) -> bool:
        return self._exists(self._key(directory, MANIFEST), "restore")

    def mtime(self, directory: str) -> float:
        """The last sign of life of ``directory``: there are no locks to tell a save in
        progress from a dead one's debris, so the time of its newest object, or now when its
        owner (the save that claimed it) is a live process of this host, or 0 when that
        process is gone (debris at once)."""
        found = self._objects(directory, "gc")
        if not found:
            raise CheckpointNotFoundError(
                f"{directory} does not exist", path=self._where(self._key(directory))
            )
        owner = self._key(directory, OWNER_FILE)
        if not any(o.key == owner for o in found) or self.has_manifest(directory):
            return max(o.mtime for o in found)
        alive = _owner_alive(self._read_owner(directory))
        if alive is None:
            return max(o.mtime for o in found)
        return time.time() if alive else 0.0

    def _read_owner(self, directory: str) -> dict[str, Any] | None:
        try:
            owner = json.loads(self.client.get(self._key(directory, OWNER_FILE), 4096))
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    # ------------------------------------------------------------------ save
    def prepare(self, directory: str) -> str:
        """Claim ``directory`` for a new save: debris of a dead save is deleted, a committed
        step refused (or moved aside when the evidence says it is damaged or abandoned); the
        claim is a conditional put of its owner object, so of two savers one gets it."""
        key = self._key(directory, OWNER_FILE)
        try:
            if self._objects(directory, "plan"):
                self._clear_debris(directory)
            token = uuid.uuid4().hex
            owner = {
                "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                "token": token,
            }  # fmt: skip
            try:
                self.client.put(key, json.dumps(owner).encode(), if_absent=True)
            except ObjectExists:
                raise CheckpointExistsError(
                    f"{directory} was claimed by another writer at the same time",
                    path=self._where(key), phase="plan",
                ) from None  # fmt: skip
        except CheckpointError:
            raise
        except OSError as e:
            raise self._io(e, f"create {directory}", key, "plan") from e
        with self._tokens_lock:
            self._tokens[directory] = token
        self._changed()
        return token

    def _clear_debris(self, directory: str) -> None:
        if self.has_manifest(directory):
            aside = aside_kind(self, directory)
            step = parse_step_dir(directory)
            if aside is not None and step is not None:
                self.rename(directory, aside_dir_name(aside, step, uuid.uuid4().hex[:8]))
                return
            raise CheckpointExistsError(
                f"{directory} is already committed; committed checkpoints are never rewritten",
                path=self._where(self._key(directory)), phase="plan",
            )  # fmt: skip
        owner = self._read_owner(directory)
        if _owner_alive(owner):
            assert owner is not None
            raise CheckpointExistsError(
                f"{directory} is being written by another process (pid {owner.get('pid')} on "
                f"{owner.get('host')})", path=self._where(self._key(directory)), phase="plan",
            )  # fmt: skip
        # a dead save's objects, or a save on another host whose liveness cannot be known:
        # taken over (that save, if alive, finds its claim gone at commit and commits nothing)
        self.remove(directory)

    def join(self, directory: str, token: str) -> None:
        key = self._key(directory, OWNER_FILE)
        try:
            owner = json.loads(self.client.get(key, 4096))
        except (OSError, ValueError) as e:
            raise CheckpointIOError(
                f"cannot check {directory}: {e}", errno=errno.EIO, path=self._where(key),
                phase="persist",
            ) from e  # fmt: skip
        if not isinstance(owner, dict) or owner.get("token") != token:
            raise CheckpointExistsError(
                f"{directory} is no longer the one this save's rank 0 claimed (another writer "
                "replaced it): not written", path=self._where(key), phase="persist",
            )  # fmt: skip

    def leave(self, directory: str) -> None:
        return None

    def _parts(self, directory: str, name: str) -> str:
        return f"{self._key(directory, name)}/"

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
        """Each extent as parts of at most ``part_bytes``, put in parallel straight from
        ``view``; ``on_extent`` once its parts are stored. Parts of an earlier write of
        ``name`` (a repair) are deleted first: a file is its parts and nothing else."""
        prefix = self._parts(directory, name)
        t0 = time.perf_counter()
        try:
            old = self.client.scan(prefix)
            self.client.delete([o.key for o in old if o.key.startswith(prefix)])
        except OSError as e:
            raise self._io(e, f"write {name}", prefix, "persist") from e
        nbytes = sum(e.nbytes for e in extents)
        parts: list[Extent] = []  # every part its own request, all in the pool at once
        whole: dict[int, Extent] = {}  # part start -> its extent
        left: dict[int, int] = {}  # extent start -> parts not yet stored
        ready: dict[int, threading.Event] = {}  # extent start -> before_extent has returned
        first: set[int] = set()
        lock = threading.Lock()
        for ext in extents:
            cuts = list(range(ext.start, ext.end, self.part_bytes)) or [ext.start]
            left[ext.start], ready[ext.start] = len(cuts), threading.Event()
            for a in cuts:
                parts.append(Extent(a, min(ext.end, a + self.part_bytes)))
                whole[a] = ext

        def job(part: Extent) -> None:
            e = whole[part.start]
            with lock:
                mine = e.start not in first
                first.add(e.start)
            if mine:  # the extent's bytes staged (once, by its first part)
                try:
                    if before_extent is not None:
                        before_extent(e)
                finally:
                    ready[e.start].set()
            else:
                ready[e.start].wait()
            key = f"{prefix}{part.start:016x}"
            try:
                self.client.put(key, view[part.start : part.end])
            except OSError as err:
                raise self._io(err, f"write {name}", key, "persist") from err
            with lock:
                left[e.start] -= 1
                last = left[e.start] == 0
            if last and on_extent is not None:
                on_extent(e)  # its checksums, once every part is stored

        _run_extents(pool, parts, job, midpoint="persist.mid")
        return IOResult(nbytes, time.perf_counter() - t0, False)

    def write_object(self, directory: str, name: str, data: bytes | memoryview) -> None:
        key = self._key(directory, name)
        try:
            self.client.put(key, data)
        except OSError as e:
            raise self._io(e, f"write {name}", key, "persist") from e

    def commit(self, directory: str, manifest: bytes) -> None:
        """The manifest, put only if absent: the checkpoint exists from here on. First, with
        no lock to keep others out, the save checks that its claim still stands and that
        every file the manifest names is there whole (another process's gc or a second job
        may have deleted what it wrote): a save never returns for a checkpoint that is not."""
        key = self._key(directory, MANIFEST)
        self._check_before_commit(directory, manifest)
        killpoint("commit.before_rename")
        try:
            self.client.put(key, manifest, if_absent=True)
        except ObjectExists:
            raise CheckpointExistsError(
                f"{directory} was committed by another writer", path=self._where(key),
                phase="commit",
            ) from None  # fmt: skip
        except OSError as e:
            raise self._io(e, f"commit {directory}", key, "commit") from e
        with self._tokens_lock:
            self._tokens.pop(directory, None)
        self._changed()
        killpoint("commit.after_rename")

    def _check_before_commit(self, directory: str, manifest: bytes) -> None:
        where = self._where(self._key(directory))
        with self._tokens_lock:
            token = self._tokens.get(directory)
        owner = self._read_owner(directory)
        if token is not None and (owner is None or owner.get("token") != token):
            raise CheckpointExistsError(
                f"{directory}: this save's claim is gone (another process removed or took the "
                "step while it was written): not committed", path=where, phase="commit",
            )  # fmt: skip
        try:
            files = Manifest.loads(manifest).files
        except CheckpointError:
            return  # not a manifest this storage can read: committed as given (tests)
        have: dict[str, int] = {}
        for o in self._objects(directory, "commit"):
            rest = o.key[len(self._key(directory)) :]
            have[rest.split("/", 1)[0]] = have.get(rest.split("/", 1)[0], 0) + o.size
        wrong = [f.name for f in files if have.get(f.name) != f.nbytes]
        if wrong:
            raise CheckpointIOError(
                f"{directory}: {', '.join(wrong[:3])} missing or incomplete at commit (removed "
                "by another process while the save wrote it?): not committed",
                errno=errno.EIO, path=where, phase="commit",
            )  # fmt: skip

    def abort(self, directory: str) -> None:
        with self._tokens_lock:
            token = self._tokens.pop(directory, None)
        if token is None:
            return
        try:
            if not self.has_manifest(directory):
                self.remove(directory)
        except CheckpointError:
            pass  # gc removes it

    # ------------------------------------------------------------------ read
    def read_manifest(self, directory: str) -> bytes:
        key = self._key(directory, MANIFEST)
        try:
            return self.client.get(key, self.io.max_metadata_bytes)
        except ObjectMissing:
            raise CheckpointNotFoundError(
                f"{directory} has no {MANIFEST}: not a committed checkpoint",
                path=self._where(key),
            ) from None
        except OSError as e:
            if e.errno == errno.EFBIG:
                raise CorruptCheckpointError(
                    f"{MANIFEST}: {e.strerror} (IOOptions.max_metadata_bytes)",
                    path=self._where(key),
                ) from e
            raise self._io(e, f"read {MANIFEST}", key, "restore") from e

    def read_object(self, directory: str, name: str) -> bytes:
        key = self._key(directory, name)
        try:
            return self.client.get(key, self.io.max_metadata_bytes)
        except ObjectMissing:
            raise CorruptCheckpointError(f"{name} is missing", path=self._where(key)) from None
        except OSError as e:
            if e.errno == errno.EFBIG:
                raise CorruptCheckpointError(f"{name}: {e.strerror}", path=self._where(key)) from e
            raise self._io(e, f"read {name}", key, "restore") from e

    def _layout(self, directory: str, name: str) -> tuple[list[int], list[int], list[str]]:
        """The parts of file ``name``: starts, sizes, keys (a whole object is one part at 0;
        a data file is its part objects); a gap is damage."""
        whole = self._key(directory, name)
        prefix = f"{whole}/"
        try:
            found = self.client.scan(self._key(directory))  # (a prefix is a "directory")
        except OSError as e:
            raise self._io(e, f"list {name}", prefix, "restore") from e
        parts = []
        for o in found:
            if o.key == whole:
                parts.append((0, o.size, o.key))
                continue
            if not o.key.startswith(prefix):
                continue  # another name that starts with this one
            try:
                parts.append((int(o.key[len(prefix) :], 16), o.size, o.key))
            except ValueError:
                continue  # not a part: ignored, like a stray file in a directory
        parts.sort()
        if not parts:
            raise CorruptCheckpointError(f"{name} is missing", path=self._where(whole))
        at = 0
        for start, size, _ in parts:
            if start != at:
                raise CorruptCheckpointError(
                    f"{name}: the part at byte {at} is missing" if start > at
                    else f"{name}: parts overlap at byte {start}",
                    path=self._where(prefix),
                )  # fmt: skip
            at = start + size
        return [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]

    def file_size(self, directory: str, name: str) -> int:
        starts, sizes, _ = self._layout(directory, name)
        return starts[-1] + sizes[-1]

    def open_data(self, directory: str, name: str) -> _PartReader:
        return _PartReader(self, directory, name, *self._layout(directory, name))

    # ------------------------------------------------------------------ lifecycle
    def lock(self, directory: str, *, exclusive: bool) -> _NoLock | None:
        """No locks on an object store: always held (see the module docstring)."""
        if not self._objects(directory):
            raise CheckpointNotFoundError(
                f"{directory} does not exist", path=self._where(self._key(directory))
            )
        return _NoLock()

    def mark(self, directory: str, kind: str, text: str) -> None:
        key = self._key(directory, MARKERS[kind])
        try:
            self.client.put(key, text.encode())
        except OSError as e:
            raise self._io(e, f"mark {directory} {kind}", key, "verify") from e

    def read_markers(self, directory: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, name in MARKERS.items():
            key = self._key(directory, name)
            try:
                data = self.client.get(key, MAX_MARKER_BYTES)
            except ObjectMissing:
                continue
            except OSError as e:
                if e.errno == errno.EFBIG:
                    out[kind] = Unreadable(f"more than {MAX_MARKER_BYTES} bytes")
                    continue
                raise self._io(e, f"read {name}", key, "restore") from e
            if not data:
                out[kind] = Unreadable("empty")
                continue
            try:
                out[kind] = load_json(data, what=name, path=self._where(key))
            except CheckpointError as e:
                out[kind] = Unreadable(f"not JSON ({e.message})")
        return out

    def unmark(self, directory: str, kind: str) -> None:
        key = self._key(directory, MARKERS[kind])
        try:
            self.client.delete([key])
        except OSError as e:
            raise self._io(e, f"unmark {directory} {kind}", key, "restore") from e

    def uncommit(self, directory: str) -> None:
        key = self._key(directory, MANIFEST)
        try:
            self.client.delete([key])
        except OSError as e:
            raise self._io(e, f"uncommit {directory}", key, "gc") from e

    def remove(self, directory: str) -> None:
        """Every object under ``directory``: the manifest first (a crash half-way leaves
        debris, never a checkpoint with files missing)."""
        found = self._objects(directory, "gc")
        manifest = self._key(directory, MANIFEST)
        keys = [o.key for o in found]
        try:
            if manifest in keys:
                self.client.delete([manifest])
            self.client.delete([k for k in keys if k != manifest])
        except OSError as e:
            raise self._io(e, f"remove {directory}", self._key(directory), "gc") from e
        finally:
            self._changed()

    def rename(self, src: str, dst: str) -> None:
        """A copy of every object, the manifest last, then ``remove(src)`` (which deletes the
        manifest first): at every moment at most one of the two is committed... or, after a
        crash between, both, with the same manifest (restore takes either)."""
        found = self._objects(src, "gc")
        if not found:
            raise CheckpointNotFoundError(f"{src} does not exist", path=self._where(self._key(src)))
        if self._objects(dst, "gc"):
            raise CheckpointExistsError(
                f"cannot rename {src}: {dst} exists", path=self._where(self._key(dst))
            )
        head, manifest = self._key(src), self._key(src, MANIFEST)
        keys = sorted((o.key for o in found), key=lambda k: k == manifest)
        try:
            for k in keys:
                self.client.copy(k, self._key(dst) + k[len(head) :])
        except OSError as e:
            raise self._io(e, f"rename {src}", head, "gc") from e
        self.remove(src)


class _PartReader:
    """Positional reads of a data file stored as parts: ranged GETs, several threads at once."""

    direct = False

    def __init__(
        self, storage: ObjectStorage, directory: str, name: str, starts: list[int],
        sizes: list[int], keys: list[str],
    ) -> None:  # fmt: skip
        self._storage, self._directory, self._name = storage, directory, name
        self._starts, self._sizes, self._keys = starts, sizes, keys

    def read_into(self, offset: int, out: memoryview) -> int:
        done = 0
        i = bisect.bisect_right(self._starts, offset) - 1
        while done < len(out) and 0 <= i < len(self._keys):
            at = offset + done
            inside = at - self._starts[i]
            want = min(len(out) - done, self._sizes[i] - inside)
            if want <= 0:
                i += 1
                continue
            try:
                got = self._storage.client.read_into(self._keys[i], inside, out[done : done + want])
            except ObjectMissing:
                where = self._storage._where(self._keys[i])
                if not self._storage.has_manifest(self._directory):
                    raise CheckpointNotFoundError(
                        f"{self._directory} was removed (retention or gc) while it was read",
                        path=where,
                    ) from None
                raise CorruptCheckpointError(
                    f"{self._name}: a part disappeared while it was read", path=where
                ) from None
            except OSError as e:
                raise self._storage._io(e, f"read {self._name}", self._keys[i], "restore") from e
            done += got
            if got < want:
                break
            i += 1
        return done

    def close(self) -> None:
        return None
