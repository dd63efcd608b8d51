"""What ``pitstop crashtest`` asks of the training process it runs, through the environment.

``pitstop crashtest -- CMD`` runs the user's script three ways (to completion, killed, resumed)
and compares the results. Two environment variables (read by :mod:`pitstop.options`) reach
the :class:`CheckpointManager` of each run:

* ``PITSTOP_CRASHTEST_KILL_STEP=k``: the resume point. The policy's decision at step ``k``
  is made a yes (:meth:`CrashProbe.resume_point` wraps the policy), and at the first step
  after the first checkpoint this process started at a step ``>= k``, :meth:`CrashProbe.reached`
  waits until every checkpoint it started has committed and SIGKILLs the process (no
  cleanup, like a node failure): the next run resumes exactly there. A script that saves
  by itself (``save``/``async_save`` and ``reached``) resumes from its first save ``>= k``.
* ``PITSTOP_CRASHTEST_LOG=path``: one JSON line per event is appended: the start (when the
  manager is built), each save, restore and training step, the kill, the end (a clean
  exit). All but the kill carry a digest of every global random generator at that moment
  (steps: torch's and CUDA's, which are cheap); steps also the epoch of the data loader in
  the state (and whether it began with the step), from the first step when it was reached
  by ``ckpt.step(step, state)``, else from the first save; saves also whether the state
  holds an ``RNGState``, the loaders in the state that draw from the global generator, the
  settings that make kernels non-deterministic, the epoch, and where the save was made: the
  line, and the chain of callers from it outwards (a framework's saves all reach pitstop
  from one line of its own; the chain tells its callbacks' hooks apart).
  crashtest reads these lines to choose resume points and to name the cause when the runs
  end differently (the generators' states at the same step of two runs agree exactly when
  nothing outside the state drew from them).

Call sequence (training thread): ``CrashProbe.from_env(newest)`` once in the manager's
constructor (None when crashtest is not running it; ``newest()`` is the newest committed
step), then ``resume_point(policy)``; ``saved(step, state)`` from ``async_save``;
``restored(step)`` after a restore; ``reached(step, committed)`` once per training step,
from ``CheckpointManager.step``/``reached``; at a clean exit, the last step reached
(``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from pitstop.log import get_logger
from pitstop.options import env_crashtest, env_rank
from pitstop.state.tree import join_key, numpy_module

if TYPE_CHECKING:
    from pitstop.policy import CheckpointPolicy, PolicyContext

__all__ = ["CrashProbe", "generator_digests"]

_log = get_logger("pitstop")
_MAX_DEPTH = 4  # how deep the state is searched for loaders and RNGState
_COMMIT_WAIT_SECS = 120.0  # how long the kill waits for the resume point's commit
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STACK_FRAMES = 40  # callers of a save recorded, at most (Lightning's: about 20 to the script)


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def generator_digests(*, host: bool = True) -> dict[str, str]:
    """A digest of the state of each global random generator of this process (``host=False``:
    torch's and CUDA's only, cheap enough for every step; Python's and NumPy's cost about a
    tenth of a millisecond each)."""
    out = {"torch": _digest(torch.get_rng_state().numpy().tobytes())}
    numpy = numpy_module() if host else None
    if host:
        out["python"] = _digest(repr(random.getstate()).encode())
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = _digest(
            numpy.asarray(keys).tobytes() + repr((name, pos, has_gauss, cached)).encode()
        )
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        out["cuda"] = _digest(b"".join(s.numpy().tobytes() for s in states))
    return out


def _scan(state: Mapping[str, Any]) -> tuple[list[str], list[str], Any]:
    """The key paths of the RNGStates in the state, of the loaders in it that have no
    generator of their own (a DataLoader draws its base seed from the global one then), and
    the loader whose epoch is followed (the first by key that has one; None if none)."""
    from pitstop.state.rng import RNGState

    rngs, loaders, epochs = [], [], []
    todo: list[tuple[str, Any, int]] = [(join_key("", k), v, 1) for k, v in state.items()]
    while todo:
        key, value, depth = todo.pop()
        if isinstance(value, RNGState):
            rngs.append(key)
        elif isinstance(value, Mapping):
            if depth < _MAX_DEPTH:
                todo.extend((join_key(key, k), v, depth + 1) for k, v in value.items())
            continue
        if isinstance(value, torch.utils.data.DataLoader) and value.generator is None:
            loaders.append(key)
        if _epoch(value) is not None:
            epochs.append((key, value))
    return sorted(rngs), sorted(loaders), min(epochs, key=lambda e: e[0])[1] if epochs else None


def _epoch(loader: Any) -> int | None:
    """The epoch a loader is in: its own ``epoch`` (``pitstop.ResumableLoader``), or its
    sampler's (``DistributedSampler``, ``ResumableSampler``), directly or under a batch
    sampler. None for anything else."""
    for owner in (loader, getattr(loader, "sampler", None),
                  getattr(getattr(loader, "batch_sampler", None), "sampler", None)):  # fmt: skip
        try:
            epoch = getattr(owner, "epoch", None) if owner is not None else None
        except Exception:  # a property that fails is no epoch
            epoch = None
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            return epoch
    return None


def _site() -> dict[str, Any]:
    """Where the save being made was asked for: the pitstop call the script made (``step``
    for the policy, ``save``, ``save_final``, an integration's hook), the line of the script
    (or library) that made it, and the chain of callers from that line outwards (``stack``:
    ``[file, line, function]``, at most :data:`_STACK_FRAMES`). A framework writes every
    checkpoint from one line of its own (a Lightning callback's saves all reach pitstop from
    its strategy's ``save_checkpoint``): the chain tells its saves from two points of its
    loop apart, and a script's helper that saves from the places that call it."""
    frame = sys._getframe(1)
    via = None
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        via, frame = frame.f_code.co_name, frame.f_back  # type: ignore[assignment]
    if frame is None:
        return {"via": via}
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    stack: list[list[Any]] = []
    while frame is not None and len(stack) < _STACK_FRAMES:
        code = frame.f_code
        stack.append([code.co_filename, frame.f_lineno, getattr(code, "co_qualname", code.co_name)])
        frame = frame.f_back  # type: ignore[assignment]
    return {"via": via, "site": site, "stack": stack}


class _ResumePoint:
    """The script's policy, but for a yes at crashtest's resume point (once, at the first
    step at or after it that the policy is asked about). Everything else is the policy's."""

    def __init__(self, policy: CheckpointPolicy, step: int) -> None:
        self.policy, self.step, self.done = policy, step, False

    def decide(self, ctx: PolicyContext) -> bool:
        decided = bool(self.policy.decide(ctx))  # the policy sees every step, as without us
        if not self.done and ctx.step >= self.step:
            self.done = True
            return True
        return decided

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)

    def __repr__(self) -> str:
        return repr(self.policy)


class CrashProbe:
    """The kill step and the log of one process run by crashtest (see the module docstring)."""

    def __init__(
        self,
        kill_step: int | None,
        log_path: str | None,
        newest: Callable[[], int | None] | None = None,
    ) -> None:
        self.kill_step = kill_step
        self.log_path = log_path
        self.newest = newest  # the newest committed step; None: do not wait for commits
        self.rank = env_rank()
        self.last_step: int | None = None
        self.saves: list[int] = []  # the steps this process started to save
        self._loader: Any = None  # the data loader whose epoch is followed
        self._epoch: int | None = None
        atexit.register(self._end)  # a clean exit says how far training went
        if kill_step is not None:
            _log.warning(
                "PITSTOP_CRASHTEST_KILL_STEP=%d: this process will checkpoint step %d and "
                "SIGKILL itself at the next step once that checkpoint has committed (pitstop "
                "crashtest sets it; unset it otherwise)", kill_step, kill_step,
            )  # fmt: skip
        self._write({"event": "start", "step": 0, "generators": generator_digests()})

    @classmethod
    def from_env(cls, newest: Callable[[], int | None] | None = None) -> CrashProbe | None:
        kill_step, log_path = env_crashtest()
        if kill_step is None and log_path is None:
            return None
        return cls(kill_step, log_path, newest)

    def resume_point(self, policy: CheckpointPolicy) -> CheckpointPolicy:
        """``policy``, saying yes at the kill step too (the resume point is a checkpoint)."""
        return policy if self.kill_step is None else _ResumePoint(policy, self.kill_step)

    def reached(self, step: int, committed: bool, state: Mapping[str, Any] | None = None) -> None:
        """Training finished ``step``: die here if crashtest asked for it (``committed``:
        whether any checkpoint is committed; the kill waits for its own resume point).
        ``state``: the state of ``ckpt.step(step, state)`` (None from ``hooks.reached``): at
        the first step of this process the probe follows its loader's epoch from then on,
        not only from the first save."""
        if self.last_step is None and self._loader is None and state is not None:
            self._follow(state)
        self.last_step = step if self.last_step is None else max(step, self.last_step)
        self._mark(step)
        due = [s for s in self.saves if self.kill_step is not None and s >= self.kill_step]
        if not due or step <= due[0]:
            return
        resume = max(self.saves)
        self._wait_commit(resume)
        self._write({"event": "kill", "step": step, "resume": resume})
        print(
            f"pitstop crashtest: the checkpoint of step {resume} committed, SIGKILL at step {step}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)

    def _wait_commit(self, step: int) -> None:
        """Until ``step`` (this process's newest save) has committed: the kill must leave it."""
        if self.newest is None:
            return
        deadline = time.monotonic() + _COMMIT_WAIT_SECS
        while time.monotonic() < deadline:
            newest = self.newest()
            if newest is not None and newest >= step:
                return
            time.sleep(0.005)
        _log.warning(
            "the checkpoint of step %d did not commit within %.0f s; killing anyway",
            step, _COMMIT_WAIT_SECS, phase="commit",
        )  # fmt: skip

    def _mark(self, step: int) -> None:
        """A record of the generators at the end of ``step`` (and the loader's epoch, and
        whether it began with this step): where two runs' random streams part is found
        to the step, and crashtest learns where the epochs begin."""
        if self.log_path is None:
            return
        digests = generator_digests(host=False)
        record: dict[str, Any] = {"event": "step", "step": step, "generators": digests}
        epoch = _epoch(self._loader) if self._loader is not None else None
        if epoch is not None:
            record.update(epoch=epoch, epoch_start=self._epoch is not None and epoch != self._epoch)
            self._epoch = epoch
        self._write(record)

    def _follow(self, state: Mapping[str, Any] | None) -> None:
        """Follow the epoch of the loader in ``state`` from now on (if it has one)."""
        loader = _scan(state)[2] if state is not None else None
        if loader is not None:
            self._loader, self._epoch = loader, _epoch(loader)

    def saved(self, step: int, state: Mapping[str, Any]) -> None:
        self.saves.append(step)
        rngs, loaders, loader = _scan(state)
        if self._loader is None and loader is not None:
            self._loader, self._epoch = loader, _epoch(loader)
        self._write(
            {
                "event": "save", "step": step, "generators": generator_digests(),
                "rng_keys": rngs, "loaders_without_generator": loaders,
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
                "threads": torch.get_num_threads(),
                "epoch": _epoch(loader) if loader is not None else None, **_site(),
            }
        )  # fmt: skip

    def restored(self, step: int) -> None:
        self._write({"event": "restore", "step": step, "generators": generator_digests()})

    def _end(self) -> None:
        if self.last_step is not None:
            self._write({"event": "end", "step": self.last_step, "generators": generator_digests()})

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
