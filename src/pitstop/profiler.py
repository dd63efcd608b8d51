"""The online profiler behind ``ckpt.step``: robust running estimates of what checkpoints cost.

Call sequence (training thread): ``iteration(secs, persisting)`` once per step with
the compute time of the iteration (stalls excluded) and whether a persist was
running beside it; ``save_started()`` when a save begins; ``checkpoint(stats)`` once
per committed save; ``settled(step)`` when no save is in flight any more; ``snapshot()``
for the policy context and ``ckpt.stats()``. Estimates are medians over a sliding
window, so they follow a disk that slows down or iterations that speed up, and a
single outlier does not move them. The first ``warmup`` iterations are not counted.

The cost of a checkpoint is also measured *in pairs*: from a save's start until no
save is in flight, its stalls plus the excess of every iteration over the quiet
iterations around it (the median of the 5 before and of up to 3 after, averaged).
Before, during and after are seconds apart, so the machine's own drift (which moves
any longer window) cancels out; a pair across which the machine changed speed (before
and after differ by more than 15 %, or, where single iterations scatter more, by more
than 3 standard errors of the two medians, read from the scatter of the last 20 quiet
iterations) measures that change, not the checkpoint, and is dropped. (With a fixed 15 %,
a host whose iterations scatter by +-30 % dropped half its pairs by chance alone, and the
estimate rested on the ones that happened to look alike.)

A budget is about the *mean* cost, and a checkpoint's cost is skewed (most persists take
little from the training thread, a few take several times more: writeback, a neighbour,
the allocator), so the estimate is the mean of the last 16 pairs, not their median
(which, on the issue's loop, was 0.6-0.7 of the mean), each kept signed (a pair's noise
is symmetric; clipping it at zero would bias the mean), plus its standard error: an upper
estimate that a few noisy pairs cannot pull below the truth (and, from 3 pairs on, minus
it: a lower one, how far CheckFreq may grow its interval at once). Not trimmed: the rare
expensive checkpoint is part of the cost.

A save's work goes on after it commits, where the loop does not see it (writeback, the
allocator giving pages back, under torch.distributed a peer rank's part of the write): the
quiet iterations just after a save (as many as it was in flight for, at least 3) are its
*tail*. They are never a baseline: only quiet iterations past every tail are (``_clean``).
Each pair keeps its tail's cost apart, and the tails count in the estimate once they show
(the mean of the pairs' tails above its standard error): where saves have none, they would
add only their noise. Before, they were both: the tail's cost was missed and, at a
short interval where every quiet iteration was some save's tail, every baseline was slowed,
each pair read its save as cheap or negative, and the interval stayed at its minimum (a
synthetic DDP-like machine: gaps of 3 steps where 107 were allowed, 72 % overhead). The
transformer loop of ``benchmarks/overhead.py`` on this host: the 6 quiet iterations after a
save ran 3-7 % slower than later ones, as much again as the save's own busy iteration.

Each pair is kept in iterations (its seconds over its own quiet iteration) and the
estimate is read in seconds of the iterations now: when a neighbour comes or goes, the
persist threads' share of the cores moves with the training thread's, and a checkpoint's
cost in iterations changes far less than in seconds (the conv loop of
``benchmarks/overhead.py``: 0.14 and 0.18 iterations alone and beside a neighbour, at 0.057
and 0.136 s a step). In seconds, the cost of a loaded host set the interval long after the
load had left (16 pairs at that long interval: hundreds of steps). In iterations too, a
little: the persist's share moves too (on the synthetic conv machine, 2.1x fewer iterations
once the load left), so once 4 pairs of the host as it is now exist (their quiet iteration
within 1.5x of now's), the pairs of the other host are left out.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from pitstop.engine.handle import SaveStats

__all__ = ["ProfileStats", "Profiler"]


@dataclass(frozen=True)
class ProfileStats:
    """What ``ckpt.stats()`` returns. Times in seconds; None until measured."""

    iterations: int
    checkpoints: int
    iter_secs: float | None
    stall_secs: float | None
    persist_secs: float | None
    slowdown_secs: float | None
    checkpoint_bytes: int | None
    write_gbps: float | None
    training_secs: float
    overhead: float
    """Measured fraction of training time spent on checkpoints (stalls + slowdown)."""
    recent_overhead: float | None = None
    """The same over the last ~100 iterations, measured against quiet iterations."""
    interval: float | None = None
    """The policy's current interval (iterations or seconds, as the policy counts), if it has one."""
    refused_saves: int = 0
    """Saves the policy asked for that were refused (the step was already committed or being
    written by another writer): each one is also a warning and a ``StepResult.REFUSED``."""
    checkpoint_cost_secs: float | None = None
    """Training time one checkpoint costs, measured in pairs (an upper estimate of the mean
    of the last 16: see the module's docstring)."""
    checkpoint_cost_step: int | None = None
    """When the newest paired measurement ended, in iterations (``ckpt.step`` calls)."""
    checkpoint_cost_low_secs: float | None = None
    """A lower estimate of the same mean (minus its standard error; from 3 pairs on)."""
    steps_since_checkpoint: int = 0
    """Steps since the newest checkpoint started (or since training started): what a failure
    now would lose."""
    secs_since_checkpoint: float = 0.0
    """The same in seconds."""
    policy_reason: str | None = None
    """What the schedule policy says of its interval now (why no checkpoint came sooner)."""
    step_secs: float | None = None
    """What ``ckpt.step`` itself costs each iteration, checkpoint or not (its bookkeeping and,
    under torch.distributed, the ranks' vote on the decision): median of recent steps; in
    ``overhead`` too."""


_BEFORE = 5  # quiet iterations just before a save: the baseline of its paired measurement
_AFTER = 3  # and after it (fewer when the next save comes sooner)
_DRIFT = 0.15  # before and after differ by more: the machine drifted across the pair
_COSTS = 16  # paired measurements the cost estimate is made of
_SCATTER = 20  # quiet iterations the machine's own scatter is read from
_SIGMAS = 3.0  # before and after differ by more than this many standard errors: drift
_REGIME = 1.5  # a pair whose quiet iteration was this much slower or faster than now's: the
_REGIME_PAIRS = 4  # host was another (a load came or left); left out once this many are not


def _median(values: deque[float]) -> float | None:
    return statistics.median(values) if values else None


def _cost_estimate(costs: list[float]) -> tuple[float | None, float | None]:
    """An upper and a lower estimate of the mean of ``costs`` (paired measurements,
    signed): their mean plus and minus its standard error (the lower one None under 3
    pairs). Not trimmed: the rare expensive checkpoint is the cost. Plain float arithmetic:
    ``statistics.stdev`` works in exact fractions, ~0.4 ms a call, and this runs in every
    ``ckpt.step``."""
    n = len(costs)
    if n < 2:
        return (costs[0] if costs else None), None
    mean = math.fsum(costs) / n
    se = math.sqrt(math.fsum((c - mean) ** 2 for c in costs) / (n - 1) / n)
    return mean + se, (mean - se if n >= 3 else None)


def _scatter(values: list[float]) -> float:
    """The relative scatter of single iterations (a robust standard deviation over the
    median: 1.4826 x the median absolute deviation)."""
    mid = statistics.median(values)
    mad = statistics.median(abs(v - mid) for v in values)
    return 1.4826 * mad / mid if mid > 0 else 0.0


def _drift_tolerance(scatter: float, before: int, after: int) -> float:
    """How far apart (relative) the medians of ``before`` and ``after`` quiet iterations may
    be before the pair is read as drift: 15 %, or more on a noisy machine, where medians of
    so few iterations differ by more than that by chance alone (``_SIGMAS`` standard
    errors; a median's is sqrt(pi / 2) times a mean's)."""
    se = scatter * math.sqrt(math.pi / 2) * math.sqrt(1 / max(before, 1) + 1 / max(after, 1))
    return max(_DRIFT, _SIGMAS * se)


class Profiler:
    def __init__(self, window: int = 50, warmup: int = 5) -> None:
        self.warmup = warmup
        self._window = window
        self.iterations = 0
        self.checkpoints = 0
        self._quiet: deque[float] = deque(maxlen=window)  # iterations with no persist beside them
        self._busy: deque[float] = deque(maxlen=window)  # iterations during a persist
        self._stall: deque[float] = deque(maxlen=max(5, window // 5))
        self._persist: deque[float] = deque(maxlen=max(5, window // 5))
        self._gbps: deque[float] = deque(maxlen=max(5, window // 5))
        self._bytes: int | None = None
        self.training_secs = 0.0
        self.stall_total = 0.0
        self.step_total = 0.0  # ckpt.step's own time (not a save's), every counted step
        self._step: deque[float] = deque(maxlen=window)
        self.refused_saves = 0
        self._recent: deque[float] = deque(maxlen=2 * window)  # every iteration, stalls included
        self._pending_stall = 0.0  # stall time since the last committed checkpoint
        self._clean: deque[float] = deque(maxlen=window)  # quiet iterations past a save's tail
        self._flight = 0  # iterations beside the save in flight (since save_started)
        self._tail = 0  # quiet iterations after it still counted as its tail
        # the open pair: [baseline before, busy seconds, busy iterations, stall, commits,
        # scatter, iterations before, tail seconds, tail iterations, persist seconds]
        self._pair: list[float] | None = None
        self._closing: tuple[list[float], list[float], int] | None = None  # (pair, after, step)
        # (step, paired cost in iterations: seconds over the pair's own quiet iteration)
        # (and the quiet iteration it was measured against, in seconds; its tail's cost apart)
        self._costs: deque[tuple[int, float, float, float]] = deque(maxlen=_COSTS)
        self._pairs = 0  # paired measurements made (the first one is a one-off)
        # (pairs made, upper and lower cost estimates)
        self._estimate: tuple[object, float | None, float | None] = (None, None, None)

    def iteration(self, secs: float, persisting: bool) -> None:
        self.iterations += 1
        if self.iterations <= self.warmup:
            return
        self.training_secs += secs
        (self._busy if persisting else self._quiet).append(secs)
        self._recent.append(secs)
        if persisting:
            self._flight += 1
            if self._pair is not None:
                self._pair[1] += secs
                self._pair[2] += 1
        elif self._tail > 0:  # just after a save: its tail (its work the loop does not see:
            self._tail -= 1  # writeback, a peer rank's part), never a baseline
            if self._closing is not None:
                self._closing[0][7] += secs
                self._closing[0][8] += 1
        else:
            self._clean.append(secs)
            if self._closing is not None:
                self._closing[1].append(secs)
                if len(self._closing[1]) >= _AFTER:
                    self._close()

    def step_cost(self, secs: float) -> None:
        """``ckpt.step`` took ``secs`` of the loop's time besides any save it started: a cost
        of every iteration, whatever the interval (counted after the warm-up)."""
        if self.iterations <= self.warmup:
            return
        self.step_total += secs
        self.training_secs += secs
        self._step.append(secs)
        if self._recent:
            self._recent[-1] += secs

    def save_started(self) -> None:
        """A save starts: open a paired measurement against the last quiet iterations (one
        is open already while earlier saves are in flight: it takes this one too)."""
        if self._closing is not None:
            self._close()
        self._tail = 0  # the previous save's tail ends here: this one's iterations are busy
        if self._pair is not None or len(self._clean) < 3:
            return
        quiet = list(self._clean)
        before = quiet[-_BEFORE:]
        scatter = _scatter(quiet[-_SCATTER:])
        self._pair = [statistics.median(before), 0.0, 0.0, 0.0, 0.0, scatter, len(before), 0, 0, 0]

    def settled(self, step: int) -> None:
        """No save is in flight: the paired measurement, if one is open, closes once a few
        quiet iterations after it are known too."""
        pair, self._pair = self._pair, None
        if self._flight > 0:  # as many quiet iterations as it ran beside are its tail
            self._tail, self._flight = max(_AFTER, self._flight), 0
        if pair is not None and pair[4] > 0:  # something committed: it is a checkpoint's cost
            self._closing = (pair, [], step)

    def _close(self) -> None:
        """The pair's baseline is the quiet iterations on both sides of it; when they disagree
        (the machine changed speed across the save) the pair measures the drift, not the
        checkpoint: it is dropped."""
        assert self._closing is not None
        pair, after, step = self._closing
        self._closing = None
        before = pair[0]
        if after:
            later = statistics.median(after)
            if abs(later - before) > _drift_tolerance(pair[5], int(pair[6]), len(after)) * before:
                return
            before = (before + later) / 2
        if before <= 0:
            return
        # signed (noise cancels in the mean), and never more than the persists ran: a save
        # slows training only while it runs (an evaluation or a data-loader restart in that
        # iteration without ckpt.pause() is not its cost; read as one, a 30 s pause set the
        # interval to thousands of steps for good)
        excess = min(pair[1] - pair[2] * before, pair[9])
        tail = min(pair[7] - pair[8] * before, pair[9])
        self._pairs += 1
        self._costs.append((step, (pair[3] + excess) / before, before, tail / before))

    def stall(self, secs: float, *, add_to_last: bool = True) -> None:
        """The loop was blocked ``secs`` by a save: in ``async_save``, or in ``optimizer.step()``
        waiting for the deferred copy (counted when it happens)."""
        self.stall_total += secs
        self.training_secs += secs
        self._pending_stall += secs
        if self._pair is not None:
            self._pair[3] += secs
        if add_to_last and self._recent:
            self._recent[-1] += secs

    def checkpoint(self, stats: SaveStats) -> None:
        """A save committed: its stall is what the loop lost to it, call and hook waits both."""
        self.checkpoints += 1
        if self._pair is not None:
            self._pair[4] += 1
            self._pair[9] += max(stats.total_secs - stats.stall_secs, 0.0)
        self._stall.append(max(stats.stall_secs - stats.alloc_secs, self._pending_stall))
        self._pending_stall = 0.0
        self._persist.append(max(stats.total_secs - stats.stall_secs, 0.0))
        self._bytes = stats.nbytes
        if stats.write_gbps > 0:
            self._gbps.append(stats.write_gbps)

    def _paired_costs(self) -> list[float]:
        """The paired costs the estimate is made of: the first save of a run (files created,
        pages touched for the first time) is a one-off, left out once another is measured;
        the pairs of another host (a load came or left since: their quiet iteration more than
        ``_REGIME`` times slower or faster than now's) are left out once ``_REGIME_PAIRS``
        of this one are measured; the tails count once they show (their mean above its
        standard error: where a save has none, they would add only their noise)."""
        costs = [(c, b, t) for _, c, b, t in self._costs]
        costs = costs[1:] if len(costs) > 1 and self._pairs == len(costs) else costs
        now = _median(self._clean) or self.iter_secs
        if now:  # the pairs of the host as it is now, once there are a few of them
            same = [x for x in costs if 1 / _REGIME < x[1] / now < _REGIME]
            costs = same if len(same) >= _REGIME_PAIRS else costs
        tails = [t for _, _, t in costs]
        _, low = _cost_estimate(tails)
        if low is not None and low > 0:
            return [c + t for c, _, t in costs]
        return [c for c, _, _ in costs]

    def _cost(self) -> tuple[float | None, float | None]:
        """The upper and lower cost estimates in seconds of the iterations now, recomputed
        only when a pair was added (snapshot runs each step). The pairs are kept in
        iterations, each of its own time: when the host's load changes (a neighbour comes or
        goes), a checkpoint's cost moves with the iterations' (the persist threads get the
        same share of the cores as the training thread), and a cost in seconds from before
        the change would set the interval for another host until 16 new pairs replaced it."""
        costs = self._paired_costs()
        key = tuple(costs)  # which pairs (the host now), and whether their tails count
        if self._estimate[0] != key:
            self._estimate = (key, *_cost_estimate(costs))
        it = self.iter_secs or 0.0
        up, low = self._estimate[1], self._estimate[2]
        # a checkpoint costs at least its stall, measured alone: noisy pairs may read less,
        # even below zero, which would set the interval to the shortest the write allows
        floor = _median(self._stall) or 0.0
        return (
            None if up is None else max(up * it, floor),
            None if low is None else max(low * it, floor),
        )

    @property
    def iter_secs(self) -> float | None:
        return _median(self._quiet) or _median(self._busy)

    def recent_overhead(self) -> float | None:
        """Measured, not modelled: how much longer the recent iterations took (stalls and all)
        than iterations with no checkpoint work beside them. None until both are known."""
        quiet = _median(self._quiet)
        if quiet is None or len(self._recent) < self._window or len(self._quiet) < 5:
            return None
        return sum(self._recent) / (len(self._recent) * quiet) - 1.0

    def slowdown_secs(self) -> float | None:
        """Extra training time per checkpoint while it persists (0 when it does not slow training)."""
        quiet, busy, persist = _median(self._quiet), _median(self._busy), _median(self._persist)
        if quiet is None or busy is None or persist is None:
            return None
        return max(busy - quiet, 0.0) * (persist / max(quiet, 1e-9))

    def snapshot(self, interval: float | None = None) -> ProfileStats:
        slowdown = self.slowdown_secs()
        cost, cost_low = self._cost()
        overhead_secs = self.stall_total + self.step_total + (slowdown or 0.0) * self.checkpoints
        return ProfileStats(
            iterations=self.iterations,
            checkpoints=self.checkpoints,
            iter_secs=self.iter_secs,
            stall_secs=_median(self._stall),
            persist_secs=_median(self._persist),
            slowdown_secs=slowdown,
            checkpoint_bytes=self._bytes,
            write_gbps=_median(self._gbps),
            training_secs=self.training_secs,
            overhead=overhead_secs / self.training_secs if self.training_secs > 0 else 0.0,
            recent_overhead=self.recent_overhead(),
            interval=interval,
            refused_saves=self.refused_saves,
            checkpoint_cost_secs=cost,
            checkpoint_cost_low_secs=cost_low,
            checkpoint_cost_step=self._costs[-1][0] if self._costs else None,
            step_secs=_median(self._step),
        )
