"""CheckFreq: the smallest interval whose measured overhead stays under a budget, retuned online."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pitstop.policy.base import PolicyContext

__all__ = ["CheckFreq"]


@dataclass
class CheckFreq:
    """Pick the checkpoint interval k (iterations) from measurements, and keep picking it.

    After ``warmup`` iterations and ``profile`` more to time them, one checkpoint is
    taken to measure its stall and persist time. From then on, at every iteration,

    * k_budget: the smallest k with (stall + slowdown) / (k * iter) <= max_overhead;
    * k_persist: the smallest k with k * iter >= persist, so the write pipeline keeps up
      (persists run one after another; ``max_in_flight`` > 1 only absorbs jitter);
    * k = max(1, k_budget, k_persist, min_interval).

    Unlike the original (which only ever grew k by 2 after the fact), k follows the
    measurements both ways: a slower disk or faster iterations raise it, and the
    reverse lowers it. A save that has to wait for a free arena shows up as a larger
    stall, which raises k too. The model is corrected by what is observed: while the
    measured overhead of recent iterations exceeds the budget, k is scaled up by 1.5
    (at most once per interval); while it stays under half the budget, the scale
    relaxes back towards 1.
    """

    max_overhead: float = 0.02
    warmup: int = 5
    profile: int = 10
    min_interval: int = 1
    interval: int | None = None
    scale: float = 1.0
    """Feedback on the model: grows while the observed overhead exceeds the budget, shrinks
    back (never below 1) while it stays under half of it."""
    _last_adjust: int = field(default=-(10**9), repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_overhead < 1:
            raise ValueError(f"CheckFreq needs 0 < max_overhead < 1, got {self.max_overhead}")

    def choose(self, ctx: PolicyContext) -> int:
        """The interval in iterations for the current measurements."""
        it = max(ctx.iter_secs or 0.0, 1e-9)
        cost = ctx.checkpoint_cost(overlapped=True)
        k_budget = math.ceil(cost / (self.max_overhead * it) - 1e-9)
        k_persist = math.ceil((ctx.persist_secs or 0.0) / it - 1e-9)
        return max(1, self.min_interval, k_budget, k_persist)

    def decide(self, ctx: PolicyContext) -> bool:
        if not ctx.measured:
            # probe: one checkpoint once iterations are timed, to measure what it costs
            return (
                ctx.checkpoints == 0
                and ctx.iter_secs is not None
                and ctx.step >= self.warmup + self.profile
            )
        self._feedback(ctx)
        self.interval = max(1, math.ceil(self.choose(ctx) * self.scale - 1e-9))
        return ctx.steps_since_checkpoint >= self.interval

    def _feedback(self, ctx: PolicyContext) -> None:
        """The model misses costs it cannot see (cache and memory-bandwidth contention, a busy
        disk); the measured overhead corrects it, at most once per interval."""
        seen = ctx.observed_overhead
        if seen is None or ctx.step - self._last_adjust < max(self.interval or 1, 20):
            return
        if seen > self.max_overhead:
            self.scale *= 1.5
        elif seen < self.max_overhead / 2 and self.scale > 1.0:
            self.scale = max(1.0, self.scale / 1.25)
        else:
            return
        self._last_adjust = ctx.step
