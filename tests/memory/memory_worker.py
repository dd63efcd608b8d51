"""A training process for the memory-level tests, run as a subprocess.

    python memory_worker.py --root DIR --shm DIR --job TOKEN --steps T [--every N]
        [--kill-at K [--kill-group]] [--rollback-at A --rollback-to B] [--linger S]
        [--plain] [--digests FILE] [--final FILE]

A small model, Adam and ``pitstop.RNGState`` in the state; every step draws a random batch
(torch and Python ``random``), so a resume is bit-exact only if weights, optimizer state and
random streams all come back. With ``--plain`` it trains without checkpoints (the
uninterrupted reference). Otherwise it runs ``CheckpointManager([Memory(...), Local(root)],
policy=EveryN(every))``: it restores (printing one JSON line: the step restored, the level
that served, what was skipped, the digest of the restored state, the keeper's pid), trains
to ``--steps`` and closes. ``--kill-at K``: SIGKILL itself right after ``ckpt.step(K)``
returned (``--kill-group``: its whole process group, the keeper too). ``--digests``: one line
``step digest`` per completed step, appended. ``--final``: the final tensors (torch.save).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

import pitstop


def build(seed: int = 0) -> dict[str, Any]:
    """The state: the same bytes for the same seed in every process."""
    torch.manual_seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return {
        "model": model,
        "optimizer": opt,
        "rng": pitstop.RNGState(),
        "progress": {"step": 0, "timeline": 0},
    }


def train_step(state: dict[str, Any], step: int) -> None:
    """One step on a random batch (torch's and Python's generators both drawn)."""
    model, opt = state["model"], state["optimizer"]
    x = torch.randn(8, 16) * (1.0 + random.random())
    y = torch.randn(8, 4)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    state["progress"]["step"] = step


def tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state by name, the random streams included."""
    out = {f"model/{k}": v for k, v in state["model"].state_dict().items()}
    for i, s in state["optimizer"].state_dict()["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{i}/{k}"] = v
    out["rng/torch"] = torch.get_rng_state()
    out["rng/python"] = torch.tensor(random.getstate()[1], dtype=torch.int64)
    return out


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k, v in sorted(tensors(state).items()):
        h.update(k.encode())
        h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(json.dumps(state["progress"], sort_keys=True).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------- the tests' side
WORKER = os.path.abspath(__file__)


def reference(steps: int) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """The uninterrupted run in this process, without checkpoints: the digest of the state
    after every step, and its final tensors (copies)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker
    try:
        state = build()
        digests = {0: digest(state)}
        for step in range(1, steps + 1):
            train_step(state, step)
            digests[step] = digest(state)
        return digests, {k: v.clone() for k, v in tensors(state).items()}
    finally:
        torch.set_num_threads(threads)


def run(
    root: str,
    shm: str,
    job: str,
    steps: int,
    *extra: str,
    group: bool = False,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> tuple[int, list[dict[str, Any]], str]:
    """Run the worker: its exit code, the JSON lines it printed, its stderr. ``group``: in a
    session of its own (its process group: it and its keeper); ``env``: added to ours (less
    any PITSTOP_ variable)."""
    argv = ["--root", root, "--shm", shm, "--job", job, "--steps", str(steps), *extra]
    if os.environ.get("PITSTOP_TEST_NO_FORK"):  # a fresh interpreter per run
        full = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
        proc = subprocess.run(
            [sys.executable, WORKER, *argv], env=full | (env or {}), capture_output=True,
            text=True, timeout=timeout, start_new_session=group,
        )  # fmt: skip
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = _forker().run(argv, group=group, env=env or {}, timeout=timeout)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return code, lines, err


class Forker:
    """A process that imported torch and pitstop once and forks one worker per run (a run
    costs no interpreter start; the worker is still a process of its own: SIGKILLed, in a
    session of its own with ``group``). Its environment: ours without PITSTOP_ variables."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, "--serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True,
        )  # fmt: skip
        self.scratch = tempfile.mkdtemp(prefix="pitstop-worker-")
        self.runs = 0

    def run(
        self, argv: list[str], *, group: bool, env: dict[str, str], timeout: float
    ) -> tuple[int, str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.runs += 1
        out, err = (os.path.join(self.scratch, f"{self.runs}.{x}") for x in ("out", "err"))
        request = {"argv": argv, "group": group, "env": env, "out": out, "err": err}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self.proc.stdout.readline())["pid"]
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)  # the worker we asked for, by its id
            self.proc.stdout.readline()
            raise TimeoutError(f"the worker {argv} ran over {timeout} s")
        code = json.loads(self.proc.stdout.readline())["code"]
        with open(out) as f, open(err) as g:
            return code, f.read(), g.read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)
        shutil.rmtree(self.scratch, ignore_errors=True)


_FORKER: list[Forker] = []


def _forker() -> Forker:
    if not _FORKER:
        _FORKER.append(Forker())
        atexit.register(_FORKER[0].close)
    return _FORKER[0]


def serve() -> int:
    """``--serve``: fork a worker per request line (JSON: argv, group, env, out, err); answer
    its pid, then its exit code (negative: the signal that ended it)."""
    build()  # what a run imports lazily (the optimizer: torch._dynamo, seconds) is imported once
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                if req["group"]:
                    os.setsid()
                os.environ.update(req["env"])
                for fd, path in ((1, req["out"]), (2, req["err"])):
                    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(target, fd)
                    os.close(target)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                sys.argv = [WORKER, *req["argv"]]
                code = main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"code": code}), flush=True)
    return 0


def first(lines: list[dict[str, Any]], key: str) -> Any:
    """The value of ``key`` in the first line that has it (None: none)."""
    return next((x[key] for x in lines if key in x), None)


def wait_gone(pid: int | None, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` (a keeper: not our child) has exited."""
    deadline = time.monotonic() + timeout
    while pid is not None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.02)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"process {pid} still runs after {timeout} s")


def read_digests(path: str) -> list[tuple[int, str]]:
    """The (step, digest) lines a worker appended, in order."""
    with open(path) as f:
        return [(int(a), b) for a, b in (line.split() for line in f if " " in line)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-group", action="store_true")
    p.add_argument("--rollback-at", type=int, default=None)
    p.add_argument("--rollback-to", type=int, default=None)
    p.add_argument("--linger", type=float, default=30.0)
    p.add_argument("--step-secs", type=float, default=0.0, help="a step's compute time")
    p.add_argument("--kill-delay", type=float, default=0.0, help="secs from step() to the kill")
    p.add_argument("--settle", action="store_true", help="ckpt.wait() before the kill")
    p.add_argument("--no-keeper", action="store_true", help="Memory(keeper=False)")
    p.add_argument("--external", action="store_true", help="Memory(keeper='external')")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--digests", default=None)
    p.add_argument("--final", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    state = build()
    log = open(a.digests, "a") if a.digests else None

    def record(step: int) -> None:
        if log is not None:
            log.write(f"{step} {digest(state)}\n")
            log.flush()

    if a.plain:
        record(0)
        for step in range(1, a.steps + 1):
            train_step(state, step)
            record(step)
        if a.final:
            torch.save(tensors(state), a.final)
        return 0

    memory = pitstop.Memory(
        job=a.job, directory=a.shm, linger_secs=a.linger,
        keeper="external" if a.external else not a.no_keeper,
    )  # fmt: skip
    ckpt = pitstop.CheckpointManager(
        [memory, pitstop.Local(a.root, redundancy="single")], policy=pitstop.EveryN(a.every)
    )
    start = ckpt.restore(state) or 0
    last = ckpt.last_restore
    level = ckpt.hooks.levels.memory
    keeper = level.keeper.pid if level is not None and level.keeper is not None else None
    info = {
        "restored": start if last is not None else None,
        "level": last.level if last is not None else None,
        "skipped": [list(s) for s in last.skipped] if last is not None else [],
        "digest": digest(state),
        "keeper": keeper,
    }
    print(json.dumps(info), flush=True)
    step = start
    while step < a.steps:
        step += 1
        train_step(state, step)
        if a.step_secs:
            time.sleep(a.step_secs)
        ckpt.step(step, state)
        record(step)
        if keeper is None and level is not None and level.keeper is not None:
            keeper = level.keeper.pid  # started at the first save
            print(json.dumps({"keeper": keeper}), flush=True)
        if a.kill_at is not None and step == a.kill_at and a.rollback_at is None:
            if a.settle:  # the durable saves in flight are on disk (memory snapshots too)
                ckpt.wait()
            taken = [h.step for h in ckpt.history][-6:]  # the newest snapshots taken
            print(json.dumps({"taken": taken}), flush=True)
            time.sleep(a.kill_delay)  # the save's threads go on meanwhile
            if a.kill_group:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if a.rollback_at is not None and step == a.rollback_at:
            assert a.rollback_to is not None
            ckpt.wait()  # the durable save of the step rolled back to is committed
            step = ckpt.restore(state, step=a.rollback_to) or 0
            assert step == a.rollback_to, step
            state["progress"]["timeline"] += 1  # a new timeline: other data from here on
            random.random()
            torch.randn(3)
            a.rollback_at = None
    ckpt.close()
    if a.final:
        torch.save(tensors(state), a.final)
    print(json.dumps({"done": step, "steps": ckpt_steps(a.root)}), flush=True)
    return 0


def ckpt_steps(root: str) -> list[int]:
    with pitstop.CheckpointManager(root) as ckpt:
        return ckpt.steps()


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main())
