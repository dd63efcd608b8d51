"""The discrete-event simulation of one run: iterations, two-phase checkpoints, failures, restarts.

It drives the very policy objects the manager drives, with the same
:class:`~pitstop.policy.PolicyContext` (a fresh copy of the policy per run). The
context's measurements appear as they would in a real run: iteration time after
the warm-up, checkpoint costs after the first checkpoint commits. A restart is a new
process: the policy starts again from a fresh copy, with nothing measured (what it
learnt died with the process), as the manager's does; ``benchmarks/goodput.py`` found
the simulator over-predicting CheckFreq's goodput when its policy kept its interval
across failures while the real one warmed up, probed and grew its interval again.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
from dataclasses import dataclass, field

from pitstop.policy.base import CheckpointPolicy, PolicyContext
from pitstop.sim.model import FailureModel, JobModel, LossModel

__all__ = ["RunResult", "simulate"]

WARMUP = 5  # iterations the profiler does not count (pitstop.profiler.Profiler.warmup)
# and a process's first iteration, which nothing times: ckpt.step measures an iteration from
# the end of the step() call before it. A policy knows the iteration time at the 7th step
# of a process, not the 6th (benchmarks/goodput.py: CheckFreq's probe after each restart
# came 7 steps after the restore; in the model, 6)
_UNTIMED = 1


@dataclass
class RunResult:
    """One simulated run. Seconds of wall-clock time unless said otherwise."""

    policy: str
    seed: int
    wall_secs: float = 0.0
    work_secs: float = 0.0
    checkpoint_secs: float = 0.0  # stalls + slowdown of training while persisting
    lost_secs: float = 0.0  # compute redone after failures
    restart_secs: float = 0.0
    checkpoints: int = 0
    failures: int = 0
    value_lost_secs: float = 0.0  # lost work weighted by the progress it bought (LossModel)
    value_ft_overhead_secs: float = (
        0.0  # checkpoint + value-weighted lost work + restarts, until the stop
    )
    stopped_at_secs: float | None = (
        None  # early termination (compute time), if the loss model has one
    )
    finished: bool = True  # False: failures came faster than the policy let it progress
    events: list[tuple[float, str, float]] = field(
        default_factory=list
    )  # (wall, kind, progress secs)

    @property
    def goodput(self) -> float:
        """Useful compute over wall-clock time (of the committed work, for a run that did not finish)."""
        return self.work_secs / self.wall_secs if self.wall_secs > 0 else 0.0

    @property
    def ft_overhead_secs(self) -> float:
        """Fault-tolerance overhead: checkpoint cost + lost work + restarts."""
        return self.checkpoint_secs + self.lost_secs + self.restart_secs

    @property
    def lost_per_failure_secs(self) -> float:
        return self.lost_secs / self.failures if self.failures else 0.0


_COSTS = 16  # paired measurements the profiler's estimate is made of (pitstop.profiler)


@dataclass
class _Measured:
    """What the profiler of one process has measured of the checkpoint cost: one sample per
    committed checkpoint (the true cost plus noise of ``job.cost_noise_secs``), its mean of
    the last 16 plus the standard error (the first sample left out once there are more), and
    from 3 samples on the same minus it (a lower estimate), as ``pitstop.profiler`` estimates
    them. Noise makes each process's intervals differ, and so
    where its checkpoints fall against the failures."""

    job: JobModel
    rng: random.Random
    samples: list[float] = field(default_factory=list)  # the last 16
    made: int = 0  # samples made in this process
    step: int | None = None  # progress at the newest sample

    def add(self, progress: int) -> None:
        """A paired measurement of a checkpoint committed at ``progress``: the profiler's
        mean (``job.measured_cost_secs``, else the cost charged) plus noise, at factor 1 (the
        profiler keeps pairs in iterations and reads them in the iterations now)."""
        noise, job = self.job.cost_noise_secs, self.job
        mean = job.measured_cost_secs
        mean = job.stall_secs + job.slowdown_secs if mean is None else mean
        self.samples.append(mean + (self.rng.gauss(0.0, noise) if noise > 0 else 0.0))
        self.samples = self.samples[-_COSTS:]
        self.made += 1
        self.step = progress

    def _used(self) -> list[float]:
        """The process's first sample (a one-off first save) is left out once there is
        another, while it is among the last 16 (``profiler._paired_costs``)."""
        first_kept = self.made == len(self.samples)
        return self.samples[1:] if len(self.samples) > 1 and first_kept else self.samples

    def cost(self) -> float | None:
        xs = self._used()
        if len(xs) < 2:
            return xs[0] if xs else None
        return statistics.fmean(xs) + statistics.stdev(xs) / len(xs) ** 0.5

    def low(self) -> float | None:
        """The lower estimate, mean minus its standard error, from 3 samples on: how far
        CheckFreq may grow its interval at once (``measured_cost_low_secs``)."""
        xs = self._used()
        if len(xs) < 3:
            return None
        return statistics.fmean(xs) - statistics.stdev(xs) / len(xs) ** 0.5

    def slowdown(self) -> float:
        """The model's slowdown: the measured cost beyond the stall (never below 0)."""
        return max((self.cost() or 0.0) - self.job.stall_secs, 0.0)


def _scaled(secs: float | None, factor: float) -> float | None:
    return None if secs is None else secs * factor


def _name(policy: CheckpointPolicy) -> str:
    return repr(policy).split("(")[0] if "(" in repr(policy) else type(policy).__name__


def simulate(
    job: JobModel,
    failures: FailureModel,
    policy: CheckpointPolicy,
    *,
    seed: int = 0,
    loss: LossModel | None = None,
    loss_every_secs: float = 60.0,
    record: bool = False,
    name: str | None = None,
    max_wall_factor: float = 50.0,
    until_secs: float | None = None,
) -> RunResult:
    """Run ``job`` to the end (or to the loss model's early stop) under ``failures`` with ``policy``.

    ``until_secs``: stop at that wall-clock time instead (a run of fixed length, as
    ``benchmarks/goodput.py`` measures): the work done is the progress reached then (no
    failure ends it), and ``goodput`` is that over ``until_secs``. Goodput over a fixed
    job (work / wall) and over a fixed time differ when failures cluster in part of the
    run: the fixed job's run goes on past them, with none.

    Raises ValueError for a parameter out of range (``loss_every_secs`` > 0,
    ``max_wall_factor`` >= 1, ``until_secs`` > 0, all finite), and
    :class:`~pitstop.sim.model.TooManyFailures` for failures more frequent than the
    simulator can draw in the run's horizon (``max_wall_factor`` x the job's work)."""
    for label, value, low, strict in (
        ("loss_every_secs", loss_every_secs, 0.0, True),
        ("max_wall_factor", max_wall_factor, 1.0, False),
        ("until_secs", until_secs, 0.0, True),
    ):
        if value is None:
            continue  # until_secs (the others are never None)
        number = isinstance(value, (int, float)) and math.isfinite(value)
        if not number or not (value > low if strict else value >= low):
            raise ValueError(
                f"simulate: {label} must be a finite number {'>' if strict else '>='} {low:g}, "
                f"got {value!r}"
            )
    rng = random.Random(seed)
    template, policy = policy, copy.deepcopy(policy)
    fail_times = failures.times(job.work_secs * max_wall_factor, rng)
    if until_secs is not None:
        fail_times = [f for f in fail_times if f < until_secs]
    stop_rng = random.Random(seed * 7919 + 1)
    target = job.iterations
    result = RunResult(policy=name or _name(policy), seed=seed)
    if loss is not None and loss.stop_min is not None:
        target = max(1, round(job.iterations * stop_rng.uniform(loss.stop_min, 1.0)))
        result.stopped_at_secs = target * job.iter_secs
    it = job.iter_secs
    loss_every = max(1, round(loss_every_secs / it))
    epoch = job.iterations_per_epoch

    t = 0.0
    progress = committed = last_ckpt = 0
    queue: list[tuple[float, int]] = []  # (commit time, iteration) of persists in flight, in order
    persist_free_at = 0.0
    measured = False
    fi = 0
    ckpt_count = 0  # in this process (the policy's context counts its own)
    secs_since_restart = 0.0
    iters_since_restart = 0
    restarted = False
    drifting, since = job.speed_trace, 0.0  # wall secs of iterations since the checkpoint
    # else the policies see the true cost, as they always did
    noisy = job.cost_noise_secs > 0 or job.measured_cost_secs is not None
    noise_rng = random.Random(seed * 104729 + 3)  # the measurement noise (its own stream)
    seen = _Measured(job, noise_rng)  # what this process's profiler measured

    def fail(at: float) -> None:
        nonlocal \
            t, \
            progress, \
            fi, \
            queue, \
            last_ckpt, \
            persist_free_at, \
            secs_since_restart, \
            committed, \
            measured, \
            restarted, \
            iters_since_restart, \
            ckpt_count, \
            since, \
            seen
        while queue and queue[0][0] <= at:  # persists that finished before the failure count
            committed = queue.pop(0)[1]
            measured = True
        if at < t:  # failed while restarting: the rest of that restart is not spent
            result.restart_secs -= t - at
        cls = failures.pick_class(rng)
        lost = progress - committed
        lost_secs = lost * it + (at - t if at > t else 0.0)
        result.failures += 1
        result.lost_secs += lost_secs
        if loss is not None:
            result.value_lost_secs += loss.weighted_secs(
                committed * it, progress * it, job.work_secs
            )
        restart = failures.restart_of(result.failures - 1, job.restart_secs)
        restart += cls.extra_restart_secs if cls else 0.0
        result.restart_secs += restart
        if record:
            result.events.append((at, "failure", progress * it))
        t = at + restart
        progress = last_ckpt = committed
        queue = []
        persist_free_at = t
        fi += 1
        secs_since_restart = 0.0
        measured, restarted, iters_since_restart, ckpt_count, since = False, True, 0, 0, 0.0
        seen = _Measured(job, noise_rng)

    cap = job.work_secs * max_wall_factor
    while progress < target:
        if t > cap:
            result.finished = False
            break
        step_secs = job.iter_secs_at(t)  # it, unless the host's speed drifts (speed_trace)
        if fi < len(fail_times) and fail_times[fi] < t + step_secs:
            fail(fail_times[fi])
            continue
        if restarted:  # a new process: a fresh policy, nothing measured yet
            policy, restarted = copy.deepcopy(template), False
        if until_secs is not None and t + step_secs > until_secs:
            break  # the time is up: an iteration not finished by then does not count
        t += step_secs
        since += step_secs
        progress += 1
        iters_since_restart += 1
        while queue and queue[0][0] <= t:
            committed = queue.pop(0)[1]
            measured = True
            seen.add(progress)
            if record:
                result.events.append((t, "commit", committed * it))
        ctx = PolicyContext(
            step=progress,
            elapsed_secs=progress * it,
            steps_since_checkpoint=progress - last_ckpt,
            secs_since_checkpoint=(progress - last_ckpt) * it if drifting is None else since,
            iter_secs=step_secs if iters_since_restart > WARMUP + _UNTIMED else None,
            stall_secs=job.stall_secs if measured else None,
            persist_secs=job.persist_secs if measured else None,
            slowdown_secs=(seen.slowdown() if noisy else job.slowdown_secs) if measured else None,
            measured_cost_secs=_scaled(seen.cost(), step_secs / it) if noisy else None,
            measured_cost_step=seen.step if noisy else None,
            measured_cost_low_secs=_scaled(seen.low(), step_secs / it) if noisy else None,
            in_flight=len(queue),
            max_in_flight=job.max_in_flight,
            checkpoints=ckpt_count,
            epoch=progress // epoch if epoch else None,
            epoch_end=bool(epoch) and progress % epoch == 0,  # type: ignore[operator]
            loss=loss.loss(progress * it)
            if loss is not None and progress % loss_every == 0
            else None,
        )
        if not policy.decide(ctx):
            continue
        # a host slower now is slower at the save's work too (torch.save's stall on a loaded
        # host). The persist begins when the stall ends; the slowdown of training beside it is
        # charged at once after the stall, and does not delay the commit (charged before the
        # persist, the model committed each checkpoint a slowdown late: a DCP async_save
        # 0.05 s, after kills that the real one beat in benchmarks/goodput.py)
        factor = job.speed_at(t)
        stall = job.stall_secs * factor
        if len(queue) >= job.max_in_flight:  # every arena busy: wait for the oldest persist
            stall += max(0.0, queue[0][0] - t)
        if fi < len(fail_times) and fail_times[fi] < t + stall:
            fail(fail_times[fi])
            continue
        start = max(t + stall, persist_free_at)
        persist_free_at = start + job.persist_secs * factor
        queue.append((persist_free_at, progress))
        last_ckpt, since = progress, 0.0
        ckpt_count += 1
        result.checkpoints += 1
        if record:
            result.events.append((t + stall, "checkpoint", progress * it))
        stall += job.slowdown_secs * factor
        if fi < len(fail_times) and fail_times[fi] < t + stall:  # killed while slowed: the
            result.checkpoint_secs += fail_times[fi] - t  # persist counts if it ended by then
            t = fail_times[fi]
            fail(t)
            continue
        t += stall
        result.checkpoint_secs += stall
        if job.persist_secs == 0:
            committed = progress
            queue.pop()
            measured = True
            seen.add(progress)
    result.wall_secs = t
    result.work_secs = (target if result.finished else committed) * it
    if until_secs is not None:
        result.finished = progress >= target
        result.wall_secs, result.work_secs = until_secs, min(progress, target) * it
    if loss is not None:
        result.value_ft_overhead_secs = (
            result.checkpoint_secs + result.value_lost_secs + result.restart_secs
        )
    return result
