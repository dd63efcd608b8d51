"""Small durable file operations: fsync'd writes, atomic rename, directory fsync."""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "read_bytes", "rename_durable", "write_bytes_durable"]


def fsync_dir(path: str) -> None:
    """fsync a directory so that entries created or renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durable(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` (replacing it) and fsync the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
