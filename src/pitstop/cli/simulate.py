"""``pitstop simulate``: compare checkpoint policies on a model of your job, in seconds, without torch."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pitstop.policy import (
    CheckFreq,
    CheckpointPolicy,
    EveryEpoch,
    EveryN,
    ValueAware,
    YoungDaly,
    daly_optimum,
)
from pitstop.policy.checkfreq import percent
from pitstop.sim.compare import PolicySummary
from pitstop.sim.engine import RunResult, simulate
from pitstop.sim.model import (
    MAX_FAILURES,
    MAX_ITERATIONS,
    MIN_WEIBULL_SHAPE,
    FailureModel,
    JobModel,
    LossModel,
    TooManyFailures,
    load_profile,
    load_trace,
)

__all__ = ["add_arguments", "run_simulate"]

EXAMPLE = (
    "pitstop simulate --iter-secs 0.5 --stall-secs 0.05 --persist-secs 0.7 --mtbf-hours 4 \\\n"
    "      --nodes 64 --hours 72 --policy all --plot out.png"
)


MAX_SEEDS = 10_000
MAX_JOBS = 1024
MAX_MTBF_HOURS = 1e12  # a node failing once in a hundred million years: never, in a simulation
WALL_FACTOR = 50.0  # a run gives up at 50 x the job's work (simulate's max_wall_factor)


def _number(low: float, *, strict: bool = False, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (> if ``strict``), at most ``high``;
    argparse names the option in its message and exits 2."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if strict else '>='} {low:g}, got {text!r}"
            )
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text!r}")
        return value

    return parse


def _count(high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= 1 (at most ``high``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {text!r}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number between 0 and 1, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    secs = _number(0.0)  # a time, 0 allowed
    job = p.add_argument_group("job")
    job.add_argument(
        "--iter-secs", type=_number(0.0, strict=True), help="compute time of one iteration"
    )
    job.add_argument("--stall-secs", type=secs, help="how long a checkpoint blocks the loop")
    job.add_argument("--persist-secs", type=secs, help="background write time until commit")
    job.add_argument(
        "--slowdown-secs",
        type=secs,
        default=None,
        help="extra training time per persist (default 0)",
    )
    job.add_argument(
        "--restart-secs",
        type=secs,
        default=None,
        help="time to restart after a failure (default 60)",
    )
    job.add_argument(
        "--hours",
        type=_number(0.0, strict=True),
        default=24.0,
        help=f"compute hours the job needs (at most {MAX_ITERATIONS:.0e} iterations)",
    )
    job.add_argument(
        "--epoch-iters", type=_count(), default=None, help="iterations per epoch (for EveryEpoch)"
    )
    job.add_argument("--max-in-flight", type=_count(), default=2)
    job.add_argument(
        "--profile", help="JSON with measured costs (pitstop bench --profile, ckpt.stats())"
    )
    fail = p.add_argument_group("failures")
    fail.add_argument(
        "--mtbf-hours",
        type=_number(0.0, strict=True, high=MAX_MTBF_HOURS),
        default=24.0,
        help="MTBF of one node",
    )
    fail.add_argument("--nodes", type=_count(), default=1)
    fail.add_argument(
        "--weibull-shape",
        type=_number(MIN_WEIBULL_SHAPE),
        default=1.0,
        help=f"1: exponential; < 1: clustered failures (>= {MIN_WEIBULL_SHAPE})",
    )
    fail.add_argument(
        "--trace", help="CSV of failure times in seconds (replaces the failure process)"
    )
    value = p.add_argument_group("value (exploratory training, COCI)")
    value.add_argument(
        "--loss-tau-hours",
        type=_number(0.0, strict=True, high=MAX_MTBF_HOURS),
        default=None,
        help="time constant of the loss curve",
    )
    value.add_argument(
        "--stop-min",
        type=_fraction,
        default=None,
        help="runs stop early, uniformly in [f, 1] x the job",
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--policy",
        default="all",
        help="all, or a comma list of: epoch, every:N, youngdaly, checkfreq[:BUDGET], value",
    )
    out.add_argument(
        "--seeds",
        type=_count(MAX_SEEDS),
        default=5,
        help="failure traces per policy (the same for every policy)",
    )
    out.add_argument(
        "--jobs",
        type=_count(MAX_JOBS),
        default=min(os.cpu_count() or 1, MAX_JOBS),
        help="processes",
    )
    out.add_argument(
        "--plot", help="write a PNG (needs the 'plot' extra: pip install 'pitstop[plot]')"
    )
    out.add_argument("--json", action="store_true", help="print the table as JSON")


def _read(option: str, path: str, load: Callable[[str], Any]) -> Any:
    """``load(path)``, its errors named by the option that gave the file (exit 2)."""
    try:
        return load(path)
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{option} {e}") from None


def _job(args: argparse.Namespace) -> JobModel:
    values: dict[str, Any] = _read("--profile", args.profile, load_profile) if args.profile else {}
    for name in ("iter_secs", "stall_secs", "persist_secs", "slowdown_secs", "restart_secs"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    missing = [n for n in ("iter_secs", "stall_secs", "persist_secs") if n not in values]
    if missing:
        raise ValueError(
            "simulate needs "
            + ", ".join("--" + m.replace("_", "-") for m in missing)
            + " (or --profile)"
        )
    values.setdefault("slowdown_secs", 0.0)
    values.setdefault("restart_secs", 60.0)
    it = values["iter_secs"]
    it_name = (
        f"--iter-secs {it:g}"
        if args.iter_secs is not None
        else f"iter_secs {it:g} (--profile {args.profile})"
    )
    job_secs = args.hours * 3600
    if it > job_secs:
        raise ValueError(
            f"{it_name} is longer than the whole job (--hours {args.hours:g} = {job_secs:g} s)"
        )
    if job_secs / it > MAX_ITERATIONS:
        raise ValueError(
            f"--hours {args.hours:g} of {it_name} is {job_secs / it:.3g} iterations, more than "
            f"the limit of {MAX_ITERATIONS:.0e} (the simulator runs 50-100 thousand a second): "
            "lower --hours or simulate coarser iterations (--iter-secs and the costs scaled alike)"
        )
    return JobModel.for_hours(
        args.hours,
        max_in_flight=args.max_in_flight,
        iterations_per_epoch=args.epoch_iters,
        **values,
    )


def _failures(args: argparse.Namespace, job: JobModel) -> FailureModel:
    trace = _read("--trace", args.trace, load_trace) if args.trace else None
    mtbf_secs = args.mtbf_hours * 3600 / args.nodes
    expected = job.work_secs * WALL_FACTOR / mtbf_secs
    if trace is None and expected > MAX_FAILURES:
        raise ValueError(
            f"--mtbf-hours {args.mtbf_hours:g} over --nodes {args.nodes} is a failure every "
            f"{mtbf_secs:.3g} s: some {expected:.3g} failures in a run (which may take "
            f"{WALL_FACTOR:g} x the job's {job.work_secs / 3600:.3g} h of compute), more than "
            f"the limit of {MAX_FAILURES:.0e}: raise --mtbf-hours, or lower --nodes or --hours"
        )
    return FailureModel.per_node(
        args.mtbf_hours, args.nodes, weibull_shape=args.weibull_shape, trace=trace
    )


def _policies(spec: str, job: JobModel, failures: FailureModel) -> dict[str, CheckpointPolicy]:
    names = (
        ["epoch", "every:100", "youngdaly", "checkfreq", "value"]
        if spec == "all"
        else spec.split(",")
    )
    out: dict[str, CheckpointPolicy] = {}
    for raw in names:
        name, _, arg = raw.strip().partition(":")
        if name == "epoch":
            if not job.iterations_per_epoch:
                if spec == "all":
                    continue
                raise ValueError("policy 'epoch' needs --epoch-iters")
            out["EveryEpoch"] = EveryEpoch()
        elif name == "every":
            try:
                every = EveryN(int(arg or 100))
            except ValueError as e:  # not an integer, or < 1
                raise ValueError(
                    f"--policy {raw.strip()!r}: every:N needs an integer N >= 1 ({e})"
                ) from None
            out[f"EveryN({every.n})"] = every
        elif name == "youngdaly":
            out["YoungDaly"] = YoungDaly(mtbf_secs=failures.mtbf_secs)
        elif name == "checkfreq":
            try:
                budget = float(arg) if arg else 0.02
                freq = CheckFreq(budget)
            except ValueError as e:
                raise ValueError(
                    f"--policy {raw.strip()!r}: checkfreq:BUDGET needs a number between 0 and 1 "
                    f"(0.02 is 2 %) ({e})"
                ) from None
            out[f"CheckFreq({percent(budget)})"] = freq
        elif name == "value":
            out["ValueAware"] = ValueAware(mtbf_secs=failures.mtbf_secs, horizon_secs=job.work_secs)
        else:
            raise ValueError(
                f"unknown policy {raw!r}: use epoch, every:N, youngdaly, checkfreq[:BUDGET], value"
            )
    return out


def _one(
    task: tuple[JobModel, FailureModel, CheckpointPolicy, int, LossModel | None, str, bool],
) -> RunResult:
    job, failures, policy, seed, loss, name, record = task
    return simulate(job, failures, policy, seed=seed, loss=loss, name=name, record=record)


def _run_all(tasks: list[Any], jobs: int) -> list[RunResult]:
    jobs = min(jobs, len(tasks))
    if jobs <= 1:
        return [_one(t) for t in tasks]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_one, tasks))


def _fmt_row(s: PolicySummary, with_value: bool) -> str:
    r = s.row()
    dnf = sum(not run.finished for run in s.runs)
    wall = (
        f"{r['wall_hours']:7.2f} ±{r['wall_hours_std']:5.2f}"
        if not dnf
        else f"{'DNF':>7} ({dnf}/{len(s.runs)})"
    )
    line = (
        f"{s.name:15} {wall:>15} {r['goodput']:7.3f} {100 * float(r['checkpoint_overhead']):7.2f}% "
        f"{r['lost_hours']:7.2f} {r['lost_per_failure_secs']:9.1f} {r['restart_hours']:7.2f} "
        f"{r['checkpoints']:9.0f} {r['failures']:7.1f}"
    )
    if with_value:
        line += f" {r['ft_overhead_hours']:8.2f} {r['value_ft_overhead_hours']:9.2f}"
    return line


def run_simulate(args: argparse.Namespace) -> int:
    """Exit status 0; ValueError (a usage error, exit 2) for a bad value, named."""
    try:
        return _run(args)
    except TooManyFailures as e:  # a Weibull shape that clusters failures past the limit
        raise ValueError(
            f"--weibull-shape {args.weibull_shape:g} with --mtbf-hours {args.mtbf_hours:g} "
            f"over --nodes {args.nodes}: {e}; raise --weibull-shape or --mtbf-hours"
        ) from None


def _run(args: argparse.Namespace) -> int:
    job = _job(args)
    failures = _failures(args, job)
    policies = _policies(args.policy, job, failures)
    loss = None
    if args.loss_tau_hours is not None or args.stop_min is not None:
        loss = LossModel(
            tau_secs=(args.loss_tau_hours or args.hours / 4) * 3600, stop_min=args.stop_min
        )
    tasks = [
        (job, failures, p, s, loss, n, s == 0)
        for n, p in policies.items()
        for s in range(args.seeds)
    ]
    runs = _run_all(tasks, args.jobs)
    summaries = [PolicySummary(n, tuple(r for r in runs if r.policy == n)) for n in policies]
    if args.json:
        print(json.dumps([s.row() for s in summaries], indent=1))
    else:
        _print_table(args, job, failures, summaries, loss is not None)
    if args.plot:
        from pitstop.sim.plot import plot_report

        sweep = _sweep(job, failures, args)
        try:
            plot_report(args.plot, summaries, sweep, job=job, mtbf_secs=failures.mtbf_secs)
        except OSError as e:
            raise ValueError(f"--plot {args.plot}: cannot write it: {e.strerror or e}") from None
        print(f"\nplot written to {args.plot}")
    return 0


def _print_table(
    args: argparse.Namespace,
    job: JobModel,
    failures: FailureModel,
    summaries: list[PolicySummary],
    with_value: bool,
) -> None:
    cost = job.stall_secs + job.slowdown_secs
    print(
        f"job: {job.work_secs / 3600:.1f} h of compute, {job.iterations} iterations of {job.iter_secs} s; "
        f"checkpoint stall {job.stall_secs} s, persist {job.persist_secs} s; restart {job.restart_secs} s"
    )
    print(
        f"failures: job MTBF {failures.mtbf_secs / 60:.1f} min ({args.nodes} nodes x {args.mtbf_hours} h"
        f"{', trace' if args.trace else ''}); Daly optimum for C = {cost:.3g} s: "
        f"{daly_optimum(max(cost, 1e-9), failures.mtbf_secs):.1f} s; {args.seeds} seeds per policy"
    )
    header = f"{'policy':15} {'wall h':>15} {'goodput':>7} {'ckpt ovh':>8} {'lost h':>7} {'lost/fail s':>9} {'restart h':>7} {'ckpts':>9} {'fails':>7}"
    if with_value:
        header += f" {'FT ovh h':>8} {'value-FT h':>9}"
    print()
    print(header)
    for s in summaries:
        print(_fmt_row(s, with_value))


def _sweep(
    job: JobModel, failures: FailureModel, args: argparse.Namespace
) -> list[tuple[float, float, float]]:
    """(interval secs, mean overhead fraction, std) of EveryN over a log grid around the optimum."""
    cost = max(job.stall_secs + job.slowdown_secs, 1e-6)
    opt = daly_optimum(cost, failures.mtbf_secs)
    ks = sorted({max(1, round(opt * 2 ** (e / 2) / job.iter_secs)) for e in range(-5, 6)})
    seeds = max(2, min(args.seeds, 3))
    tasks = [(job, failures, EveryN(k), s, None, f"k={k}", False) for k in ks for s in range(seeds)]
    runs = _run_all(tasks, args.jobs)
    out = []
    for k in ks:
        over = [1 - r.goodput for r in runs if r.policy == f"k={k}"]
        mean = sum(over) / len(over)
        std = math.sqrt(sum((o - mean) ** 2 for o in over) / max(1, len(over) - 1))
        out.append((k * job.iter_secs, mean, std))
    return out
