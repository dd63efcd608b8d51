"""The loop driver behind ``ckpt.step``: measures the loop, asks the policy, starts saves.

Call sequence (training thread only)::

    driver = LoopDriver(manager, saver, policy)
    result = driver.step(step, state, loss=...)   # once per iteration, after optimizer.step()
    driver.pause()                                # before other work (evaluation)
    driver.stats()

A save the policy asks for that cannot be taken (its step is already committed, or
another writer holds it) is never skipped silently: ``step`` returns
``StepResult.REFUSED``, logs a warning, and ``stats().refused_saves`` counts it.
Signals from ``save_on_signal`` make the next ``step`` save synchronously and exit. Under
torch.distributed ``step`` is collective: rank 0's policy decides for every rank, and a
signal on any rank makes all ranks save. The ranks vote on it with one small all-reduce on
pitstop's own gloo group, started a step ahead so that it travels while the next iteration
runs: at step t the policy is asked about step t+1 (its context one step on), and at step
t+1 every rank reads the same result without waiting for the slowest. At a step given
``epoch_end=True`` (on every rank alike) the vote is taken at once. Any rank may ask for a
save in the vote (``asked``: its memory snapshots need a plan every rank agrees on, after
its state's layout changed), and a rank whose memory level went off turns it off on every
rank (a step is a memory checkpoint only if every rank holds its part). The time ``step`` itself
takes (bookkeeping, the vote) is measured as overhead (``stats().step_secs``) and the
policies count it against their budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import signal
import time
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from pitstop.engine.handle import SaveHandle
from pitstop.errors import CheckpointExistsError
from pitstop.log import get_logger
from pitstop.policy import CheckpointPolicy, PolicyContext
from pitstop.policy.fixed import explain
from pitstop.profiler import Profiler, ProfileStats

if TYPE_CHECKING:
    from pitstop.engine.saver import Saver
    from pitstop.manager import CheckpointManager
    from pitstop.ranks.group import Vote

__all__ = ["LoopDriver", "StepResult"]

_log = get_logger("pitstop")

_QUIET_STEPS, _QUIET_SECS = 100, 60.0  # a stretch without a checkpoint worth a warning


class StepResult(enum.IntEnum):
    """What ``ckpt.step`` did. Truthy only for SAVED (so ``if ckpt.step(...)`` still reads
    "a save started"); REFUSED means the policy asked for a save that could not be taken;
    SNAPSHOT: no save, but a memory snapshot of the step was staged (a memory level)."""

    SKIPPED = 0
    SAVED = 1
    REFUSED = 2
    SNAPSHOT = 3

    def __bool__(self) -> bool:
        return self is StepResult.SAVED


class LoopDriver:
    """Timing state and decisions of ``CheckpointManager.step`` (training thread only)."""

    def __init__(self, manager: CheckpointManager, saver: Saver, policy: CheckpointPolicy) -> None:
        self.manager = manager
        self.saver = saver
        self.policy = policy
        self.profiler = Profiler()
        self.start = 0.0
        self.started = False
        self.hook_wait_seen = 0.0
        self.last: float | None = None
        self.persisting = False
        self.ckpt_step: int | None = None
        self.ckpt_time: float | None = None
        self.pending: list[SaveHandle] = []
        self.preempted: int | None = None
        self.step_seen = 0
        self.calls = 0  # step() calls: iterations, whatever the caller's step numbers count
        self.ckpt_calls: int | None = None  # calls when the newest checkpoint started
        self._behind_said = False  # a step below the newest checkpoint's was warned about
        self.exit_code: int | None = 0
        self._signals: dict[int, Any] = {}
        self._quiet = (_QUIET_STEPS, _QUIET_SECS)  # the next stretch to warn about
        self._vote: Vote | None = None  # several ranks: the vote on the next step's decision
        self.asked: str | None = None  # several ranks: why this rank asks for a save (voted)
        self.memory: Any = None  # the memory level (its ``active``, ``off``), if any

    # ------------------------------------------------------------------ per iteration
    def step(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        loss: float | None = None,
        epoch: int | None = None,
        epoch_end: bool = False,
    ) -> StepResult:
        now = time.perf_counter()
        if self.ckpt_step is not None and step < self.ckpt_step and not self._behind_said:
            self._behind_said = True
            _log.warning(
                "ckpt.step(%d) is below step %d, the newest checkpoint's (restored or saved): "
                "step numbers should go on from what ckpt.restore() returned; a save of a "
                "lower step is one more checkpoint, older than the newest by number",
                step, self.ckpt_step, phase="plan",
            )  # fmt: skip
        self.step_seen = step
        self.calls += 1
        self._measure(now)
        self.collect()
        extra: dict[str, Any] = {"loss": loss, "epoch": epoch, "epoch_end": epoch_end}
        decide, stop, ctx = self._decide(step, now, extra)
        if stop:
            self._save_and_exit(step, state)
        if not decide and not self.saver.reserving:
            self.saver.reserve_async(state)  # the arena fills in while training goes on
        result, saving = StepResult.SKIPPED, 0.0
        if not decide:
            self._say_unprotected(ctx)
        if decide:
            t0 = time.perf_counter()
            result = self._save(step, state, loss)
            saving = time.perf_counter() - t0
        if self.saver.group.size > 1 and not epoch_end:
            self._vote_ahead(step, now, extra)
        self.persisting = bool(self.pending)
        self.last = time.perf_counter()
        self.profiler.step_cost(self.last - now - saving)  # step()'s own time is overhead too
        return result

    def _decide(
        self, step: int, now: float, extra: dict[str, Any]
    ) -> tuple[bool, bool, PolicyContext]:
        """(checkpoint at ``step``, save and exit now, the policy's context), the same on
        every rank. One process: the policy's word and this process's signal. Several
        ranks: rank 0's policy decides for all and a signal on any rank stops all, once
        voted on; the vote was started at the previous step (:meth:`_vote_ahead`) and has
        long arrived, so no rank waits here for the others. At an epoch's end
        (``epoch_end`` is given alike on every rank) the vote is taken now: a checkpoint of
        that state cannot wait a step."""
        group = self.saver.group
        ctx = self._context(step, now, **extra)
        if group.size == 1:
            return bool(self.policy.decide(ctx)), self.preempted is not None, ctx
        vote, self._vote = self._vote, None
        words = vote.result() if vote is not None else [0, 0, 0]
        if extra["epoch_end"]:
            mine = self._words(bool(self.policy.decide(ctx)) and group.rank == 0)
            both = [max(a, b) for a, b in zip(mine, words, strict=True)]
            words = group.vote(both, "plan").result()
        if words[1]:  # a signal reached some rank: every rank saves and exits now
            self.preempted = words[1]
        if words[2] and self.memory is not None and self.memory.active:
            self.memory.off(f"it is off on rank {words[2] - 1} (a memory checkpoint needs "
                            "every rank's part)")  # fmt: skip
        return bool(words[0]), bool(words[1]), ctx

    def _vote_ahead(self, step: int, now: float, extra: dict[str, Any]) -> None:
        """Several ranks: ask the policy now whether to checkpoint at the next step (its
        context one step on, this step's save counted) and start the vote on it, which
        travels while the next iteration runs."""
        ctx = self._context(step + 1, now, ahead=1, **{**extra, "epoch_end": False})
        mine = bool(self.policy.decide(ctx)) and self.saver.group.rank == 0
        self._vote = self.saver.group.vote(self._words(mine), "plan")

    def _words(self, save: bool) -> list[int]:
        """This rank's vote: [save, the signal it got, its rank + 1 if its memory level is
        off]; a save it asked for (``asked``) is in it, and asked no more."""
        asked, self.asked = self.asked, None
        off = self.memory is not None and self.memory.listed and not self.memory.active
        return [int(save or asked is not None), self.preempted or 0,
                self.saver.group.rank + 1 if off else 0]  # fmt: skip

    def _save(self, step: int, state: Mapping[str, Any], loss: float | None) -> StepResult:
        """The policy's checkpoint of ``step``; its time in the loop is a stall."""
        t0 = time.perf_counter()
        metrics = {"loss": float(loss)} if loss is not None else None
        self.profiler.save_started()
        alloc = 0.0
        try:
            handle = self.manager.async_save(step, state, metrics=metrics)
            self.pending.append(handle)
            self.asked = None  # planned anew: what a rank asked a save for is answered
            alloc = handle.stats.alloc_secs  # a one-time cost, not the checkpoint's
            result = StepResult.SAVED
        except CheckpointExistsError as e:
            self._refused(step, e)
            result = StepResult.REFUSED
        self.profiler.stall(max(time.perf_counter() - t0 - alloc, 0.0))
        return result

    def _measure(self, now: float) -> None:
        waited = self.saver.hook_wait_secs - self.hook_wait_seen  # optimizer.step() waited
        self.hook_wait_seen += waited
        if self.last is not None:
            self.profiler.iteration(now - self.last - waited, persisting=self.persisting)
            if waited > 0:
                self.profiler.stall(waited, add_to_last=True)
        elif not self.started:
            self.start, self.started = now, True

    def _context(self, step: int, now: float, ahead: int = 0, **extra: Any) -> PolicyContext:
        measured = self.profiler.snapshot()
        since = self.ckpt_time if self.ckpt_time is not None else self.start
        calls = self.calls + ahead
        return PolicyContext(
            step=step,
            elapsed_secs=now - self.start,
            steps_since_checkpoint=step - self.ckpt_step if self.ckpt_step is not None else step,
            iteration=calls,
            iters_since_checkpoint=calls - (self.ckpt_calls or 0),
            secs_since_checkpoint=now - since,
            iter_secs=measured.iter_secs,
            stall_secs=measured.stall_secs,
            persist_secs=measured.persist_secs,
            slowdown_secs=measured.slowdown_secs,
            observed_overhead=measured.recent_overhead,
            measured_cost_secs=measured.checkpoint_cost_secs,
            measured_cost_step=measured.checkpoint_cost_step,
            measured_cost_low_secs=measured.checkpoint_cost_low_secs,
            step_secs=measured.step_secs,
            in_flight=len(self.pending),
            max_in_flight=self.manager.options.max_in_flight,
            checkpoints=self.profiler.checkpoints + len(self.pending),
            **extra,
        )

    def saved(self, step: int) -> None:
        """A save of ``step`` started (from ``step()`` or the loop's own ``save``/``async_save``/
        ``save_final``): the policy and ``stats()`` count from it."""
        self.ckpt_time, self.ckpt_calls = time.perf_counter(), self.calls  # whatever its number
        self._quiet = (_QUIET_STEPS, _QUIET_SECS)
        if self.ckpt_step is None or step >= self.ckpt_step:
            self.ckpt_step = step

    def _say_unprotected(self, ctx: PolicyContext) -> None:
        """Warn once the work a failure would lose passes a stretch (both steps and seconds),
        then again each time both doubled: a policy that waits long says so, and why."""
        steps, secs = self._quiet
        if ctx.steps_since_checkpoint < steps or ctx.secs_since_checkpoint < secs:
            return
        self._quiet = (2 * steps, 2 * secs)
        _log.warning(
            "no checkpoint for %d steps (%.0f s of training): %s; a failure now loses that "
            "much work (ckpt.stats() shows it; EveryN or Every bound it)",
            ctx.steps_since_checkpoint, ctx.secs_since_checkpoint, explain(self.policy, ctx),
            phase="plan",
        )  # fmt: skip

    def _refused(self, step: int, error: Exception) -> None:
        self.profiler.refused_saves += 1
        _log.warning(
            "checkpoint of step %d refused: %s (refused so far: %d)",
            step, error, self.profiler.refused_saves, phase="plan",
        )  # fmt: skip

    def collect(self) -> None:
        """Feed finished saves to the profiler; a refused background save is counted and
        warned about, any other background error is raised."""
        done = [h for h in self.pending if h.done()]
        self.pending = [h for h in self.pending if not h.done()]
        for h in done:
            if h.committed:
                self.profiler.checkpoint(h.stats)
                continue
            err = h.take_error()
            if isinstance(err, CheckpointExistsError):
                self._refused(h.step, err)
            elif err is not None:
                raise err
        if not self.pending:
            self.profiler.settled(self.calls)  # in iterations, as the policy counts
        self.saver.raise_pending()

    def pause(self) -> None:
        self.last = None

    def exclude(self, secs: float) -> None:
        """``secs`` spent after ``step()`` decided (a memory snapshot) are no iteration's."""
        if self.last is not None:
            self.last += secs

    def stats(self) -> ProfileStats:
        self.collect()
        interval = getattr(self.policy, "interval", None) or getattr(
            self.policy, "interval_secs", None
        )
        now = time.perf_counter()
        ctx = self._context(max(self.step_seen, self.ckpt_step or 0), now)  # a rerun: none yet
        return dataclasses.replace(
            self.profiler.snapshot(interval=interval),
            steps_since_checkpoint=ctx.steps_since_checkpoint,
            secs_since_checkpoint=ctx.secs_since_checkpoint if self.started else 0.0,
            policy_reason=explain(self.policy, ctx),
        )

    # ------------------------------------------------------------------ signals
    def save_on_signal(self, signals: tuple[int, ...], exit_code: int | None) -> None:
        self.exit_code = exit_code
        for sig in signals or (signal.SIGTERM, signal.SIGUSR1):
            self._signals[sig] = signal.signal(sig, self._on_signal)

    def restore_signals(self) -> None:
        for sig, previous in self._signals.items():
            signal.signal(sig, previous)
        self._signals.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.preempted = signum

    def _save_and_exit(self, step: int, state: Mapping[str, Any]) -> None:
        _log.warning(
            "signal %s: saving a final checkpoint at step %d", self.preempted, step, phase="persist"
        )
        self.manager.wait()
        with contextlib.suppress(CheckpointExistsError):  # already saved at this step
            self.manager.save(step, state)
        code = self.exit_code
        self.preempted = None
        if code is not None:
            raise SystemExit(code)
