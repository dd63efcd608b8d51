from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))


class Net(nn.Module):
    """Linear + BatchNorm + a tied output layer: buffers, parameters and sharing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(torch.relu(self.fc(self.embed(idx)))))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 10, (16,), generator=g)
    loss = nn.functional.cross_entropy(model(idx), idx)
    opt.zero_grad()
    loss.backward()
    opt.step()


def launcher_keeper(root: str, shm: str, job: str, *extra: str) -> subprocess.Popen[str]:
    """``pitstop keeper ROOT --job JOB --shm-dir SHM ...`` as a launcher starts it (no
    ``PITSTOP_`` variables), once it watches the job."""
    from pitstop.levels.keeper_watch import external_keeper

    env = {k: v for k, v in os.environ.items() if not k.startswith("PITSTOP_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pitstop.cli.main import main; "
         "sys.exit(main(sys.argv[1:]))", "keeper", root, "--job", job, "--shm-dir", shm,
         *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not external_keeper(shm, job):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return proc


def flip_byte(path: str, offset: int) -> None:
    """Damage one byte of ``path`` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def make_state(seed: int = 0, steps: int = 1) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(steps):
        train_step(model, opt, seed * 1000 + i)
        sched.step()
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "extra": {"epoch": steps, "tag": "run"},
    }


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of a state (through state_dict), cloned, by key path."""
    out: dict[str, torch.Tensor] = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            out[key] = obj.detach().clone()
        elif hasattr(obj, "state_dict") and not isinstance(obj, dict):
            walk(obj.state_dict(), key)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")

    walk(state, "")
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def root(tmp_path: Any) -> str:
    return str(tmp_path / "ckpts")


class AheadRuns:
    """Runs of subprocesses (``pitstop crashtest`` of a script) started ahead of the tests
    that read them, ``workers`` at a time: while a test waits on one run (one process on one
    core), the next is already under way on the other core. Each test still asserts on its
    own run. A run is named by a key; ``run(key)`` does it (in a worker thread, so it must
    only start subprocesses and return their results). Runs are started in the order of the
    selected tests that declared them (:func:`uses_runs`); one asked for that was not
    declared starts when asked. ``alone()`` waits until no run is under way (for a test
    whose own processes must not share the machine, e.g. gloo)."""

    def __init__(self, run: Callable[[Any], Any], workers: int = 2) -> None:
        self._run = run
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ahead")
        self._futures: dict[Any, Future[Any]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_module(cls, request: Any, run: Callable[[Any], Any]) -> AheadRuns:
        """The runs declared by the selected tests of ``request``'s module, started."""
        workers = max(1, min(2, len(os.sched_getaffinity(0))))
        runs = cls(run, workers)
        for item in request.session.items:
            if getattr(item, "module", None) is not request.module:
                continue
            declared = getattr(getattr(item, "function", None), "ahead_runs", ())
            params = item.callspec.params if hasattr(item, "callspec") else {}
            for key in declared(params) if callable(declared) else declared:
                runs.start(key)
        return runs

    def start(self, key: Any) -> Future[Any]:
        with self._lock:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._run, key)
            return self._futures[key]

    def result(self, key: Any) -> Any:
        return self.start(key).result()

    def alone(self) -> None:
        """Until every run started is done (a failed one fails the test that reads it)."""
        with self._lock:
            futures = list(self._futures.values())
        for f in futures:
            f.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def uses_runs(*keys: Any, of: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """Declare the :class:`AheadRuns` keys a test reads (``of``: from its parameters)."""

    def mark(fn: Any) -> Any:
        fn.ahead_runs = of if of is not None else keys
        return fn

    return mark
