"""ValueAware (after COCI): checkpoints dense where training progress is worth most.

Over a short interval tau at time t, the expected cost per unit time is
C/tau + lambda * w(t) * tau / 2, where w(t) weighs the work a failure would destroy by
how much progress it bought, relative to an average second of the run:
w(t) = rate(t) / mean rate, rate(t) = -dL/dt of the fitted loss curve. So tau*(t) is
Daly's optimum with the value-weighted MTBF M / w(t): dense early (w > 1) and sparse
late (w < 1). Unlike COCI's published formula, every term is a time or a ratio, so the
schedule does not change with the loss's scale, and tau is clamped to
[tau_min, max_factor * Daly(C, M)], so late training is never left unprotected.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pitstop.policy.base import PolicyContext, Schedule
from pitstop.policy.theory import daly_optimum

__all__ = ["LossCurve", "ValueAware"]


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _binned(points: list[tuple[float, float]], bins: int) -> tuple[list[float], list[float]]:
    """At most ``bins`` points: the median time and loss of consecutive runs (robust, and cheap to fit)."""
    size = max(1, math.ceil(len(points) / bins))
    ts, ls = [], []
    for i in range(0, len(points), size):
        chunk = points[i : i + size]
        ts.append(_median([p[0] for p in chunk]))
        ls.append(_median([p[1] for p in chunk]))
    return ts, ls


@dataclass
class LossCurve:
    """A robust fit of L(t) = c + a * g(t), g = exp(-b t) (``exp``) or (t + t0)^-b (``power``).

    The losses are first smoothed by a running median (robust to spikes); then for each
    b on a log grid, (c, a) come from linear least squares, and the b with the smallest
    sum of absolute residuals wins (refined by golden-section search).
    """

    model: str = "exp"
    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    t0: float = 1.0
    fitted: bool = False

    def __post_init__(self) -> None:
        if self.model not in ("exp", "power"):
            raise ValueError(f"LossCurve model must be 'exp' or 'power', got {self.model!r}")

    def _g(self, t: float, b: float) -> float:
        return math.exp(-b * t) if self.model == "exp" else (t + self.t0) ** (-b)

    def value(self, t: float) -> float:
        return self.c + self.a * self._g(t, self.b)

    def rate(self, t: float) -> float:
        """-dL/dt: progress per second at time t (0 when the fit is not decreasing)."""
        if not self.fitted:
            return 0.0
        if self.model == "exp":
            return self.a * self.b * math.exp(-self.b * t)
        return self.a * self.b * (t + self.t0) ** (-self.b - 1.0)

    def _solve(self, ts: list[float], ls: list[float], b: float) -> tuple[float, float, float]:
        gs = [self._g(t, b) for t in ts]
        n = len(ts)
        sg, sl = sum(gs), sum(ls)
        sgg = sum(g * g for g in gs)
        sgl = sum(g * loss for g, loss in zip(gs, ls))
        det = n * sgg - sg * sg
        if abs(det) < 1e-300:
            return 0.0, _median(ls), math.inf
        a = (n * sgl - sg * sl) / det
        c = (sl - a * sg) / n
        err = sum(abs(loss - c - a * g) for g, loss in zip(gs, ls))
        return a, c, err

    def fit(self, ts: list[float], losses: list[float], smooth: int = 5) -> bool:
        if len(ts) < 5 or ts[-1] <= ts[0]:
            return False
        half = max(0, smooth // 2)
        ls = [_median(losses[max(0, i - half) : i + half + 1]) for i in range(len(losses))]
        span = ts[-1] - ts[0]
        self.t0 = max(ts[0], span / 100.0, 1e-9) if self.model == "power" else self.t0
        if self.model == "exp":
            lo, hi = math.log(0.01 / span), math.log(100.0 / span)
        else:
            lo, hi = math.log(0.02), math.log(4.0)
        grid = [lo + (hi - lo) * i / 48 for i in range(49)]
        best = min(grid, key=lambda lb: self._solve(ts, ls, math.exp(lb))[2])
        left, right = best - (hi - lo) / 48, best + (hi - lo) / 48
        ratio = (math.sqrt(5) - 1) / 2
        for _ in range(40):
            m1, m2 = right - ratio * (right - left), left + ratio * (right - left)
            if self._solve(ts, ls, math.exp(m1))[2] < self._solve(ts, ls, math.exp(m2))[2]:
                right = m2
            else:
                left = m1
        b = math.exp(0.5 * (left + right))
        a, c, err = self._solve(ts, ls, b)
        if not math.isfinite(err) or a <= 0:
            self.fitted = False  # not decreasing: no progress to weigh
            return False
        self.a, self.b, self.c, self.fitted = a, b, c, True
        return True


@dataclass
class ValueAware(Schedule):
    """Checkpoint every tau(t) = Daly(C, M / w(t)) seconds, w = progress rate relative to the mean.

    ``mtbf_secs``: the job's MTBF. ``horizon_secs``: expected length of the run (the mean
    progress rate is taken over it; default: over the run so far). tau stays within
    [Daly(C, M) / max_factor, max_factor * Daly(C, M)], at least the persist time, and, with
    ``max_overhead``, at least C / max_overhead. Pass the loss
    to ``ckpt.step(step, state, loss=...)``; until the curve is fitted, w = 1 (Young/Daly).
    """

    mtbf_secs: float
    horizon_secs: float | None = None
    max_overhead: float | None = None
    max_factor: float = 4.0
    model: str = "exp"
    window: int = 4000
    refit_every: int = 50
    min_points: int = 20
    warmup: int = 5
    cost_horizon: int = 500
    curve: LossCurve = field(default_factory=LossCurve)
    interval_secs: float | None = None
    weight: float = 1.0
    _points: deque[tuple[float, float]] = field(default_factory=deque, repr=False)
    _since_fit: int = 0
    _first_loss: float | None = None
    _cached: tuple[tuple[float, float], float, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mtbf_secs <= 0:
            raise ValueError(f"ValueAware needs mtbf_secs > 0, got {self.mtbf_secs}")
        if self.curve.model != self.model:
            self.curve = LossCurve(model=self.model)
        self._points = deque(maxlen=self.window)

    def observe(self, t: float, loss: float) -> None:
        if not math.isfinite(loss):
            return
        if self._first_loss is None:
            self._first_loss = loss
        self._points.append((t, loss))
        self._since_fit += 1
        if len(self._points) >= self.min_points and (
            self._since_fit >= self.refit_every or not self.curve.fitted
        ):
            self.curve.fit(*_binned(list(self._points), 200))
            self._since_fit = 0
            self._cached = None

    def relative_value(self, t: float) -> float:
        """w(t): progress rate at t over the mean rate of the run (1 when unknown)."""
        if not self.curve.fitted:
            return 1.0
        end = self.horizon_secs if self.horizon_secs is not None else max(t, 1e-9)
        start = self._points[0][0] if self._points else 0.0
        mean_rate = (self.curve.value(start) - self.curve.value(end)) / max(end - start, 1e-9)
        if mean_rate <= 0:
            return 1.0
        return self.curve.rate(t) / mean_rate

    def interval_for(self, t: float, cost: float, persist: float) -> float:
        key = (cost, persist)
        if (
            self._cached is not None
            and self._cached[0] == key
            and abs(t - self._cached[1]) < 0.01 * self._cached[2]
        ):
            return self._cached[2]  # w(t) changes slowly: recompute after 1 % of an interval
        tau = self._interval(t, cost, persist)
        self._cached = (key, t, tau)
        return tau

    def _interval(self, t: float, cost: float, persist: float) -> float:
        self.weight = max(self.relative_value(t), 1e-12)
        base = daly_optimum(cost, self.mtbf_secs)
        tau_max = self.max_factor * base
        floor = cost / self.max_overhead if self.max_overhead else 0.0
        tau_min = min(max(base / self.max_factor, persist, floor), tau_max)
        effective_mtbf = self.mtbf_secs / self.weight
        tau = daly_optimum(cost, effective_mtbf) if cost < 2 * effective_mtbf else effective_mtbf
        return min(max(tau, tau_min), tau_max)

    def explain(self, ctx: PolicyContext) -> str:
        if self.interval_secs is None:
            return "ValueAware waits for a measured checkpoint cost"
        return (
            f"ValueAware checkpoints every {self.interval_secs:.3g} s of training now: sparser "
            "as the fitted loss curve flattens (progress is worth less), never past its bound"
        )

    def decide(self, ctx: PolicyContext) -> bool:
        if ctx.loss is not None:
            self.observe(ctx.elapsed_secs, ctx.loss)
        if not ctx.measured:
            return ctx.checkpoints == 0 and ctx.step >= self.warmup
        paired = ctx.paired_cost(self.cost_horizon)
        cost = max(paired if paired is not None else ctx.checkpoint_cost(overlapped=True), 1e-9)
        self.interval_secs = self.interval_for(ctx.elapsed_secs, cost, ctx.persist_secs or 0.0)
        return ctx.secs_since_checkpoint >= self.interval_secs
