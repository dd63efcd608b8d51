"""The context a policy decides on, and the policy protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["CheckpointPolicy", "PolicyContext", "Schedule"]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What is known after an iteration. Times are seconds of wall-clock training time.

    Estimates are None until measured. ``iter_secs`` is the compute time of one
    iteration (stalls excluded); ``stall_secs`` how long a checkpoint blocks the
    loop; ``persist_secs`` how long the background write takes until commit;
    ``slowdown_secs`` how much longer training takes, per checkpoint, because a
    persist runs beside it (contention for cores, memory bandwidth, the GIL);
    ``observed_overhead`` the measured fraction of extra time over recent iterations
    (stalls included) against iterations with no checkpoint work, when known (it moves
    with the machine's own drift: policies use the paired cost). ``measured_cost_secs``
    is what one checkpoint costs measured in pairs (its stall plus how much longer the
    iterations during its persist took than those just before it; median of the last
    few), ``measured_cost_step`` when the newest such measurement ended (an iteration, where
    ``iteration`` is given; else a step),
    ``measured_cost_low_secs`` a lower estimate of the same (None until a few pairs agree). ``step_secs`` is
    what deciding costs each iteration, checkpoint or not (``ckpt.step``'s bookkeeping and,
    under torch.distributed, the ranks' vote): a cost no interval changes, which comes out
    of an overhead budget first.
    """

    step: int
    elapsed_secs: float
    steps_since_checkpoint: int
    secs_since_checkpoint: float
    iter_secs: float | None = None
    stall_secs: float | None = None
    persist_secs: float | None = None
    slowdown_secs: float | None = None
    observed_overhead: float | None = None
    measured_cost_secs: float | None = None
    measured_cost_step: int | None = None
    measured_cost_low_secs: float | None = None
    step_secs: float | None = None
    iteration: int | None = None
    """``ckpt.step`` calls so far (None: count by ``step``). Step numbers may count
    samples or tokens; an interval in iterations is counted in these."""
    iters_since_checkpoint: int | None = None
    """Iterations (calls) since the newest checkpoint started (None: ``steps_since_checkpoint``)."""
    in_flight: int = 0
    max_in_flight: int = 1
    checkpoints: int = 0
    epoch: int | None = None
    epoch_end: bool = False
    loss: float | None = None

    @property
    def measured(self) -> bool:
        """True once an iteration and a whole checkpoint have been measured."""
        return (
            self.iter_secs is not None
            and self.stall_secs is not None
            and self.persist_secs is not None
        )

    def paired_cost(self, horizon: int) -> float | None:
        """The paired measurement of a checkpoint's cost, if one is at most ``horizon``
        steps old (an older one is not trusted: the model re-probes)."""
        paired, at = self.measured_cost_secs, self.measured_cost_step
        now = self.step if self.iteration is None else self.iteration
        if paired is None or at is None or now - at > horizon:
            return None
        return paired

    def checkpoint_cost(self, *, overlapped: bool) -> float:
        """Training time one checkpoint costs: the stall, plus the slowdown while it persists,
        or plus the whole persist when persists cannot overlap with training."""
        stall = self.stall_secs or 0.0
        if overlapped:
            return stall + (self.slowdown_secs or 0.0)
        return stall + (self.persist_secs or 0.0)


@runtime_checkable
class CheckpointPolicy(Protocol):
    """``decide(ctx)`` is called once per iteration, on the training thread (or by the
    simulator); True means: checkpoint now. A policy may keep state between calls
    (fits, current interval) but reads no clock and does no I/O."""

    def decide(self, ctx: PolicyContext) -> bool: ...


class Schedule:
    """The base of pitstop's schedule policies: ``a | b`` checkpoints when either says so
    (:class:`~pitstop.policy.fixed.AnyPolicy`), as retention policies combine with ``|``."""

    def __or__(self, other: CheckpointPolicy) -> CheckpointPolicy:
        from pitstop.policy.fixed import AnyPolicy

        return AnyPolicy(self, other)  # type: ignore[arg-type]

    def __ror__(self, other: CheckpointPolicy) -> CheckpointPolicy:
        from pitstop.policy.fixed import AnyPolicy

        return AnyPolicy(other, self)  # type: ignore[arg-type]
