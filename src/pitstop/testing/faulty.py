"""FaultyStorage: wraps any Storage and fails chosen calls, by phase and count."""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

from pitstop.errors import CheckpointIOError
from pitstop.io.parallel import Extent, IOResult
from pitstop.storage.base import Storage

__all__ = ["PHASES", "FaultyStorage"]

PHASES = ("plan", "persist", "commit", "restore", "gc")
"""Phases whose storage calls FaultyStorage can fail: ``prepare`` is plan; data and
objects writes are persist; ``commit``; reads are restore; uncommit/remove/rename are gc."""


class FaultyStorage:
    """Forwards to ``inner``; the N-th call (1-based) of a phase listed in ``fail`` raises
    ``CheckpointIOError`` with ``errno`` (default EIO) instead, without touching ``inner``.

    ``calls`` counts every call by phase, so tests can check what happened.
    """

    def __init__(
        self,
        inner: Storage,
        fail: Mapping[str, Iterable[int]] | None = None,
        *,
        errno: int = errno_mod.EIO,
    ) -> None:
        unknown = set(fail or {}) - set(PHASES)
        if unknown:
            raise ValueError(
                f"FaultyStorage: unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}"
            )
        self.inner = inner
        self.fail = {phase: set(counts) for phase, counts in (fail or {}).items()}
        self.errno = errno
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def io(self) -> Any:
        return self.inner.io

    def _enter(self, phase: str, what: str) -> None:
        with self._lock:
            self.calls[phase] += 1
            n = self.calls[phase]
        if n in self.fail.get(phase, ()):
            raise CheckpointIOError(
                f"injected {errno_mod.errorcode.get(self.errno, self.errno)} in {what} "
                f"({os.strerror(self.errno)})",
                errno=self.errno,
                path=f"{self.url}/{what}",
                phase=phase,
            )

    def entries(self) -> list[str]:
        return self.inner.entries()

    def has_manifest(self, directory: str) -> bool:
        return self.inner.has_manifest(directory)

    def prepare(self, directory: str) -> None:
        self._enter("plan", directory)
        self.inner.prepare(directory)

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
        self._enter("persist", f"{directory}/{name}")
        return self.inner.write_data(directory, name, view, extents, pool=pool, on_extent=on_extent)

    def write_object(self, directory: str, name: str, data: bytes) -> None:
        self._enter("persist", f"{directory}/{name}")
        self.inner.write_object(directory, name, data)

    def commit(self, directory: str, manifest: bytes) -> None:
        self._enter("commit", directory)
        self.inner.commit(directory, manifest)

    def read_manifest(self, directory: str) -> bytes:
        return self.inner.read_manifest(directory)

    def read_object(self, directory: str, name: str) -> bytes:
        self._enter("restore", f"{directory}/{name}")
        return self.inner.read_object(directory, name)

    def file_size(self, directory: str, name: str) -> int:
        return self.inner.file_size(directory, name)

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
        self._enter("restore", f"{directory}/{name}")
        return self.inner.read_data(directory, name, view, extents, pool=pool, on_extent=on_extent)

    def uncommit(self, directory: str) -> None:
        self._enter("gc", directory)
        self.inner.uncommit(directory)

    def remove(self, directory: str) -> None:
        self._enter("gc", directory)
        self.inner.remove(directory)

    def rename(self, src: str, dst: str) -> None:
        self._enter("gc", src)
        self.inner.rename(src, dst)
