"""What ``pitstop crashtest`` asks of the training process it runs, through the environment.

``pitstop crashtest -- CMD`` runs the user's script three ways (to completion, killed, resumed)
and compares the results. Two environment variables (read by :mod:`pitstop.options`) reach
the :class:`CheckpointManager` of each run:

* ``PITSTOP_CRASHTEST_KILL_STEP=k``: :meth:`CrashProbe.reached` SIGKILLs the process at the
  first step ``>= k`` once a checkpoint has committed (no cleanup, like a node failure);
* ``PITSTOP_CRASHTEST_LOG=path``: one JSON line per save and per restore is appended, with
  a digest of every global random generator at that moment, whether the state holds an
  ``RNGState``, the loaders in the state that draw from the global generator, and the
  settings that make kernels non-deterministic. crashtest reads these lines to name the
  cause when the two runs end differently (the generators' states at the same step of the
  two runs agree exactly when nothing outside the state drew from them).

Call sequence (training thread): ``CrashProbe.from_env()`` once in the manager's
constructor (None when crashtest is not running it); ``saved(step, state)`` from
``async_save``; ``restored(step)`` after a restore; ``reached(step, committed)`` once per
training step, from ``CheckpointManager.step``/``reached``; at a clean exit, the last step
reached (``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from pitstop.log import get_logger
from pitstop.options import env_crashtest, env_rank
from pitstop.state.tree import join_key, numpy_module

__all__ = ["CrashProbe", "generator_digests"]

_log = get_logger("pitstop")
_MAX_DEPTH = 4  # how deep the state is searched for loaders and RNGState


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def generator_digests() -> dict[str, str]:
    """A digest of the state of each global random generator of this process."""
    out = {
        "torch": _digest(torch.get_rng_state().numpy().tobytes()),
        "python": _digest(repr(random.getstate()).encode()),
    }
    numpy = numpy_module()
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = _digest(
            numpy.asarray(keys).tobytes() + repr((name, pos, has_gauss, cached)).encode()
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        out["cuda"] = _digest(b"".join(s.numpy().tobytes() for s in states))
    return out


def _scan(state: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The key paths of the RNGStates in the state, and of the loaders in it that have no
    generator of their own (a DataLoader draws its base seed from the global one then)."""
    from pitstop.state.rng import RNGState

    rngs, loaders = [], []
    todo: list[tuple[str, Any, int]] = [(join_key("", k), v, 1) for k, v in state.items()]
    while todo:
        key, value, depth = todo.pop()
        if isinstance(value, RNGState):
            rngs.append(key)
        elif isinstance(value, torch.utils.data.DataLoader) and value.generator is None:
            loaders.append(key)
        elif isinstance(value, Mapping) and depth < _MAX_DEPTH:
            todo.extend((join_key(key, k), v, depth + 1) for k, v in value.items())
    return sorted(rngs), sorted(loaders)


class CrashProbe:
    """The kill step and the log of one process run by crashtest (see the module docstring)."""

    def __init__(self, kill_step: int | None, log_path: str | None) -> None:
        self.kill_step = kill_step
        self.log_path = log_path
        self.rank = env_rank()
        self.last_step: int | None = None
        atexit.register(self._end)  # a clean exit says how far training went
        if kill_step is not None:
            _log.warning(
                "PITSTOP_CRASHTEST_KILL_STEP=%d: this process will SIGKILL itself at step %d or "
                "later once a checkpoint has committed (pitstop crashtest sets it; unset it "
                "otherwise)", kill_step, kill_step,
            )  # fmt: skip

    @classmethod
    def from_env(cls) -> CrashProbe | None:
        kill_step, log_path = env_crashtest()
        if kill_step is None and log_path is None:
            return None
        return cls(kill_step, log_path)

    def reached(self, step: int, committed: bool) -> None:
        """Training finished ``step``: die here if crashtest asked for it."""
        self.last_step = step if self.last_step is None else max(step, self.last_step)
        if self.kill_step is not None and committed and step >= self.kill_step:
            self._write({"event": "kill", "step": step})
            print(f"pitstop crashtest: SIGKILL at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def saved(self, step: int, state: Mapping[str, Any]) -> None:
        rngs, loaders = _scan(state)
        self._write(
            {
                "event": "save", "step": step, "generators": generator_digests(),
                "rng_keys": rngs, "loaders_without_generator": loaders,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                "threads": torch.get_num_threads(),
            }
        )  # fmt: skip

    def restored(self, step: int) -> None:
        self._write({"event": "restore", "step": step, "generators": generator_digests()})

    def _end(self) -> None:
        if self.last_step is not None:
            self._write({"event": "end", "step": self.last_step})

    def _write(self, record: dict[str, Any]) -> None:
        if self.log_path is None:
            return
        record.update(rank=self.rank, pid=os.getpid())
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)  # one write with O_APPEND: lines of ranks do not interleave
            finally:
                os.close(fd)
        except OSError as e:  # a diagnostic log never stops training
            _log.warning(
                "cannot append to PITSTOP_CRASHTEST_LOG=%s (%s); crashtest's log is off",
                self.log_path, e.strerror or e,
            )  # fmt: skip
            self.log_path = None
