"""CheckFreq keeps its overhead budget on a synthetic machine, and keeps checkpointing.

The machine (no wall clock: every time is drawn from a seeded generator) is what the
loop driver sees on a real 2-core host: iterations with noise; a checkpoint stalls the
loop for the copy, then persist threads run for a while and take CPU (and the GIL)
from the training thread, so every iteration they overlap runs slower. How long they
run is skewed, as measured on the issue's loop (10 x Linear(1024, 1024) + Adam):
most persists cost little, some (page-cache writeback, a neighbour's burst, the
allocator) cost several times more, so the median checkpoint costs far less than the
mean one, and the budget is about the mean.

The loop's own profiler and the policy are driven exactly as ``ckpt.step`` drives them
(``iteration``, ``save_started``, ``stall``, ``checkpoint``, ``settled``, then
``decide`` over the same context). The overhead is measured in pairs: the same seeded
iterations with and without the checkpoints' extra time.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest

from pitstop.engine.handle import SaveStats
from pitstop.policy import CheckFreq, CheckpointPolicy, PolicyContext
from pitstop.profiler import Profiler


@dataclass
class Machine:
    """A synthetic host. ``iter_secs`` with +-``noise`` uniform jitter per iteration and a
    drift factor redrawn every 20-80 iterations in [1 - drift, 1 + drift]; a checkpoint
    stalls ``stall_secs`` then persists for a time drawn from ``persist_secs`` (a list:
    one value at random per checkpoint); while it persists, the training thread runs at
    ``1 / slowdown`` of its speed (the persist threads' CPU and GIL share). Persists run
    one at a time (``max_in_flight=1``): the policy is asked, a save in flight is not
    doubled."""

    iter_secs: float = 0.1
    noise: float = 0.1
    drift: float = 0.0
    stall_secs: float = 0.003
    persist_secs: list[float] = field(default_factory=lambda: [0.06] * 4 + [0.6])
    slowdown: float = 2.0
    first_wait_secs: float = 0.0  # a one-off slow first save: waiting on I/O, no CPU taken
    neighbour_at: tuple[int, float] | None = None  # (step, slowdown from then on)
    neighbour_iter: float = 1.0  # and the factor on ``iter_secs`` from then on
    hiccup: tuple[float, float] = (0.0, 0.0)  # (probability, extra iterations): another job's burst
    tail_secs: float = 0.0  # after a save commits, its work goes on this long (writeback, a
    # peer rank's part): iterations still run slower, but the loop sees no save in flight


@dataclass
class Run:
    saved: list[int]
    base_secs: float  # the same iterations without checkpoints
    extra_secs: float  # what the checkpoints added (stalls + slower iterations)
    mean_cost_secs: float  # per checkpoint, as the machine drew them
    mean_iter_secs: float
    intervals: list[int]
    extra_by_step: list[float] = field(default_factory=list)
    base_by_step: list[float] = field(default_factory=list)

    def overhead_from(self, step: int) -> float:
        """The overhead of the steps from ``step`` on."""
        return sum(self.extra_by_step[step - 1 :]) / sum(self.base_by_step[step - 1 :])

    @property
    def overhead(self) -> float:
        return self.extra_secs / self.base_secs

    def allowed(self, budget: float) -> float:
        """The interval the budget allows: mean cost / (budget x iteration)."""
        return self.mean_cost_secs / (budget * self.mean_iter_secs)


def run(policy: CheckpointPolicy, machine: Machine, *, steps: int, seed: int) -> Run:
    rng = random.Random(seed)
    prof = Profiler()
    saved: list[int] = []
    costs: list[float] = []
    intervals: list[int] = []
    base_total = extra_total = 0.0
    extras: list[float] = []
    bases: list[float] = []
    drift, left = 1.0, 0
    persist_left = 0.0  # seconds of persist work still to run (at full speed)
    tail_left = 0.0  # seconds of a committed save's tail still to run
    wait_left = 0.0  # seconds of the persist spent waiting on I/O (no CPU taken)
    pending: SaveStats | None = None
    persist_started = 0.0
    clock = 0.0
    last_ckpt, since = 0, 0.0
    for step in range(1, steps + 1):
        if left == 0:
            drift, left = rng.uniform(1 - machine.drift, 1 + machine.drift), rng.randint(20, 80)
        left -= 1
        base = machine.iter_secs * drift * rng.uniform(1 - machine.noise, 1 + machine.noise)
        if machine.hiccup[0] > 0 and rng.random() < machine.hiccup[0]:
            base += machine.iter_secs * machine.hiccup[1]
        # the persist overlaps the first part of the iteration: that part runs slower
        slowdown = machine.slowdown
        if machine.neighbour_at is not None and step >= machine.neighbour_at[0]:
            slowdown = machine.neighbour_at[1]
            base *= machine.neighbour_iter
        overlap = min(persist_left, base * slowdown)  # wall seconds of overlap
        extra = overlap - overlap / slowdown
        persist_left -= overlap
        if pending is None and tail_left > 0:  # the tail, unseen by the loop
            overlap = min(tail_left, base * slowdown)
            extra += overlap - overlap / slowdown
            tail_left -= overlap
            costs[-1] += overlap - overlap / slowdown
        secs = base + extra
        wait_left -= secs
        prof.iteration(secs, persisting=pending is not None)
        clock += secs
        base_total, extra_total = base_total + base, extra_total + extra
        extras.append(extra)
        bases.append(base)
        if pending is not None:
            costs[-1] += extra
        since += secs
        if (
            pending is not None and persist_left <= 0 and wait_left <= 0
        ):  # collect(): the save committed
            pending.total_secs = pending.stall_secs + clock - persist_started
            prof.checkpoint(pending)
            pending = None
            tail_left = machine.tail_secs
        if pending is None:
            prof.settled(step)
        snap = prof.snapshot()
        c = PolicyContext(
            step=step, elapsed_secs=clock, steps_since_checkpoint=step - last_ckpt,
            secs_since_checkpoint=since, iter_secs=snap.iter_secs, stall_secs=snap.stall_secs,
            persist_secs=snap.persist_secs, slowdown_secs=snap.slowdown_secs,
            in_flight=int(pending is not None), max_in_flight=1,
            checkpoints=snap.checkpoints + int(pending is not None),
            observed_overhead=snap.recent_overhead,
            measured_cost_secs=snap.checkpoint_cost_secs,
            measured_cost_step=snap.checkpoint_cost_step,
            measured_cost_low_secs=getattr(snap, "checkpoint_cost_low_secs", None),
        )  # fmt: skip
        if policy.decide(c) and pending is None:
            interval = getattr(policy, "interval", None)
            if interval is not None:
                intervals.append(interval)
            prof.save_started()
            prof.stall(machine.stall_secs)
            extra_total += machine.stall_secs
            extras[-1] += machine.stall_secs
            clock += machine.stall_secs
            persist_left = rng.choice(machine.persist_secs)
            wait_left = 0.0 if saved else machine.first_wait_secs
            persist_started = clock
            saved.append(step)
            costs.append(machine.stall_secs)
            last_ckpt, since = step, 0.0
            pending = SaveStats(step=step, stall_secs=machine.stall_secs)
    # the checkpoint's cost as drawn (after the first, which may be a one-off)
    mean_cost = sum(costs[1:]) / max(1, len(costs) - 1)
    return Run(
        saved, base_total, extra_total, mean_cost, base_total / steps, intervals, extras, bases
    )


def expected_cost(machine: Machine) -> float:
    """The mean cost of one checkpoint on ``machine``: the stall plus, for a persist that runs
    P seconds while training runs at 1/s of its speed, P x (1 - 1/s) seconds of training lost."""
    mean_persist = sum(machine.persist_secs) / len(machine.persist_secs) + machine.tail_secs
    return machine.stall_secs + mean_persist * (1 - 1 / machine.slowdown)


SHAPES = {
    # a wide MLP: short persists, skewed (one in five hits writeback and takes 10x longer)
    "skewed": Machine(),
    # a conv net: slower iterations, persists of a few iterations, noisier
    "long_persist": Machine(iter_secs=0.3, noise=0.2, persist_secs=[0.3, 0.3, 0.3, 2.4]),
    # a small transformer on a drifting host (a neighbour comes and goes)
    "drifting": Machine(iter_secs=0.05, noise=0.1, drift=0.2, persist_secs=[0.02] * 3 + [0.2]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_checkfreq_keeps_its_budget_and_its_frequency(shape: str, seed: int) -> None:
    machine = SHAPES[shape]
    r = run(CheckFreq(0.02), machine, steps=3000, seed=seed)
    allowed = expected_cost(machine) / (0.02 * r.mean_iter_secs)
    gaps = [b - a for a, b in itertools.pairwise(r.saved)]
    assert r.overhead <= 0.03, (r.overhead, gaps)  # the budget, measured in pairs
    assert max(gaps[2:]) <= 4 * allowed, (allowed, gaps)  # and it keeps checkpointing


def test_the_machine_is_what_it_says() -> None:
    """The synthetic machine's checkpoints cost what ``expected_cost`` says (so the budget's
    allowed interval above is the right yardstick), and EveryN(allowed) spends the budget."""
    machine = SHAPES["skewed"]
    k = round(expected_cost(machine) / (0.02 * machine.iter_secs))
    from pitstop.policy import EveryN

    r = run(EveryN(k), machine, steps=6000, seed=0)
    assert r.mean_cost_secs == pytest.approx(expected_cost(machine), rel=0.2)
    assert 0.015 <= r.overhead <= 0.025, r.overhead


def test_a_slow_first_save_and_dropped_pairs_do_not_stop_checkpointing() -> None:
    """Under DDP the first save is slow (plans, files, the ranks agreeing) and the noisy
    iterations of two ranks make most paired measurements disagree before and after, so
    the interval comes from the model alone: it must grow in bounded steps, not jump to
    what one slow save suggests (the issue: 1 checkpoint in 135 steps)."""
    machine = Machine(
        iter_secs=0.015, noise=0.4, stall_secs=0.002, persist_secs=[0.01], first_wait_secs=1.0
    )
    r = run(CheckFreq(0.02), machine, steps=600, seed=5)
    allowed = expected_cost(machine) / (0.02 * r.mean_iter_secs)
    gaps = [b - a for a, b in itertools.pairwise(r.saved)]
    # the first gap cannot be shorter than the first save (one save in flight at a time)
    assert gaps[0] <= 1.0 / r.mean_iter_secs + 2 * allowed, gaps
    assert max(gaps) <= 4 * allowed, (allowed, gaps)
    assert r.overhead <= 0.03, r.overhead


def test_a_noisy_machine_keeps_its_paired_measurements() -> None:
    """Iterations that scatter by +-30 % (a loaded host) with no drift at all: the medians
    of 5 quiet iterations before and 3 after a save differ by more than 15 % by chance
    alone, about half the time. Those pairs are not drift and are kept (the tolerance
    follows the machine's own scatter), so the estimate rests on every checkpoint, not
    on the half that happened to look alike. Before: ~50 % were dropped."""
    rng = random.Random(7)
    prof = Profiler(warmup=0)
    cost, saves = 0.05, 40

    def it(extra: float = 0.0, persisting: bool = False) -> None:
        prof.iteration(0.1 * rng.uniform(0.7, 1.3) + extra, persisting=persisting)

    for step in range(saves):
        for _ in range(12):
            it()
        prof.save_started()
        prof.stall(0.003)
        it(cost / 2, persisting=True)
        it(cost / 2, persisting=True)
        prof.checkpoint(SaveStats(step=step, stall_secs=0.003, total_secs=0.2))
        prof.settled(step)
    for _ in range(3):
        it()
    assert prof._pairs >= 0.9 * saves, prof._pairs
    snap = prof.snapshot()
    up, low = snap.checkpoint_cost_secs, snap.checkpoint_cost_low_secs
    assert up is not None and low is not None
    # the mean of the pairs (each counts its tail too: 3 more noisy iterations, so the upper
    # estimate, mean + standard error, sits further above it than the pairs' noise alone)
    assert abs((up + low) / 2 - (cost + 0.003)) <= 0.4 * cost, (low, up)


NOISY_NEIGHBOUR = Machine(
    iter_secs=0.15, noise=0.3, persist_secs=[0.05] * 4 + [0.3], slowdown=1.5,
    neighbour_at=(600, 6.0),
)  # fmt: skip


@pytest.mark.parametrize("seed", range(1, 9))
def test_a_neighbour_arriving_on_a_noisy_machine_keeps_the_budget(seed: int) -> None:
    """A neighbour arrives at step 600 and every persist beside it takes 4x more from the
    training thread (the transformer loop of ``benchmarks/overhead.py``), on a machine whose
    iterations scatter by +-30 %. The interval must follow within a few checkpoints. Before:
    most pairs were dropped as drift and the growth bound held the interval at the old
    cost's (3.2 % from step 600 on with seed 3)."""
    r = run(CheckFreq(0.02), NOISY_NEIGHBOUR, steps=1500, seed=seed)
    assert r.overhead_from(600) <= 0.03, r.overhead_from(600)
    after = [s for s in r.saved if s >= 600]
    beside = Machine(**{**NOISY_NEIGHBOUR.__dict__, "slowdown": 6.0, "neighbour_at": None})
    allowed = expected_cost(beside) / (0.02 * r.mean_iter_secs)
    assert max(b - a for a, b in itertools.pairwise(after)) <= 4 * allowed


# a load leaves at step 600 (the conv net of ``benchmarks/overhead.py`` after a neighbour's
# burst): iterations run 3x faster and a persist takes a smaller share of the cores, so a
# checkpoint costs 3x fewer seconds of training and 2.1x fewer iterations
LOAD_LEAVING = Machine(
    iter_secs=0.14, noise=0.2, stall_secs=0.01, persist_secs=[0.08] * 4 + [0.4], slowdown=6.0,
    neighbour_at=(600, 1.08), neighbour_iter=1 / 3,
)  # fmt: skip


@pytest.mark.parametrize("seed", range(1, 9))
def test_the_interval_follows_a_load_that_leaves(seed: int) -> None:
    """Measured on the conv loop with two busy processes for its first 16 s: the policy's
    estimate stayed at the loaded host's cost in seconds (0.019 s against 0.0036 s measured
    after) and its interval at 25-29 where 3.9 was allowed (longest gap 7.9x), because the
    estimate was the mean of the last 16 pairs in seconds, and at the long interval the
    loaded pairs took hundreds of steps to leave it. Pairs are now kept in iterations of
    their own time: the cost falls with the iterations at once, and the rest follows as new
    pairs come. Before: the longest gap after the load left 5.4-9.1x the allowed interval
    (mean 4.4-8.2x); now 2.0-3.5x (mean 1.4-2.6x: the cost in iterations fell 2.1x, and
    that part still waits for new pairs)."""
    r = run(CheckFreq(0.02), LOAD_LEAVING, steps=1500, seed=seed)
    after_load = Machine(**{**LOAD_LEAVING.__dict__, "slowdown": 1.08, "neighbour_at": None})
    iter_after = sum(r.base_by_step[600:]) / len(r.base_by_step[600:])
    allowed = expected_cost(after_load) / (0.02 * iter_after)
    gaps = [b - a for a, b in itertools.pairwise([s for s in r.saved if s >= 600])]
    assert max(gaps) <= 4 * allowed, (allowed, gaps)
    assert r.overhead_from(600) <= 0.03, r.overhead_from(600)


# a save's work goes on after it commits, unseen by the loop (writeback, the allocator giving
# pages back, under DDP a peer rank's part): the quiet iterations right after it run slower
TAILS = {
    # DDP-like: short noisy iterations, a short write, a tail three times as long
    "ddp": Machine(
        iter_secs=0.015, noise=0.4, stall_secs=0.002, persist_secs=[0.01], tail_secs=0.05
    ),
    # the transformer loop: the write takes two iterations, its tail four more
    "transformer": Machine(
        iter_secs=0.05, noise=0.3, persist_secs=[0.1] * 3 + [0.4], slowdown=3.0, tail_secs=0.2
    ),
}


@pytest.mark.parametrize("shape", sorted(TAILS))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_saves_tail_after_it_commits_is_part_of_its_cost(shape: str, seed: int) -> None:
    """The quiet iterations just after a save are its tail, never a baseline. Before, they
    were both: the tail's cost was missed and, at a short interval, every baseline was a
    tail, so each pair read the save as cheap (or negative) and the interval fell to its
    minimum and stayed there: before, the 'ddp' machine cost 15-72 % (gaps of 3 steps where
    107 were allowed, seed 3), the 'transformer' one 3.3-8.6 %."""
    machine = TAILS[shape]
    r = run(CheckFreq(0.02), machine, steps=4000, seed=seed)
    allowed = expected_cost(machine) / (0.02 * r.mean_iter_secs)
    gaps = [b - a for a, b in itertools.pairwise(r.saved)]
    assert r.overhead <= 0.03, (r.overhead, allowed, gaps)
    assert max(gaps[2:]) <= 4 * allowed, (allowed, gaps)


@pytest.mark.parametrize("seed", range(1, 9))
def test_pairs_of_a_host_that_was_another_are_left_out(seed: int) -> None:
    """Once a few pairs of the host as it is now are measured, the pairs taken under the
    load that left (their quiet iteration 3x slower) no longer set the estimate: before,
    they stayed among the 16 for hundreds of steps, and from step 900 on (300 after the
    load left) the mean interval was 1.3-2.2x what the budget allows; now 0.9-1.5x."""
    r = run(CheckFreq(0.02), LOAD_LEAVING, steps=1500, seed=seed)
    after_load = Machine(**{**LOAD_LEAVING.__dict__, "slowdown": 1.08, "neighbour_at": None})
    iter_after = sum(r.base_by_step[600:]) / len(r.base_by_step[600:])
    allowed = expected_cost(after_load) / (0.02 * iter_after)
    late = [s for s in r.saved if s >= 900]
    assert (late[-1] - late[0]) / (len(late) - 1) <= 1.6 * allowed, (allowed, late)
