"""FaultyStorage and GateStorage: wrap any Storage to fail or hold chosen calls.

``FaultyStorage(inner, fail={"restore": [1, 2]})`` fails the 1st and 2nd storage calls
of the restore phase; ``fail={"read_object": [1]}`` the first ``read_object`` call.
Every call of the Storage protocol can fail, reads included. Faults are
CheckpointIOError with ``errno`` (default EIO), raised without touching ``inner``.

``GateStorage(inner, hold={"uncommit"})`` stops the calling thread at the first call
of each held method until the test opens it: tests force interleavings (restore while
retention runs) with events, not sleeps::

    gate = GateStorage(LocalStorage(tmp), hold={"uncommit"})
    ...                          # a background save commits, retention calls uncommit
    gate.arrived["uncommit"].wait(5)     # retention is parked inside uncommit
    ...                          # do the concurrent thing
    gate.open("uncommit")        # let it go on

A reader that offers its file in place (``data_view()``, a memory slot's) skips
``read_into``. FaultyStorage passes that hook on only while no fault is configured for
reads (neither ``"restore"`` nor ``"read_into"`` in ``fail``), so an injected read fault
always lands and restore's call numbering is the one without the view; with the hook
passed on, a restore makes no ``read_into`` call and ``bytes_read`` stays 0. GateStorage
passes it on unless ``read_into`` is held.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pitstop.errors import CheckpointIOError
from pitstop.storage.wrap import StorageWrapper

__all__ = ["CALLS", "PHASES", "FaultyStorage", "GateStorage"]

CALLS: dict[str, str] = {
    "prepare": "plan",
    "write_data": "persist",
    "write_object": "persist",
    "commit": "commit",
    "abort": "commit",
    "entries": "restore",
    "entry_kind": "restore",
    "has_manifest": "restore",
    "read_markers": "restore",
    "read_manifest": "restore",
    "lock": "restore",
    "file_size": "restore",
    "read_object": "restore",
    "open_data": "restore",
    "read_into": "restore",
    "mark": "verify",
    "mtime": "gc",
    "uncommit": "gc",
    "remove": "gc",
    "rename": "gc",
}
"""Every storage call and the phase it belongs to."""

PHASES = ("plan", "persist", "commit", "restore", "verify", "gc")
"""Phases whose storage calls FaultyStorage can fail: ``prepare`` is plan; data and objects
writes are persist; ``commit``/``abort``; every read (listing, manifests, markers, pins,
sizes, objects files, data files opened and each read request) is restore; ``mark`` is verify; mtime, uncommit,
remove and rename are gc."""


class _Wrapper(StorageWrapper):
    """Runs ``_before(name, args)`` ahead of every Storage call and ``_after(name, result)``
    once it returned."""

    def _call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if name not in CALLS:
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            self._before(name, args)
            result = fn(*args, **kwargs)
            self._after(name, result)
            return result

        return call

    def _after(self, name: str, result: Any) -> None:
        pass

    def _before(self, name: str, args: tuple[Any, ...]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class FaultyStorage(_Wrapper):
    """Forwards to ``inner``; the N-th call (1-based) of a phase or method named in ``fail``
    raises ``CheckpointIOError`` with ``errno`` instead (a name that is both, ``commit``, is
    the phase). ``calls`` counts calls by phase, ``by_call`` by method, ``bytes_read`` the data
    bytes read through ``read_into`` (an in-place reader's view, passed on while no read
    fault is configured, reads none: see the module docstring)."""

    def __init__(
        self,
        inner: Any,
        fail: Mapping[str, Iterable[int]] | None = None,
        *,
        errno: int = errno_mod.EIO,
    ) -> None:
        unknown = set(fail or {}) - set(PHASES) - set(CALLS)
        if unknown:
            raise ValueError(
                f"FaultyStorage: unknown phases or calls {sorted(unknown)}; "
                f"phases: {', '.join(PHASES)}; calls: {', '.join(CALLS)}"
            )
        super().__init__(inner)
        self.fail = {key: set(counts) for key, counts in (fail or {}).items()}
        self.errno = errno
        self.calls: dict[str, int] = dict.fromkeys(PHASES, 0)
        self.by_call: dict[str, int] = dict.fromkeys(CALLS, 0)
        self.bytes_read = 0  # data bytes read through ``read_into``
        self._lock = threading.Lock()

    def _passes_data_view(self) -> bool:
        return not any(self.fail.get(key) for key in ("restore", "read_into"))

    def _after(self, name: str, result: Any) -> None:
        if name == "read_into":
            with self._lock:
                self.bytes_read += int(result)

    def _before(self, name: str, args: tuple[Any, ...]) -> None:
        phase = CALLS[name]
        with self._lock:
            self.calls[phase] += 1
            self.by_call[name] += 1
            hit = self.calls[phase] in self.fail.get(phase, ())
            if name not in PHASES:
                hit = hit or self.by_call[name] in self.fail.get(name, ())
        if hit:
            what = "/".join(str(a) for a in args[:2] if isinstance(a, str))
            raise CheckpointIOError(
                f"injected {errno_mod.errorcode.get(self.errno, self.errno)} in {name} {what} "
                f"({os.strerror(self.errno)})",
                errno=self.errno,
                path=f"{self.url}/{what}",
                phase=phase,
            )


class GateStorage(_Wrapper):
    """Forwards to ``inner``; the first call of each method in ``hold`` (optionally only
    those whose arguments pass ``when``) sets ``arrived[name]`` and waits until
    ``open(name)``. Later calls pass."""

    def __init__(
        self,
        inner: Any,
        hold: Iterable[str],
        *,
        when: Callable[[str, tuple[Any, ...]], bool] | None = None,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(inner)
        self.hold = set(hold)
        unknown = self.hold - set(CALLS)
        if unknown:
            raise ValueError(f"GateStorage: unknown calls {sorted(unknown)}")
        self.when = when
        self.timeout = timeout
        self.arrived = {name: threading.Event() for name in self.hold}
        self._open = {name: threading.Event() for name in self.hold}
        self._lock = threading.Lock()

    def open(self, name: str) -> None:
        self._open[name].set()

    def _passes_data_view(self) -> bool:
        return "read_into" not in self.hold

    def _before(self, name: str, args: tuple[Any, ...]) -> None:
        if name not in self.hold or (self.when is not None and not self.when(name, args)):
            return
        with self._lock:
            first = not self.arrived[name].is_set()
            self.arrived[name].set()
        if first and not self._open[name].wait(self.timeout):
            raise TimeoutError(f"GateStorage: {name} was never opened")
