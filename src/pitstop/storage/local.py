"""Checkpoints in a directory of a POSIX file system (local disk, /dev/shm, or shared).

The root is a boundary: nothing outside it is read, written, renamed or removed.
A step directory that is a symlink is foreign (never followed, never removed); files
are opened only if they are regular files (see :mod:`pitstop.io.files`).

Concurrent writers: a save creates its directory under a private name
(``.writing-step-N-ID``, holding an ``flock`` and an owner file) and renames it into
place, which fails if the step exists and is not empty; it keeps the lock until it
commits, so another writer's save in progress is never mistaken for debris. The
manifest is committed with a hard link, which never replaces an existing one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Sequence
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
from pitstop.format.markers import (
    MAX_MARKER_BYTES,
    Unreadable,
    not_a_marker,
)
from pitstop.format.names import (
    MANIFEST,
    MANIFEST_TMP,
    MARKERS,
    OWNER_FILE,
    aside_dir_name,
    parse_step_dir,
    writing_dir_name,
)
from pitstop.io.files import (
    fsync_dir,
    link_no_replace,
    read_regular,
    regular_size,
    rename_durable,
    write_bytes_durable,
)
from pitstop.io.locks import DirLock, try_lock
from pitstop.io.parallel import Extent, FileReader, IOResult, write_file
from pitstop.options import IOOptions
from pitstop.storage.aside import aside_kind

__all__ = ["LocalStorage", "RamStorage", "local_path", "object_url", "open_root", "refuse_url"]


# "scheme:" as the first component of a path (after "./" and blanks): "s3://b/r", "gs:/b" (a
# pathlib.Path of "gs://b"), "./s3://x", "s3:" alone
_URL = re.compile(r"^\s*(?:\./+)*([A-Za-z][A-Za-z0-9+.-]*):(?=/|$)")


# "s3:bucket/run" (no slashes): a known store's scheme as the first word of a path
_SCHEME_WORD = re.compile(
    r"^\s*(?:\./+)*(s3|s3a|gs|gcs|az|abfs|abfss|azure|memory|http|https|hdfs|hf|oss|r2):",
    re.I,
)
_OBJECT_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://[^/\s]")


def object_url(root: Any) -> str | None:
    """``root`` if it is an object-store URL (a str ``scheme://bucket/...``, any scheme but
    ``file``), else None. A pathlib.Path of one is not (it reads ``s3:/bucket``)."""
    if isinstance(root, str):
        match = _OBJECT_URL.match(root)
        if match is not None and match.group(1).lower() != "file":
            return root
    return None


def refuse_url(root: Any) -> None:
    """A root that is a URL or looks like one where a directory must be (a node-local level;
    ``s3:/bucket/run``, which is what a ``pathlib.Path`` of ``s3://bucket/run`` reads) is
    refused with an error that says so, never created as a directory named ``s3:`` in the
    working directory (a job that believed its checkpoints were in a bucket would lose them
    with the node). ``file:`` URLs are left to :func:`local_path`. Bytes are refused: a root
    is a str or an os.PathLike."""
    if isinstance(root, bytes):
        raise TypeError(f"a checkpoint root is a str or os.PathLike path, not bytes: {root!r}")
    if not isinstance(root, (str, os.PathLike)):
        return
    match = _URL.match(os.fspath(root)) or _SCHEME_WORD.match(os.fspath(root))
    if match is None or match.group(1).lower() == "file":
        return
    if object_url(root) is not None:
        why = (
            "this place needs a directory (a node-local level is a directory on each node); "
            "object storage goes in CheckpointManager(url) or pitstop.Shared(url)"
        )
    else:
        why = (
            "and not a URL pitstop can open either: give an object-store URL as a string "
            f"'{match.group(1)}://bucket/prefix' (a pathlib.Path of one reads "
            f"'{match.group(1)}:/bucket/prefix')"
        )
    raise UnsupportedSetupError(
        f"{os.fspath(root)}: {match.group(1)}:// is not a directory, {why}",
        path=os.fspath(root), phase="plan",
    )  # fmt: skip


def local_path(root: str | os.PathLike[str]) -> str:
    """``root`` as a directory path: a URL refused (:func:`refuse_url`); a ``file:`` URL of
    an absolute local path (``file:///p``, ``file://localhost/p``, ``file:/p``) is ``/p``,
    any other ``file:`` form (another host, a relative path) refused."""
    refuse_url(root)
    path = os.fspath(root)
    match = _URL.match(path)
    if match is None:
        return path
    rest = path[match.end() :]
    for prefix in ("///", "//localhost/"):
        if rest.startswith(prefix):
            rest = "/" + rest[len(prefix) :].lstrip("/")
            break
    if rest.startswith("/") and not rest.startswith("//") and len(rest) > 1:
        return rest
    raise UnsupportedSetupError(
        f"{path}: a file: URL names an absolute path on this host (file:///path); give the "
        "directory itself",
        path=path, phase="plan",
    )  # fmt: skip


def _io_error(e: OSError, what: str, path: str, phase: str) -> CheckpointIOError:
    return CheckpointIOError(
        f"cannot {what}: {e.strerror or e}", errno=e.errno, path=path, phase=phase
    )


class LocalStorage:
    """A root directory; each checkpoint is a subdirectory. See :class:`Storage`."""

    def __init__(self, root: str | os.PathLike[str], io: IOOptions | None = None) -> None:
        self.root = os.path.abspath(local_path(root))
        self.url = self.root
        self.io = io if io is not None else IOOptions.from_env()
        self._writing: dict[str, DirLock] = {}
        self._joined: dict[str, int] = {}  # directories of other ranks' saves, held open
        self._pinned: dict[str, list[int]] = {}  # directory -> fds of pins held (reads use them)
        self._pin_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def _path(self, directory: str, name: str | None = None) -> str:
        if not directory or "/" in directory or directory in (".", ".."):
            raise UnsafePathError(
                f"{directory!r} is not a name directly under the root", path=self.root
            )
        return (
            os.path.join(self.root, directory, name) if name else os.path.join(self.root, directory)
        )

    def _dir(self, directory: str, phase: str = "restore") -> str:
        """The path of ``directory``, which must be a real directory (not a symlink)."""
        path = self._path(directory)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{directory} does not exist", path=path) from None
        except OSError as e:
            raise _io_error(e, f"stat {directory}", path, phase) from e
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(
                f"{directory} is a symbolic link: pitstop does not follow links out of the root",
                path=path,
            )
        if not stat.S_ISDIR(st.st_mode):
            raise CorruptCheckpointError(f"{directory} is not a directory", path=path)
        return path

    # ------------------------------------------------------------------ listing
    def entries(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointNotFoundError(
                f"{self.root} is not a directory", path=self.root
            ) from None
        except OSError as e:
            raise _io_error(e, f"list {self.root}", self.root, "restore") from e

    def entry_kind(self, name: str) -> str:
        """``dir``, ``link`` (a symlink: foreign), ``file``, ``other`` or ``missing``."""
        try:
            mode = os.lstat(self._path(name)).st_mode
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            raise _io_error(e, f"stat {name}", self._path(name), "restore") from e
        if stat.S_ISLNK(mode):
            return "link"
        return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    def has_manifest(self, directory: str) -> bool:
        """Whether ``directory`` holds a manifest; an error other than "no such file" (EACCES,
        EIO) is raised, never taken for "no manifest" (that would make a checkpoint debris)."""
        try:
            path = os.path.join(self._dir(directory), MANIFEST)
        except CheckpointNotFoundError:
            return False
        return self._exists(path, "restore")

    def _exists(self, path: str, phase: str) -> bool:
        try:
            os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _io_error(e, f"stat {os.path.basename(path)}", path, phase) from e
        return True

    def mtime(self, directory: str) -> float:
        """The newest modification time of ``directory`` and the files in it."""
        path = self._dir(directory, "gc")
        try:
            times = [os.lstat(path).st_mtime]
            for name in os.listdir(path):
                with contextlib.suppress(FileNotFoundError):
                    times.append(os.lstat(os.path.join(path, name)).st_mtime)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{directory} does not exist", path=path) from None
        except OSError as e:
            raise _io_error(e, f"list {directory}", path, "gc") from e
        return max(times)

    # ------------------------------------------------------------------ save
    def prepare(self, directory: str) -> str:
        """Create ``directory`` exclusively and hold it until ``commit`` or ``abort``; returns
        its token, by which the other ranks of the save find this very directory (``join``)."""
        final = self._path(directory)
        step = parse_step_dir(directory)
        try:
            os.makedirs(self.root, exist_ok=True)
            if os.path.lexists(final):
                self._clear_debris(directory)
            tmp = self._path(
                writing_dir_name(step if step is not None else 0, uuid.uuid4().hex[:12])
            )
            os.mkdir(tmp)
            lock = try_lock(tmp, exclusive=True)
            assert lock is not None  # nobody else knows the name yet
            token = uuid.uuid4().hex
            owner = {
                "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                "token": token,
            }  # fmt: skip
            write_bytes_durable(
                os.path.join(tmp, OWNER_FILE), json.dumps(owner).encode(), fsync=False
            )
            try:
                os.rename(tmp, final)  # refused if another writer's (non-empty) directory is there
            except OSError as e:
                lock.release()
                shutil.rmtree(tmp, ignore_errors=True)
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise CheckpointExistsError(
                        f"{directory} was created by another writer at the same time",
                        path=final, phase="plan",
                    ) from None  # fmt: skip
                raise
            self._writing[directory] = lock
            return token
            # not made durable here: commit syncs the root once the manifest is in (a crash
            # before that may lose the empty claim, which was not a checkpoint anyway)
        except CheckpointError:
            raise
        except OSError as e:
            raise _io_error(e, f"create {directory}", final, "plan") from e

    def _clear_debris(self, directory: str) -> None:
        """Remove an earlier, dead writer's uncommitted ``directory``; refuse anything else."""
        final = self._path(directory)
        kind = self.entry_kind(directory)
        if kind != "dir":
            raise CheckpointExistsError(
                f"{directory} exists and is a {kind}, not a directory pitstop wrote: not touched",
                path=final, phase="plan",
            )  # fmt: skip
        if self.has_manifest(directory):  # markers that are no evidence move nothing
            aside = aside_kind(self, directory)
            if aside is not None and self._move_aside(directory, aside):
                return  # a damaged or abandoned checkpoint left in use then: out of the way now
            raise CheckpointExistsError(
                f"{directory} is already committed; committed checkpoints are never rewritten",
                path=final, phase="plan",
            )  # fmt: skip
        lock = try_lock(final, exclusive=True)
        if lock is None:
            raise CheckpointExistsError(
                f"{directory} is being written by another process ({self._owner(directory)})",
                path=final, phase="plan",
            )  # fmt: skip
        with lock:
            if not self.has_manifest(directory):
                shutil.rmtree(final)

    def _move_aside(self, directory: str, kind: str) -> bool:
        step = parse_step_dir(directory)
        lock = try_lock(self._path(directory), exclusive=True)
        if lock is None or step is None:
            return False
        with lock:
            target = self._path(aside_dir_name(kind, step, uuid.uuid4().hex[:8]))
            rename_durable(self._path(directory), target, fsync=self.io.fsync)
        return True

    def _owner(self, directory: str) -> str:
        try:
            raw = read_regular(self._path(directory, OWNER_FILE), 4096)
            owner = json.loads(raw)
            return f"pid {owner['pid']} on {owner['host']}"
        except (OSError, CheckpointError, ValueError, KeyError, TypeError):
            return "owner unknown"

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
        path, dir_fd = self._target(directory, name)
        try:  # a file already there (a repair) is replaced, never written through: see
            os.lstat(path, dir_fd=dir_fd)  # write_object
        except FileNotFoundError:
            return write_file(
                path, view, extents, pool=pool, direct=self.io.direct, fsync=self.io.fsync,
                before_extent=before_extent, on_extent=on_extent, dir_fd=dir_fd,
            )  # fmt: skip
        except OSError as e:
            raise _io_error(e, f"stat {name}", self._path(directory, name), "persist") from e
        tmp = os.path.join(os.path.dirname(path), f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            result = write_file(
                tmp, view, extents, pool=pool, direct=self.io.direct, fsync=self.io.fsync,
                before_extent=before_extent, on_extent=on_extent, dir_fd=dir_fd,
            )  # fmt: skip
            os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            if isinstance(e, OSError) and not isinstance(e, CheckpointError):
                raise _io_error(e, f"write {name}", self._path(directory, name), "persist") from e
            raise
        return result

    def join(self, directory: str, token: str) -> None:
        """Another rank's ``prepare``d ``directory``: open it and check that it is the one
        with ``token``, then write into that open directory until ``leave``. A directory
        replaced meanwhile (a restarted job took the step of a dead one) is never written."""
        path = self._path(directory)
        try:
            fd = os.open(
                path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
            )
        except OSError as e:
            raise _io_error(e, f"open {directory}", path, "persist") from e
        try:
            owner = json.loads(read_regular(OWNER_FILE, 4096, fd))
            mine = isinstance(owner, dict) and owner.get("token") == token
        except (OSError, CheckpointError, ValueError) as e:
            os.close(fd)
            raise _io_error(
                OSError(errno.EIO, str(e)), f"check {directory}", path, "persist"
            ) from e
        if not mine:
            os.close(fd)
            raise CheckpointExistsError(
                f"{directory} is no longer the directory this save's rank 0 created (another "
                "writer replaced it): not written", path=path, phase="persist",
            )  # fmt: skip
        self._joined[directory] = fd

    def leave(self, directory: str) -> None:
        fd = self._joined.pop(directory, None)
        if fd is not None:
            os.close(fd)

    def _target(self, directory: str, name: str) -> tuple[str, int | None]:
        """Where a save writes ``name``: relative to the directory it holds open (a directory
        swapped for a symlink after ``prepare`` is not followed), else a checked path."""
        lock = self._writing.get(directory)
        if lock is not None:
            return name, lock.fd
        if directory in self._joined:
            return name, self._joined[directory]
        self._dir(directory, "persist")
        return self._path(directory, name), None

    def write_object(self, directory: str, name: str, data: bytes | memoryview) -> None:
        """Write file ``name`` whole: into a new file, renamed over any old one, so that
        what stood there (a hard link to another checkpoint's file, a FIFO, a symlink) is
        replaced, never written through (a restart rewrites redundancy in committed steps)."""
        path = self._path(directory, name)
        target, dir_fd = self._target(directory, name)
        tmp = os.path.join(os.path.dirname(target), f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            write_bytes_durable(tmp, data, fsync=self.io.fsync, dir_fd=dir_fd, exclusive=True)
            try:
                os.replace(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
        except OSError as e:
            raise _io_error(e, f"write {name}", path, "persist") from e

    def commit(self, directory: str, manifest: bytes) -> None:
        """Make the checkpoint exist: durable manifest under its final name; never replaces one."""
        final = self._path(directory, MANIFEST)
        tmp, dir_fd = self._target(directory, MANIFEST_TMP)
        name = MANIFEST if dir_fd is not None else final
        try:
            write_bytes_durable(tmp, manifest, fsync=self.io.fsync, dir_fd=dir_fd)
            killpoint("commit.before_rename")
            link_no_replace(tmp, name, fsync=self.io.fsync, dir_fd=dir_fd)
            if self.io.fsync:
                fsync_dir(self.root)  # the step directory's own name, from prepare
        except FileExistsError:
            raise CheckpointExistsError(
                f"{directory} was committed by another writer", path=final, phase="commit"
            ) from None
        except OSError as e:
            raise _io_error(e, f"commit {directory}", final, "commit") from e
        lock = self._writing.pop(directory, None)
        if lock is not None:
            lock.release()
        killpoint("commit.after_rename")

    def abort(self, directory: str) -> None:
        """A save of ``directory`` failed: remove what it wrote (if uncommitted) and let go."""
        lock = self._writing.pop(directory, None)
        if lock is None:
            return
        try:
            if not self.has_manifest(directory):
                shutil.rmtree(self._path(directory), ignore_errors=True)
        finally:
            lock.release()

    # ------------------------------------------------------------------ read
    def read_manifest(self, directory: str) -> bytes:
        path = self._path(directory, MANIFEST)
        source, dir_fd = self._source(directory, MANIFEST)
        try:
            return read_regular(source, self.io.max_metadata_bytes, dir_fd)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{directory} has no {MANIFEST}: not a committed checkpoint", path=path
            ) from None
        except OSError as e:
            raise _io_error(e, f"read {path}", path, "restore") from e

    def read_object(self, directory: str, name: str) -> bytes:
        limit = self.io.max_metadata_bytes
        return self._file(
            directory, name, lambda p, d: read_regular(p, limit, d), "read", "restore"
        )

    def file_size(self, directory: str, name: str) -> int:
        return self._file(directory, name, regular_size, "stat", "verify")

    def _file(
        self, directory: str, name: str, fn: Callable[[str, int | None], Any], what: str, phase: str
    ) -> Any:
        """``fn(path, dir_fd)`` of a file of a checkpoint: missing is damage, other OS errors
        are I/O."""
        path = self._path(directory, name)
        source, dir_fd = self._source(directory, name)
        try:
            return fn(source, dir_fd)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{name} is missing", path=path) from None
        except OSError as e:
            raise _io_error(e, f"{what} {name}", path, phase) from e

    def open_data(self, directory: str, name: str) -> FileReader:
        source, dir_fd = self._source(directory, name)
        try:
            return FileReader(source, self.io.direct, dir_fd=dir_fd)
        except CorruptCheckpointError:
            raise
        except CheckpointIOError as e:
            if e.errno == errno.ENOENT:
                raise CorruptCheckpointError(
                    f"{name} is missing", path=self._path(directory, name)
                ) from None
            raise

    # ------------------------------------------------------------------ lifecycle
    def lock(self, directory: str, *, exclusive: bool) -> DirLock | None:
        """Hold ``directory`` (shared: a pin; exclusive: to remove or move it) or None if held.
        While a pin is held, this storage reads the directory's files through it, so a
        directory swapped for a symlink meanwhile is not followed."""
        path = self._dir(directory)
        try:
            lock = try_lock(path, exclusive=exclusive)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{directory} does not exist", path=path) from None
        except OSError as e:
            raise _io_error(e, f"lock {directory}", path, "restore") from e
        if lock is not None and not exclusive:
            fd = lock.fd
            with self._pin_lock:
                self._pinned.setdefault(directory, []).append(fd)
            lock.on_release = lambda: self._unpin(directory, fd)
        return lock

    def _unpin(self, directory: str, fd: int) -> None:
        with self._pin_lock:
            fds = self._pinned.get(directory, [])
            if fd in fds:
                fds.remove(fd)
            if not fds:
                self._pinned.pop(directory, None)

    def _source(self, directory: str, name: str) -> tuple[str, int | None]:
        """Where to read ``name``: relative to a pin of its directory, else a checked path."""
        with self._pin_lock:
            fds = self._pinned.get(directory)
            if fds:
                return name, fds[-1]
        self._dir(directory)
        return self._path(directory, name), None

    def mark(self, directory: str, kind: str, text: str) -> None:
        """Record ``text`` (JSON) as marker ``kind`` of ``directory`` (see format.names.MARKERS),
        atomically: a crash leaves the old marker or the new one."""
        self._dir(directory)
        name = MARKERS[kind]
        tmp, final = self._path(directory, name + ".tmp"), self._path(directory, name)
        try:
            write_bytes_durable(tmp, text.encode(), fsync=self.io.fsync)
            rename_durable(tmp, final, fsync=self.io.fsync)
        except OSError as e:
            raise _io_error(e, f"mark {directory} {kind}", final, "verify") from e

    def read_markers(self, directory: str) -> dict[str, Any]:
        """The markers of ``directory`` by kind, as they are: one that cannot be read as JSON
        reads as a :class:`pitstop.format.markers.Unreadable` saying what it is (a FIFO, a
        directory, too large, not JSON); whether one is evidence is for
        :func:`pitstop.format.markers.usable_markers` to say. An I/O error is raised."""
        out: dict[str, Any] = {}
        for kind, name in MARKERS.items():
            path = self._path(directory, name)
            try:
                st = os.lstat(path)
                what = not_a_marker(st.st_mode, st.st_size)
                if what is None:
                    data = read_regular(path, MAX_MARKER_BYTES)
                    out[kind] = load_json(data, what=name, path=path)
                else:
                    out[kind] = Unreadable(what)
            except FileNotFoundError:
                continue  # none, or removed since we looked
            except OSError as e:
                raise _io_error(e, f"read {name}", path, "restore") from e
            except CheckpointError as e:  # not JSON, or replaced since the lstat
                out[kind] = Unreadable(f"not JSON ({e.message})")
        return out

    def unmark(self, directory: str, kind: str) -> None:
        """Remove marker ``kind`` of ``directory`` durably (none there: nothing to do)."""
        path = self._path(directory, MARKERS[kind])
        try:
            os.unlink(path)
            if self.io.fsync:
                fsync_dir(self._path(directory))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _io_error(e, f"unmark {directory} {kind}", path, "restore") from e

    def uncommit(self, directory: str) -> None:
        path = self._dir(directory, "gc")
        try:
            os.unlink(os.path.join(path, MANIFEST))
            if self.io.fsync:
                fsync_dir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _io_error(e, f"uncommit {directory}", path, "gc") from e

    def remove(self, directory: str) -> None:
        """Remove ``directory`` (a real directory or a regular file under the root); a symlink
        is refused: it is foreign."""
        path = self._path(directory)
        kind = self.entry_kind(directory)
        if kind == "missing":
            return
        if kind == "link":
            raise UnsafePathError(
                f"{directory} is a symbolic link: pitstop does not remove it", path=path
            )
        try:
            if kind == "dir":
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise _io_error(e, f"remove {directory}", path, "gc") from e

    def rename(self, src: str, dst: str) -> None:
        self._dir(src, "gc")
        if os.path.lexists(self._path(dst)):
            raise CheckpointExistsError(f"cannot rename {src}: {dst} exists", path=self._path(dst))
        try:
            rename_durable(self._path(src), self._path(dst), fsync=self.io.fsync)
        except OSError as e:
            raise _io_error(e, f"rename {src}", self._path(src), "gc") from e


class RamStorage(LocalStorage):
    """Checkpoints in RAM (/dev/shm by default): fast, lost with the node. Buffered I/O."""

    def __init__(
        self, root: str | os.PathLike[str] | None = None, io: IOOptions | None = None
    ) -> None:
        base = io if io is not None else IOOptions.from_env()
        if root is None:
            root = os.path.join("/dev/shm", f"pitstop-{os.getuid()}")
        super().__init__(root, dataclasses.replace(base, direct="off", fsync=False))


def open_root(
    root: str | os.PathLike[str] | Any, options_io: IOOptions | None, **knobs: object
) -> tuple[Any, IOOptions]:
    """The storage of ``root`` (a path, or a Storage that is used as it is) and its IOOptions.
    I/O ``knobs`` (threads, chunk_bytes, direct) configure a path; a Storage object brings its
    own, so knobs given with one are refused rather than silently ignored."""
    if object_url(root) is not None:
        from pitstop.storage.object_store import ObjectStorage, object_store_io

        io = object_store_io(options_io, **knobs)
        storage = ObjectStorage(os.fspath(root), io)
        storage.check()  # a missing bucket or refused credentials: said now, not at a flush
        return storage, io
    if isinstance(root, (str, os.PathLike)):  # (a near-URL: LocalStorage refuses it)
        io = options_io or IOOptions.from_env(**knobs)
        return LocalStorage(root, io), io
    if not all(hasattr(root, a) for a in ("io", "url", "prepare", "commit", "open_data")):
        raise TypeError(
            "a checkpoint root is a directory path, a pitstop Storage or a list of levels "
            f"[pitstop.Local(...), pitstop.Shared(...)], not {type(root).__name__}: {root!r}"
        )
    check = getattr(root, "check", None)
    if callable(check):
        check()  # (an ObjectStorage built by hand: its bucket reachable)
    given = [k for k, v in knobs.items() if v is not None]
    if options_io is not None and options_io not in (root.io, IOOptions.from_env()):
        given.append("SaveOptions(io=...)")
    if given:
        raise ValueError(
            f"{', '.join(given)} configure a directory root; {type(root).__name__} brings its "
            "own IOOptions (pass io=IOOptions(...) when you build it)"
        )
    return root, root.io
