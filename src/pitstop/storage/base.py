"""The Storage protocol: what the engine needs from a place that holds checkpoints.

Names are relative: a *checkpoint directory* (``step-0000001200``) and a *file*
in it (``rank-00000.bin``). Implementations: :class:`LocalStorage` (a directory
on a local or shared file system), :class:`RamStorage` (/dev/shm), and later an
object store; :class:`RetryingStorage` retries transient errors of any of them;
test doubles (``pitstop.testing.FaultyStorage``, ``GateStorage``) wrap any of them.

Call sequence of a save, on the persist thread of each writing rank::

    prepare(d)                         # coordinator: create d exclusively and hold it;
                                       #   CheckpointExistsError if committed or being written
    write_data(d, f, view, extents)    # every writing rank, its own files
    write_object(d, f, data)           # every rank, its objects file
    commit(d, manifest)                # coordinator, after every rank's data is durable;
                                       #   never replaces a manifest; lets go of d
    abort(d)                           # instead of commit, after a failure

of a restore, on the calling thread: ``entries()``, ``entry_kind(n)``,
``read_manifest(d)``, ``lock(d, exclusive=False)`` (a pin, held while reading),
``file_size``, ``read_object``, ``open_data`` (a reader whose ``read_into`` the reader
threads call with their own buffers); ``mark(d, "damaged", why)`` when
verification fails (``read_markers(d)`` reads them back). Retention and gc take ``lock(d, exclusive=True)`` (None:
pinned, skip it), then ``uncommit(d)`` (the manifest goes first, so a crash leaves
debris, never a half-deleted checkpoint that looks committed) and ``remove(d)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, runtime_checkable

from pitstop.io.locks import DirLock
from pitstop.io.parallel import Extent, IOResult
from pitstop.options import IOOptions

__all__ = ["DataReader", "Storage"]


@runtime_checkable
class DataReader(Protocol):
    """Positional reads of one data file, safe from several threads at once."""

    direct: bool
    """True when offsets, lengths and buffer addresses must be multiples of ALIGN_BYTES."""

    def read_into(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` with the bytes at ``offset``; how many there were (fewer only at the
        end of the file). CheckpointIOError on an I/O error."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    url: str
    io: IOOptions

    def entries(self) -> list[str]:
        """Names directly under the root (checkpoint directories and debris)."""
        ...

    def entry_kind(self, name: str) -> str:
        """``dir``, ``link`` (foreign: never followed), ``file``, ``other`` or ``missing``."""
        ...

    def has_manifest(self, directory: str) -> bool: ...

    def mtime(self, directory: str) -> float:
        """Newest modification time in ``directory`` (gc keeps recently written debris)."""
        ...

    def prepare(self, directory: str) -> str:
        """Create ``directory`` for a new checkpoint and hold it until commit or abort; returns
        a token naming this very directory, for the other ranks' ``join``."""
        ...

    def join(self, directory: str, token: str) -> None:
        """Another rank's save: write into the ``directory`` its coordinator prepared (checked
        by ``token``; a replaced one is refused) until ``leave``."""
        ...

    def leave(self, directory: str) -> None: ...

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
        """Write the extents of ``view`` to data file ``name``, in parallel, durably.
        ``before_extent(e)`` runs in the writer thread before ``e`` is written (the bytes may
        still be arriving), ``on_extent(e)`` after (the checksums)."""
        ...

    def write_object(self, directory: str, name: str, data: bytes | memoryview) -> None: ...

    def commit(self, directory: str, manifest: bytes) -> None:
        """Make the checkpoint exist: durable manifest under its final name, atomically."""
        ...

    def abort(self, directory: str) -> None:
        """Remove an uncommitted ``directory`` this storage prepared, and let go of it."""
        ...

    def read_manifest(self, directory: str) -> bytes: ...

    def read_object(self, directory: str, name: str) -> bytes: ...

    def file_size(self, directory: str, name: str) -> int: ...

    def open_data(self, directory: str, name: str) -> DataReader:
        """A reader of data file ``name`` (close it when done; the caller has checked its
        size). ``reader.direct`` says whether its requests must be aligned."""
        ...

    def lock(self, directory: str, *, exclusive: bool) -> DirLock | None:
        """Pin (shared) or hold (exclusive) ``directory`` without waiting; None if held."""
        ...

    def mark(self, directory: str, kind: str, text: str) -> None:
        """Write marker ``kind`` (damaged, abandoned, rollback) of ``directory``: JSON ``text``."""
        ...

    def read_markers(self, directory: str) -> dict[str, Any]:
        """The parsed markers of ``directory`` by kind (``{}`` for one that does not parse)."""
        ...

    def unmark(self, directory: str, kind: str) -> None:
        """Remove marker ``kind`` of ``directory`` (a node's copy of a step made whole again)."""
        ...

    def uncommit(self, directory: str) -> None:
        """Remove the manifest durably: from here on ``directory`` is debris."""
        ...

    def remove(self, directory: str) -> None: ...

    def rename(self, src: str, dst: str) -> None: ...
