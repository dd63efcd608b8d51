"""One exception tree for everything pitstop raises.

::

    CheckpointError(Exception)                     step, path, rank, phase
    ├── CheckpointNotFoundError(+FileNotFoundError) no checkpoint where one was asked for
    ├── NotACheckpointError(+ValueError)           a directory that is not a checkpoint
    ├── CheckpointExistsError(+FileExistsError)    that step is already committed
    ├── CorruptCheckpointError                     checksum, size or parse failure
    │   ├── ManifestError(+ValueError)             manifest.json does not parse or validate
    │   └── UnsafePathError(+ValueError)           a name that escapes the checkpoint directory
    ├── FormatVersionError                         written by a newer pitstop: upgrade
    ├── StateMismatchError(+ValueError)            checkpoint and live state disagree (keys named)
    │   └── PartialRestoreError                    failed after part of the live state was overwritten
    ├── UnsupportedValueError(+TypeError)          a value pitstop cannot store (key named)
    ├── PickleRefusedError                         a pickled value without the caller's opt-in
    ├── CheckpointIOError(+OSError)                storage failed (ENOSPC, EIO, ...) after retries
    │   └── ShmSpaceError                          shared memory too small or full for a slot
    ├── UnsupportedSetupError(+RuntimeError)       a setup this pitstop cannot serve yet
    ├── DistributedCheckpointError(+RuntimeError)  another rank failed or did not arrive
    │                                              (every rank raises it; ``ranks`` names them)
    └── MissingExtraError(+ImportError)            an optional dependency is not installed

Only evidence of damage (CorruptCheckpointError: checksum, size, parse) marks a
checkpoint bad and makes restore try an older one; a CheckpointIOError is an
error of the storage, not of the checkpoint, and is raised as it is.

Every error carries ``step``, ``path``, ``rank`` and ``phase`` where known, and
its message names them. An error raised in a background thread is kept and
raised once, from the next call that waits.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "FormatVersionError",
    "ManifestError",
    "MissingExtraError",
    "NotACheckpointError",
    "PartialRestoreError",
    "PickleRefusedError",
    "ShmSpaceError",
    "StateMismatchError",
    "UnsafePathError",
    "UnsupportedSetupError",
    "UnsupportedValueError",
]


class CheckpointError(Exception):
    """Root of every error pitstop raises. ``live_overwritten``: a restore failed after
    writing part of the live state (its message says so)."""

    live_overwritten: bool = False

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        path: str | None = None,
        rank: int | None = None,
        phase: str | None = None,
    ) -> None:
        self.message = message
        self.step = step
        self.path = path
        self.rank = rank
        self.phase = phase
        super().__init__(message)

    def __str__(self) -> str:
        where = []
        if self.phase is not None:
            where.append(f"phase={self.phase}")
        if self.step is not None:
            where.append(f"step={self.step}")
        if self.rank is not None:
            where.append(f"rank={self.rank}")
        if self.path is not None:
            where.append(f"path={self.path}")
        return f"{self.message} [{', '.join(where)}]" if where else self.message


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint exists where one was asked for."""


class NotACheckpointError(CheckpointError, ValueError):
    """A path that is neither a checkpoint root nor a checkpoint directory."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The step is already committed; committed checkpoints are never rewritten."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification (checksum, size or structure)."""


class ManifestError(CorruptCheckpointError, ValueError):
    """manifest.json or an objects file does not parse or does not validate."""


class UnsafePathError(CorruptCheckpointError, ValueError):
    """A file name in a manifest would escape the checkpoint directory."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written in a newer format than this pitstop reads."""


class StateMismatchError(CheckpointError, ValueError):
    """The checkpoint and the live state disagree: missing or unexpected keys, shapes, dtypes."""


class PartialRestoreError(StateMismatchError):
    """Restore failed after part of the live state was overwritten: do not train from it."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state that pitstop cannot store (and pickle was not allowed)."""


class PickleRefusedError(CheckpointError):
    """A pickled value was found and the caller did not opt in to unpickling."""


class CheckpointIOError(CheckpointError, OSError):
    """Storage failed while saving or loading; carries the OS errno where there was one."""

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        step: int | None = None,
        path: str | None = None,
        rank: int | None = None,
        phase: str | None = None,
    ) -> None:
        CheckpointError.__init__(self, message, step=step, path=path, rank=rank, phase=phase)
        self.errno = errno
        self.strerror = _errno.errorcode.get(errno, "") if errno is not None else None
        self.filename = path


class ShmSpaceError(CheckpointIOError):
    """Shared memory (``/dev/shm``) is too small or full for a memory-level slot: found when
    the slot is reserved, never as a SIGBUS at the first copy. ``errno`` is ENOSPC (or the
    reservation's own errno) and ``path`` the slot file. An OSError through
    CheckpointIOError, like every space error of storage; not a MemoryError (the process's
    heap is fine: a file system is full)."""


class UnsupportedSetupError(CheckpointError, RuntimeError):
    """The caller's setup (e.g. several ranks) is one this pitstop does not serve yet."""


class DistributedCheckpointError(CheckpointError, RuntimeError):
    """A collective save or restore failed on some rank (or a rank did not arrive in time):
    every rank raises it, naming the ``phase`` and the failed ``ranks``."""

    def __init__(
        self,
        message: str,
        *,
        ranks: list[int] | None = None,
        step: int | None = None,
        path: str | None = None,
        rank: int | None = None,
        phase: str | None = None,
    ) -> None:
        super().__init__(message, step=step, path=path, rank=rank, phase=phase)
        self.ranks = sorted(ranks or [])


class MissingExtraError(CheckpointError, ImportError):
    """An optional dependency is needed; the message names the pip extra."""
