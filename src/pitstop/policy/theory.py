"""Checkpoint-interval theory: Young, Daly (first order, higher order, exact), Lambert W.

C = cost of one checkpoint, M = mean time between failures, R = restart time;
all in seconds. See docs/policies.md for the derivations and references.
"""

from __future__ import annotations

import math

__all__ = ["daly_higher_order", "daly_optimum", "lambert_w0", "young_interval"]


def lambert_w0(x: float) -> float:
    """Principal branch W0 of the Lambert W function for x >= -1/e (Halley's method)."""
    if x < -1 / math.e:
        raise ValueError(f"lambert_w0 is real only for x >= -1/e, got {x}")
    if x == 0.0:
        return 0.0
    if x < -0.3:  # near the branch point: series in p = sqrt(2(ex + 1))
        p = math.sqrt(max(0.0, 2.0 * (math.e * x + 1.0)))
        w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p**3
    elif x < 3.0:
        w = math.log1p(x) * 0.9
    else:
        lx = math.log(x)
        w = lx - math.log(lx)
    previous = math.inf
    for _ in range(50):  # Halley's method converges cubically; rounding ends it near the branch
        ew = math.exp(w)
        f = w * ew - x
        wp1 = w + 1.0
        if wp1 == 0.0 or f == 0.0:
            break
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w -= step
        if abs(step) <= 1e-14 * (1.0 + abs(w)) or abs(step) >= previous:
            break
        previous = abs(step)
    return w


def young_interval(cost_secs: float, mtbf_secs: float) -> float:
    """Young (1974): tau = sqrt(2 C M)."""
    return math.sqrt(2.0 * cost_secs * mtbf_secs)


def daly_higher_order(cost_secs: float, mtbf_secs: float) -> float:
    """Daly (2006), higher-order estimate; tau = M when C >= 2M."""
    c, m = cost_secs, mtbf_secs
    if c >= 2.0 * m:
        return m
    r = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - c


def daly_optimum(cost_secs: float, mtbf_secs: float) -> float:
    """The exact optimum of Daly's model: tau = M [1 + W0(-exp(-(C/M + 1)))]; R drops out."""
    if cost_secs <= 0.0:
        return 0.0
    return mtbf_secs * (1.0 + lambert_w0(-math.exp(-(cost_secs / mtbf_secs + 1.0))))
