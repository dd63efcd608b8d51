"""What the simulator simulates: a job, its checkpoint costs, its failures, its value. No torch.

Times are seconds. A *job* needs ``work_secs`` of compute (``iterations`` x
``iter_secs``). A checkpoint stalls the loop ``stall_secs``, then persists in the
background for ``persist_secs`` and counts once committed; the slowdown of training
beside the persist (``slowdown_secs`` in all) is charged with the stall, so that a
run without failures takes exactly work + (stall + slowdown) x checkpoints; the persist
begins when the stall ends (the slowdown does not delay its commit). A failure loses the
work since the last committed checkpoint and costs ``restart_secs``. A host whose speed drifts (a shared
machine, a neighbour's job) is a ``speed_trace``: from each listed wall-clock time on,
an iteration takes ``iter_secs`` x that factor (the work it does is still ``iter_secs``).

Failures come from an exponential process (``weibull_shape=1``), a Weibull renewal
process (shape < 1: failures cluster, as Tiwari et al. observed), or a trace of
failure times. The job's MTBF is the per-node MTBF divided by the node count.
Multi-level jobs give each failure a *class* (process crash, node loss,
catastrophe), each recovered from the cheapest level that survives it.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import random
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["FailureClass", "FailureModel", "JobModel", "LossModel", "load_profile", "load_trace"]


@dataclass(frozen=True)
class JobModel:
    iter_secs: float
    stall_secs: float
    persist_secs: float
    iterations: int
    slowdown_secs: float = 0.0
    restart_secs: float = 60.0
    max_in_flight: int = 2
    iterations_per_epoch: int | None = None
    cost_noise_secs: float = 0.0
    """Standard deviation of one checkpoint's cost as the loop measures it (its stall plus
    the excess of the iterations beside its persist: noisy on a shared machine). The
    policies see what the profiler would: a first estimate from one noisy checkpoint, then
    the mean of the last 16 plus its standard error; 0: the true cost at once."""
    measured_cost_secs: float | None = None
    """The mean of what the loop's profiler measures one checkpoint to cost, when it is not
    the cost charged (``stall_secs + slowdown_secs``, the default): the profiler leaves out
    each process's first save and drops a pair across which the host changed speed, while
    the run pays for both. With the cost charged as the one measured, the model's CheckFreq
    grew its interval to 120-240 steps where the real one, measuring 0.07 s a checkpoint
    against 0.29 s charged, stayed at 30-60 (``benchmarks/goodput.py``: 15 points below)."""
    speed_trace: tuple[tuple[float, float], ...] | None = None
    """``(wall secs, factor)`` pairs, times increasing: from that time on (until the next)
    an iteration takes ``iter_secs * factor`` of wall-clock time; before the first, 1. A
    checkpoint begun then stalls ``stall_secs * factor``, slows training by ``slowdown_secs *
    factor`` and persists for ``persist_secs * factor``: a slower host is slower at a save's
    work too (the costs are those of the host at factor 1)."""

    def __post_init__(self) -> None:
        for f in (
            "iter_secs", "stall_secs", "persist_secs", "slowdown_secs", "restart_secs",
            "cost_noise_secs",
        ):  # fmt: skip
            if getattr(self, f) < 0:
                raise ValueError(f"JobModel.{f} must be >= 0, got {getattr(self, f)}")
        if self.measured_cost_secs is not None and not self.measured_cost_secs >= 0:
            raise ValueError(
                f"JobModel.measured_cost_secs must be >= 0, got {self.measured_cost_secs}"
            )
        if self.iter_secs <= 0 or self.iterations < 1:
            raise ValueError("JobModel needs iter_secs > 0 and iterations >= 1")
        if self.speed_trace is not None:
            times = [t for t, _ in self.speed_trace]
            if times != sorted(times) or any(not f > 0 for _, f in self.speed_trace):
                raise ValueError("JobModel.speed_trace needs increasing times and factors > 0")

    def speed_at(self, t: float) -> float:
        """The host's factor at ``t``: how much longer than at factor 1 its work takes."""
        trace = self.speed_trace
        if not trace:
            return 1.0
        i = bisect.bisect_right(trace, t, key=lambda p: p[0])
        return trace[i - 1][1] if i else 1.0

    def iter_secs_at(self, t: float) -> float:
        """Wall-clock time of an iteration that starts at ``t`` (``iter_secs`` on a steady host)."""
        return self.iter_secs * self.speed_at(t)

    @property
    def work_secs(self) -> float:
        return self.iter_secs * self.iterations

    @classmethod
    def for_hours(cls, hours: float, **kw: Any) -> JobModel:
        """A job of ``hours`` of compute."""
        return cls(iterations=max(1, round(hours * 3600 / kw["iter_secs"])), **kw)


@dataclass(frozen=True)
class FailureClass:
    """A kind of failure: its share of all failures, and the extra restart cost of recovering
    from the level that survives it (e.g. rebuilding from a partner, fetching from shared storage)."""

    name: str
    share: float
    extra_restart_secs: float = 0.0


@dataclass(frozen=True)
class FailureModel:
    """Failures of the whole job: exponential or Weibull inter-arrival times, or a trace."""

    mtbf_secs: float
    weibull_shape: float = 1.0
    trace: tuple[float, ...] | None = None
    classes: tuple[FailureClass, ...] = ()
    restart_trace: tuple[float, ...] = ()
    """The restart time of each failure, in order, as measured (the i-th failure's restart
    takes ``restart_trace[i]`` instead of ``JobModel.restart_secs``; failures past its end
    take that). Restarts vary (0.15-0.45 s in ``benchmarks/goodput.py``): with their mean
    for every one, the model drifted a few tenths of a second off the measured run, and a
    checkpoint a real run took just before a kill fell just after it in the model."""

    trace_jitter_secs: float = 0.0
    """How well the trace's times are known against the model's clock: each run (seed) moves
    each failure by a uniform draw in +-this. A measured run's speed is known per second and
    its costs as means, so the model's iterations are a few off the run's by the time of a
    kill (2 % over 11 s in ``benchmarks/goodput.py``); with failures at their exact times, a
    checkpoint the run took a step before a kill fell a step after it in the model, or the
    other way round, and a fixed interval of 40 steps moved the prediction by 6 points. The
    prediction is then a mean over seeds, with its spread."""

    def __post_init__(self) -> None:
        if any(not r >= 0 for r in self.restart_trace):
            raise ValueError("FailureModel.restart_trace needs restart times >= 0")
        if not self.trace_jitter_secs >= 0:
            raise ValueError("FailureModel.trace_jitter_secs must be >= 0")

    def restart_of(self, i: int, default: float) -> float:
        """The restart time of the ``i``-th failure (from 0): measured, or ``default``."""
        return self.restart_trace[i] if i < len(self.restart_trace) else default

    @classmethod
    def per_node(cls, mtbf_hours_per_node: float, nodes: int, **kw: Any) -> FailureModel:
        return cls(mtbf_secs=mtbf_hours_per_node * 3600 / max(1, nodes), **kw)

    def times(self, horizon_secs: float, rng: random.Random) -> list[float]:
        """Failure times in [0, horizon) of wall-clock time."""
        if self.trace is not None:
            j = self.trace_jitter_secs
            moved = [max(t + rng.uniform(-j, j), 0.0) for t in self.trace] if j else self.trace
            return sorted(t for t in moved if 0 <= t < horizon_secs)
        out: list[float] = []
        t = 0.0
        k = self.weibull_shape
        scale = self.mtbf_secs / math.gamma(1 + 1 / k)  # so that the mean gap is the MTBF
        while True:
            t += rng.weibullvariate(scale, k) if k != 1.0 else rng.expovariate(1 / self.mtbf_secs)
            if t >= horizon_secs:
                return out
            out.append(t)

    def pick_class(self, rng: random.Random) -> FailureClass | None:
        if not self.classes:
            return None
        x = rng.random() * sum(c.share for c in self.classes)
        for c in self.classes:
            x -= c.share
            if x <= 0:
                return c
        return self.classes[-1]


@dataclass(frozen=True)
class LossModel:
    """The training loss as a function of compute time, L(t) = floor + scale * exp(-t / tau),
    for value-aware policies and value-weighted figures; and when the run may be stopped early
    (COCI's exploratory setting): at a time drawn uniformly from [stop_min, 1] x the job's work."""

    floor: float = 0.5
    scale: float = 3.0
    tau_secs: float = 3 * 3600.0
    stop_min: float | None = None

    def loss(self, t: float) -> float:
        return self.floor + self.scale * math.exp(-t / self.tau_secs)

    def weight(self, t: float, work_secs: float) -> float:
        """Progress rate at t relative to the mean rate over the job's work."""
        mean = (self.loss(0.0) - self.loss(work_secs)) / work_secs
        rate = self.scale / self.tau_secs * math.exp(-t / self.tau_secs)
        return rate / mean if mean > 0 else 1.0

    def weighted_secs(self, t0: float, t1: float, work_secs: float) -> float:
        """Integral of weight(t) dt over [t0, t1]: value-weighted seconds of work."""
        if t1 <= t0:
            return 0.0
        mean = (self.loss(0.0) - self.loss(work_secs)) / work_secs
        return (self.loss(t0) - self.loss(t1)) / mean if mean > 0 else t1 - t0


def load_profile(path: str) -> dict[str, float]:
    """The job-model fields found in a profile JSON (``iter_secs``, ``stall_secs``, ...)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile must be a JSON object")
    names = {f.name for f in fields(JobModel)}
    out = {
        k: float(v)
        for k, v in doc.items()
        if k in names and isinstance(v, (int, float)) and v is not None
    }
    if not out:
        raise ValueError(f"{path}: no job-model fields ({', '.join(sorted(names))}) in the profile")
    return out


def load_trace(path: str) -> tuple[float, ...]:
    """Failure times (seconds since the job started) from a CSV: one per row, first column,
    or a column named ``time_secs``; a header row is skipped."""
    times: list[float] = []
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return ()
    column = 0
    if rows[0] and "time_secs" in rows[0]:
        column = rows[0].index("time_secs")
    for i, row in enumerate(rows):
        if not row or not row[column].strip():
            continue
        try:
            times.append(float(row[column]))
        except ValueError:
            if i == 0:
                continue  # a header
            raise ValueError(
                f"{path}: row {i + 1} has no number in column {column + 1}: {row!r}"
            ) from None
    return tuple(sorted(times))
