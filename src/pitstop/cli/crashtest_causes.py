"""Why a crashtest's two runs ended differently: the runs' logs, read back and diagnosed.

Every process crashtest runs appends one JSON line per save and per restore (see
:mod:`pitstop.probe`). From them :func:`unseeded` finds the generators the script does not
seed, and :func:`diagnose` names the causes it can see: no ``RNGState`` in the state, loaders
without a generator of their own, generators drawn outside the state after an exact restore,
a restore that did not put them back, settings that changed between runs, or (when the
generators agree) the computation itself. :func:`state_causes` reads the differences.

Call sequence (the CLI's thread, after the runs): ``read_log`` per log file ->
``unseeded(reference, first crashed run)`` -> ``state_causes(diffs)`` + ``diagnose(...)``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pitstop.cli.compare import Difference

__all__ = ["Record", "diagnose", "read_log", "state_causes", "unseeded"]


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


def unseeded(ref: list[Record], fresh: list[Record]) -> set[str]:
    """Generators that two fresh processes start differently (the script does not seed them):
    their digests differ at the first step both saved before any restore."""
    mine = {(r.step, r.rank): r.data for r in fresh if r.event == "save"}
    restored = {r.pid for r in fresh if r.event == "restore"}
    for r in ref:
        other = mine.get((r.step, r.rank))
        if r.event != "save" or other is None or any(x.pid in restored for x in fresh):
            continue
        a, b = r.data.get("generators") or {}, other.get("generators") or {}
        return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    return set()


def diagnose(ref: list[Record], crashed: list[Record], skip: set[str]) -> list[str]:
    """The causes of a difference that the runs' logs show (see the module docstring);
    generators in ``skip`` (unseeded ones) are left out of the comparison of digests."""
    causes: list[str] = []
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
    drift = _generator_drift(ref_saves, crashed, skip)
    for found in (drift, _settings(ref_saves, crashed)):
        if found:
            causes.append(found)
    if skip - {"torch"}:
        names = " and ".join(sorted(skip - {"torch"}))
        causes.append(
            f"the script does not seed {names}: if anything draws from them (augmentation in "
            "the main process, random.shuffle), two runs differ; seed them at the start "
            "(random.seed, numpy.random.seed)"
        )
    if not causes:
        causes.append(
            "the global random generators agree with the reference at every save after the "
            "resume, so the computation itself differs: non-deterministic kernels "
            "(torch.use_deterministic_algorithms(True)), or training state kept outside the "
            "checkpoint (a counter, a schedule, a cache)"
        )
    return causes


def state_causes(diffs: list[Difference]) -> list[str]:
    """Causes that the differing keys themselves show: a different number of optimizer steps,
    a different data position, a torchdata loader whose order does not resume."""
    causes = []
    steps = [d for d in diffs if d.key.endswith("/step") and "state" in d.key]
    if steps:
        by = f" by {steps[0].max_abs:g}" if steps[0].max_abs else ""
        causes.append(
            f"the runs made a different number of optimizer steps ({steps[0].key} differs{by}): "
            "a step or epoch counter, or a loop bound, kept outside the state?"
        )
    torchdata = [d.key for d in diffs if "_sampler_iter_state" in d.key or "_num_yielded" in d.key]
    position = [d.key for d in diffs if "sampler" in d.key and d.key not in torchdata]
    if torchdata:
        causes.append(
            f"the data loader's own state differs ({torchdata[0]}): batches after the resume do "
            "not come in the reference's order; torchdata's StatefulDataLoader needs its own "
            "RandomSampler (torchdata.stateful_dataloader.sampler) with a generator apart from "
            "the loader's: StatefulDataLoader(ds, sampler=RandomSampler(ds, generator="
            "torch.Generator().manual_seed(s)), generator=torch.Generator().manual_seed(s + 1))"
        )
    elif position and not steps:
        causes.append(
            f"the data position differs ({position[0]}): the runs consumed different batches"
        )
    return causes


def _seeded(data: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    gens = data.get("generators") or {}
    return dict(data, generators={k: v for k, v in gens.items() if k not in skip})


def _generator_drift(
    ref_saves: dict[tuple[int, int], dict[str, Any]], crashed: list[Record], skip: set[str]
) -> str | None:
    """The first place, in run order, where the crashed runs' generators leave the reference's:
    a restore that does not put them back where the checkpoint's writer saved them, or a save
    of a process that restored exactly and then drew outside the state."""
    written: dict[tuple[int, int], dict[str, Any]] = {}  # what each checkpoint was saved with
    restored: dict[tuple[int, int], Record] = {}  # (pid, rank) -> its restore
    for r in crashed:
        got = _seeded(r.data, skip)["generators"]
        if r.event == "restore":
            restored[(r.pid, r.rank)] = r
            want = written.get((r.step, r.rank))
            if want is not None and got != want:
                return (
                    f"after the restore of step {r.step} the global generators "
                    f"({_differing(got, want)}) are not where they were when it was saved: the "
                    "state does not restore them (add pitstop.RNGState() to the state)"
                )
        elif r.event == "save":
            written[(r.step, r.rank)] = got
            ref = ref_saves.get((r.step, r.rank))
            back = restored.get((r.pid, r.rank))
            if ref is not None and back is not None and got != ref["generators"]:
                return (
                    f"the global random generators ({_differing(got, ref['generators'])}) were "
                    f"drawn outside the saved state: restored exactly at step {back.step}, they "
                    f"differ from the reference at step {r.step} (rank {r.rank}); typical: a "
                    "DataLoader without generator= (evaluation loaders draw a seed at every "
                    "iter(), with persistent workers only at the first), evaluation or "
                    "augmentation in the main process drawing a different amount after a resume"
                )
    return None


def _differing(a: dict[str, Any], b: dict[str, Any]) -> str:
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))) or "?"


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
