"""``pitstop crashtest -- CMD ...``: prove that the user's own script resumes bit for bit.

CMD takes its checkpoint directory on its command line as ``{dir}``. crashtest runs it

1. to completion in a fresh directory (the *reference*);
2. in a second directory with ``PITSTOP_CRASHTEST_KILL_STEP=k`` set, a random step after
   the first checkpoint of the reference: the CheckpointManager SIGKILLs the process at the
   first step ``>= k`` once a checkpoint has committed (``--kills N``: N such runs, each
   killed at a random step after the newest checkpoint the previous one left);
3. again in that directory, without a kill step, until it exits 0 (it resumes);

then compares the newest committed checkpoints of the two directories tensor by tensor and
value by value. It prints ``identical: yes`` (exit 0), or the first differences with their
largest absolute difference and the causes it can see in the runs' logs (exit 1). A run
that fails on its own, or a kill that never comes, is exit 2.

Causes are found from ``PITSTOP_CRASHTEST_LOG`` (see :mod:`pitstop.probe`): at each save
every process logs a digest of each global random generator. The generators at a step of
the resumed run must equal those of the reference at the same step; if they were restored
(the restore logs them too) and differ at a later save, something outside the saved state
drew from them between the two (a DataLoader without ``generator=``, evaluation,
augmentation in the main process). Equal generators and different tensors point to the
computation itself (non-deterministic kernels, a different thread count).

Call sequence (the CLI's thread): ``run_crashtest(args)``: ``_Runner.run`` x (1 + kills + up
to ``--restarts`` reruns) -> ``_load`` x 2 -> ``compare`` -> ``diagnose`` -> print.
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pitstop.cli.crashtest_causes import Record, diagnose, read_log, state_causes, unseeded

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


def _pick(rng: random.Random, low: int, high: int) -> int | None:
    return rng.randint(low, high) if low <= high else None


def _crash_runs(
    runner: _Runner, args: argparse.Namespace, rng: random.Random, crash_dir: str, steps: range
) -> list[str]:
    """The killed runs (each at a step of ``steps`` after the newest checkpoint), then the
    reruns until one exits 0; the log files of all of them. Every run after the first must
    have restored what the previous one left, or nothing was tested."""
    logs: list[str] = []
    warnings: dict[str, None] = {}  # pitstop's warnings in the runs' output, in order, once
    first, final = steps.start, steps.stop
    for i in range(args.kills):
        have = _committed_steps(crash_dir)
        low = max(first, (have[-1] + 1) if have else first)
        kill = _pick(rng, low, final - 1)
        if i == 0 and args.kill_at is not None:
            if not first <= args.kill_at < final:
                raise CrashtestError(
                    f"--kill-at {args.kill_at}: the reference checkpointed first at step "
                    f"{first - 1} and ended at {final}; choose a step from {first} to {final - 1}"
                )
            kill = args.kill_at
        if kill is None:
            _say(f"kill {i + 1}: no step left between the newest checkpoint and the last step")
            break
        log = os.path.join(runner.workdir, f"crashed-{i + 1}.log")
        logs.append(log)
        run = runner.run(f"crashed-{i + 1}", crash_dir, log, kill)
        records = read_log(log, "")
        kills = [r.step for r in records if r.event == "kill"]
        if not kills:  # the probe did not kill it: it ended, or something else did
            raise CrashtestError(_not_killed(i + 1, kill, run))
        _check_restored(f"crashed run {i + 1}", records, resumed=i > 0)
        warnings.update(_warnings(run.output))
        newest = _committed_steps(crash_dir)
        _say(
            f"crashed run {i + 1}: SIGKILL at step {min(kills)} ({run.secs:.1f} s); newest "
            f"committed checkpoint: {newest[-1] if newest else 'none'}"
        )
    if not logs:
        raise CrashtestError("no run was killed: nothing was tested")
    for attempt in range(1 + args.restarts):
        log = os.path.join(runner.workdir, f"resumed-{attempt + 1}.log")
        logs.append(log)
        run = runner.run(f"resumed-{attempt + 1}", crash_dir, log, None)
        if run.returncode == 0:
            _check_restored("the resumed run", read_log(log, ""), resumed=True)
            _say(f"resumed run: exit 0 ({run.secs:.1f} s)")
            return logs
        _say(f"resumed run {attempt + 1}: {_exit(run.returncode)}\n{_tail(run.output)}")
    raise CrashtestError(f"the resumed run did not exit 0 in {1 + args.restarts} attempts")


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
            "finished without being killed: does the script call ckpt.step() (or "
            "ckpt.reached(step) once per step) and commit a checkpoint before its last step?"
        )
    else:
        why = (
            f"ended ({_exit(run.returncode)}) before crashtest killed it: it failed by itself "
            "(out of memory, a crash, a signal from elsewhere?)"
        )
    return f"run {run_no} was to be killed at step {kill} but {why}\n{_tail(run.output)}"


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
    rng = random.Random(seed)
    ref_dir, crash_dir = os.path.join(workdir, "reference"), os.path.join(workdir, "crashed")
    ref_log = os.path.join(workdir, "reference.log")
    _say(f"crashtest seed {seed}: {' '.join(cmd)}")
    run = runner.run("reference", ref_dir, ref_log, None)
    if run.returncode != 0:
        raise CrashtestError(f"the reference run exited {run.returncode}\n{_tail(run.output)}")
    ref_records = read_log(ref_log, "reference")
    saves = sorted({r.step for r in ref_records if r.event == "save"})
    committed = _committed_steps(ref_dir)
    final = committed[-1] if committed else None
    if final is None or not saves:
        raise CrashtestError(
            f"the reference run left no committed checkpoint in {ref_dir}: does the script save "
            "to the directory it is given as {dir}?"
        )
    if saves[0] >= final:
        raise CrashtestError(
            f"the reference run checkpointed first at its last step ({final}): there is no step "
            "to kill at after a checkpoint; checkpoint more often or train longer"
        )
    _say(f"reference run: exit 0 ({run.secs:.1f} s), final step {final}, {len(saves)} saves")
    trained = max((r.step for r in ref_records if r.event == "end"), default=final)
    if trained > final:
        _say(
            f"note: the reference trained to step {trained} but its newest checkpoint is of step "
            f"{final}: what came after is not compared (save the final state at the end)"
        )
    logs = _crash_runs(runner, args, rng, crash_dir, range(saves[0] + 1, final))
    crash_records = [r for i, log in enumerate(logs) for r in read_log(log, f"run{i}")]
    skip = unseeded(ref_records, read_log(logs[0], "run0"))
    ignore = list(args.ignore or ())
    rng_keys = sorted({k for r in ref_records for k in r.data.get("rng_keys", [])})
    names = [f"{k}/{g}" for k in rng_keys for g in sorted(skip - {"torch"})]
    if names:
        ignore += names + [f"rank*/{n}" for n in names]  # the per-rank states of a job
        _say(
            f"not compared: {', '.join(names)} (the script does not seed "
            f"{' and '.join(sorted(skip - {'torch'}))}: they differ between any two runs)"
        )
    from pitstop.cli.compare import compare  # torch: only once the runs are done

    (step_a, a, ranks), (step_b, b, _) = (
        _load(ref_dir, args.allow_pickle),
        _load(crash_dir, args.allow_pickle),
    )
    if ranks > 1:
        _say(f"{ranks} ranks saved the newest step: each rank's own values are compared")
    diffs = compare(a, b, ignore=ignore)
    causes = state_causes(diffs) + diagnose(ref_records, crash_records, skip)
    return _report(step_a, step_b, a, diffs, causes, args)


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
    p.add_argument("--kills", type=_at_least(1), default=1, help="kill this many times (default 1)")
    p.add_argument("--seed", type=int, help="seed of the random kill steps (default: random)")
    p.add_argument("--kill-at", type=_at_least(1), help="the first kill's step (default: random)")
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
