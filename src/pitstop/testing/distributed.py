"""Run a function on N ranks of a gloo process group on this machine, for tests.

::

    from pitstop.testing.distributed import run_ranks

    def train(rank: int, world: int, root: str) -> float:   # module level (spawned)
        ckpt = pitstop.CheckpointManager(root)              # collective
        ...
        return loss

    losses = run_ranks(train, 2, root, timeout_secs=60)     # [loss of rank 0, of rank 1]

Each call gets its own TCPStore, served by the calling process on a port the system
picks (as torchrun's agent serves one: no interference between tests), ``timeout_secs`` bounds the process group's collectives and
the whole run (a hung rank is killed, and the error says which), every rank uses one
CPU thread. A rank that raises makes :class:`RankError` carry its traceback; a rank that
dies (``PITSTOP_KILL_AT``, SIGKILL) is reported with its exit code. ``env`` adds
environment variables to some ranks, e.g. ``{1: {"PITSTOP_KILL_AT": "persist.after_data"}}``.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RankError", "run_ranks"]


class RankError(RuntimeError):
    """Some ranks failed: ``failures`` maps each to its traceback or exit status."""

    def __init__(self, failures: dict[int, str], results: dict[int, Any]) -> None:
        self.failures, self.results = failures, results
        text = "\n".join(f"--- rank {r}:\n{why}" for r, why in sorted(failures.items()))
        super().__init__(f"rank(s) {sorted(failures)} failed:\n{text}")


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    workdir: str,
    port: int,
    timeout_secs: float,
    env: dict[str, str],
    args: tuple[Any, ...],
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(workdir, f"result-{rank}.pkl")
    try:
        timeout = datetime.timedelta(seconds=timeout_secs)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        try:
            value: Any = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:
        value = ("error", traceback.format_exc())
    with open(out + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(out + ".tmp", out)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_secs: float = 60.0,
    env: Mapping[int, Mapping[str, str]] | None = None,
    allow_failures: bool = False,
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks; their return values in rank
    order. Raises RankError if any failed (with ``allow_failures``: their entries are the
    RankError's ``failures`` texts instead)."""
    import torch.distributed as dist

    ctx = multiprocessing.get_context("spawn")
    workdir = tempfile.mkdtemp(prefix="pitstop-ranks-")
    server = dist.TCPStore(
        "127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_secs),
    )  # fmt: skip
    try:
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    fn,
                    r,
                    world,
                    workdir,
                    server.port,
                    timeout_secs,
                    dict((env or {}).get(r, {})),
                    args,
                ),
                name=f"pitstop-rank-{r}",
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_secs + 60  # start-up of torch in each child
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        failures: dict[int, str] = {}
        results: dict[int, Any] = {}
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                failures[r] = f"did not finish within {timeout_secs:g} s (killed)"
                continue
            path = os.path.join(workdir, f"result-{r}.pkl")
            if not os.path.exists(path):
                failures[r] = f"died with exit code {p.exitcode}"
                continue
            with open(path, "rb") as f:
                kind, value = pickle.load(f)
            if kind == "ok":
                results[r] = value
            else:
                failures[r] = value
        if failures and not allow_failures:
            raise RankError(failures, results)
        return [results[r] if r in results else failures[r] for r in range(world)]
    finally:
        del server
        shutil.rmtree(workdir, ignore_errors=True)
