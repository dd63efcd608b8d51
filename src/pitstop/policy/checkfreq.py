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
    reverse lowers it. A save that has to wait for a free arena, or an optimizer step
    that waits for the copy, shows up as a larger stall, which raises k too.

    The model cannot see every cost (cache and memory-bandwidth contention, a busy
    disk), so it is checked against what is measured: at most once per interval, the
    observed overhead of recent iterations (against iterations with no checkpoint work)
    gives the cost a checkpoint really has, C_obs = observed x k x iter, hence
    k_obs = observed x k / max_overhead; k_obs is smoothed (half old, half new) and
    k = max(k_model, k_obs). Its fixed point does not depend on k, so it settles in a
    few adjustments, and falls back to the model when the observed cost drops.
    """

    max_overhead: float = 0.02
    warmup: int = 5
    profile: int = 10
    min_interval: int = 1
    interval: int | None = None
    observed_interval: float | None = None
    """k_obs, the interval the measured overhead asks for (smoothed); None until measured."""
    _last_adjust: int = field(default=-(10**9), repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_overhead < 1:
            raise ValueError(f"CheckFreq needs 0 < max_overhead < 1, got {self.max_overhead}")

    def choose(self, ctx: PolicyContext) -> int:
        """The interval in iterations for the current measurements."""
        it = max(ctx.iter_secs or 0.0, 1e-9)
        cost = ctx.checkpoint_cost(overlapped=True)
        k_budget = math.ceil(cost / (self.max_overhead * it) - 1e-9)
        persist = ctx.persist_secs or 0.0
        # the pipeline must keep up, with one quiet iteration between persists (the baseline
        # that the observed overhead is measured against stays fresh)
        k_persist = math.ceil(persist / it - 1e-9) + (1 if persist > 0 else 0)
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
        k = self.choose(ctx)
        if self.observed_interval is not None:
            k = max(k, math.ceil(self.observed_interval - 1e-9))
        self.interval = k
        return ctx.steps_since_checkpoint >= self.interval

    def _feedback(self, ctx: PolicyContext) -> None:
        """Update k_obs from the measured overhead, at most once per interval."""
        seen = ctx.observed_overhead
        if (
            seen is None
            or self.interval is None
            or ctx.step - self._last_adjust < max(self.interval, 20)
        ):
            return
        k_obs = max(seen, 0.0) * self.interval / self.max_overhead
        previous = self.observed_interval
        self.observed_interval = k_obs if previous is None else 0.5 * (previous + k_obs)
        self._last_adjust = ctx.step
