"""Where ``pitstop crashtest`` resumes a run: points chosen from the reference run's log.

A resume shows a leak only when it lands where the leak acts: something drawn outside the
saved state on the first pass of an evaluation loader (persistent workers) shows only after
a resume past the first epoch's end; a final save that depends on the policy, only when the
resumed run trains the last steps. So the points cover, from the reference's log of saves and
epochs (:mod:`pitstop.probe` logs the epoch of the data loader in the state at every step):

* **early**: the reference's first checkpoint;
* **mid-epoch**: the middle third of the first epoch that has one after the early point;
* **a later epoch**: the first half of the second epoch (after the first end-of-epoch work);
* **the last step**: the step before the final one (the resumed run trains the last step and
  does the end-of-training work).

Without epochs in the log (no loader with an epoch in the state) the middle and the last
quarter of the run stand in for the two epoch points. Fewer points (``--kills``) keep the
most telling ones (a later epoch, early, the last step, mid-epoch); more add random steps.
A script that does not save its final state (the reference trained past its newest
checkpoint) resumes only at the reference's own checkpoints: its newest checkpoint is then
of the same step in both runs (a resume elsewhere shifts a schedule such as ``EveryN``).

Call sequence (the CLI's thread): ``Timeline.of(reference records, final step)`` ->
``choose(timeline, count, rng)`` (or ``given(timeline, steps)`` for ``--kill-at``) -> one
killed run per point, in order -> ``Timeline.label(step)`` for the report. Pure: no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pitstop.cli.crashtest_causes import Record

__all__ = ["NO_SAVE", "ResumePoint", "Timeline", "choose", "given", "grouped"]

_PRIORITY = ("epoch", "early", "last", "mid")  # kept first when fewer points are asked for


@dataclass(frozen=True)
class ResumePoint:
    """A step crashtest makes the run checkpoint and resume from, and why it was chosen."""

    step: int
    kind: str  # "early", "mid-epoch 0", "epoch 1" (loader.epoch), "last step", "middle", ...


@dataclass
class Timeline:
    """What the reference run's log says: its first checkpoint, its final (compared) step,
    the first step seen in each epoch (ascending; empty when no epoch was seen), its
    checkpoints, and the last step it trained."""

    first_save: int
    final: int
    starts: list[tuple[int, int]] = field(default_factory=list)  # (epoch, first step)
    saves: list[int] = field(default_factory=list)
    trained: int = 0

    @classmethod
    def of(cls, records: list[Record], final: int) -> Timeline:
        saves = [r.step for r in records if r.event == "save" and r.rank == 0]
        seen: dict[int, int] = {}
        for r in records:  # a save after the last step (save_final) sees the next epoch
            epoch = r.data.get("epoch")
            at = r.event == "step" or (r.event == "save" and r.step < final)
            if at and r.rank == 0 and type(epoch) is int:
                seen[epoch] = min(seen.get(epoch, r.step), r.step)
        starts = sorted(seen.items())
        if starts:  # the first epoch seen began before the first record that shows it
            starts[0] = (starts[0][0], 1)
        starts = [s for i, s in enumerate(starts) if i == 0 or s[1] > starts[i - 1][1]]
        trained = max((r.step for r in records if r.event in ("step", "end")), default=final)
        return cls(min(saves, default=final), final, starts, sorted(set(saves)), trained)

    def epoch_of(self, step: int) -> int | None:
        """The epoch ``step`` belongs to (as the loader counts), None if unknown."""
        epochs = [e for e, first in self.starts if first <= step]
        return epochs[-1] if epochs else None

    def bounds(self, index: int) -> tuple[int, int]:
        """The first and last step of the ``index``-th epoch seen."""
        last = self.starts[index + 1][1] - 1 if index + 1 < len(self.starts) else self.final
        return self.starts[index][1], last

    def label(self, step: int) -> str:
        """``epoch N`` of ``step`` (N as the loader counts: ``loader.epoch``), or "" when
        epochs are unknown."""
        epoch = self.epoch_of(step)
        return "" if epoch is None or len(self.starts) < 2 else f"epoch {epoch}"

    def describe(self, point: ResumePoint, step: int) -> str:
        """``step N (kind, epoch E)``: a point tested, resumed from ``step``."""
        epoch = self.label(step)
        where = point.kind if not epoch or point.kind.endswith(epoch) else f"{point.kind}, {epoch}"
        return f"step {step} ({where})"


NO_SAVE = (  # why a run that saved nothing at or after a point leaves it untested
    ": crashtest makes a run checkpoint at its resume point only through ckpt.step()'s "
    "policy; saves decided otherwise (the script's own save(), Lightning's ModelCheckpoint) "
    "are the script's"
)


def grouped(untested: list[tuple[ResumePoint, str]]) -> dict[str, list[str]]:
    """The points not tested, by reason (each reason said once)."""
    out: dict[str, list[str]] = {}
    for point, why in untested:
        out.setdefault(why, []).append(f"step {point.step} ({point.kind})")
    return out


def choose(tl: Timeline, count: int | None, rng: random.Random) -> list[ResumePoint]:
    """``count`` resume points (None: the four kinds of the module docstring), ascending,
    from the reference's first checkpoint to the step before its final one."""
    lo, hi = tl.first_save, tl.final - 1
    if hi < lo:
        return []
    kinds: dict[str, ResumePoint] = {"early": ResumePoint(lo, "early")}
    if len(tl.starts) >= 2:
        kinds.update(_epoch_points(tl, lo, hi, rng))
    else:
        middle = _pick(rng, lo + 1, hi - 1, (lo + hi) // 2, (lo + 2 * hi) // 3)
        late = _pick(rng, lo + 1, hi - 1, (lo + 3 * hi) // 4, hi - 1)
        kinds.update({k: p for k, p in (("mid", middle), ("epoch", late)) if p is not None})
        kinds = {k: ResumePoint(p.step, _PLAIN.get(k, p.kind)) for k, p in kinds.items()}
    kinds["last"] = ResumePoint(hi, "last step")
    ordered = [kinds[k] for k in _PRIORITY if k in kinds]
    saved = [s for s in tl.saves if lo <= s <= hi]
    snap = tl.trained > tl.final and saved  # no final save: resume at the reference's saves
    points: dict[int, ResumePoint] = {}
    for p in ordered[: len(ordered) if count is None else count]:
        step = max(s for s in saved if s <= p.step) if snap else p.step
        points.setdefault(step, ResumePoint(step, p.kind))
    spare = [s for s in (saved if snap else range(lo, hi + 1)) if s not in points]
    for s in rng.sample(spare, min(len(spare), max(0, (count or 0) - len(points)))):
        points[s] = ResumePoint(s, "random")
    return [points[s] for s in sorted(points)]


_PLAIN = {"mid": "middle", "epoch": "late"}


def given(tl: Timeline, steps: list[int]) -> list[ResumePoint]:
    """The points ``--kill-at`` names, ascending."""
    return [ResumePoint(s, "chosen") for s in sorted(set(steps))]


def _epoch_points(tl: Timeline, lo: int, hi: int, rng: random.Random) -> dict[str, ResumePoint]:
    """A step in the first half of the second epoch, and one in the middle third of the first
    epoch that has one after the early point (never an epoch's first or last step)."""
    out: dict[str, ResumePoint] = {}
    first, last = tl.bounds(1)
    later_hi = first + (last - first) // 2
    for index in range(len(tl.starts)):
        a, b = tl.bounds(index)
        third = (b - a) // 3
        mid = _pick(rng, max(lo + 1, a + 1), min(hi, b - 1), a + third, b - third)
        if mid is not None:
            out["mid"] = ResumePoint(mid.step, f"mid-epoch {tl.starts[index][0]}")
            if index == 1:  # the later-epoch point goes before it, in the same epoch
                later_hi = min(later_hi, mid.step - 1)
            break
    later = _pick(rng, max(lo + 1, first), min(hi, last), first, later_hi)
    if later is not None:
        out["epoch"] = ResumePoint(later.step, f"epoch {tl.starts[1][0]}")
    return out


def _pick(rng: random.Random, lo: int, hi: int, want_lo: int, want_hi: int) -> ResumePoint | None:
    """A random step of ``[want_lo, want_hi]`` within ``[lo, hi]`` (else of ``[lo, hi]``
    nearest to the wanted range); None if ``[lo, hi]`` is empty."""
    if hi < lo:
        return None
    a, b = max(lo, want_lo), min(hi, want_hi)
    if a > b:
        a = b = min(max(want_lo, lo), hi)
    return ResumePoint(rng.randint(a, b), "")
