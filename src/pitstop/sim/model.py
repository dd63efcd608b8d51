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
import numbers
import random
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_FAILURES",
    "MAX_ITERATIONS",
    "FailureClass",
    "FailureModel",
    "JobModel",
    "LossModel",
    "TooManyFailures",
    "load_profile",
    "load_trace",
]

MAX_ITERATIONS = 10**7
"""The most iterations a job may have: the engine runs 50-100 thousand a second, so a run of
this many takes minutes (and one that never finishes, 50 times its work, far longer)."""
MAX_FAILURES = 10**6
"""The most failures one run may draw over its horizon (50 times the job's work): more would
take as long as the iterations above, and a job failing that often makes no progress anyway."""
MIN_WEIBULL_SHAPE = 0.05
"""Below this the Weibull gaps are mostly shorter than a nanosecond, and a run draws far more
failures than its MTBF says (shape 0.01: some 10^16 in a horizon of 50 MTBF)."""


class TooManyFailures(ValueError):
    """A failure process that would draw more than :data:`MAX_FAILURES` failures in one run."""


def _finite(owner: str, name: str, value: Any, *, low: float = 0.0, strict: bool = False) -> None:
    """Refuse ``value`` unless it is a finite real number >= ``low`` (> ``low`` if ``strict``)."""
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (float(value) > low if strict else float(value) >= low)
    )
    if not ok:
        raise ValueError(
            f"{owner}.{name} must be a finite number {'>' if strict else '>='} {low:g}, "
            f"got {value!r}"
        )


def _count(owner: str, name: str, value: Any, *, high: int | None = None) -> None:
    """Refuse ``value`` unless it is an integer >= 1 (and <= ``high``)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or int(value) < 1:
        raise ValueError(f"{owner}.{name} must be an integer >= 1, got {value!r}")
    if high is not None and int(value) > high:
        raise ValueError(f"{owner}.{name} is {value}, more than the limit of {high}")


COST_FIELDS = (
    "iter_secs", "stall_secs", "persist_secs", "slowdown_secs", "restart_secs",
    "cost_noise_secs", "measured_cost_secs",
)  # fmt: skip
"""The job's times in seconds: what a profile JSON may give (``load_profile``)."""


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
        _finite("JobModel", "iter_secs", self.iter_secs, strict=True)
        for f in COST_FIELDS[1:]:
            if f != "measured_cost_secs" or self.measured_cost_secs is not None:
                _finite("JobModel", f, getattr(self, f))
        _count("JobModel", "iterations", self.iterations, high=MAX_ITERATIONS)
        _count("JobModel", "max_in_flight", self.max_in_flight)
        if self.iterations_per_epoch is not None:
            _count("JobModel", "iterations_per_epoch", self.iterations_per_epoch)
        if self.speed_trace is not None:
            times = [t for t, _ in self.speed_trace]
            if (
                times != sorted(times)
                or not all(math.isfinite(t) for t in times)
                or not all(0 < f < math.inf for _, f in self.speed_trace)
            ):
                raise ValueError(
                    "JobModel.speed_trace needs finite increasing times and finite factors > 0"
                )

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
        """A job of ``hours`` of compute (at least one iteration, at most
        :data:`MAX_ITERATIONS`)."""
        _finite("JobModel.for_hours", "hours", hours, strict=True)
        it = kw["iter_secs"]
        _finite("JobModel", "iter_secs", it, strict=True)
        n = hours * 3600 / it
        if n > MAX_ITERATIONS:
            raise ValueError(
                f"JobModel.for_hours: {hours:g} hours of {it:g} s iterations is {n:.3g} "
                f"iterations, more than the limit of {MAX_ITERATIONS:.0e} (the simulator runs "
                "50-100 thousand a second): simulate fewer hours or longer iterations"
            )
        return cls(iterations=max(1, round(n)), **kw)


@dataclass(frozen=True)
class FailureClass:
    """A kind of failure: its share of all failures, and the extra restart cost of recovering
    from the level that survives it (e.g. rebuilding from a partner, fetching from shared storage)."""

    name: str
    share: float
    extra_restart_secs: float = 0.0

    def __post_init__(self) -> None:
        _finite("FailureClass", "share", self.share)
        _finite("FailureClass", "extra_restart_secs", self.extra_restart_secs)


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
        _finite("FailureModel", "mtbf_secs", self.mtbf_secs, strict=True)
        _finite("FailureModel", "weibull_shape", self.weibull_shape, low=MIN_WEIBULL_SHAPE)
        if self.trace is not None and not all(0 <= t < math.inf for t in self.trace):
            raise ValueError("FailureModel.trace needs finite failure times >= 0")
        if any(not 0 <= r < math.inf for r in self.restart_trace):
            raise ValueError("FailureModel.restart_trace needs finite restart times >= 0")
        _finite("FailureModel", "trace_jitter_secs", self.trace_jitter_secs)
        if self.classes and not sum(c.share for c in self.classes) > 0:
            raise ValueError("FailureModel.classes need a share > 0 between them")

    def restart_of(self, i: int, default: float) -> float:
        """The restart time of the ``i``-th failure (from 0): measured, or ``default``."""
        return self.restart_trace[i] if i < len(self.restart_trace) else default

    @classmethod
    def per_node(cls, mtbf_hours_per_node: float, nodes: int, **kw: Any) -> FailureModel:
        _finite("FailureModel.per_node", "mtbf_hours_per_node", mtbf_hours_per_node, strict=True)
        _count("FailureModel.per_node", "nodes", nodes)
        return cls(mtbf_secs=mtbf_hours_per_node * 3600 / nodes, **kw)

    def check_horizon(self, horizon_secs: float) -> None:
        """Refuse a horizon over which the failure process would draw more than
        :data:`MAX_FAILURES` failures on average (a trace is as long as it is)."""
        expected = horizon_secs / self.mtbf_secs
        if self.trace is None and not expected <= MAX_FAILURES:
            raise TooManyFailures(
                f"an MTBF of {self.mtbf_secs:.3g} s over a horizon of {horizon_secs:.3g} s is "
                f"{expected:.3g} failures, more than the limit of {MAX_FAILURES:.0e}"
            )

    def times(self, horizon_secs: float, rng: random.Random) -> list[float]:
        """Failure times in [0, horizon) of wall-clock time; :class:`TooManyFailures` when
        there would be more than :data:`MAX_FAILURES` (expected, or drawn: a small Weibull
        shape draws many more than the MTBF says)."""
        self.check_horizon(horizon_secs)
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
            if len(out) > MAX_FAILURES:
                raise TooManyFailures(
                    f"a Weibull shape of {k:g} at an MTBF of {self.mtbf_secs:.3g} s drew more "
                    f"than {MAX_FAILURES:.0e} failures in a horizon of {horizon_secs:.3g} s "
                    "(a smaller shape clusters more failures in bursts)"
                )

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

    def __post_init__(self) -> None:
        _finite("LossModel", "floor", self.floor, low=-math.inf)
        _finite("LossModel", "scale", self.scale)
        _finite("LossModel", "tau_secs", self.tau_secs, strict=True)
        if self.stop_min is not None and not (
            isinstance(self.stop_min, (int, float)) and 0 <= self.stop_min <= 1
        ):
            raise ValueError(f"LossModel.stop_min must be between 0 and 1, got {self.stop_min!r}")

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
    """The job's times found in a profile JSON (``iter_secs``, ``stall_secs``, ...: the
    fields of :data:`COST_FIELDS`; other keys are left alone). A value that is not a finite
    number >= 0 (> 0 for ``iter_secs``) is refused, named. OSError when it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: not a JSON profile ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a profile must be a JSON object")
    out: dict[str, float] = {}
    for k in COST_FIELDS:
        if k not in doc or (k == "measured_cost_secs" and doc[k] is None):
            continue
        v = doc[k]
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not number or not (v > 0 if k == "iter_secs" else v >= 0):
            raise ValueError(
                f"{path}: {k} is {v!r}, not a finite number {'>' if k == 'iter_secs' else '>='} 0"
            )
        out[k] = float(v)
    if not out:
        raise ValueError(f"{path}: none of {', '.join(COST_FIELDS)} in the profile")
    return out


def load_trace(path: str) -> tuple[float, ...]:
    """Failure times (seconds since the job started) from a CSV: one per row, first column,
    or a column named ``time_secs``; a header row (a first row with no number) is skipped,
    and so are blank rows. A time that is not a finite number >= 0, or a file with no time,
    is refused, naming the file and the line; OSError when it cannot be read."""
    times: list[float] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"{path}: not a CSV of failure times ({e})") from None
    column = 0
    if rows and rows[0] and "time_secs" in rows[0]:
        column = rows[0].index("time_secs")
    header = False
    for i, row in enumerate(rows):
        cell = row[column].strip() if len(row) > column else ""
        if not cell:
            continue
        try:
            t = float(cell)
        except ValueError:
            if i == 0:
                header = True
                continue  # a header
            raise ValueError(
                f"{path}: line {i + 1} has no number in column {column + 1}: {row!r}"
            ) from None
        if not 0 <= t < math.inf:
            raise ValueError(
                f"{path}: line {i + 1}: failure time {cell!r} is not a finite number >= 0"
            )
        times.append(t)
    if not times:
        what = "only a header" if header else "nothing"
        raise ValueError(f"{path}: no failure times in the trace (it holds {what})")
    return tuple(sorted(times))
