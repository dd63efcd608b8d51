"""CheckFreq: the smallest interval whose measured overhead stays under a budget, retuned online."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pitstop.policy.base import PolicyContext, Schedule

__all__ = ["CheckFreq"]


@dataclass
class CheckFreq(Schedule):
    """Pick the checkpoint interval k (iterations) from measurements, and keep picking it.

    After ``warmup`` iterations and ``profile`` more to time them, one checkpoint is
    taken to measure what it costs. From then on, at every iteration,

    * C, the cost of one checkpoint in training time: measured in pairs around each
      checkpoint (its stall, plus how much longer the iterations during its persist took
      than the iterations just before it; the median of the last few), or, before such a
      measurement exists and when the newest is older than ``cost_horizon`` iterations (or
      two intervals, if longer), the model: stall + slowdown beside a persist;
    * k_budget: the smallest k with C / (k * iter) <= max_overhead - d / iter, where d is
      what ``ckpt.step`` itself costs every iteration (bookkeeping; under
      torch.distributed the ranks' vote), paid whatever k is (at least max_overhead / 2);
    * k_persist: the smallest k with k * iter >= persist, so the write pipeline keeps up
      (plus one quiet iteration, the baseline of the next paired measurement);
    * k = max(1, k_budget, k_persist, min_interval); a new paired measurement may shrink
      the interval to it at once (by at most ``max_change`` while under 3 pairs are known:
      one noisy pair can read a checkpoint as free), but grow it by at most a factor
      ``max_change`` (from the last interval a measurement gave; after the first one, from
      ``warmup + profile``);
      without one (pairs dropped on a noisy machine, a slow first save) the model's
      interval grows by at most ``max_change`` per checkpoint taken. Once a few pairs
      agree (the lower estimate of their mean, mean - standard error, is known), the
      interval may grow at once to what that lower estimate allows: the bound is against
      one outlier, and a cost several pairs show is none.

    Why pairs: on a shared machine iterations drift by tens of percent with no checkpoint
    running (a neighbour's job, thermal limits, the page cache), and an overhead measured
    over a window against "quiet" iterations reads that drift as checkpoint cost. Before
    vs during, a few seconds apart, cancels it. Why bounded growth and a horizon: one bad
    measurement (a one-off slow first save) cannot stretch the interval so far that no
    checkpoint, and so no new measurement, comes for hundreds of iterations; and an
    estimate older than ``cost_horizon`` is dropped, so the model's interval re-probes the
    cost. The price: a state that really is expensive to save reaches its long interval
    in a few doublings. (The original CheckFreq only ever grew k by 2 after the fact.)
    """

    max_overhead: float = 0.02
    warmup: int = 5
    profile: int = 10
    min_interval: int = 1
    max_change: float = 2.0
    cost_horizon: int = 500
    interval: int | None = None
    cost_secs: float | None = None
    """The per-checkpoint cost the interval was chosen for."""
    _source: int | None = field(default=None, repr=False)  # step of the measurement in use
    _ref: int = field(default=0, repr=False)  # the interval growth is bounded from
    _paired_k: int | None = field(default=None, repr=False)  # last interval from a measurement

    def __post_init__(self) -> None:
        if not 0 < self.max_overhead < 1:
            raise ValueError(f"CheckFreq needs 0 < max_overhead < 1, got {self.max_overhead}")
        if self.max_change <= 1:
            raise ValueError(f"CheckFreq needs max_change > 1, got {self.max_change}")
        if self.cost_horizon < 1:
            raise ValueError(f"CheckFreq needs cost_horizon >= 1, got {self.cost_horizon}")

    def cost(self, ctx: PolicyContext) -> tuple[float, int | None]:
        """(cost of one checkpoint, step of the paired measurement it comes from or None).
        A measurement is trusted for ``cost_horizon`` steps, or two intervals if longer."""
        horizon = max(self.cost_horizon, 2 * (self._paired_k or 0))
        paired = ctx.paired_cost(horizon)
        if paired is not None and math.isfinite(paired):
            return max(paired, 0.0), ctx.measured_cost_step
        return _finite(ctx.checkpoint_cost(overlapped=True)), None

    def budget(self, ctx: PolicyContext) -> float:
        """The overhead left for checkpoints: ``max_overhead`` less what deciding costs every
        step (``ctx.step_secs``: no interval changes it), and never under half of it (a
        decision that costs more than the budget cannot stop checkpoints)."""
        fixed = _finite(ctx.step_secs) / max(_finite(ctx.iter_secs), 1e-9)
        return max(self.max_overhead - fixed, self.max_overhead / 2)

    def choose(self, ctx: PolicyContext, cost: float | None = None) -> int:
        """The interval in iterations for the current measurements (no bound on the move)."""
        it = max(_finite(ctx.iter_secs), 1e-9)
        if cost is None:
            cost = self.cost(ctx)[0]
        k_budget = _ceil(cost / (self.budget(ctx) * it))
        persist = _finite(ctx.persist_secs)
        k_persist = _ceil(persist / it) + (1 if persist > 0 else 0)
        return max(1, self.min_interval, k_budget, k_persist)

    def decide(self, ctx: PolicyContext) -> bool:
        if not ctx.measured:
            # probe: one checkpoint once iterations are timed, to measure what it costs
            return (
                ctx.checkpoints == 0
                and ctx.iter_secs is not None
                and ctx.step >= self.warmup + self.profile
            )
        cost, source = self.cost(ctx)
        target = self.choose(ctx, cost)
        if source is not None and source != self._source:
            # a new measurement: the interval may shrink to the target at once, but grow only
            # by max_change from the last one a measurement gave (after the first measurement,
            # which may be a one-off slow first save, from a short confirming interval)
            self._source = source
            self._ref = self._paired_k or self._ref
        # the model's interval (no paired measurement yet: dropped pairs, a re-probe) grows in
        # the same bounded steps, one per checkpoint: one slow first save cannot stretch it
        # to hundreds of iterations with no checkpoint and so no new measurement
        cap = _ceil((self._ref or self.warmup + self.profile) * self.max_change)
        low = ctx.measured_cost_low_secs
        if source is not None and low is not None and math.isfinite(low):
            # several pairs agree the checkpoint costs at least ``low``: no outlier, the
            # interval may grow at once to what that supports
            cap = max(cap, self.choose(ctx, max(low, 0.0)))
        k = min(target, cap)
        if source is not None and (low is None or not math.isfinite(low)) and self._ref:
            # under 3 pairs one noisy pair can read a checkpoint as nearly free: the interval
            # shrinks by at most max_change too (at once only once a few pairs agree)
            k = max(k, math.floor(self._ref / self.max_change))
        if source is not None:
            self._paired_k = k
        self.interval, self.cost_secs = k, cost
        since = ctx.iters_since_checkpoint
        take = (ctx.steps_since_checkpoint if since is None else since) >= k
        if take and source is None:
            self._ref = k
        return take

    def explain(self, ctx: PolicyContext) -> str:
        """Why the interval is what it is (``ckpt.stats().policy_reason``, the loop's warning)."""
        name = f"CheckFreq({percent(self.max_overhead)})"
        if not ctx.measured or self.interval is None:
            return f"{name} is warming up: no checkpoint until iterations and one save are timed"
        it = _finite(ctx.iter_secs)
        budget = f"{percent(self.max_overhead)} overhead budget"
        why = (
            f"{name} checkpoints every {self.interval} steps: one checkpoint costs "
            f"{self.cost_secs or 0.0:.3g} s of training (stall {_finite(ctx.stall_secs):.3g} s "
            f"+ slowdown) against {it:.3g} s per step, and more often would exceed the {budget}"
        )
        persist = _finite(ctx.persist_secs)
        if persist > 0 and it > 0 and _ceil(persist / it) + 1 >= self.interval:
            why += f"; a write takes {persist:.3g} s, and the next waits for it"
        return why


_MAX_INTERVAL = 10**9


def _finite(x: float | None) -> float:
    """A measured time as a usable number (a NaN, an infinity or a negative one: 0)."""
    return x if x is not None and math.isfinite(x) and x > 0 else 0.0


def _ceil(x: float) -> int:
    return min(_MAX_INTERVAL, math.ceil(x - 1e-9)) if math.isfinite(x) else _MAX_INTERVAL


def percent(fraction: float) -> str:
    """A budget as the user gave it: 0.02 -> '2%', 0.005 -> '0.5%' (not '0%')."""
    return f"{fraction * 100:.3g}%"
