"""RetryingStorage: transient storage errors are retried with backoff, then raised.

An I/O error is an error of the storage, not evidence that a checkpoint is damaged:
it is retried ``io.retries`` times in all (backoff ``io.retry_backoff_secs`` doubling)
and then raised as the CheckpointIOError it is. It never marks anything damaged and
never makes restore fall back to an older checkpoint.

Reads and small metadata operations are retried on any CheckpointIOError but a permanent
one (EACCES, EPERM, EINVAL: an object store's 403 and 400 too); a data
write (``write_data``, ``prepare``) only on errors that can pass (EIO, EAGAIN,
ETIMEDOUT, ...), since rewriting a large file for ENOSPC only wastes time.

A reader's in-place ``data_view()`` hook (a memory slot's) is passed on: a view of bytes
already in memory has no I/O to retry, and hiding it would make a restore from memory
copy every byte through the read buffers.

Call sequence: as :class:`Storage`; the engine wraps the user's storage once.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from typing import Any

from pitstop.errors import CheckpointIOError
from pitstop.log import get_logger
from pitstop.storage.wrap import StorageWrapper

__all__ = ["PERMANENT_ERRNOS", "TRANSIENT_ERRNOS", "RetryingStorage"]

_log = get_logger("pitstop.storage")

TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR, errno.EBUSY, errno.ESTALE,
     errno.ECONNRESET, errno.ECONNABORTED, errno.ENOLCK, errno.EREMOTEIO}
)  # fmt: skip
PERMANENT_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENAMETOOLONG})
"""Errors no retry can pass (refused permission, a malformed request): raised at once."""
_RETRY_ANY = frozenset(
    {"entries", "entry_kind", "has_manifest", "mtime", "read_manifest", "read_object",
     "file_size", "open_data", "read_into", "write_object", "commit", "mark", "read_markers",
     "uncommit", "unmark", "remove"}
)  # fmt: skip
_RETRY_TRANSIENT = frozenset({"prepare", "write_data"})


class RetryingStorage(StorageWrapper):
    """Wraps any Storage; see the module docstring."""

    def _call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _RETRY_ANY:
            return self._wrap(fn, name, transient_only=False)
        if name in _RETRY_TRANSIENT:
            return self._wrap(fn, name, transient_only=True)
        return fn

    def _passes_data_view(self) -> bool:
        return True  # a view does no I/O: nothing to retry

    def _wrap(
        self, fn: Callable[..., Any], name: str, *, transient_only: bool
    ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            attempts = max(1, int(self.io.retries))
            delay = float(self.io.retry_backoff_secs)
            for attempt in range(1, attempts + 1):
                try:
                    return fn(*args, **kwargs)
                except CheckpointIOError as e:
                    retry = (
                        not transient_only and e.errno not in PERMANENT_ERRNOS
                    ) or e.errno in TRANSIENT_ERRNOS
                    if not retry or attempt == attempts:
                        if attempt > 1:
                            e.message = f"{e.message} (after {attempt} attempts)"
                        raise
                    _log.warning(
                        "%s failed (%s); retrying in %.2f s (attempt %d of %d)",
                        name, e.message, delay, attempt + 1, attempts, phase=e.phase or "restore",
                    )  # fmt: skip
                    time.sleep(delay)
                    delay *= 2
            raise AssertionError("unreachable")  # pragma: no cover

        return call
