"""Type aliases shared by every layer."""

from __future__ import annotations

from typing import Any

__all__ = ["KeyPath", "StateDict"]

StateDict = dict[str, Any]
"""What ``state_dict()`` returns and ``load_state_dict()`` takes."""

KeyPath = str
"""A '/'-joined path naming one leaf of the state, e.g. ``model/fc.weight``."""
