"""Fixed schedules, and AnyPolicy to combine policies (``a | b``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pitstop.policy.base import CheckpointPolicy, PolicyContext, Schedule

__all__ = ["AnyPolicy", "Every", "EveryEpoch", "EveryN", "explain"]


@dataclass
class EveryN(Schedule):
    """Every ``n`` iterations (steps that are multiples of n)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"EveryN needs n >= 1, got {self.n}")

    def decide(self, ctx: PolicyContext) -> bool:
        return ctx.steps_since_checkpoint >= self.n

    def explain(self, ctx: PolicyContext) -> str:
        return f"EveryN({self.n}) checkpoints every {self.n} steps"


@dataclass
class EveryEpoch(Schedule):
    """At the end of every epoch (the manager learns it from ``step(..., epoch_end=True)``)."""

    def decide(self, ctx: PolicyContext) -> bool:
        return ctx.epoch_end

    def explain(self, ctx: PolicyContext) -> str:
        return "EveryEpoch() checkpoints at the end of every epoch (step(..., epoch_end=True))"


@dataclass
class Every(Schedule):
    """Every ``secs`` seconds of training time."""

    secs: float

    def __post_init__(self) -> None:
        if self.secs <= 0:
            raise ValueError(f"Every needs secs > 0, got {self.secs}")

    def decide(self, ctx: PolicyContext) -> bool:
        return ctx.secs_since_checkpoint >= self.secs

    def explain(self, ctx: PolicyContext) -> str:
        return f"Every(secs={self.secs:g}) checkpoints every {self.secs:g} s of training"


@dataclass(init=False)
class AnyPolicy(Schedule):
    """Checkpoint when any of ``policies`` says so (each sees every iteration); what
    ``EveryN(100) | EveryEpoch()`` makes."""

    policies: tuple[CheckpointPolicy, ...] = field(default=())

    def __init__(self, *policies: CheckpointPolicy) -> None:
        if not policies:
            raise ValueError("AnyPolicy needs at least one policy")
        for p in policies:
            if not isinstance(p, CheckpointPolicy):
                raise TypeError(
                    f"AnyPolicy combines schedule policies (with a decide(ctx) method), got {p!r}"
                )
        flat: list[CheckpointPolicy] = []
        for p in policies:  # (a | b) | c: one level
            flat.extend(p.policies if isinstance(p, AnyPolicy) else (p,))
        self.policies = tuple(flat)

    def decide(self, ctx: PolicyContext) -> bool:
        votes = [p.decide(ctx) for p in self.policies]  # every policy updates its state
        return any(votes)

    def explain(self, ctx: PolicyContext) -> str:
        return "; or ".join(explain(p, ctx) for p in self.policies)


def explain(policy: CheckpointPolicy, ctx: PolicyContext) -> str:
    """What ``policy`` says of its schedule now (its ``explain(ctx)``, if it has one)."""
    fn = getattr(policy, "explain", None)
    return str(fn(ctx)) if callable(fn) else f"{policy!r} decides"
