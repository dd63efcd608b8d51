"""Type aliases shared by every layer."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["KeyPath", "StateDict", "Stateful"]

StateDict = dict[str, Any]
"""What ``state_dict()`` returns and ``load_state_dict()`` takes."""

KeyPath = str
"""A '/'-joined path naming one leaf of the state, e.g. ``model/fc.weight``."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, ..."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...
