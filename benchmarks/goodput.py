"""Goodput under real failures: a training loop SIGKILLed at seeded exponential times.

    python benchmarks/goodput.py            # ~12-15 minutes (12 runs of 40 s + warm-ups)
    python benchmarks/goodput.py --quick    # under 3 minutes (a smoke test: 10 s runs, 3
                                            # failures, no YoungDaly, one k; every spare warms up
                                            # before the first run, DCP imported only by DCP's)

A small CPU training loop (an MLP + Adam, ~40 MB of state, one torch thread) runs in a
worker process for a fixed wall-clock time ``T`` while this supervisor SIGKILLs it at
failure times drawn from an exponential distribution (seeded: the same trace for every
contender) and restarts it at once; each incarnation resumes from the newest checkpoint
its method can read. At ``T`` the worker is told to stop: it reports the step it reached
and a digest of its state. Contenders, each in its own run of the same trace:

* ``none``: no checkpoints, no failures: the yardstick (goodput 1 by definition);
* pitstop ``ckpt.step`` with ``CheckFreq(0.02)`` (the default), ``YoungDaly(mtbf)`` (given
  the trace's MTBF) and ``EveryN(k)`` at the best k of a sweep;
* DCP ``async_save`` (the previous one waited for first) and ``torch.save`` + fsync
  (tmp + rename), each every k steps at the best k of the same sweep.

Goodput = steps reached at ``T`` / steps the yardstick reached at ``T``. Also reported:
checkpoints, work lost per failure (steps reached before the kill minus the step
resumed from), restart time (kill to the first step trained after the restore). A
restart takes a warm spare (a process that has imported torch and pitstop, the modules
pitstop imports lazily included, and built the model: imports take 3-15 s on this host),
one pre-warmed per failure of the trace; a replacement warms up at nice 19 beside the
training (on a cluster the spare is another machine). Every run's final state is checked
bit-exact against an uninterrupted run to the same step (a separate worker at the end,
hashing the state at those steps).

Beside each measurement: the simulator's prediction (``pitstop.sim.simulate``, what
``pitstop simulate`` runs) with what this run measured: its iteration time and the host's
speed through the run (per second, the quiet iterations over their mean: ``speed_trace``),
the contender's stall (plus its per-step loop work beyond the yardstick's, per checkpoint),
persist time (DCP's by a callback on its future, not when the loop next looks), slowdown
(the excess of iterations while a save is in flight over the quiet ones of the same second,
per checkpoint), each divided by the host's factor when it happened (the model scales
them back), each failure as it happened with its own restart
time (``restart_trace``), and, for the policies that decide on measured costs, what the
worker's own profiler measured one checkpoint to cost and its spread (``P`` lines:
``measured_cost_secs``, ``cost_noise_secs``). The prediction is the mean over 20
seeds, +- their standard deviation: in each, every kill moves within +-1.5 iterations of
its time (``trace_jitter_secs``: the model's clock is that far off the run's by then) and
the noisy policies draw other measurements. ``--dump FILE`` writes each run's timeline and
the model's events (of the exact trace).

This machine has 2 cores shared with other jobs: the figures are noisy (each contender is
one run, minutes apart from the others; a neighbour's burst moves one run, not all).
A run whose checkpoints fall within a fraction of a second of a kill is chaotic: a
1 % timing error moves a checkpoint to the other side of it, and the run by tens of steps
(the prediction's spread says how much; ``--dump`` shows it).
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH, LAYERS, BATCH = 768, 6, 128  # ~3.6 M parameters: ~43 MB with Adam's two moments


# --------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """One incarnation: restore, then train and checkpoint until SIGUSR1 (or a SIGKILL)."""
    stop = threading.Event()
    os.nice(args.nice)  # a replacement warms up at low priority: on a cluster, another machine
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    import hashlib

    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(LAYERS):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(WIDTH, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def train(step: int) -> float:
        g = torch.Generator().manual_seed(step)  # the data of a step depends on the step alone
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.item())

    def digest() -> str:
        h = hashlib.sha256()
        tensors = list(model.state_dict().values())
        for per_param in opt.state.values():
            tensors += [v for _, v in sorted(per_param.items()) if isinstance(v, torch.Tensor)]
        for t in tensors:
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    def say(*words: object) -> None:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()

    state: dict[str, Any] = {"model": model, "optimizer": opt}
    step = 0
    ckpt: Any = None
    if not args.no_dcp:  # a spare for DCP's run (all of them, but at --quick) imports it now
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import pitstop
    from pitstop.policy import CheckFreq, EveryN, YoungDaly

    _ = pitstop.CheckpointManager  # its modules are imported lazily: a warm spare has them
    say("W")  # a warm spare: imports done, model built; told what to run when needed
    words = sys.stdin.readline().split()
    if not words:
        return
    ordered = time.perf_counter()  # the restore's own time: from here to the "R" line
    with contextlib.suppress(PermissionError):  # taken: back to normal (needs root here)
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    args.worker, args.k, args.root, args.mtbf = words[0], int(words[1]), words[2], float(words[3])
    args.digests = words[4] if len(words) > 4 else ""
    kind, k, root = args.worker, args.k, args.root
    if kind in ("checkfreq", "youngdaly", "everyn"):
        policy = {
            "checkfreq": lambda: CheckFreq(0.02),
            "youngdaly": lambda: YoungDaly(mtbf_secs=args.mtbf),
            "everyn": lambda: EveryN(k),
        }[kind]()
        ckpt = pitstop.CheckpointManager(root, keep_last=2, policy=policy)
        step = ckpt.restore(state) or 0
    elif kind == "dcp":
        import torch.distributed.checkpoint as dcp  # imported before "W" in a DCP spare
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = sorted(
            (int(d[1:]) for d in os.listdir(root) if os.path.exists(f"{root}/{d}/.metadata")),
            reverse=True,
        )
        if done:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=f"{root}/s{done[0]}")
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            step = done[0]
    elif kind == "torchsave":
        path = f"{root}/ckpt.pt"
        if os.path.exists(path):
            saved = torch.load(path, weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            step = saved["step"]
    say("R", step, f"{time.perf_counter() - ordered:.6f}")
    if args.digests:  # the reference run: digests at the steps the contenders stopped at
        wanted = sorted({int(s) for s in args.digests.split(",")})
        for target in wanted:
            while step < target:
                step += 1
                train(step)
            say("D", step, digest())
        return

    pending: Any = None  # DCP: (future, step, started, [done at])
    pending_dirs: list[int] = []
    inflight: list[Any] = []  # pitstop: saves started and not yet seen done
    t2 = 0.0
    while not stop.is_set():
        step += 1
        gap = time.perf_counter() - t2 if t2 else 0.0  # the loop's own work after the last step
        t0 = time.perf_counter()
        busy = 0
        if ckpt is not None:
            busy = int(bool(ckpt.history) and not ckpt.history[-1].done())
        elif pending is not None:
            busy = int(not pending[0].done())
        loss = train(step)
        t1 = time.perf_counter()
        saved = 0
        if ckpt is not None:
            saved = int(bool(ckpt.step(step, state, loss=loss)))
        elif kind == "dcp" and step % k == 0:
            if pending is not None:
                pending[0].result()
            msd, osd = get_state_dict(model, opt)  # the keys dcp.load finds on restore
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/s{step}")
            fut = getattr(fut, "upload_completion", fut)
            # when it is done, as it happens (the loop only looks after each step: up to an
            # iteration later, and a kill in between finds the checkpoint there)
            done_at: list[float] = []
            begun = time.perf_counter()
            fut.add_done_callback(lambda _, at=done_at: at.append(time.perf_counter()))
            pending = (fut, step, begun, done_at)
            saved = 1
        elif kind == "torchsave" and step % k == 0:
            path = f"{root}/ckpt.pt"
            with open(path + ".tmp", "wb") as f:
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
            saved = 1
        t2 = time.perf_counter()
        if ckpt is not None:  # each commit said as it happens: a kill loses what is unsaid
            if saved:
                inflight.append(ckpt.history[-1])
                if kind != "everyn":  # the policy's interval, what its profiler measured
                    chosen = getattr(ckpt.policy, "interval", None)
                    chosen = getattr(ckpt.policy, "interval_secs", chosen) or 0
                    st = ckpt.stats()
                    up, low = st.checkpoint_cost_secs, st.checkpoint_cost_low_secs
                    say("P", step, chosen, st.checkpoints, st.iter_secs or 0.0,
                        -1 if up is None else up, -1 if low is None else low)  # fmt: skip
            for h in [h for h in inflight if h.done()]:
                inflight.remove(h)
                if h.committed:
                    say("C", h.step, f"{h.stats.total_secs - h.stats.stall_secs:.6f}")
        if pending is not None and pending[0].done():
            pending[0].result()
            done = pending[3][0] if pending[3] else time.perf_counter()
            # the persist's time, and how long before this line it ended
            say("C", pending[1], f"{done - pending[2]:.6f}", f"{time.perf_counter() - done:.6f}")
            pending_dirs.append(pending[1])
            pending = None
            for old in pending_dirs[:-2]:
                shutil.rmtree(f"{root}/s{old}", ignore_errors=True)
            pending_dirs = pending_dirs[-2:]
        say("S", step, f"{t1 - t0:.6f}", f"{t2 - t1:.6f}", busy, saved, f"{gap:.6f}")
    say("F", step, digest())
    os._exit(0)  # a save in flight is abandoned, as a kill would


# --------------------------------------------------------------------------- supervisor


@dataclass
class Run:
    name: str
    kind: str
    k: int = 0
    final_step: int = 0
    digest: str = ""
    exact: bool | None = None
    failures: int = 0
    lost_steps: list[int] = field(default_factory=list)
    restart_secs: list[float] = field(default_factory=list)
    restore_secs: list[float] = field(default_factory=list)  # of each restart: order to "R"
    checkpoints: int = 0
    train_secs: list[float] = field(default_factory=list)  # per step: quiet iterations
    busy_secs: list[float] = field(default_factory=list)  # iterations with a save in flight
    save_secs: list[float] = field(default_factory=list)  # the time ckpt.step / the save took
    persist_secs: list[float] = field(default_factory=list)
    other_secs: list[float] = field(default_factory=list)  # per step: the loop's own work
    kills: list[float] = field(default_factory=list)  # when each failure happened (s)
    seconds: float = 0.0  # the run's wall-clock time T
    timeline: list[dict[str, Any]] = field(default_factory=list)  # per incarnation (--dump)
    sim_events: list[tuple[float, str, int]] = field(default_factory=list)  # (secs, kind, step)
    goodput: float = 0.0
    adjusted: float = 0.0
    predicted: float | None = None
    predicted_sd: float | None = None  # over the measurement noise's seeds (NOISY policies)
    sim: dict[str, float] = field(default_factory=dict)  # the simulator's inputs

    @property
    def own_iter_secs(self) -> float:
        """This run's own iteration time: the mean of its iterations with no save in flight
        (the host's speed during this run, which drifts 2x between runs here; this includes
        iterations slowed by a spare warming up after a restart)."""
        return statistics.fmean(self.train_secs) if self.train_secs else float("nan")

    def row(self) -> dict[str, Any]:
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {
            "name": self.name, "k": self.k or None, "goodput": round(self.goodput, 4),
            "adjusted": round(self.adjusted, 4), "own_iter_secs": self.own_iter_secs,
            "predicted": None if self.predicted is None else round(self.predicted, 4),
            "predicted_sd": None if self.predicted_sd is None else round(self.predicted_sd, 4),
            "checkpoints": self.checkpoints, "failures": self.failures,
            "lost_steps_per_failure": mean(self.lost_steps),
            "restart_secs": mean(self.restart_secs), "restore_secs": mean(self.restore_secs),
            "final_step": self.final_step,
            "other_secs_per_step": mean(self.other_secs),
            "bit_exact": self.exact, "sim": self.sim,
        }  # fmt: skip


MAX_SECONDS = 3600.0  # one run's wall time: the benchmark runs a dozen of them
MAX_FAILURES = 32  # a trace's: each failure of each run restarts from a warm spare (~0.3 GB)
MAX_DRAWS = 10**6  # failures failure_trace may draw: seconds / mtbf at most this


def failure_trace(seconds: float, mtbf: float, seed: int) -> list[float]:
    """Exponential failure times in [0, seconds), mean gap ``mtbf``: both finite and > 0,
    and ``seconds / mtbf`` at most MAX_DRAWS (ValueError, naming them, otherwise)."""
    for name, value in (("seconds", seconds), ("mtbf", mtbf)):
        if not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"failure_trace: {name} must be a finite number > 0, got {value!r}")
    if seconds / mtbf > MAX_DRAWS:
        raise ValueError(
            f"failure_trace: seconds {seconds:g} / mtbf {mtbf:g} is {seconds / mtbf:.3g} "
            f"failures, more than the limit of {MAX_DRAWS:.0e}"
        )
    rng, t = random.Random(seed), 0.0
    out: list[float] = []
    while True:
        t += rng.expovariate(1.0 / mtbf)
        if t >= seconds:
            return out
        out.append(t)


class Incarnation:
    """One worker process and a thread reading its lines (each stamped on arrival)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        self.dcp = True  # it imports DCP before it is warm
        self.lines: list[tuple[float, list[str]]] = []
        self.warm = threading.Event()
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if not words:
                continue
            self.lines.append((time.perf_counter(), words))
            if words[0] == "W":
                self.warm.set()
            if words[0] == "R":
                self.ready.set()
            if words[0] in ("F", "D"):
                self.finished.set()
        self.finished.set()
        self.ready.set()
        self.warm.set()

    def go(self, order: str) -> float:
        """Restore and train (once warm): ``order`` is "kind k root mtbf [digests]"."""
        self.warm.wait(timeout=600)
        assert self.proc.stdin is not None
        self.proc.stdin.write(order + "\n")
        self.proc.stdin.flush()
        return time.perf_counter()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.thread.join(timeout=5)


class Pool:
    """Warm spares (a new Python process imports torch and pitstop for seconds, many on a
    busy host): a failed worker is replaced by a spare at once, and a new spare starts
    warming up beside the training (its CPU is part of what a restart costs here). With
    ``refill=False`` (``--quick``) every spare the benchmark needs warms up before the first
    run and none beside the training: no run waits for replacements to warm up after it."""

    def __init__(self, size: int, *, refill: bool = True, dcp: list[bool] | None = None) -> None:
        self.argv = [sys.executable, os.path.abspath(__file__), "--worker", "spare"]
        self.refill = refill
        # before any run: nice 0; a spare for a run known to be no DCP's skips its import
        self.spares = [self._new(d) for d in (dcp if dcp is not None else [True] * size)]

    def _new(self, dcp: bool, *extra: str) -> Incarnation:
        spare = Incarnation([*self.argv, *extra, *([] if dcp else ["--no-dcp"])])
        spare.dcp = dcp
        return spare

    def take(self, dcp: bool = True) -> Incarnation:
        """A spare for a DCP run (``dcp``) or another: one that imported DCP serves any."""
        fits = [s for s in self.spares if s.dcp == dcp] or [s for s in self.spares if s.dcp]
        if not fits:  # more taken than foreseen: one more, warming now
            fits = [self._new(dcp)]
            self.spares += fits
        self.spares.remove(fits[0])
        if self.refill:
            self.spares.append(self._new(True, "--nice", "19"))  # beside a run
        return fits[0]

    def close(self) -> None:
        for spare in self.spares:
            spare.kill()


def run_one(run: Run, args: argparse.Namespace, trace: list[float], root: str, pool: Pool) -> Run:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    run.seconds = args.seconds
    order = f"{run.kind} {run.k} {root} {args.mtbf}"
    first = pool.take(run.kind == "dcp")
    for spare in pool.spares:  # no spare warms up in the first seconds of a run
        with contextlib.suppress(OSError):  # no run beside it now: full speed (needs root)
            os.setpriority(os.PRIO_PROCESS, spare.proc.pid, 0)
        spare.warm.wait(timeout=600)
    first.go(order)
    first.ready.wait(timeout=600)  # the clock starts once the first incarnation trains
    start = time.perf_counter()
    incarnations: list[tuple[float, Incarnation]] = [(0.0, first)]
    for at in trace if run.kind != "none" else []:
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        born = time.perf_counter() - start  # the failure: restart and loss count from here
        incarnations[-1][1].kill()
        run.kills.append(born)
        incarnations.append((born, pool.take(run.kind == "dcp")))
        incarnations[-1][1].go(order)
    delay = start + args.seconds - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    last = incarnations[-1][1]
    last.ready.wait(timeout=600)
    last.proc.send_signal(signal.SIGUSR1)
    last.finished.wait(timeout=600)
    last.proc.wait(timeout=600)
    last.thread.join(timeout=5)
    # what each incarnation did
    reached_before = 0
    for i, (born, inc) in enumerate(incarnations):
        steps = [w for _, w in inc.lines if w[0] == "S"]
        restored = next((int(w[1]) for _, w in inc.lines if w[0] == "R"), None)
        if i > 0:
            run.failures += 1
            # kill to the first step trained after the restore (or to the end of this
            # incarnation, if it trained none: killed again, or stopped, while restoring)
            first_step = next((t for t, w in inc.lines if w[0] == "S"), None)
            if i + 1 < len(incarnations):  # killed at the next one's birth
                ended = start + incarnations[i + 1][0]
            else:  # stopped at T (the spare's "W" line predates its birth)
                ended = max([t for t, _ in inc.lines] + [start + born])
            run.restart_secs.append((first_step or ended) - start - born)
            run.restore_secs += [float(w[2]) for _, w in inc.lines if w[0] == "R"]
            if restored is not None:
                run.lost_steps.append(reached_before - restored)
        for w in steps:
            secs, save, busy, saved = float(w[2]), float(w[3]), int(w[4]), int(w[5])
            (run.busy_secs if busy else run.train_secs).append(secs)
            run.other_secs.append(float(w[6]) + (0.0 if saved else save))
            if saved:
                run.checkpoints += 1
                run.save_secs.append(save)
        stamped = [(t - start, w) for t, w in inc.lines if w[0] in "RSC"]
        run.timeline.append({
            "born": born, "restored": restored,
            "first_step": next((t for t, w in stamped if w[0] == "S"), None),
            "reached": int(steps[-1][1]) if steps else None,
            "last_step": next((t for t, w in reversed(stamped) if w[0] == "S"), None),
            "commits": [  # (when it was seen, its step)
                (round(t, 3), int(w[1])) for t, w in stamped if w[0] == "C"
            ],
            "persists": [  # (when it ended, its time)
                (round(t - (float(w[3]) if len(w) > 3 else 0.0), 3), float(w[2]))
                for t, w in stamped if w[0] == "C"
            ],
            "chosen": [  # (step, interval, commits, iter secs, cost estimate, its lower one)
                (int(w[1]), float(w[2]), int(w[3]), float(w[4]), float(w[5]), float(w[6]))
                for _, w in inc.lines if w[0] == "P"
            ],
            "saves": [(round(t, 3), int(w[1])) for t, w in stamped if w[0] == "S" and w[5] == "1"],
            "iters": [  # (start, training secs, a save in flight, its save's secs or 0): the
                # line comes at the iteration's end
                (t - float(w[2]) - float(w[3]), float(w[2]), int(w[4]), float(w[3]) * int(w[5]))
                for t, w in stamped if w[0] == "S"
            ],
        })  # fmt: skip
        run.persist_secs += [float(w[2]) for _, w in inc.lines if w[0] == "C"]
        if steps:
            reached_before = int(steps[-1][1])
        elif restored is not None:
            reached_before = restored
    final = next((w for _, w in last.lines if w[0] == "F"), None)
    if final is not None:
        run.final_step, run.digest = int(final[1]), final[2]
    return run


SPEED_BIN_SECS = 1.0
NOISY = ("checkfreq", "youngdaly")  # policies that decide on measured costs
JITTER_ITERS = 1.5  # how far (iterations) the model's clock may be off the run's at a kill


def speed_trace(run: Run, it: float) -> tuple[tuple[float, float], ...]:
    """The host's speed through the run, as the simulator's ``speed_trace``: per second of
    the run, the mean quiet iteration (no save in flight) started in it over ``it`` (a
    second with none: the one before). This host's speed drifts by 10-30 % within a run
    (other jobs, a spare warming up after a restart), and with constant iterations the model
    puts checkpoints on the wrong side of failures."""
    bins: dict[int, list[float]] = {}
    for inc in run.timeline:
        for t, secs, busy, _ in inc["iters"]:
            if not busy:
                bins.setdefault(int(t / SPEED_BIN_SECS), []).append(secs)
    out, last = [], 1.0
    for b in range(math.ceil(run.seconds / SPEED_BIN_SECS) + 1):
        last = statistics.fmean(bins[b]) / it if b in bins else last
        out.append((b * SPEED_BIN_SECS, last))
    return tuple(out)


def profiled_cost(run: Run, it: float) -> tuple[float, float] | None:
    """What the worker's own profiler measured one checkpoint to cost (the mean of its
    paired measurements, over the incarnations, each read at the newest save with a lower
    estimate known: (upper + lower) / 2, from ~commits - 1 pairs, its first save left out),
    in seconds of an iteration of ``it``; and their standard deviation (the standard error
    times sqrt(pairs)). None when no incarnation measured two pairs."""
    means: list[tuple[float, float, int]] = []  # (mean, sd, pairs) per incarnation
    for inc in run.timeline:
        known = [c for c in inc.get("chosen", []) if c[5] >= 0 and c[3] > 0]
        if known:
            _, _, commits, secs, up, low = known[-1]
            pairs = max(min(commits - 1, 16), 2)
            sd = (up - low) / 2 * math.sqrt(pairs)
            means.append(((up + low) / 2 * it / secs, sd * it / secs, pairs))
    if not means:
        return None
    n = sum(p for _, _, p in means)
    mean = sum(m * p for m, _, p in means) / n
    return mean, math.sqrt(sum(sd * sd * p for _, sd, p in means) / n)


def predict(run: Run, base: Run, args: argparse.Namespace, trace: list[float]) -> float:
    """The simulator's goodput for ``run`` with what this benchmark measured."""
    from pitstop.policy import CheckFreq, EveryN, YoungDaly
    from pitstop.sim import FailureModel, JobModel, simulate

    mean = lambda xs, d=0.0: sum(xs) / len(xs) if xs else d  # noqa: E731
    it = run.own_iter_secs  # compared with the adjusted goodput: this run's own speed
    speed = speed_trace(run, it)
    factor = lambda t: speed[min(int(t / SPEED_BIN_SECS), len(speed) - 1)][1]  # noqa: E731
    # the costs as the host's speed at factor 1 would take them (the model scales a save's
    # stall, slowdown and persist by the factor of its time, as it does the iterations):
    # slowdown: the iterations beside a save in flight over the quiet ones of the same second
    slowdown = sum(
        secs / factor(t) - it
        for inc in run.timeline for t, secs, busy, _ in inc["iters"] if busy
    ) / max(run.checkpoints, 1)  # fmt: skip
    # each checkpoint's cost as a profiler sees it: its save plus the excess of the busy
    # iterations after it; their spread is the noise the policy's estimate carries
    costs: list[float] = []
    saves: list[float] = []
    for inc in run.timeline:
        for t, secs, busy, save in inc["iters"]:
            if save:
                saves.append(save / factor(t + secs))
                costs.append(saves[-1])
            elif busy and costs:
                costs[-1] += secs / factor(t) - it
    noise = statistics.stdev(costs) if len(costs) > 1 else 0.0
    # what the run's own profiler measured instead, where it did (its policy decided on it):
    # it leaves out each process's first save and drops pairs across which the host changed
    # speed, and on this host it measures a checkpoint at a fraction of what the run pays
    profiled = profiled_cost(run, it) if run.kind in NOISY else None
    if profiled is not None:
        noise = profiled[1]
    persists = [p / factor(t - p) for inc in run.timeline for t, p in inc.get("persists", [])]
    # the loop's own per-step work beyond the yardstick's (ckpt.step's bookkeeping, DCP's
    # removal of old directories): a cost of checkpointing, charged per checkpoint
    extra = sum(run.other_secs) - len(run.other_secs) * mean(base.other_secs)
    stall = mean(saves) + max(extra, 0.0) / max(run.checkpoints, 1)
    policy = {
        "checkfreq": lambda: CheckFreq(0.02),
        "youngdaly": lambda: YoungDaly(mtbf_secs=args.mtbf),
    }.get(run.kind, lambda: EveryN(run.k))()
    job = JobModel(
        iter_secs=it, stall_secs=stall, persist_secs=mean(persists or run.persist_secs),
        slowdown_secs=max(slowdown, 0.0), iterations=10 * max(1, round(args.seconds / it)),
        restart_secs=max(mean(run.restart_secs, 3.0) - it, 0.0), max_in_flight=1,
        speed_trace=speed, cost_noise_secs=noise if run.kind in NOISY else 0.0,
        measured_cost_secs=None if profiled is None else profiled[0],
    )  # fmt: skip
    run.sim = {f: getattr(job, f) for f in ("iter_secs", "stall_secs", "persist_secs",
               "slowdown_secs", "restart_secs", "cost_noise_secs", "measured_cost_secs")}  # fmt: skip
    # the failures as they happened (a kill waits for the supervisor: a few ms after the trace's),
    # each with its own restart time as measured (they vary 2x: with their mean the model
    # drifted tenths of a second off the run and moved checkpoints across kills)
    restarts = tuple(max(r - it, 0.0) for r in run.restart_secs)
    kills = tuple(run.kills or trace)
    failures = FailureModel(mtbf_secs=args.mtbf, trace=kills, restart_trace=restarts)
    # a run of T seconds, as measured (goodput over a fixed job would dilute the failures)
    result = simulate(job, failures, policy, until_secs=args.seconds, record=True)
    run.sim_events = [(round(t, 3), kind, round(p / it)) for t, kind, p in result.events]
    # the model's clock is a few iterations off the run's by the time of a kill (speeds known
    # per second, costs as means): each kill within +-JITTER_ITERS iterations of its time; and
    # a policy deciding on noisy measurements takes other intervals in each seed. Where a
    # checkpoint falls within that of a kill the runs differ by its interval's worth of work:
    # the prediction is the mean over seeds, +- their spread
    failures = FailureModel(
        mtbf_secs=args.mtbf, trace=kills, restart_trace=restarts,
        trace_jitter_secs=JITTER_ITERS * it,
    )  # fmt: skip
    seeds = [simulate(job, failures, policy, seed=s, until_secs=args.seconds) for s in range(20)]
    run.predicted_sd = statistics.stdev(r.goodput for r in seeds)
    return statistics.fmean(r.goodput for r in seeds)


def _positive(high: float) -> Any:
    """An argparse type: a finite number > 0, at most ``high`` (argparse names the option)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:g}, got {text!r}")
        return value

    return parse


def _intervals(text: str) -> list[int]:
    """``--sweep``: a comma list of integers >= 1."""
    out = []
    for word in text.split(","):
        try:
            k = int(word)
        except ValueError:
            k = 0
        if k < 1:
            raise argparse.ArgumentTypeError(
                f"needs a comma list of integers >= 1, got {word.strip()!r} in {text!r}"
            )
        out.append(k)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--seconds",
        type=_positive(MAX_SECONDS),
        default=None,
        help=f"wall time of each run (default 40, 10 with --quick; at most {MAX_SECONDS:g})",
    )
    p.add_argument(
        "--mtbf",
        type=_positive(math.inf),
        default=None,
        help="mean time between failures (s; default 12, 5 with --quick)",
    )
    p.add_argument("--seed", type=int, default=26)
    p.add_argument(
        "--sweep",
        type=_intervals,
        default=None,
        help="intervals k (steps) of the fixed contenders: a comma list of integers >= 1",
    )
    p.add_argument("--root", default=None)
    p.add_argument("--only", default=None, help="contenders whose name contains this (and none)")
    p.add_argument("--dump", default=None, help="write each run's timeline and the sim's here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--digests", default="", help=argparse.SUPPRESS)
    p.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--no-dcp", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, HERE)
    from _common import json_line, log

    if args.seconds is None:  # 0 is refused by --seconds's type, not taken for the default
        args.seconds = 10.0 if args.quick else 40.0
    if args.mtbf is None:
        args.mtbf = 5.0 if args.quick else 12.0
    sweep = args.sweep or ([20] if args.quick else [10, 40, 160])
    try:
        trace = failure_trace(args.seconds, args.mtbf, args.seed)
    except ValueError as e:
        p.error(f"--seconds {args.seconds:g} with --mtbf {args.mtbf:g}: {e}")
    if len(trace) > MAX_FAILURES:
        p.error(
            f"--seconds {args.seconds:g} with --mtbf {args.mtbf:g}: {len(trace)} failures in the "
            f"trace, more than the limit of {MAX_FAILURES} (each restarts a run from a warm spare "
            "process that has imported torch, ~0.3 GB each): raise --mtbf or lower --seconds"
        )
    base_dir = args.root or tempfile.mkdtemp(prefix="pitstop-goodput-")
    log(
        f"T={args.seconds:.0f}s per run, MTBF {args.mtbf:.0f}s, trace {[round(t, 1) for t in trace]}"
    )
    runs = [Run("none", "none"), Run("pitstop CheckFreq(0.02)", "checkfreq")]
    if not args.quick:  # the quick table: pitstop's two policies against the two peers
        runs.append(Run(f"pitstop YoungDaly({args.mtbf:.0f}s)", "youngdaly"))
    for kind, label in (
        ("everyn", "pitstop EveryN"),
        ("dcp", "DCP async_save"),
        ("torchsave", "torch.save"),
    ):
        runs += [Run(f"{label}({k})", kind, k) for k in sweep]
    runs = [r for r in runs if r.kind == "none" or not args.only or args.only in r.name]
    # a warm spare for each failure of a run: on this host a spare warming up at low priority
    # beside the training and other jobs may take longer than a quick succession of failures
    if args.quick:  # every spare warm before the first run (~0.3 GB each): ~2 minutes in all
        plan = [r.kind == "dcp" for r in runs[1:] for _ in range(len(trace) + 1)]
        pool = Pool(len(plan) + 2, refill=False, dcp=[False, *plan, False])  # yardstick, ..., ref
    else:
        pool = Pool(max(3, len(trace) + 1))
    try:
        for r in runs:
            run_one(r, args, trace, os.path.join(base_dir, "ckpt"), pool)
            log(
                f"{r.name}: step {r.final_step}, {r.checkpoints} checkpoints, {r.failures} failures"
            )
        base = runs[0]
        for r in runs:
            r.goodput = r.final_step / max(base.final_step, 1)
            # the same, each run at its own speed: steps reached x own iteration time / T,
            # over the yardstick's (the host's speed moves 2x between runs minutes apart)
            r.adjusted = (r.final_step * r.own_iter_secs) / (base.final_step * base.own_iter_secs)
        ref = pool.take(False)  # bit-exact: one uninterrupted run to every step a contender reached
        ref.go(f"none 0 {base_dir} {args.mtbf} " + ",".join(str(r.final_step) for r in runs))
        ref.finished.wait(timeout=600)
        ref.proc.wait(timeout=600)
        ref.thread.join(timeout=5)
        digests = {int(w[1]): w[2] for _, w in ref.lines if w[0] == "D"}
        for r in runs:
            r.exact = digests.get(r.final_step) == r.digest if r.digest else False
            if r.kind != "none":
                r.predicted = predict(r, base, args, trace)
    finally:
        pool.close()
        if args.root is None:
            shutil.rmtree(base_dir, ignore_errors=True)
    best: dict[str, Run] = {}
    for r in runs[1:]:
        if r.kind not in best or r.adjusted > best[r.kind].adjusted:
            best[r.kind] = r
    print(f"{'contender':28s} {'goodput':>8s} {'adjusted':>8s} {'predicted':>12s} {'ckpts':>6s} {'fails':>5s} "
          f"{'lost/fail':>9s} {'restart':>8s} {'restore':>8s} {'exact':>6s}")  # fmt: skip
    for r in runs:
        row = r.row()
        star = "*" if best.get(r.kind) is r and r.kind in ("everyn", "dcp", "torchsave") else " "
        lost = row["lost_steps_per_failure"]
        pred = "" if r.predicted is None else f"{r.predicted:.3f}"
        pred += "" if r.predicted_sd is None else f"+-{r.predicted_sd:.3f}"
        rs, ro = row["restart_secs"], row["restore_secs"]
        print(f"{r.name + star:28s} {r.goodput:8.3f} {r.adjusted:8.3f} "
              f"{pred:>12s} {r.checkpoints:6d} "
              f"{r.failures:5d} {'' if lost is None else f'{lost:.1f}':>9s} "
              f"{'' if rs is None else f'{rs:.2f}s':>8s} "
              f"{'' if ro is None else f'{ro:.3f}s':>8s} {r.exact!s:>6s}")  # fmt: skip
    print(
        "* best of the sweep (adjusted). goodput = steps at T / steps of 'none' at T; adjusted: "
        "each run at its own mean quiet-iteration speed; predicted: the simulator, same trace and "
        "measured costs, to compare with adjusted; restart: kill to the first step trained, "
        "restore: of that, the restore (order received to state loaded). One run each, on a "
        "shared 2-core host"
    )
    result = {
        "seconds": args.seconds, "mtbf_secs": args.mtbf, "seed": args.seed, "failures": len(trace),
        "iter_secs": args.seconds / max(runs[0].final_step, 1),
        "runs": [r.row() for r in runs],
        "best": {k: v.name for k, v in best.items()},
        "all_exact": all(r.exact for r in runs),
    }  # fmt: skip
    log("done")
    print(json_line(result))
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(json_line({"trace": trace, "runs": [
                {**r.row(), "timeline": r.timeline, "sim_events": r.sim_events} for r in runs
            ]}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
