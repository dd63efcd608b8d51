"""Which committed checkpoints to keep: small retention policy objects, combinable.

Pure, like the schedule policies: no I/O, no clock, no torch. The manager gives a
policy the committed checkpoints of its run (oldest first) and deletes the ones it
does not keep, never the newest, never a pinned one, never one of another run.

=======================  =======================================================
``KeepLast(n)``          the newest n
``KeepEvery(steps=n)``   the first checkpoint at or after every multiple of n steps
``KeepEvery(secs=s)``    one per s seconds of wall-clock time (e.g. one per hour)
``KeepBest("loss", n)``  the n best by a metric saved with them (``min`` or ``max``)
``a | b`` / ``KeepAny``  a checkpoint kept by any of them
=======================  =======================================================

``CheckpointManager(root, keep_last=3)`` is ``retention=KeepLast(3)``; e.g.
``KeepLast(3) | KeepEvery(secs=3600) | KeepBest("val_loss")`` keeps the three newest,
one per hour forever, and the best one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "CheckpointInfo",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One committed checkpoint as retention sees it."""

    step: int
    created_unix_secs: float
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RetentionPolicy(Protocol):
    """``keep(checkpoints)`` gets committed checkpoints oldest first and returns the steps
    to keep. Called on the persist thread right after a commit, before ``save()`` returns."""

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]: ...


class _Combinable:
    def __or__(self, other: RetentionPolicy) -> KeepAny:
        return KeepAny(self, other)  # type: ignore[arg-type]


@dataclass(frozen=True)
class KeepLast(_Combinable):
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepLast(n) needs n >= 1, got {self.n}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        return {c.step for c in checkpoints[-self.n :]}


@dataclass(frozen=True)
class KeepEvery(_Combinable):
    """Keep the first checkpoint in each window of ``steps`` steps or ``secs`` seconds."""

    steps: int | None = None
    secs: float | None = None

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.secs is None):
            raise ValueError("KeepEvery needs exactly one of steps= or secs=")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"KeepEvery(steps=) must be >= 1, got {self.steps}")
        if self.secs is not None and not (self.secs > 0 and math.isfinite(self.secs)):
            raise ValueError(f"KeepEvery(secs=) must be a positive number, got {self.secs}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        kept: set[int] = set()
        seen: set[int] = set()
        for c in checkpoints:
            if self.steps is not None:
                window = c.step // self.steps
            else:
                window = math.floor(c.created_unix_secs / (self.secs or 1.0))
            if window not in seen:
                seen.add(window)
                kept.add(c.step)
        return kept


@dataclass(frozen=True)
class KeepBest(_Combinable):
    """Keep the ``n`` checkpoints with the best ``metric`` (saved with ``metrics=``);
    checkpoints without the metric are not ranked (other policies decide for them)."""

    metric: str
    n: int = 1
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepBest(n=) must be >= 1, got {self.n}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest(mode=) must be 'min' or 'max', got {self.mode!r}")

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        ranked = [c for c in checkpoints if self.metric in c.metrics]
        sign = 1.0 if self.mode == "min" else -1.0
        ranked.sort(key=lambda c: (sign * c.metrics[self.metric], -c.step))
        return {c.step for c in ranked[: self.n]}


@dataclass(frozen=True, init=False)
class KeepAny(_Combinable):
    """Keep what any of ``policies`` keeps."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("KeepAny needs at least one policy")
        object.__setattr__(self, "policies", tuple(policies))

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(checkpoints)
        return out
