"""Fixed schedules, and Any to combine policies."""

from __future__ import annotations

from dataclasses import dataclass, field

from pitstop.policy.base import CheckpointPolicy, PolicyContext

__all__ = ["Any", "Every", "EveryEpoch", "EveryN"]


@dataclass
class EveryN:
    """Every ``n`` iterations (steps that are multiples of n)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"EveryN needs n >= 1, got {self.n}")

    def decide(self, ctx: PolicyContext) -> bool:
        return ctx.steps_since_checkpoint >= self.n


@dataclass
class EveryEpoch:
    """At the end of every epoch (the manager learns it from ``step(..., epoch_end=True)``)."""

    def decide(self, ctx: PolicyContext) -> bool:
        return ctx.epoch_end


@dataclass
class Every:
    """Every ``secs`` seconds of training time."""

    secs: float

    def __post_init__(self) -> None:
        if self.secs <= 0:
            raise ValueError(f"Every needs secs > 0, got {self.secs}")

    def decide(self, ctx: PolicyContext) -> bool:
        return ctx.secs_since_checkpoint >= self.secs


@dataclass(init=False)
class Any:
    """Checkpoint when any of ``policies`` says so (each sees every iteration)."""

    policies: tuple[CheckpointPolicy, ...] = field(default=())

    def __init__(self, *policies: CheckpointPolicy) -> None:
        if not policies:
            raise ValueError("Any needs at least one policy")
        self.policies = policies

    def decide(self, ctx: PolicyContext) -> bool:
        votes = [p.decide(ctx) for p in self.policies]  # every policy updates its state
        return any(votes)
