"""Multi-level checkpoints: node-local every time (with partner or XOR redundancy across
nodes), every Nth flushed to shared storage, restart from the newest level that can deliver.
See :mod:`pitstop.levels.stack` for the call sequence."""

from __future__ import annotations

from pitstop.levels.spec import Local, Shared

__all__ = ["Local", "Shared"]
