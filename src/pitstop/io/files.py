"""Small durable file operations: fsync'd writes, no-replace commit, bounded safe reads.

Reads of checkpoint files open only regular files (``O_NOFOLLOW``, ``O_NONBLOCK`` and an
``fstat`` check), so a symlink out of the root, a FIFO or a device where a file should be
is refused instead of followed, blocked on or read forever; metadata reads are bounded.
"""

from __future__ import annotations

import errno
import os
import stat

from pitstop.errors import CorruptCheckpointError, UnsafePathError

__all__ = [
    "READ_FLAGS",
    "check_regular",
    "fsync_dir",
    "link_no_replace",
    "open_regular",
    "read_regular",
    "regular_size",
    "rename_durable",
    "write_bytes_durable",
]

READ_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
)
"""Flags for opening a checkpoint file to read: never through a symlink, never blocking on a FIFO."""


def fsync_dir(path: str) -> None:
    """fsync a directory so that entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durable(
    path: str,
    data: bytes | memoryview,
    *,
    fsync: bool = True,
    dir_fd: int | None = None,
    exclusive: bool = False,
) -> None:
    """Write ``data`` to ``path`` (replacing it; never through a symlink; ``exclusive``: a
    new file only) and fsync the file. With ``dir_fd``, ``path`` is a name in that open
    directory."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_EXCL if exclusive else 0
    fd = os.open(path, flags, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def rename_durable(src: str, dst: str, *, fsync: bool = True) -> None:
    """Rename ``src`` to ``dst`` atomically and fsync the directory that holds ``dst``."""
    os.rename(src, dst)
    if fsync:
        fsync_dir(os.path.dirname(dst) or ".")


def link_no_replace(src: str, dst: str, *, fsync: bool = True, dir_fd: int | None = None) -> None:
    """Give the file ``src`` the name ``dst`` atomically, failing with FileExistsError if ``dst``
    exists (a hard link, then ``src`` is unlinked); never replaces what another writer committed.
    Where hard links are not supported, falls back to an existence check and rename. With
    ``dir_fd``, both are names in that open directory."""
    fds = {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}
    try:
        os.link(src, dst, **fds, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        try:
            os.lstat(dst, dir_fd=dir_fd)
        except FileNotFoundError:
            os.rename(src, dst, **fds)
        else:
            raise FileExistsError(errno.EEXIST, "exists", dst) from None
    else:
        os.unlink(src, dir_fd=dir_fd)
    if fsync and dir_fd is not None:
        os.fsync(dir_fd)
    elif fsync:
        fsync_dir(os.path.dirname(dst) or ".")


def check_regular(st: os.stat_result, path: str) -> None:
    """Raise unless ``st`` (of ``path``) is a regular file."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(
            f"{os.path.basename(path)} is a symbolic link: not followed", path=path
        )
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(
            f"{os.path.basename(path)} is not a regular file (a FIFO, device or directory)",
            path=path,
        )


def regular_size(path: str, dir_fd: int | None = None) -> int:
    """Size of the regular file ``path`` (not followed if a symlink; with ``dir_fd``, a name in
    that open directory)."""
    st = os.lstat(path, dir_fd=dir_fd)
    check_regular(st, path)
    return st.st_size


def open_regular(path: str, dir_fd: int | None = None) -> int:
    """Open a regular file to read; a symlink, FIFO or device is refused."""
    try:
        fd = os.open(path, READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{os.path.basename(path)} is a symbolic link: not followed", path=path
            ) from None
        raise
    try:
        check_regular(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int, dir_fd: int | None = None) -> bytes:
    """The whole regular file ``path``, refusing one larger than ``limit`` bytes before reading."""
    fd = open_regular(path, dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpointError(
                f"{os.path.basename(path)} is {size} bytes, more than the limit of {limit} "
                "(IOOptions.max_metadata_bytes)",
                path=path,
            )
        chunks = []
        remaining = size
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
