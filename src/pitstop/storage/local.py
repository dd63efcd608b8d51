"""Checkpoints in a directory of a POSIX file system (local disk, /dev/shm, or shared)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from pitstop.errors import (
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
)
from pitstop.faults import killpoint
from pitstop.format.names import MANIFEST, MANIFEST_TMP
from pitstop.io.files import fsync_dir, read_bytes, rename_durable, write_bytes_durable
from pitstop.io.parallel import Extent, IOResult, read_file, write_file
from pitstop.options import IOOptions

__all__ = ["LocalStorage", "RamStorage"]


class LocalStorage:
    """A root directory; each checkpoint is a subdirectory. See :class:`Storage`."""

    def __init__(self, root: str | os.PathLike[str], io: IOOptions | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.io = io if io is not None else IOOptions.from_env()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def _path(self, directory: str, name: str | None = None) -> str:
        return (
            os.path.join(self.root, directory, name) if name else os.path.join(self.root, directory)
        )

    def entries(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise CheckpointNotFoundError(
                f"{self.root} is not a directory", path=self.root
            ) from None

    def has_manifest(self, directory: str) -> bool:
        return os.path.isfile(self._path(directory, MANIFEST))

    def prepare(self, directory: str) -> None:
        path = self._path(directory)
        try:
            os.makedirs(self.root, exist_ok=True)
            if os.path.isdir(path):
                if self.has_manifest(directory):
                    raise CheckpointExistsError(
                        f"{directory} is already committed; committed checkpoints are never rewritten",
                        path=path,
                        phase="plan",
                    )
                shutil.rmtree(path)  # debris of an interrupted save of the same step
            os.mkdir(path)
            if self.io.fsync:
                fsync_dir(self.root)
        except OSError as e:
            if isinstance(e, CheckpointExistsError):
                raise
            raise CheckpointIOError(
                f"cannot create {path}: {e.strerror}", errno=e.errno, path=path, phase="plan"
            ) from e

    def write_data(
        self,
        directory: str,
        name: str,
        view: memoryview,
        extents: Sequence[Extent],
        *,
        pool: Executor,
        on_extent: Callable[[Extent], None] | None = None,
    ) -> IOResult:
        return write_file(
            self._path(directory, name), view, extents,
            pool=pool, direct=self.io.direct, fsync=self.io.fsync, on_extent=on_extent,
        )  # fmt: skip

    def write_object(self, directory: str, name: str, data: bytes) -> None:
        path = self._path(directory, name)
        try:
            write_bytes_durable(path, data, fsync=self.io.fsync)
        except OSError as e:
            raise CheckpointIOError(
                f"cannot write {name}: {e.strerror}", errno=e.errno, path=path, phase="persist"
            ) from e

    def commit(self, directory: str, manifest: bytes) -> None:
        tmp, final = self._path(directory, MANIFEST_TMP), self._path(directory, MANIFEST)
        try:
            write_bytes_durable(tmp, manifest, fsync=self.io.fsync)
            killpoint("commit.before_rename")
            rename_durable(tmp, final, fsync=self.io.fsync)
        except OSError as e:
            raise CheckpointIOError(
                f"cannot commit {directory}: {e.strerror}",
                errno=e.errno,
                path=final,
                phase="commit",
            ) from e
        killpoint("commit.after_rename")

    def read_manifest(self, directory: str) -> bytes:
        path = self._path(directory, MANIFEST)
        try:
            return read_bytes(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"{directory} has no {MANIFEST}: not a committed checkpoint", path=path
            ) from None
        except OSError as e:
            raise CheckpointIOError(
                f"cannot read {path}: {e.strerror}", errno=e.errno, path=path, phase="restore"
            ) from e

    def read_object(self, directory: str, name: str) -> bytes:
        path = self._path(directory, name)
        try:
            return read_bytes(path)
        except OSError as e:
            raise CheckpointIOError(
                f"cannot read {name}: {e.strerror}", errno=e.errno, path=path, phase="restore"
            ) from e

    def file_size(self, directory: str, name: str) -> int:
        path = self._path(directory, name)
        try:
            return os.stat(path).st_size
        except OSError as e:
            raise CheckpointIOError(
                f"cannot stat {name}: {e.strerror}", errno=e.errno, path=path, phase="verify"
            ) from e

    def read_data(
        self,
        directory: str,
        name: str,
        view: memoryview,
        extents: Sequence[Extent],
        *,
        pool: Executor,
        on_extent: Callable[[Extent], None] | None = None,
    ) -> IOResult:
        return read_file(
            self._path(directory, name),
            view,
            extents,
            pool=pool,
            direct=self.io.direct,
            on_extent=on_extent,
        )

    def uncommit(self, directory: str) -> None:
        path = self._path(directory)
        try:
            os.unlink(os.path.join(path, MANIFEST))
            if self.io.fsync:
                fsync_dir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CheckpointIOError(
                f"cannot uncommit {directory}: {e.strerror}", errno=e.errno, path=path, phase="gc"
            ) from e

    def remove(self, directory: str) -> None:
        path = self._path(directory)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
        except OSError as e:
            raise CheckpointIOError(
                f"cannot remove {directory}: {e.strerror}", errno=e.errno, path=path, phase="gc"
            ) from e

    def rename(self, src: str, dst: str) -> None:
        try:
            rename_durable(self._path(src), self._path(dst), fsync=self.io.fsync)
        except OSError as e:
            raise CheckpointIOError(
                f"cannot rename {src}: {e.strerror}",
                errno=e.errno,
                path=self._path(src),
                phase="gc",
            ) from e


class RamStorage(LocalStorage):
    """Checkpoints in RAM (/dev/shm by default): fast, lost with the node. Buffered I/O."""

    def __init__(
        self, root: str | os.PathLike[str] | None = None, io: IOOptions | None = None
    ) -> None:
        base = io if io is not None else IOOptions.from_env()
        if root is None:
            root = os.path.join("/dev/shm", f"pitstop-{os.getuid()}")
        super().__init__(root, dataclasses.replace(base, direct="off", fsync=False))
