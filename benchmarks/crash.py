"""Crash-consistency run: SIGKILL a training child at random times and at every kill point,
restore, and check that the newest committed step comes back with the bytes that were saved.

    python benchmarks/crash.py --trials 200        # the full run (a few minutes)
    python benchmarks/crash.py --quick             # 12 trials

Each trial starts ``python -m pitstop.testing.crash ROOT async 400 3``: a child that
builds a state that is a pure function of the step, appends "<step> <sha256>" to a side
file (fsynced) and calls ``async_save`` every step (keep_last=3). Every fourth trial
sets PITSTOP_KILL_AT to one of the named kill points (cycling, N in 2..4; ``gc.mid`` is
reached by a child in ``gc`` mode: five saves, debris, ``gc``); the others are
SIGKILLed by the parent after a random delay once the child has recorded a few saves.
Then this process (not the killed one) restores and checks:

* the restored step is the newest committed one (and nothing when nothing committed);
* its digest equals the one the child recorded for that step;
* no partial directory was loaded, and ``pitstop verify`` passes on the whole root.

It prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import pitstop
from pitstop.engine.catalog import Catalog
from pitstop.engine.verify import verify_checkpoint
from pitstop.faults import KILL_POINTS
from pitstop.testing.crash import digest, state_for

# the points this benchmark's child (one process, one root) reaches: the multi-level ones
# (replicate.mid, flush.mid) and the Lightning ones are the fault tests' (tests/multilevel,
# tests/integrations); a child never killed would exit normally and fail its trial
ROOT_POINTS = tuple(
    p for p in KILL_POINTS if not p.startswith(("replicate.", "flush.", "lightning."))
)


@dataclass
class Trial:
    index: int
    how: str
    committed: int | None = None
    restored: int | None = None
    correct: bool = False
    corrupt_load: bool = False
    verify_ok: bool = False
    resume_secs: float = 0.0
    error: str = ""


def _wait_for_saves(path: str, count: int, deadline: float) -> None:
    while time.time() < deadline:
        if os.path.exists(path):
            with open(path) as f:
                if f.read().count("\n") >= count:
                    return
        time.sleep(0.005)


def run_trial(index: int, workdir: str, seed: int) -> Trial:
    rng = random.Random(seed * 1_000_003 + index)
    root = os.path.join(workdir, f"t{index:04d}")
    env = dict(os.environ)
    env.pop("PITSTOP_KILL_AT", None)
    mode, steps = "async", "400"
    if index % 4 == 3:
        point = ROOT_POINTS[(index // 4) % len(ROOT_POINTS)]
        env["PITSTOP_KILL_AT"] = f"{point}:{rng.randint(2, 4) if point != 'gc.mid' else 1}"
        how = env["PITSTOP_KILL_AT"]
        if point == "gc.mid":
            mode, steps = "gc", "5"
    else:
        how = "random time"
    cmd = [sys.executable, "-m", "pitstop.testing.crash", root, mode, steps, "3"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    if how == "random time":
        _wait_for_saves(root + ".digests", 3, time.time() + 60)
        time.sleep(rng.uniform(0.0, 2.0))
        proc.send_signal(signal.SIGKILL)
    code = proc.wait(timeout=120)
    trial = Trial(index, how)
    if code != -signal.SIGKILL:
        trial.error = f"child exited with {code}, not killed"
        return trial
    try:
        recorded: dict[str, str] = {}
        if mode == "gc":  # sync saves of a state that is a pure function of the step
            recorded = {str(s): digest(state_for(s)) for s in range(1, 6)}
        else:
            with open(root + ".digests") as f:
                recorded = dict(line.split() for line in f.read().splitlines() if " " in line)
        ckpt = pitstop.CheckpointManager(root)
        storage = ckpt.hooks.storage
        steps = ckpt.steps()
        trial.committed = steps[-1] if steps else None
        fresh = state_for(10**6)
        t0 = time.perf_counter()
        trial.restored = ckpt.restore(fresh)
        trial.resume_secs = time.perf_counter() - t0
        ckpt.close()
        if trial.restored is None:
            trial.correct = trial.committed is None
        else:
            same = digest(fresh) == recorded.get(str(trial.restored))
            trial.corrupt_load = not same
            trial.correct = same and trial.restored == trial.committed
        trial.verify_ok = (
            all(  # what `pitstop verify` checks, without printing (trials run in threads)
                verify_checkpoint(storage, e.name, e.manifest).ok if e.manifest else False
                for e in Catalog(storage).scan()
                if e.status in ("committed", "damaged")
            )
        )
    except Exception as e:  # a failed restore is a result, not a crash of the benchmark
        trial.error = f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return trial


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="12 trials")
    p.add_argument("--parallel", type=int, default=2, help="trials at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    trials_n = 12 if args.quick else args.trials
    workdir = args.dir or tempfile.mkdtemp(prefix="pitstop-crash-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        trials = list(pool.map(lambda i: run_trial(i, workdir, args.seed), range(trials_n)))
    elapsed = time.perf_counter() - t0
    if args.dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    correct = sum(t.correct and t.verify_ok and not t.error for t in trials)
    corrupt = sum(t.corrupt_load for t in trials)
    resumes = [t.resume_secs for t in trials if t.restored is not None]
    by_how: dict[str, list[Trial]] = {}
    for t in trials:
        by_how.setdefault(t.how.split(":")[0], []).append(t)
    print(f"{'kill':24} {'trials':>6} {'correct':>7} {'restored step (median)':>22}")
    for how, group in sorted(by_how.items()):
        steps = [t.restored for t in group if t.restored is not None]
        med = statistics.median(steps) if steps else "-"
        print(
            f"{how:24} {len(group):>6} {sum(t.correct and t.verify_ok for t in group):>7} {med!s:>22}"
        )
    for t in trials:
        if not (t.correct and t.verify_ok) or t.error:
            print(f"  trial {t.index} ({t.how}): {asdict(t)}")
    mean_resume = statistics.mean(resumes) if resumes else 0.0
    print(f"\n{correct}/{trials_n} correct restores, {corrupt} corrupt loads, "
          f"mean time to resume {mean_resume * 1000:.1f} ms, {elapsed:.0f} s in all")  # fmt: skip
    print(json.dumps({
        "trials": trials_n, "correct": correct, "corrupt_loads": corrupt,
        "mean_resume_secs": mean_resume, "elapsed_secs": elapsed,
        "nothing_committed": sum(t.committed is None for t in trials),
    }))  # fmt: skip
    return 0 if correct == trials_n and corrupt == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
