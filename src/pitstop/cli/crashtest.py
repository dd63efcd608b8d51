"""``pitstop crashtest -- CMD ...``: prove that the user's own script resumes bit for bit.

CMD takes its checkpoint directory on its command line as ``{dir}``. crashtest runs it

1. to completion in a fresh directory (the *reference*), whose log says where it saved and
   where its epochs begin; from it, resume points (:mod:`~pitstop.cli.crashtest_points`: an
   early step, a mid-epoch step, a step in a later epoch, the last step; ``--kills N``: N
   points; ``--kill-at K``: those);
2. in a second directory once per point ``k``, in order, with ``PITSTOP_CRASHTEST_KILL_STEP=k``
   set: the CheckpointManager checkpoints step ``k`` (whatever the policy says) and SIGKILLs
   the process at the next step, once that checkpoint has committed; each run after the
   first resumes from the checkpoint the previous one was killed after;
3. again in that directory, without a kill step, until it exits 0 (it resumes);

then compares the newest committed checkpoints of the two directories tensor by tensor and
value by value. It prints the resume points it tested (and those it could not, with why: a
script whose saves are its own, such as Lightning's ModelCheckpoint, may save nothing after a
point) and ``identical: yes`` (exit 0), or the first differences with their largest absolute
difference and the causes it can see in the runs' logs (exit 1). Values a framework saves but
does not restore (``crashtest_causes.NOT_RESTORED``) are not counted, and said. A run that
fails on its own, or a first kill that never comes, is exit 2.

Causes are found from ``PITSTOP_CRASHTEST_LOG`` (see :mod:`pitstop.probe`): at every step and
save each process logs a digest of the global random generators. The generators at a step of
a resumed run must equal those of the reference at the same step; if they were restored
(the restore logs them too) and differ at a later step, something outside the saved state
drew from them in between (a DataLoader without ``generator=``, evaluation, augmentation in
the main process): the first such step is named. Equal generators and different tensors
point to the computation itself (non-deterministic kernels, a different thread count). A
compared checkpoint taken at different places in the two runs (the policy's save in the loop,
the final save after it; a framework's callback saving at the end of a batch, or after
validation: the saves' chains of callers part) is named as such, not as the differences it
explains; unseeded generators are named only when something draws from them.

Call sequence (the CLI's thread): ``run_crashtest(args)``: ``_Runner.run`` (the reference)
-> ``choose`` -> ``_Runner.run`` x (points + up to ``--restarts`` reruns) -> ``_load`` x 2 ->
``compare`` -> ``causes_of`` -> print.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pitstop.cli.crashtest_causes import (
    Record,
    causes_of,
    drawn,
    held,
    not_compared,
    not_restored,
    read_log,
    unseeded,
)
from pitstop.cli.crashtest_points import NO_SAVE, ResumePoint, Timeline, choose, given, grouped

if TYPE_CHECKING:
    from pitstop.cli.compare import Difference

__all__ = ["add_arguments", "main_exit", "run_crashtest"]

DOCS = "docs/determinism.md"


class CrashtestError(Exception):
    """A run that could not be used for the comparison (exit 2)."""


def _committed(root: str) -> dict[int, int]:
    """The committed steps under ``root``, each with the number of ranks that saved it."""
    from pitstop.cli.main import catalog_of

    if not os.path.isdir(root):
        return {}
    catalog = catalog_of(root)
    try:
        return {
            e.step: e.manifest.world_size
            for e in catalog.committed()
            if e.step is not None and e.manifest is not None
        }
    finally:
        catalog.close()


def _committed_steps(root: str) -> list[int]:
    return sorted(_committed(root))


@dataclass
class _Run:
    label: str
    returncode: int
    secs: float
    output: str


class _Runner:
    """Runs CMD with ``{dir}`` replaced, its output in ``<workdir>/<label>.out``."""

    def __init__(self, cmd: list[str], workdir: str, timeout_secs: float) -> None:
        self.cmd, self.workdir, self.timeout_secs = cmd, workdir, timeout_secs

    def run(self, label: str, ckpt_dir: str, log: str, kill_step: int | None) -> _Run:
        argv = [a.replace("{dir}", ckpt_dir) for a in self.cmd]
        env = dict(os.environ, PITSTOP_CRASHTEST_LOG=log)
        env.pop("PITSTOP_CRASHTEST_KILL_STEP", None)
        if kill_step is not None:
            env["PITSTOP_CRASHTEST_KILL_STEP"] = str(kill_step)
        out_path = os.path.join(self.workdir, f"{label}.out")
        t0 = time.perf_counter()
        with open(out_path, "wb") as out:
            try:
                proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            except OSError as e:
                raise CrashtestError(f"cannot run {argv[0]!r}: {e.strerror or e}") from None
            try:
                code = proc.wait(timeout=self.timeout_secs)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise CrashtestError(
                    f"{label} run did not finish within {self.timeout_secs:.0f} s "
                    f"(--timeout; --keep keeps its output, {label}.out)"
                ) from None
            finally:
                _kill_group(proc.pid)  # workers a killed process left behind
        with open(out_path, encoding="utf-8", errors="replace") as f:
            output = f.read()
        return _Run(label, code, time.perf_counter() - t0, output)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def _say(text: str) -> None:
    print(text, flush=True)


@dataclass
class _Chain:
    """The runs in the crashed directory: their logs, the points each resume tested (the
    point, the step the next run restored), the points not tested (and why), pitstop's
    warnings in their output."""

    logs: list[str]
    tested: list[tuple[ResumePoint, int]]
    warnings: dict[str, None]
    untested: list[tuple[ResumePoint, str]] = field(default_factory=list)


def _crash_runs(
    runner: _Runner, args: argparse.Namespace, crash_dir: str, points: list[ResumePoint],
    final: int,
) -> _Chain:  # fmt: skip
    """One killed run per point (each after the newest checkpoint the previous one left),
    then reruns until one exits 0. Every run after the first must have restored what the
    previous one left, or nothing was tested. A run after the first that is not killed (no
    checkpoint at or after its point before the end) is the one that finishes."""
    chain = _Chain([], [], {})
    killed: ResumePoint | None = None
    for n, point in enumerate(points):
        have = _committed_steps(crash_dir)
        kill = point.step if not have else max(point.step, have[-1] + 1)
        if kill >= final:
            _say(f"{point.kind} (step {point.step}): no step left before the last: not tested")
            chain.untested.append((point, f"the killed run's checkpoint is of step {have[-1]}"))
            continue
        log = os.path.join(runner.workdir, f"crashed-{len(chain.logs) + 1}.log")
        chain.logs.append(log)
        run = runner.run(f"crashed-{len(chain.logs)}", crash_dir, log, kill)
        records = read_log(log, "")
        chain.warnings.update(_warnings(run.output))
        kills = [r for r in records if r.event == "kill"]
        if not kills and (killed is None or run.returncode != 0):
            raise CrashtestError(_not_killed(len(chain.logs), kill, run))  # it ended, or died
        resumed = _resumed(chain, killed, records, f"crashed run {len(chain.logs)}")
        if not kills:
            _say(
                f"crashed run {len(chain.logs)}{resumed}: no checkpoint at or after step {kill} "
                f"before the end: it ran to the end ({run.secs:.1f} s)"
            )
            why = f"the run saved no checkpoint from step {kill} to its final one{NO_SAVE}"
            chain.untested += [(p, why) for p in points[n:]]
            return chain
        killed = point
        _say(
            f"crashed run {len(chain.logs)} ({point.kind}){resumed}: the checkpoint of step "
            f"{kills[0].data.get('resume', '?')} committed, SIGKILL at step {kills[0].step} "
            f"({run.secs:.1f} s)"
        )
    if killed is None:
        raise CrashtestError("no run was killed: nothing was tested")
    _resumed_runs(runner, args, crash_dir, chain, killed)
    return chain


def _resumed_runs(
    runner: _Runner, args: argparse.Namespace, crash_dir: str, chain: _Chain,
    killed: ResumePoint,
) -> None:  # fmt: skip
    """The runs after the last kill, until one exits 0."""
    for attempt in range(1 + args.restarts):
        log = os.path.join(runner.workdir, f"resumed-{attempt + 1}.log")
        chain.logs.append(log)
        run = runner.run(f"resumed-{attempt + 1}", crash_dir, log, None)
        chain.warnings.update(_warnings(run.output))
        if run.returncode == 0:
            resumed = _resumed(chain, killed, read_log(log, ""), "the resumed run")
            _say(f"resumed run{resumed}: exit 0 ({run.secs:.1f} s)")
            return
        _say(f"resumed run {attempt + 1}: {_exit(run.returncode)}\n{_tail(run.output)}")
    raise CrashtestError(f"the resumed run did not exit 0 in {1 + args.restarts} attempts")


def _resumed(chain: _Chain, killed: ResumePoint | None, records: list[Record], label: str) -> str:
    """A run after a kill must have restored a checkpoint (else the resume was not tested):
    the step it restored is the one the killed point tested. Text for the run's line."""
    if killed is None:
        return ""
    _check_restored(label, records, resumed=True)
    step = min((r for r in records if r.event == "restore"), key=lambda r: r.rank).step
    chain.tested.append((killed, step))
    return f", resumed from step {step}"


_WARNED = re.compile(r"^\[rank \d+\] [a-z-]+: |\bpitstop\b.*\bWARNING\b")


def _warnings(output: str) -> dict[str, None]:
    """pitstop's warnings in a run's output (its log lines name the rank), but for the kill
    step's own."""
    return {
        line.strip()[:300]: None
        for line in output.splitlines()
        if _WARNED.search(line) and "PITSTOP_CRASHTEST_KILL_STEP" not in line
    }


def _exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit {code}"


def _not_killed(run_no: int, kill: int, run: _Run) -> str:
    if run.returncode == 0:
        why = (
            "finished without being killed: does the script call ckpt.step() once per step "
            "(or, if it saves with save()/async_save() itself, ckpt.hooks.reached(step), and "
            f"save a checkpoint at or after step {kill} before its last step)?"
        )
    else:
        why = (
            f"ended ({_exit(run.returncode)}) before crashtest killed it: it failed by itself "
            "(out of memory, a crash, a signal from elsewhere?)"
        )
    return (
        f"run {run_no} was to be killed after its checkpoint of step {kill} but {why}\n"
        f"{_tail(run.output)}"
    )


def _check_restored(label: str, records: list[Record], *, resumed: bool) -> None:
    """A run after a kill must have restored a checkpoint: else the resume was not tested."""
    if resumed and not any(r.event == "restore" for r in records):
        raise CrashtestError(
            f"{label} restored no checkpoint (no ckpt.restore(state) before training?): "
            "it started over, so a crash would lose all progress and nothing was tested"
        )


def _load(root: str, allow_pickle: bool) -> tuple[int, Any, int]:
    """The newest committed step and its state, per rank (see ``compare.load_ranks``)."""
    from pitstop.cli.compare import load_ranks

    committed = _committed(root)
    if not committed:
        raise CrashtestError(f"{root}: the run left no committed checkpoint")
    return load_ranks(root, max(committed), allow_pickle=allow_pickle)


def run_crashtest(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise CrashtestError(
            "give the command to test after --: pitstop crashtest -- python train.py --dir {dir}"
        )
    if not any("{dir}" in a for a in cmd):
        raise CrashtestError(
            "the command must take its checkpoint directory as {dir}, e.g. "
            "pitstop crashtest -- python train.py --dir {dir}"
        )
    workdir = _workdir(args.workdir)
    try:
        return _crashtest(cmd, workdir, args)
    finally:
        if args.keep:
            _say(f"runs kept in {workdir}")
        elif args.workdir:  # the user's directory stays; what crashtest wrote goes
            for name in os.listdir(workdir):
                path = os.path.join(workdir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _workdir(given: str | None) -> str:
    if given is None:
        return tempfile.mkdtemp(prefix="pitstop-crashtest-")
    if "://" in given or re.match(r"^\s*[A-Za-z][A-Za-z0-9+.-]*:", given):
        raise CrashtestError(
            f"--workdir {given}: crashtest runs and compares the checkpoints in a local "
            "directory; give one (a script that saves to a bucket can take the bucket from "
            "its own option and {dir} for the local runs)"
        )
    try:
        os.makedirs(given, exist_ok=True)
        names = os.listdir(given)
    except OSError as e:
        raise CrashtestError(f"--workdir {given}: {e.strerror or e}") from None
    if names:
        raise CrashtestError(f"--workdir {given} is not empty; crashtest needs an empty one")
    return given


def _crashtest(cmd: list[str], workdir: str, args: argparse.Namespace) -> int:
    runner = _Runner(cmd, workdir, args.timeout)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    ref_dir, crash_dir = os.path.join(workdir, "reference"), os.path.join(workdir, "crashed")
    _say(f"crashtest seed {seed}: {' '.join(cmd)}")
    ref_records, final, warned = _reference(runner, ref_dir, os.path.join(workdir, "reference.log"))
    tl = Timeline.of(ref_records, final)
    outside = [k for k in args.kill_at or () if k >= final]
    if outside:
        raise CrashtestError(
            f"--kill-at {outside[0]}: the reference run's final checkpoint is of step {final}; "
            f"choose steps from 1 to {final - 1}"
        )
    points = (
        given(tl, args.kill_at) if args.kill_at else choose(tl, args.kills, random.Random(seed))
    )
    _say("resume points: " + ", ".join(f"step {p.step} ({p.kind})" for p in points))
    chain = _crash_runs(runner, args, crash_dir, points, final)
    crash_records = [r for i, log in enumerate(chain.logs) for r in read_log(log, f"run{i}")]
    used = drawn(ref_records + crash_records)
    skip = unseeded(ref_records, read_log(chain.logs[0], "run0"), used)
    names, note = not_compared(ref_records, skip, used)
    if note:
        _say(note)
    ignore = list(args.ignore or ()) + names
    from pitstop.cli.compare import compare  # torch: only once the runs are done

    (step_a, a, ranks), (step_b, b, _) = (
        _load(ref_dir, args.allow_pickle),
        _load(crash_dir, args.allow_pickle),
    )
    if ranks > 1:
        _say(f"{ranks} ranks saved the newest step: each rank's own values are compared")
    for line in {**warned, **chain.warnings}:
        _say(f"pitstop warned in a run: {line}")
    _say("resume points tested: " + ", ".join(tl.describe(p, step) for p, step in chain.tested))
    for why, group in grouped(chain.untested).items():
        _say(f"resume points not tested: {', '.join(group)}: {why}")
    diffs, dropped = not_restored(compare(a, b, ignore=ignore))
    for key, why in dropped:
        _say(f"differs, not counted: {key} ({why})")
    same = step_b if step_a == step_b else None
    causes = causes_of(ref_records, crash_records, same, diffs, held(a), skip, used)
    return _report(step_a, step_b, a, diffs, causes, args)


def _reference(
    runner: _Runner, ref_dir: str, ref_log: str
) -> tuple[list[Record], int, dict[str, None]]:
    """Run the reference: its log records, its final (newest committed) step, its warnings."""
    run = runner.run("reference", ref_dir, ref_log, None)
    if run.returncode != 0:
        raise CrashtestError(f"the reference run exited {run.returncode}\n{_tail(run.output)}")
    records = read_log(ref_log, "reference")
    saves = sorted({r.step for r in records if r.event == "save"})
    committed = _committed_steps(ref_dir)
    final = committed[-1] if committed else None
    if final is None or not saves:
        raise CrashtestError(
            f"the reference run left no committed checkpoint in {ref_dir}: does the script save "
            "to the directory it is given as {dir}?"
        )
    if saves[0] >= final:
        raise CrashtestError(
            f"the reference run checkpointed first at its last step ({final}): there is no "
            "checkpoint to resume from before the end; checkpoint more often or train longer"
        )
    starts = Timeline.of(records, final).starts
    epochs = ""
    if len(starts) > 1:
        epochs = f", {len(starts)} epochs (loader.epoch {starts[0][0]} to {starts[-1][0]})"
    _say(
        f"reference run: exit 0 ({run.secs:.1f} s), final step {final}, {len(saves)} saves" + epochs
    )
    trained = max((r.step for r in records if r.event == "end"), default=final)
    if trained > final:
        _say(
            f"note: the reference trained to step {trained} but its newest checkpoint is of step "
            f"{final}: what came after is not compared (save the final state at the end: "
            "ckpt.save_final(step, state))"
        )
    return records, final, _warnings(run.output)


def _report(
    step_a: int, step_b: int, a: Any, diffs: list[Difference], causes: list[str],
    args: argparse.Namespace,
) -> int:  # fmt: skip
    from pitstop.cli.compare import count_tensors, format_differences

    if step_a != step_b:
        _say(f"the newest checkpoints are of different steps: {step_a} (reference) vs {step_b}")
    if not diffs and step_a == step_b:
        _say(f"compared step {step_a}: {count_tensors(a)} tensors and every other value")
        _say("identical: yes")
        return 0
    _say(f"compared step {step_a} (reference) with step {step_b} (killed and resumed):")
    differ = sum(d.is_tensor for d in diffs)
    _say(f"{differ} tensors and {len(diffs) - differ} other values differ:")
    for line in format_differences(diffs, limit=args.show):
        _say(line)
    _say("identical: no")
    if causes:
        _say("likely causes:")
        for c in causes:
            _say(f"  - {c}")
    _say(f"see the determinism checklist: {DOCS}")
    return 1


def _at_least(low: float, kind: type = int) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command; {dir} is replaced")
    p.add_argument("--kills", type=_at_least(1),
                   help="resume points (default 4: early, mid-epoch, a later epoch, the last "
                        "step, chosen from the reference run)")  # fmt: skip
    p.add_argument("--seed", type=int, help="seed of the steps chosen (default: random)")
    p.add_argument("--kill-at", type=_at_least(1), action="append", metavar="STEP",
                   help="resume from this step (repeatable; instead of chosen points)")  # fmt: skip
    p.add_argument("--workdir", help="where the runs go (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the runs' directories and output")
    p.add_argument("--timeout", type=_at_least(1, float), default=900.0,
                   help="seconds per run (default 900)")  # fmt: skip
    p.add_argument("--allow-pickle", action="store_true",
                   help="the script saves with allow_pickle=True (trusted checkpoints only)")  # fmt: skip
    p.add_argument("--restarts", type=_at_least(0), default=2,
                   help="reruns allowed after the resumed run fails (default 2)")  # fmt: skip
    p.add_argument("--ignore", action="append", metavar="GLOB",
                   help="key paths not compared, e.g. 'progress/wall_secs' (repeatable)")  # fmt: skip
    p.add_argument("--show", type=int, default=10, help="differences shown (default 10)")


def main_exit(args: argparse.Namespace) -> int:
    try:
        return run_crashtest(args)
    except CrashtestError as e:
        print(f"pitstop crashtest: {e}", file=sys.stderr)
        return 2
