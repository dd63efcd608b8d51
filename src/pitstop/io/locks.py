"""Directory locks: pins (shared) and exclusive holds, across threads and processes.

A lock is ``flock(2)`` on the directory itself, so it is released when its holder dies
(a SIGKILLed writer leaves debris that ``gc`` may collect, never a stale lock) and it
works between two managers of one process as well as between processes. Where the
file system has no ``flock`` (some network file systems), a process-local table keeps
the same rules inside this process.

Holders: a save holds its step directory exclusively from creation to commit; restore,
load, export and verify pin (share) a committed one while they read it; retention,
gc and set-aside take it exclusively without waiting and skip it when it is held.

Call sequence: any thread; ``try_lock`` never blocks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
from collections.abc import Callable
from types import TracebackType

__all__ = ["DirLock", "pid_alive", "try_lock"]

_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}
_table_lock = threading.Lock()
_table: dict[tuple[int, int], int] = {}  # (dev, ino) -> holders: >0 shared count, -1 exclusive


class DirLock:
    """A held lock on one directory; ``release()`` (or leaving the ``with`` block) drops it."""

    def __init__(self, fd: int, key: tuple[int, int], local: bool, exclusive: bool) -> None:
        self.fd, self.key, self.local, self.exclusive = fd, key, local, exclusive
        self.on_release: Callable[[], None] | None = None  # the holder's bookkeeping
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.on_release is not None:
            self.on_release()
        if self.local:
            with _table_lock:
                held = _table.get(self.key, 0)
                held = 0 if held < 0 else held - 1
                if held:
                    _table[self.key] = held
                else:
                    _table.pop(self.key, None)
        os.close(self.fd)  # drops the flock

    def __enter__(self) -> DirLock:
        return self

    def __exit__(
        self, tp: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _local_acquire(key: tuple[int, int], exclusive: bool) -> bool:
    with _table_lock:
        held = _table.get(key, 0)
        if exclusive:
            if held:
                return False
            _table[key] = -1
        else:
            if held < 0:
                return False
            _table[key] = held + 1
    return True


def try_lock(path: str, *, exclusive: bool) -> DirLock | None:
    """Lock the directory ``path`` now or return None if it is held in a conflicting way.

    Raises FileNotFoundError if ``path`` does not exist, NotADirectoryError if it is not a
    directory (a symlink is not followed: OSError ELOOP/ENOTDIR).
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            if not _local_acquire(key, exclusive):
                os.close(fd)
                return None
            return DirLock(fd, key, True, exclusive)
        return DirLock(fd, key, False, exclusive)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (one of another user counts); a zombie (dead,
    its parent not having waited for it yet) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read(4096).rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (or it just went): the kill said it exists
    return state not in (b"Z", b"X")
