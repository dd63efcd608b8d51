"""The failure simulator: exact accounting, Daly's optimum, determinism, the CLI."""

from __future__ import annotations

import json
import math
import os
import statistics

import pytest

from pitstop.cli.main import main
from pitstop.policy import CheckFreq, EveryEpoch, EveryN, ValueAware, YoungDaly, daly_optimum
from pitstop.sim import (
    FailureClass,
    FailureModel,
    JobModel,
    LossModel,
    compare,
    load_trace,
    simulate,
)

NO_FAILURES = FailureModel(mtbf_secs=1e9, trace=())


@pytest.mark.parametrize("policy", [EveryN(7), CheckFreq(0.05), YoungDaly(600.0)], ids=repr)
def test_without_failures_overhead_is_cost_times_count(policy: object) -> None:
    job = JobModel(
        iter_secs=0.5, stall_secs=0.2, persist_secs=1.0, slowdown_secs=0.3, iterations=2000
    )
    r = simulate(job, NO_FAILURES, policy)  # type: ignore[arg-type]
    assert r.failures == 0 and r.lost_secs == 0 and r.restart_secs == 0 and r.checkpoints > 0
    assert r.checkpoint_secs == pytest.approx((0.2 + 0.3) * r.checkpoints, rel=1e-12)
    assert r.wall_secs == pytest.approx(job.work_secs + r.checkpoint_secs, rel=1e-12)


def test_every_n_takes_the_expected_count() -> None:
    job = JobModel(iter_secs=1.0, stall_secs=0.1, persist_secs=0.5, iterations=1000)
    assert simulate(job, NO_FAILURES, EveryN(10)).checkpoints == 100
    epochs = JobModel(
        iter_secs=1.0, stall_secs=0.1, persist_secs=0.5, iterations=1000, iterations_per_epoch=250
    )
    assert simulate(epochs, NO_FAILURES, EveryEpoch()).checkpoints == 4


@pytest.mark.slow
def test_simulated_optimum_interval_matches_daly() -> None:
    """Synchronous checkpoints (persist 0) under exponential failures: Daly's model exactly."""
    cost, mtbf = 60.0, 3600.0
    job = JobModel.for_hours(
        400, iter_secs=30.0, stall_secs=cost, persist_secs=0.0, restart_secs=30.0
    )
    failures = FailureModel(mtbf_secs=mtbf)
    ks = list(range(8, 42, 2))
    seeds = range(5)
    wall = {k: sum(simulate(job, failures, EveryN(k), seed=s).wall_secs for s in seeds) for k in ks}
    # a parabola through the points around the minimum, in log(interval)
    best = min(ks, key=wall.__getitem__)
    i = ks.index(best)
    lo, hi = max(0, i - 4), min(len(ks), i + 5)
    xs = [math.log(k * job.iter_secs) for k in ks[lo:hi]]
    ys = [wall[k] for k in ks[lo:hi]]
    n = len(xs)
    sx, sy = sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    sx3, sx4, sx2y = (
        sum(x**3 for x in xs),
        sum(x**4 for x in xs),
        sum(x * x * y for x, y in zip(xs, ys)),
    )
    # least squares for y = a x^2 + b x + c (Cramer's rule on the normal equations)
    m = [[sx4, sx3, sxx], [sx3, sxx, sx], [sxx, sx, n]]
    v = [sx2y, sxy, sy]

    def det(a: list[list[float]]) -> float:
        return (
            a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0])
        )

    d = det(m)
    a = det([[v[0], m[0][1], m[0][2]], [v[1], m[1][1], m[1][2]], [v[2], m[2][1], m[2][2]]]) / d
    b = det([[m[0][0], v[0], m[0][2]], [m[1][0], v[1], m[1][2]], [m[2][0], v[2], m[2][2]]]) / d
    assert a > 0
    simulated = math.exp(-b / (2 * a))
    expected = daly_optimum(cost, mtbf)
    assert abs(simulated - expected) / expected < 0.10, (simulated, expected)


def test_deterministic_for_a_seed() -> None:
    job = JobModel.for_hours(5, iter_secs=1.0, stall_secs=0.5, persist_secs=2.0)
    failures = FailureModel.per_node(2.0, 4, weibull_shape=0.7)
    a = simulate(job, failures, CheckFreq(0.02), seed=3, record=True)
    b = simulate(job, failures, CheckFreq(0.02), seed=3, record=True)
    assert a == b and a.failures > 0
    assert simulate(job, failures, CheckFreq(0.02), seed=4).events != a.events  # the seed matters


def test_failures_lose_work_since_the_last_commit() -> None:
    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=10.0, iterations=100
    )
    failures = FailureModel(mtbf_secs=1.0, trace=(25.5,))
    r = simulate(job, failures, EveryN(10))
    assert r.failures == 1 and r.lost_secs == pytest.approx(5.5) and r.restart_secs == 10.0
    assert r.wall_secs == pytest.approx(100 + 5.5 + 10.0)


def test_a_persist_in_flight_at_the_failure_is_lost() -> None:
    job = JobModel(iter_secs=1.0, stall_secs=0.0, persist_secs=3.0, restart_secs=0.0, iterations=30)
    r = simulate(job, FailureModel(mtbf_secs=1.0, trace=(21.5,)), EveryN(10))
    # checkpoint at 20 would commit at 23: the failure at 21.5 falls back to 10
    assert r.lost_secs == pytest.approx(11.5)


def test_failure_classes_add_their_restart_cost() -> None:
    job = JobModel(iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=5.0, iterations=50)
    failures = FailureModel(
        mtbf_secs=1.0,
        trace=(10.5, 60.5),
        classes=(FailureClass("node", 1.0, extra_restart_secs=20.0),),
    )
    assert simulate(job, failures, EveryN(5)).restart_secs == pytest.approx(2 * 25.0)


@pytest.mark.slow
def test_value_aware_beats_uniform_on_value_weighted_overhead_with_early_stop() -> None:
    job = JobModel.for_hours(
        48, iter_secs=2.0, stall_secs=30.0, persist_secs=60.0, restart_secs=120.0
    )
    failures = FailureModel(mtbf_secs=2 * 3600.0)
    loss = LossModel(tau_secs=8 * 3600.0, stop_min=0.1)
    summaries = compare(
        job, failures,
        {"uniform": YoungDaly(failures.mtbf_secs), "value": ValueAware(failures.mtbf_secs, horizon_secs=job.work_secs)},
        seeds=6, loss=loss,
    )  # fmt: skip
    uniform, value = (s.mean(lambda r: r.value_ft_overhead_secs) for s in summaries)
    assert value < uniform


def test_trace_csv(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "t.csv")
    with open(path, "w") as f:
        f.write("node,time_secs\na,30.5\nb,10\n")
    assert load_trace(path) == (10.0, 30.5)


@pytest.mark.slow
def test_cli_simulate_table_json_and_plot(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["simulate", "--iter-secs", "1", "--stall-secs", "0.5", "--persist-secs", "2", "--mtbf-hours", "8",
            "--nodes", "8", "--hours", "4", "--epoch-iters", "1000", "--seeds", "2", "--jobs", "1"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    first = capsys.readouterr().out
    rows = json.loads(first)
    assert {r["policy"] for r in rows} == {
        "EveryEpoch",
        "EveryN(100)",
        "YoungDaly",
        "CheckFreq(2%)",
        "ValueAware",
    }
    assert main([*args, "--json"]) == 0
    assert capsys.readouterr().out == first  # deterministic
    plot = os.path.join(str(tmp_path), "out.png")
    pytest.importorskip("matplotlib")
    assert main([*args, "--policy", "epoch,checkfreq", "--plot", plot]) == 0
    out = capsys.readouterr().out
    assert "EveryEpoch" in out and "CheckFreq(2%)" in out and os.path.getsize(plot) > 10_000
    assert main(["simulate", "--iter-secs", "1"]) == 2  # names what is missing
    assert "--stall-secs" in capsys.readouterr().err


def test_a_persist_that_finished_before_the_failure_counts() -> None:
    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=2.0, restart_secs=0.0, iterations=200
    )
    # checkpoint at 100 commits at 102; the failure at 103.5 (mid-iteration) keeps it
    r = simulate(job, FailureModel(mtbf_secs=1.0, trace=(103.5,)), EveryN(100))
    assert r.lost_secs == pytest.approx(3.5)


def test_the_persist_begins_when_the_stall_ends_not_after_the_slowdown() -> None:
    """The slowdown is training slowed while the persist runs: charged with the stall, but
    the persist begins when the stall ends, and commits a persist's time later. Begun after
    the slowdown, the model committed a DCP async_save every 40 steps 0.05 s late in
    ``benchmarks/goodput.py`` and lost checkpoints that the real run had before its kills."""
    job = JobModel(
        iter_secs=1.0, stall_secs=0.1, persist_secs=1.0, slowdown_secs=0.5, restart_secs=0.0,
        iterations=20,
    )  # fmt: skip
    # step 5 ends at 5; stalled until 5.1, the persist commits at 6.1; the slowdown takes
    # the loop to 5.6; killed at 6.3 (in step 6): back to 5, 0.7 s lost
    r = simulate(job, FailureModel(mtbf_secs=1.0, trace=(6.3,)), EveryN(5), record=True)
    assert r.lost_secs == pytest.approx(0.7) and r.checkpoints == 4  # 5, 10, 15, 20
    assert [(round(t, 6), kind, p) for t, kind, p in r.events[:2]] == [
        (5.1, "checkpoint", 5.0), (6.3, "failure", 5.0),
    ]  # fmt: skip
    assert r.wall_secs == pytest.approx(job.work_secs + r.lost_secs + r.checkpoint_secs)
    # killed while slowed (5.1-5.6): the checkpoint counts if its persist ended by then
    quick = JobModel(
        iter_secs=1.0, stall_secs=0.1, persist_secs=0.1, slowdown_secs=0.5, restart_secs=0.0,
        iterations=20,
    )  # fmt: skip
    r = simulate(quick, FailureModel(mtbf_secs=1.0, trace=(5.3,)), EveryN(5))
    assert r.failures == 1 and r.lost_secs == 0.0  # committed at 5.2
    assert r.checkpoint_secs == pytest.approx(0.3 + 3 * 0.6)  # 5-5.3, then 10, 15 and 20
    assert r.wall_secs == pytest.approx(job.work_secs + r.checkpoint_secs)
    r = simulate(job, FailureModel(mtbf_secs=1.0, trace=(5.3,)), EveryN(5))
    assert r.lost_secs == pytest.approx(5.0)  # its persist (to 6.1) was not done: back to 0


def test_a_failure_during_a_restart_charges_only_the_time_spent() -> None:
    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=60.0, iterations=300
    )
    r = simulate(job, FailureModel(mtbf_secs=1.0, trace=(105.0, 110.0)), EveryN(100))
    assert r.restart_secs == pytest.approx(5.0 + 60.0)
    assert r.wall_secs == pytest.approx(job.work_secs + r.lost_secs + r.restart_secs)


def test_a_restart_is_a_new_process_whose_policy_measures_again() -> None:
    """After a failure the manager's policy is a fresh object in a new process: CheckFreq
    warms up, probes and grows its interval again, and the simulator must say so (it kept
    the old interval across failures, and over-predicted goodput when failures are frequent)."""
    from pitstop.sim.engine import WARMUP

    job = JobModel(
        iter_secs=1.0, stall_secs=0.01, persist_secs=0.0, slowdown_secs=0.0,
        restart_secs=2.0, iterations=400,
    )  # fmt: skip
    r = simulate(job, FailureModel(mtbf_secs=1.0, trace=(200.5,)), CheckFreq(0.02), record=True)
    kinds = [(kind, progress) for _, kind, progress in r.events]
    at = next(i for i, (kind, _) in enumerate(kinds) if kind == "failure")
    before = [p for k, p in kinds[:at] if k == "checkpoint"]
    after = [p for k, p in kinds[at + 1 :] if k == "checkpoint"]
    assert before[-1] - before[-2] == 1.0  # an interval of 1 by then (0.01 s / 2 % of 1 s)
    resumed = before[-1]
    # no checkpoint until the new process timed its first iteration (it cannot: nothing
    # marks its start) and WARMUP more, then the probe
    assert after[0] - resumed == WARMUP + 2, (resumed, after[:3])


def test_a_run_of_fixed_length_counts_the_progress_reached() -> None:
    """``until_secs``: goodput over a fixed wall-clock time (what a benchmark that kills a
    loop for T seconds measures) is the progress reached at T over T; over a fixed job the
    same failures are diluted by the time the run goes on without them."""
    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=10.0, iterations=1000
    )
    failures = FailureModel(mtbf_secs=1.0, trace=(25.5, 80.5))
    r = simulate(job, failures, EveryN(10), until_secs=100.0)
    # 25.5: back to 20, restart until 35.5; 80.5 (step 65): back to 60, restart until 90.5;
    # 9 more iterations by 99.5, the 10th unfinished at 100
    assert r.failures == 2 and r.work_secs == 69.0 and r.wall_secs == 100.0
    assert r.lost_secs == pytest.approx(10.5) and r.goodput == pytest.approx(0.69)
    whole = simulate(job, failures, EveryN(10))
    assert whole.goodput == pytest.approx(1000 / (1000 + 10.5 + 20))  # the same, diluted


def test_a_host_whose_speed_drifts_moves_the_checkpoints_against_the_failures() -> None:
    """``speed_trace``: a host that slows down (a neighbour's job) stretches the iterations
    from that time on. With constant iterations the model put a checkpoint on the wrong
    side of a failure (benchmarks/goodput.py: a real loop that ran 10 % faster in one stretch
    checkpointed 50 ms before a kill that the model placed 2 steps before the checkpoint)."""
    steady = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=0.0, iterations=1000
    )
    slow = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=0.0, iterations=1000,
        speed_trace=((5.0, 2.0), (15.0, 1.0)),
    )  # fmt: skip
    assert [slow.iter_secs_at(t) for t in (0.0, 4.9, 5.0, 14.9, 15.0)] == [1, 1, 2, 2, 1]
    # no failure: 5 iterations by 5 s, 5 more (2 s each) by 15 s, then 15 by 30 s
    assert simulate(slow, NO_FAILURES, EveryN(10), until_secs=30.0).work_secs == 25.0
    failures = FailureModel(mtbf_secs=1.0, trace=(16.5,))
    # steady: step 16 at 16 s, the checkpoint of step 10 committed: 6 steps + 0.5 s lost
    r = simulate(steady, failures, EveryN(10), until_secs=30.0)
    assert r.lost_secs == pytest.approx(6.5) and r.work_secs == 10 + 13
    # slow: step 11 at 16 s: 1 step + 0.5 s lost, 13 more steps by 30 s
    r = simulate(slow, failures, EveryN(10), until_secs=30.0)
    assert r.lost_secs == pytest.approx(1.5) and r.work_secs == 10 + 13


def test_time_based_policies_count_the_wall_clock_of_a_drifting_host() -> None:
    from pitstop.policy import Every

    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, iterations=20,
        speed_trace=((0.0, 2.0),),
    )  # fmt: skip
    r = simulate(job, NO_FAILURES, Every(secs=4.0), record=True)
    # every iteration takes 2 s: Every(4 s) checkpoints every 2 steps, as a real loop would
    assert [round(p) for _, kind, p in r.events if kind == "checkpoint"] == list(range(2, 21, 2))
    with pytest.raises(ValueError, match="speed_trace"):
        JobModel(iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, iterations=1,
                 speed_trace=((1.0, 1.0), (0.5, 2.0)))  # fmt: skip


_ESTIMATES: list[float] = []  # what the policy below saw (its copies in simulate() share it)


class _Recording(CheckFreq):
    def decide(self, ctx: object) -> bool:
        cost = getattr(ctx, "measured_cost_secs", None)
        if cost is not None:
            _ESTIMATES.append(cost)
        return super().decide(ctx)  # type: ignore[arg-type]


def test_policies_decide_on_noisy_measurements_and_the_true_costs_are_charged() -> None:
    """``cost_noise_secs``: the loop measures each checkpoint's cost with noise, and the policy
    decides on the profiler's estimate (one noisy sample first, then the mean of the last 16
    plus its standard error). With exact measurements the model's CheckFreq kept one rhythm
    after every restart, and on benchmarks/goodput.py's trace (failures 2.7 s apart) put a
    checkpoint just before 4 of 5 failures: 0.918 predicted, 0.832 measured; with 0.01-0.02 s
    of noise in a 0.033 s cost, 0.84 (+-0.03-0.04 over seeds)."""

    def run(noise: float, seed: int) -> int:
        job = JobModel(
            iter_secs=1.0, stall_secs=0.01, persist_secs=0.0, slowdown_secs=0.03,
            iterations=3000, cost_noise_secs=noise,
        )  # fmt: skip
        r = simulate(job, NO_FAILURES, _Recording(0.02), seed=seed)
        # the true costs are charged, whatever the policy believed
        assert r.checkpoint_secs == pytest.approx(r.checkpoints * 0.04)
        return r.checkpoints

    _ESTIMATES.clear()
    assert len({run(0.0, s) for s in range(4)}) == 1  # exact: every seed alike
    assert not _ESTIMATES  # and the policy saw the model's cost, as it always did
    counts = {run(0.02, s) for s in range(4)}
    assert len(counts) > 1  # noisy: the intervals, and so the count, differ between runs
    # the estimates scatter around the true cost; their typical one is near it
    assert len(set(_ESTIMATES)) > 10
    assert statistics.median(_ESTIMATES) == pytest.approx(0.04, abs=0.01)
    with pytest.raises(ValueError, match="cost_noise_secs"):
        JobModel(iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, iterations=1,
                 cost_noise_secs=-1.0)  # fmt: skip


def test_each_failure_takes_its_measured_restart_time() -> None:
    """``FailureModel.restart_trace``: the i-th failure's restart takes the time measured for
    it. Restarts vary (0.15-0.45 s in benchmarks/goodput.py); with their mean for each, the
    model ran 0.25 s ahead of a DCP run 11 s after a slow restart, took a checkpoint the real
    run reached just after a kill, and predicted 0.760 for a measured 0.702."""
    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=10.0, iterations=1000
    )
    traced = FailureModel(mtbf_secs=1.0, trace=(25.5, 60.5), restart_trace=(2.0, 5.0))
    r = simulate(job, traced, EveryN(10), until_secs=100.0)
    # 25.5: back to 20, restarted at 27.5; 60.5 (step 53): back to 50, restarted at 65.5;
    # 34 more iterations by 99.5
    assert r.restart_secs == 7.0 and r.work_secs == 84.0
    # past the end of the trace, the job's restart time
    r = simulate(job, FailureModel(1.0, trace=(25.5, 60.5), restart_trace=(2.0,)), EveryN(10))
    assert r.restart_secs == 12.0
    mean = simulate(
        job, FailureModel(mtbf_secs=1.0, trace=(25.5, 60.5)), EveryN(10), until_secs=100.0
    )
    assert mean.restart_secs == 20.0 and mean.work_secs == 69.0
    with pytest.raises(ValueError, match="restart_trace"):
        FailureModel(mtbf_secs=1.0, restart_trace=(-1.0,))


_LOWS: list[tuple[float, float]] = []  # (lower, upper) estimates the policy below saw


class _RecordingLow(CheckFreq):
    def decide(self, ctx: object) -> bool:
        low = getattr(ctx, "measured_cost_low_secs", None)
        if low is not None:
            _LOWS.append((low, getattr(ctx, "measured_cost_secs", math.nan)))
        return super().decide(ctx)  # type: ignore[arg-type]


def test_noisy_measurements_give_the_lower_estimate_as_the_profiler_does() -> None:
    """From 3 paired measurements on, the profiler gives CheckFreq a lower estimate of the cost
    (mean - standard error: how far it may grow its interval at once); the simulator gave none,
    so its CheckFreq grew only 2x per measurement after every restart, where the real one jumped."""
    job = JobModel(
        iter_secs=1.0, stall_secs=0.01, persist_secs=0.0, slowdown_secs=0.03,
        iterations=3000, cost_noise_secs=0.01,
    )  # fmt: skip
    _LOWS.clear()
    simulate(job, NO_FAILURES, _RecordingLow(0.02), seed=1)
    assert _LOWS and all(low < high for low, high in _LOWS)
    assert statistics.median(low for low, _ in _LOWS) == pytest.approx(0.04, abs=0.01)


def test_a_trace_known_to_within_some_time_moves_each_failure_per_seed() -> None:
    """``trace_jitter_secs``: a measured run's failures are exact on its clock, not on the
    model's (a few iterations apart after seconds): each seed moves each failure within
    +-the jitter, and the prediction is a spread. Exact times put a checkpoint one step on
    the wrong side of a kill and moved DCP(40)'s prediction by 6 points."""
    import random

    exact = FailureModel(mtbf_secs=1.0, trace=(10.0, 20.0))
    assert exact.times(100.0, random.Random(1)) == [10.0, 20.0]
    jittered = FailureModel(mtbf_secs=1.0, trace=(10.0, 20.0), trace_jitter_secs=0.5)
    draws = [jittered.times(100.0, random.Random(s)) for s in range(20)]
    assert all(abs(a - 10.0) <= 0.5 and abs(b - 20.0) <= 0.5 for a, b in draws)
    assert len({tuple(d) for d in draws}) == 20  # each seed its own
    # a failure right at a checkpoint's commit: before or after it, by seed
    job = JobModel(iter_secs=1.0, stall_secs=0.0, persist_secs=0.5, iterations=100)
    near = FailureModel(mtbf_secs=1.0, trace=(10.6,), trace_jitter_secs=0.3)
    lost = {simulate(job, near, EveryN(10), seed=s).lost_secs for s in range(20)}
    assert min(lost) < 1.0 < 10.0 < max(lost)
    with pytest.raises(ValueError, match="trace_jitter_secs"):
        FailureModel(mtbf_secs=1.0, trace_jitter_secs=-1.0)


def test_a_slower_host_is_slower_at_a_saves_work_too() -> None:
    """``speed_trace`` scales a checkpoint's stall, slowdown and persist with the iterations:
    with the stall at its mean everywhere, the model drifted 0.4 s behind a real torch.save
    every 10 steps over 15 s in ``benchmarks/goodput.py`` (its saves took 0.06 s while the
    host ran fast, 0.1-0.15 s later), and put checkpoints on the wrong side of kills."""
    job = JobModel(
        iter_secs=1.0, stall_secs=1.0, persist_secs=3.0, restart_secs=0.0, iterations=1000,
        speed_trace=((0.0, 2.0),),
    )  # fmt: skip
    r = simulate(job, NO_FAILURES, EveryN(5), until_secs=24.0, record=True)
    # 5 iterations of 2 s, a stall of 2 s, twice: 24 s; the first persist takes 6 s
    assert r.work_secs == 10.0 and r.checkpoint_secs == pytest.approx(4.0)
    assert [(t, kind) for t, kind, _ in r.events][:2] == [(12.0, "checkpoint"), (18.0, "commit")]


def test_the_policy_decides_on_what_the_profiler_measures_and_the_run_pays_the_cost() -> None:
    """``measured_cost_secs``: the profiler leaves out a process's first save and drops pairs
    across which the host changed speed, so on a busy host it measures a checkpoint far below
    what the run pays (``benchmarks/goodput.py``: 0.07 s against 0.29 s charged). With the
    charged cost as the measured one the model's CheckFreq chose 2-4x the real intervals and
    predicted 15 points below the measurement."""

    def run(measured: float | None) -> tuple[int, float]:
        job = JobModel(
            iter_secs=1.0, stall_secs=0.01, persist_secs=0.0, slowdown_secs=0.3,
            iterations=3000, measured_cost_secs=measured,
        )  # fmt: skip
        r = simulate(job, NO_FAILURES, CheckFreq(0.02))
        assert r.checkpoint_secs == pytest.approx(r.checkpoints * 0.31)  # charged in full
        return r.checkpoints, r.checkpoint_secs

    charged, _ = run(None)  # an interval of 16: 0.31 / (0.02 x 1 s)
    measured, _ = run(0.05)  # of 3: 0.05 / 0.02
    assert 150 < charged < 200 and 900 < measured < 1100
    with pytest.raises(ValueError, match="measured_cost_secs"):
        JobModel(iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, iterations=1,
                 measured_cost_secs=-1.0)  # fmt: skip


def test_a_process_knows_its_iteration_time_at_its_seventh_step() -> None:
    """The first iteration of a process is not timed (``ckpt.step`` times an iteration from
    the end of the call before it) and the profiler leaves out the 5 after it: CheckFreq's
    probe after a restart comes 7 steps after the restore, as in ``benchmarks/goodput.py``
    (restored 114, 121, 128: probes at 121, 128, 135), not 6."""
    job = JobModel(
        iter_secs=1.0, stall_secs=0.0, persist_secs=0.0, restart_secs=0.0, iterations=1000
    )
    failures = FailureModel(mtbf_secs=1.0, trace=(30.5,))
    r = simulate(job, failures, CheckFreq(0.02), until_secs=60.0, record=True)
    points = [round(p) for _, kind, p in r.events if kind == "checkpoint"]
    # costs are 0: a checkpoint every step once measured; the failure at 30.5 restores 30
    assert points[0] == 15 and 30 in points and points[points.index(30) + 1] == 37
