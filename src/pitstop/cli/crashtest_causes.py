"""Why a crashtest's two runs ended differently: the runs' logs, read back and diagnosed.

Every process crashtest runs appends one JSON line per event (start, save, restore, epoch,
kill, end; see :mod:`pitstop.probe`). From them :func:`unseeded` finds the generators the
script does not seed, :func:`drawn` those that something in the runs draws from (evidence,
not a guess: a digest that changes within one process), :func:`final_sites` whether the
compared checkpoint was taken at the same place in both runs (the same line of the script,
and the same chain of callers: a framework's callback saves at the end of a batch in one
run and after validation in the other, both through one line of its own), and
:func:`diagnose` names the causes it can see: no ``RNGState`` in the state, loaders without a
generator of their own, generators drawn outside the state after an exact restore, a
restore that did not put them back, settings that changed between runs, unseeded generators
the script draws from, or (when the generators agree and the places do not explain the
differences) the computation itself.
:func:`state_causes` reads the differences.

Call sequence (the CLI's thread, after the runs): ``read_log`` per log file ->
``drawn(all records)`` -> ``unseeded(reference, first crashed run, drawn)`` -> ``causes_of``
(``final_sites`` + ``state_causes(diffs)`` + ``diagnose(...)``).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pitstop.cli.compare import Difference

__all__ = [
    "Record", "causes_of", "diagnose", "drawn", "final_sites", "held", "not_compared",
    "not_restored", "read_log", "state_causes", "unseeded",
]  # fmt: skip


@dataclass
class Record:
    """One line of a run's crashtest log (see :mod:`pitstop.probe`)."""

    run: str
    event: str
    step: int
    rank: int
    pid: int
    data: dict[str, Any] = field(default_factory=dict)


def read_log(path: str, run: str) -> list[Record]:
    out: list[Record] = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                d = json.loads(line)
                out.append(
                    Record(run, d["event"], int(d["step"]), int(d["rank"]), int(d["pid"]), d)
                )
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by the kill
    return out


def unseeded(ref: list[Record], fresh: list[Record], used: set[str] | None = None) -> set[str]:
    """Generators that two fresh processes start differently (the script does not seed them):
    each one's digests differ at the first step (or save) both logged before any restore.
    A generator no such record decides (the runs saved at different steps before the first
    kill) is decided by the processes' start records if nothing in the runs draws from it
    (not in ``used``, see :func:`drawn`): then its state is the one it started with, wherever
    it was saved. One that is drawn from stays undecided (it may be seeded after the start)."""
    restored = {r.pid for r in fresh if r.event == "restore"}
    mine: dict[tuple[int, int, str], dict[str, Any]] = {}
    for r in fresh:
        if r.event in (*_MARKS, "start") and r.pid not in restored:
            mine.setdefault((r.step, r.rank, r.event), r.data.get("generators") or {})
    decided: set[str] = set()
    out: set[str] = set()
    for r in (*(r for r in ref if r.event in _MARKS), *(r for r in ref if r.event == "start")):
        b = mine.get((r.step, r.rank, r.event), {})
        a = r.data.get("generators") or {}
        if r.event == "start":
            b = {k: v for k, v in b.items() if k not in (used or set())}
        for k in (set(a) & set(b)) - decided:
            decided.add(k)
            if a[k] != b[k]:
                out.add(k)
    return out


def not_compared(ref: list[Record], skip: set[str], used: set[str]) -> tuple[list[str], str]:
    """The key paths of the generators the script does not seed (``skip``): they are not
    compared; and the note that says so ("" if none)."""
    rng_keys = sorted({k for r in ref for k in r.data.get("rng_keys", [])})
    gens = sorted(skip - {"torch"})
    names = [f"{k}/{g}" for k in rng_keys for g in gens]
    if not names:
        return [], ""
    drawn_from = [g for g in gens if g in used]
    why = (
        f"unseeded, and the script draws from {' and '.join(drawn_from)}"
        if drawn_from
        else "unseeded, and nothing in the runs draws from them"
    )
    note = f"not compared: {', '.join(names)} ({why}: they differ between any two runs)"
    return names + [f"rank*/{n}" for n in names], note  # and the per-rank states of a job


_SEED = {"python": "random.seed", "numpy": "numpy.random.seed"}


def drawn(records: list[Record]) -> set[str]:
    """The generators that something in the runs draws from: the evidence is a digest that
    changes between two records of one process (but for a restore, which sets them)."""
    last: dict[tuple[str, int, int], dict[str, Any]] = {}
    used: set[str] = set()
    for r in records:
        gens = r.data.get("generators")
        if not gens:
            continue
        before = last.setdefault((r.run, r.pid, r.rank), {})
        if r.event != "restore":
            used |= {k for k, v in gens.items() if k in before and before[k] != v}
        before.update(gens)
    return used


def final_sites(
    ref: list[Record],
    crashed: list[Record],
    step: int,
    diffs: Sequence[Difference] = (),
    held: Sequence[str] = (),
) -> str | None:
    """The cause when the checkpoint of ``step`` (the one compared) was taken at different
    places in the two runs, so that what runs between the two places is in one checkpoint and
    not in the other: places of the script (the policy's save in the loop in one, the save
    after the loop in the other), or points of a framework's loop that reach pitstop from one
    line of its own (a Lightning callback that saves at the end of a batch in one run, after
    validation in the other): the saves' chains of callers part there. ``diffs``: what
    differs; ``held``: the top-level keys of the state that hold tensors (those without a
    difference are said to agree). None when the places agree, or are not known."""
    a, b = _last_save(ref, step), _last_save(crashed, step)
    if a is None or b is None:
        return None
    if _where(a) != _where(b):
        return (
            f"the checkpoint of step {step} was taken at different places in the two runs: "
            f"{_where(a)} in the reference, {_where(b)} in the resumed run, so what the script "
            "did in between (evaluation, scheduler.step() after the last step) is in one and "
            "not the other. A policy that decides by time saves the last step in some runs "
            "only: pass last=True to ckpt.step() at the last step and save the final state "
            "after the end-of-training work with ckpt.save_final(step, state)"
        )
    parted = _parted(a.data.get("stack") or [], b.data.get("stack") or [])
    if parted is None:
        return None
    fa, fb = parted
    pkg = _package(fa[0])
    who = (
        f"{pkg} saves at a different point after a resume (its own code decides where, not "
        "the script)"
        if pkg is not None and pkg == _package(fb[0])
        else "the save is made from a different place after a resume"
    )
    groups = list(dict.fromkeys(d.key.split("/")[0] for d in diffs))
    agree = [k for k in held if k not in groups]
    values = f"; the values that differ are under {', '.join(groups)}" if groups else ""
    return (
        f"step {step} was saved from {_frame(fa)} in the reference and from {_frame(fb)} in "
        f"the resumed run: {who}, so what ran between the two points is in one checkpoint and "
        "not in the other (both saves reach pitstop from the same line, "
        f"{os.path.basename(str(a.data.get('site')))})"
        + values
        + (f"; these agree: {', '.join(agree)}" if agree else "")
    )


def held(state: Any) -> list[str]:
    """The top-level keys of a loaded state that hold tensors, as its key paths begin."""
    from pitstop.cli.compare import count_tensors  # torch: once the runs are done
    from pitstop.state.tree import join_key

    if not isinstance(state, Mapping):
        return []
    return [join_key("", k) for k, v in state.items() if count_tensors(v)]


def _parted(a: list[list[Any]], b: list[list[Any]]) -> tuple[list[Any], list[Any]] | None:
    """The innermost frames (``[file, line, function]``) at which two chains of callers of a
    save part, from the save outwards; None if they do not (as far as both go)."""
    return next(((fa, fb) for fa, fb in zip(a, b) if list(fa) != list(fb)), None)


def _frame(frame: list[Any]) -> str:
    return f"{frame[2]} ({os.path.basename(str(frame[0]))}:{frame[1]})"


def _package(path: str) -> str | None:
    """The installed package a file belongs to (the directory under site-packages), or None."""
    parts = str(path).replace("\\", "/").split("/")
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1].removesuffix(".py")
    return None


def causes_of(
    ref: list[Record],
    crashed: list[Record],
    step: int | None,
    diffs: list[Difference],
    tensors: Sequence[str],
    skip: set[str],
    used: set[str],
) -> list[str]:
    """Every cause of the differences: :func:`final_sites` (``step``: the step of both compared
    checkpoints, None if they differ; ``tensors``: see :func:`held`), then
    :func:`state_causes` and :func:`diagnose` for what the places do not explain."""
    site = final_sites(ref, crashed, step, diffs, tensors) if step is not None else None
    if site is None or step is None:
        return state_causes(diffs) + diagnose(ref, crashed, skip, used)
    more = state_causes(diffs, position=False)  # the places explain the data position
    return [site, *more, *diagnose(ref, crashed, skip, used, {step}, explained=True)]


def _last_save(records: list[Record], step: int) -> Record | None:
    saves = [r for r in records if r.event == "save" and r.step == step]
    return min(saves[::-1], key=lambda r: r.rank) if saves else None  # the last one, rank 0


def _where(r: Record) -> str:
    via, site = r.data.get("via"), r.data.get("site")
    call = "by the policy in ckpt.step()" if via == "step" else f"by {via or 'a save'}()"
    return f"{call} at {os.path.basename(site)}" if site else call


def diagnose(
    ref: list[Record],
    crashed: list[Record],
    skip: set[str],
    used: set[str] | None = None,
    exclude: set[int] | None = None,
    *,
    explained: bool = False,
) -> list[str]:
    """The causes of a difference that the runs' logs show (see the module docstring);
    generators in ``skip`` (unseeded ones) are left out of the comparison of digests and
    named when they are in ``used`` (see :func:`drawn`); saves of the steps in ``exclude``
    (taken at different places, see :func:`final_sites`) are not compared. ``explained``: the
    difference has a cause already (:func:`final_sites`), so none found here is not a sign
    that the computation itself differs."""
    causes: list[str] = []
    exclude = exclude or set()
    ref = [r for r in ref if not (r.event == "save" and r.step in exclude)]
    crashed = [r for r in crashed if not (r.event == "save" and r.step in exclude)]
    saves = [r for r in ref if r.event == "save"]
    ref_saves = {(r.step, r.rank): _seeded(r.data, skip) for r in saves}
    if "torch" in skip:
        causes.append(
            "the script does not seed torch (torch.manual_seed): two fresh runs already "
            "differ before any kill, so no resume can match the reference"
        )
    if any(not r.data.get("rng_keys") for r in saves):
        causes.append(
            "the state holds no pitstop.RNGState: the random streams (dropout, augmentation, "
            "shuffling from the global generator) restart from the script's seed on a resume"
        )
    loaders = sorted({k for r in saves for k in r.data.get("loaders_without_generator", [])})
    if loaders:
        causes.append(
            f"loaders in the state without their own generator: {', '.join(loaders)} "
            "(DataLoader(..., generator=torch.Generator().manual_seed(seed)))"
        )
    marks = {(r.step, r.rank, r.event): _seeded(r.data, skip) for r in ref if r.event in _MARKS}
    starts = {r.step for r in ref if r.event == "step" and r.data.get("epoch_start")}
    drift = _generator_drift(marks, crashed, skip, starts)
    for found in (drift, _settings(ref_saves, crashed)):
        if found:
            causes.append(found)
    named = sorted((skip - {"torch"}) & (used or set()))
    if named:
        causes.append(
            f"the script does not seed {' and '.join(named)} and draws from "
            f"{'it' if len(named) == 1 else 'them'} (in the main process, e.g. augmentation, "
            "random.shuffle): two runs differ; seed at the start ("
            + ", ".join(_SEED.get(n, "torch.manual_seed") for n in named)
            + ")"
        )
    if not causes and not explained:
        causes.append(
            "the global random generators agree with the reference at every step after the "
            "resume, so the computation itself differs: non-deterministic kernels "
            "(torch.use_deterministic_algorithms(True)), or training state kept outside the "
            "checkpoint (a counter, a schedule, a cache)"
        )
    return causes


def state_causes(diffs: list[Difference], *, position: bool = True) -> list[str]:
    """Causes that the differing keys themselves show: a different number of optimizer steps,
    a different data position (unless ``position`` is False: the checkpoints were taken at
    different places, which explains it), a torchdata loader whose order does not resume."""
    causes = []
    steps = [d for d in diffs if d.key.endswith("/step") and "state" in d.key]
    if steps:
        by = f" by {steps[0].max_abs:g}" if steps[0].max_abs else ""
        causes.append(
            f"the runs made a different number of optimizer steps ({steps[0].key} differs{by}): "
            "a step or epoch counter, or a loop bound, kept outside the state?"
        )
    torchdata = [d.key for d in diffs if "_sampler_iter_state" in d.key or "_num_yielded" in d.key]
    where = [d.key for d in diffs if "sampler" in d.key and d.key not in torchdata]
    if torchdata:
        causes.append(
            f"the data loader's own state differs ({torchdata[0]}): batches after the resume do "
            "not come in the reference's order; torchdata's StatefulDataLoader needs its own "
            "RandomSampler (torchdata.stateful_dataloader.sampler) with a generator apart from "
            "the loader's: StatefulDataLoader(ds, sampler=RandomSampler(ds, generator="
            "torch.Generator().manual_seed(s)), generator=torch.Generator().manual_seed(s + 1))"
        )
    elif position and not steps and where:
        causes.append(
            f"the data position differs ({where[0]}): the runs consumed different batches"
        )
    return causes


# Values a framework saves in its checkpoints but does not put back on a resume: not
# training state (a resumed run cannot carry them over, and nothing in training reads them
# back), so a difference in them is no failure to resume. Each entry: a glob over key paths,
# and why. Lightning: ModelCheckpoint.load_state_dict restores best_model_score, kth_value,
# best_k_models, kth_best_model_path, last_model_path, best_model_path, never current_score
# (the score of its newest check, None until a check after the resume).
NOT_RESTORED = (
    ("callbacks/ModelCheckpoint*/current_score",
     "Lightning's ModelCheckpoint does not restore it on a resume: the score of its newest "
     "check, not training state"),
)  # fmt: skip


def not_restored(diffs: list[Difference]) -> tuple[list[Difference], list[tuple[str, str]]]:
    """The differences but those in :data:`NOT_RESTORED`, and those (key, why)."""
    kept, dropped = [], []
    for d in diffs:
        why = next((w for glob, w in NOT_RESTORED if fnmatch.fnmatchcase(d.key, glob)), None)
        if why is None:
            kept.append(d)
        else:
            dropped.append((d.key, why))
    return kept, dropped


def _seeded(data: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    gens = data.get("generators") or {}
    return dict(data, generators={k: v for k, v in gens.items() if k not in skip})


_MARKS = ("save", "step")  # records whose generators are compared with the reference's


def _generator_drift(
    marks: dict[tuple[int, int, str], dict[str, Any]],
    crashed: list[Record],
    skip: set[str],
    starts: set[int],
) -> str | None:
    """The first place, in run order, where the crashed runs' generators leave the reference's
    (``marks``: its generators at each save and step): a restore that does not put them back
    where the checkpoint's writer saved them, or, in a process that restored exactly, the
    first step at which they differ from the reference's (something outside the state drew;
    ``starts``: the steps that begin an epoch, where the work between epochs is the suspect)."""
    written: dict[tuple[int, int], dict[str, Any]] = {}  # what each checkpoint was saved with
    restored: dict[tuple[int, int], Record] = {}  # (pid, rank) -> its restore
    agreed: dict[tuple[int, int], dict[str, int]] = {}  # (pid, rank) -> generator -> the
    # last step at which it agreed (steps log torch's only: python's agrees at saves)
    for r in crashed:
        if r.event != "restore" and r.event not in _MARKS:
            continue
        got = _seeded(r.data, skip)["generators"]
        proc = (r.pid, r.rank)
        if r.event == "restore":
            restored[proc] = r
            want = written.get((r.step, r.rank))
            off = _differing(got, want) if want is not None else ""
            if off:
                return (
                    f"after the restore of step {r.step} the global generators "
                    f"({off}) are not where they were when it was saved: the "
                    "state does not restore them (add pitstop.RNGState() to the state)"
                )
            continue
        if r.event == "save":
            written[(r.step, r.rank)] = got
        ref, back = marks.get((r.step, r.rank, r.event)), restored.get(proc)
        if ref is None or back is None:
            continue
        differing = _differing(got, ref["generators"])
        if not differing:
            common = set(got) & set(ref["generators"])
            agreed.setdefault(proc, {}).update(dict.fromkeys(common, r.step))
            continue
        last = [agreed.get(proc, {}).get(k) for k in differing.split(", ")]
        known = [s for s in last if s is not None]
        since = min(known) if known and len(known) == len(last) else None
        return _drawn_outside(back.step, r, since, differing, r.step in starts)
    return None


def _drawn_outside(
    restored: int, at: Record, agreed: int | None, names: str, epoch_start: bool
) -> str:
    where = f"at step {at.step}"
    if at.event == "save":
        where = f"at the save of step {at.step} ({_where(at)})"
    since = f"agree with the reference up to step {agreed} and " if agreed is not None else ""
    between = ""
    if agreed == at.step - 1 and epoch_start:
        between = (
            f" (step {at.step} begins an epoch: the work between two epochs, such as an "
            "evaluation, drew from them)"
        )
    elif agreed == at.step and at.event == "save":
        between = (
            f" (the work between the end of step {at.step} and that save, such as a final "
            "evaluation, drew from them)"
        )
    return (
        f"the global random generators ({names}) were drawn outside the saved state: restored "
        f"exactly at step {restored}, they {since}differ {where}"
        f"{f' on rank {at.rank}' if at.rank else ''}{between}; "
        "typical: a DataLoader without generator= (evaluation loaders draw a seed at every "
        "iter(), with persistent workers only at the first), evaluation or augmentation in the "
        "main process drawing a different amount after a resume"
    )


def _differing(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The generators both dicts hold that differ, or ""."""
    return ", ".join(sorted(k for k in set(a) & set(b) if a[k] != b[k]))


def _settings(
    ref_saves: dict[tuple[int, int], dict[str, Any]], crashed: list[Record]
) -> str | None:
    for r in crashed:
        want = ref_saves.get((r.step, r.rank))
        if r.event != "save" or want is None:
            continue
        for name in ("threads", "deterministic", "cudnn_benchmark"):
            if r.data.get(name) != want.get(name):
                return (
                    f"{name} differs between the runs ({want.get(name)} in the reference, "
                    f"{r.data.get(name)} after the resume)"
                )
    return None
