"""The Storage protocol: what the engine needs from a place that holds checkpoints.

Names are relative: a *checkpoint directory* (``step-0000001200``) and a *file*
in it (``rank-00000.bin``). Implementations: :class:`LocalStorage` (a directory
on a local or shared file system), :class:`RamStorage` (/dev/shm), and later an
object store; test doubles (``pitstop.testing.FaultyStorage``) wrap any of them.

Call sequence of a save, on the persist thread of each writing rank::

    prepare(d)                         # coordinator: create d; clear debris; refuse a committed d
    write_data(d, f, view, extents)    # every writing rank, its own files
    write_object(d, f, data)           # every rank, its objects file
    commit(d, manifest)                # coordinator, after every rank's data is durable

and of a restore, on the calling thread: ``entries()``, ``read_manifest(d)``,
``file_size``, ``read_object``, ``read_data``. Retention and gc call
``uncommit(d)`` (the manifest goes first, so a crash leaves debris, never a
half-deleted checkpoint that looks committed) and then ``remove(d)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Protocol, runtime_checkable

from pitstop.io.parallel import Extent, IOResult
from pitstop.options import IOOptions

__all__ = ["Storage"]


@runtime_checkable
class Storage(Protocol):
    url: str
    io: IOOptions

    def entries(self) -> list[str]:
        """Names directly under the root (checkpoint directories and debris)."""
        ...

    def has_manifest(self, directory: str) -> bool: ...

    def prepare(self, directory: str) -> None:
        """Create ``directory`` for a new checkpoint; raise CheckpointExistsError if committed."""
        ...

    def write_data(
        self,
        directory: str,
        name: str,
        view: memoryview,
        extents: Sequence[Extent],
        *,
        pool: Executor,
        on_extent: Callable[[Extent], None] | None = None,
    ) -> IOResult: ...

    def write_object(self, directory: str, name: str, data: bytes) -> None: ...

    def commit(self, directory: str, manifest: bytes) -> None:
        """Make the checkpoint exist: durable manifest under its final name, atomically."""
        ...

    def read_manifest(self, directory: str) -> bytes: ...

    def read_object(self, directory: str, name: str) -> bytes: ...

    def file_size(self, directory: str, name: str) -> int: ...

    def read_data(
        self,
        directory: str,
        name: str,
        view: memoryview,
        extents: Sequence[Extent],
        *,
        pool: Executor,
        on_extent: Callable[[Extent], None] | None = None,
    ) -> IOResult: ...

    def uncommit(self, directory: str) -> None:
        """Remove the manifest durably: from here on ``directory`` is debris."""
        ...

    def remove(self, directory: str) -> None: ...

    def rename(self, src: str, dst: str) -> None: ...
