"""YoungDaly: the interval that minimizes expected lost time, from the measured cost and the MTBF."""

from __future__ import annotations

from dataclasses import dataclass, field

from pitstop.policy.base import PolicyContext, Schedule
from pitstop.policy.theory import daly_optimum, young_interval

__all__ = ["YoungDaly"]


@dataclass
class YoungDaly(Schedule):
    """Checkpoint every tau seconds of training, tau = Daly's exact optimum
    ``M [1 + W0(-exp(-(C/M + 1)))]`` (``exact=False``: Young's sqrt(2CM)).

    C is the measured cost of one checkpoint: measured in pairs around checkpoints (see
    ``CheckFreq``) while the newest such measurement is at most ``cost_horizon`` steps old, else
    the model's stall plus the slowdown while it persists, or plus the whole persist when
    saves cannot overlap training (``max_in_flight == 1`` and a persist longer than the
    interval). Until a
    checkpoint has been measured, one is taken after ``warmup`` iterations.
    ``mtbf_secs`` is the job's mean time between failures (per-node MTBF / nodes).
    """

    mtbf_secs: float
    restart_secs: float = 0.0
    exact: bool = True
    warmup: int = 5
    cost_horizon: int = 500
    interval_secs: float | None = None
    _memo: tuple[float, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mtbf_secs <= 0:
            raise ValueError(f"YoungDaly needs mtbf_secs > 0, got {self.mtbf_secs}")

    def interval_for(self, cost_secs: float) -> float:
        if self._memo is not None and self._memo[0] == cost_secs:
            return self._memo[1]
        if self.exact:
            tau = daly_optimum(cost_secs, self.mtbf_secs)
        else:
            tau = young_interval(cost_secs, self.mtbf_secs)
        self._memo = (cost_secs, tau)
        return tau

    def explain(self, ctx: PolicyContext) -> str:
        if self.interval_secs is None:
            return f"YoungDaly(mtbf={self.mtbf_secs:g} s) waits for a measured checkpoint cost"
        return (
            f"YoungDaly(mtbf={self.mtbf_secs:g} s) checkpoints every {self.interval_secs:.3g} s "
            "of training: the interval that loses least to checkpoints and failures together"
        )

    def decide(self, ctx: PolicyContext) -> bool:
        if not ctx.measured:
            return ctx.checkpoints == 0 and ctx.step >= self.warmup
        cost = ctx.paired_cost(self.cost_horizon)
        if cost is None:
            cost = ctx.checkpoint_cost(overlapped=True)
        tau = self.interval_for(max(cost, 1e-9))
        if ctx.max_in_flight == 1 and (ctx.persist_secs or 0.0) > tau:
            tau = self.interval_for(ctx.checkpoint_cost(overlapped=False))
        self.interval_secs = tau
        return ctx.secs_since_checkpoint >= tau
