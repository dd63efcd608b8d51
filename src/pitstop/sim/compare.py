"""Many seeds of many policies on one job: means and spreads, for tables and plots."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pitstop.policy import CheckFreq, CheckpointPolicy, EveryEpoch, EveryN, ValueAware, YoungDaly
from pitstop.sim.engine import RunResult, simulate
from pitstop.sim.model import FailureModel, JobModel, LossModel

__all__ = ["PolicySummary", "compare", "default_policies"]


@dataclass(frozen=True)
class PolicySummary:
    name: str
    runs: tuple[RunResult, ...]

    def mean(self, metric: Callable[[RunResult], float]) -> float:
        return statistics.fmean(metric(r) for r in self.runs)

    def std(self, metric: Callable[[RunResult], float]) -> float:
        values = [metric(r) for r in self.runs]
        return statistics.stdev(values) if len(values) > 1 else 0.0

    def row(self) -> dict[str, float | str]:
        return {
            "policy": self.name,
            "wall_hours": self.mean(lambda r: r.wall_secs) / 3600,
            "wall_hours_std": self.std(lambda r: r.wall_secs) / 3600,
            "goodput": self.mean(lambda r: r.goodput),
            "checkpoint_overhead": self.mean(lambda r: r.checkpoint_secs / r.wall_secs),
            "lost_hours": self.mean(lambda r: r.lost_secs) / 3600,
            "lost_per_failure_secs": self.mean(lambda r: r.lost_per_failure_secs),
            "restart_hours": self.mean(lambda r: r.restart_secs) / 3600,
            "checkpoints": self.mean(lambda r: r.checkpoints),
            "failures": self.mean(lambda r: r.failures),
            "ft_overhead_hours": self.mean(lambda r: r.ft_overhead_secs) / 3600,
            "value_ft_overhead_hours": self.mean(lambda r: r.value_ft_overhead_secs) / 3600,
        }


def default_policies(job: JobModel, failures: FailureModel) -> dict[str, CheckpointPolicy]:
    """The policies ``pitstop simulate --policy all`` compares."""
    policies: dict[str, CheckpointPolicy] = {}
    if job.iterations_per_epoch:
        policies["EveryEpoch"] = EveryEpoch()
    policies["EveryN(100)"] = EveryN(100)
    policies["YoungDaly"] = YoungDaly(mtbf_secs=failures.mtbf_secs)
    policies["CheckFreq(2%)"] = CheckFreq(0.02)
    policies["ValueAware"] = ValueAware(mtbf_secs=failures.mtbf_secs, horizon_secs=job.work_secs)
    return policies


def compare(
    job: JobModel,
    failures: FailureModel,
    policies: Mapping[str, CheckpointPolicy],
    *,
    seeds: int = 5,
    loss: LossModel | None = None,
    record_first: bool = False,
) -> list[PolicySummary]:
    """Simulate every policy on the same failure traces (seed i gives every policy the same
    failures), and summarize."""
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ValueError(f"compare: seeds must be an integer >= 1, got {seeds!r}")
    out = []
    for name, policy in policies.items():
        runs = tuple(
            simulate(
                job, failures, policy, seed=s, loss=loss, name=name, record=record_first and s == 0
            )
            for s in range(seeds)
        )
        out.append(PolicySummary(name, runs))
    return out
