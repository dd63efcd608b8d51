"""Hugging Face ``Trainer``: pitstop checkpoints of a Trainer run, and an exact resume.

::

    from pitstop.integrations import hf

    ckpt = hf.PitstopCallback("ckpts", every=100, keep_last=3)   # one root per run
    args = TrainingArguments(output_dir="ckpts/hf", save_strategy="no", ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ckpt])
    hf.train(trainer)     # instead of trainer.train(): resumes from the root's newest checkpoint

The seam is the Trainer's own resume path: a callback alone cannot resume a Trainer, which
computes the epochs and batches to skip from ``resume_from_checkpoint``'s
``trainer_state.json`` before any callback runs, and creates the optimizer and scheduler
inside ``train()``. :func:`train` passes a directory holding only the checkpoint's
``trainer_state.json`` and, for the call, replaces ``_load_from_checkpoint`` (no weights to
load there) and ``_load_rng_state`` (the checkpoint's generators, applied where the Trainer
applies its own: after drawing the skipped batches) on the instance. The Trainer's optimizer
and scheduler loaders find no files there. Everything else is the callback.

Call sequence (the training thread; every rank under torchrun, at the same steps)::

    hf.train(trainer)
      PitstopCallback.open         manager on the root; partial restore of the newest
                                   checkpoint's Trainer state and generators
      trainer.train(resume_from_checkpoint=<dir with trainer_state.json>)
        Trainer                    TrainerState, epochs / batches to skip, optimizer, scheduler
        on_train_begin             restore everything in place; check the data position
        [Trainer._load_rng_state]  the checkpoint's generators again, after the skipped batches
        on_step_end(k)             step k done (optimizer stepped, global_step = k)
        (Trainer: log, evaluate step k)
        on_step_begin / on_epoch_begin   step k's checkpoint point: manager.step(k, state)
                                   (the policy may async_save; crashtest's reached(k))
        on_epoch_end (stopping) / on_train_end   the last step: reached(N), async_save(N)
        on_train_end               wait for saves in flight; a failed one's error is raised
      PitstopCallback.close        the manager is closed

Step k is checkpointed at the start of step k+1 because a resumed Trainer continues there:
step k's logging and evaluation are done (the loss accumulators, and the generators an
evaluation drew from, are saved as the continuation sees them) and the Trainer re-applies
the generators at that very point. Unsupported: DeepSpeed, FSDP, ``ignore_data_skip``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import torch

from pitstop.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MissingExtraError,
    StateMismatchError,
    UnsupportedSetupError,
)
from pitstop.log import get_logger
from pitstop.loop import StepResult
from pitstop.manager import CheckpointManager
from pitstop.options import SaveOptions
from pitstop.policy import CheckpointPolicy, EveryN, RetentionPolicy
from pitstop.state.rng import RNGState
from pitstop.state.tree import hookable_optimizer
from pitstop.storage.base import Storage

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import TrainOutput, has_length
    from transformers.training_args import TrainingArguments
except ImportError as e:  # pragma: no cover - exercised in a subprocess without transformers
    raise MissingExtraError(
        f"pitstop.integrations.hf needs transformers ({e}): pip install 'pitstop[hf]'"
    ) from e

__all__ = ["PitstopCallback", "train"]

_log = get_logger("pitstop.integrations.hf")

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_SEAM = ("_load_from_checkpoint", "_load_rng_state")  # Trainer methods replaced while resuming
_WALL_CLOCK = ("_runtime", "_per_second")  # log history keys of transformers' speed_metrics
_Args: TypeAlias = TrainingArguments  # the hooks' signatures, kept on one line
_State: TypeAlias = TrainerState
_Control: TypeAlias = TrainerControl


class _TrainerRNG(RNGState):
    """RNGState that keeps what it loaded, so the Trainer's resume point can apply it again."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.loaded = state

    def reapply(self) -> None:
        if self.loaded is not None:
            super().load_state_dict(self.loaded)


class _Holder:
    """A Stateful that only keeps what a (partial) restore gives it."""

    def __init__(self) -> None:
        self.value: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state


def _trainer_state_json(trainer: Trainer) -> str:
    """``trainer_state.json`` as ``Trainer._save_checkpoint`` writes it, with the states of the
    callbacks that export one taken now (the trainer's own state is not changed), and without
    the wall-clock measurements of the log history (``eval_runtime``, ``*_per_second``): they
    differ between any two runs, so a resumed run's checkpoint could never equal a clean one's."""
    exportable = [
        cb
        for cb in [*trainer.callback_handler.callbacks, trainer.control]
        if isinstance(cb, ExportableState)
    ]
    saved = dataclasses.asdict(trainer.state)
    saved["stateful_callbacks"] = TrainerState(
        stateful_callbacks=exportable  # type: ignore[arg-type]
    ).stateful_callbacks
    saved["log_history"] = [
        {k: v for k, v in entry.items() if not k.endswith(_WALL_CLOCK)}
        for entry in saved.get("log_history") or []
    ]
    return json.dumps(saved, indent=2, sort_keys=True) + "\n"


class _TrainerProgress:
    """The Trainer's progress: ``global_step``, ``epoch``, the whole TrainerState (JSON text:
    log history, flos, best metric, callback states) and the loss accumulators of logging."""

    _LOSS: ClassVar[dict[str, str]] = {
        "total": "_total_loss_scalar", "last_logged": "_globalstep_last_logged",
        "initial_step": "_initial_global_step",  # train_loss averages the whole run's steps
    }  # fmt: skip

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        loss: dict[str, Any] = {k: getattr(t, a) for k, a in self._LOSS.items() if hasattr(t, a)}
        if isinstance(getattr(t, "_tr_loss", None), torch.Tensor):
            loss["tr_loss"] = float(t._tr_loss.item())  # a float32 is exact as a double
        loss["flos"] = float(getattr(t, "current_flos", 0.0))
        return {
            "global_step": t.state.global_step, "epoch": t.state.epoch,
            "state": _trainer_state_json(t), "loss": loss,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """on_train_begin: the TrainerState came from trainer_state.json already; check it and
        put back the loss accumulators (the next logged loss averages the same steps)."""
        t = self.trainer
        if state["global_step"] != t.state.global_step:
            raise StateMismatchError(
                f"the Trainer resumed at global_step {t.state.global_step} but the checkpoint "
                f"is of global_step {state['global_step']}",
                step=state["global_step"], phase="restore",
            )  # fmt: skip
        loss = state.get("loss") or {}
        for key, attr in self._LOSS.items():
            if key in loss and hasattr(t, attr):
                setattr(t, attr, loss[key])
        if "tr_loss" in loss and isinstance(getattr(t, "_tr_loss", None), torch.Tensor):
            t._tr_loss.fill_(loss["tr_loss"])
        if "flos" in loss:
            t.current_flos = loss["flos"]


class _DataPosition:
    """Where the data stands: the epoch and the batches of it consumed, with what fixes the
    order (batches per epoch, gradient accumulation, the sampler's seed). The Trainer's data
    order is a function of (seed, epoch) and it skips to the position itself; restoring this
    checks that the resumed Trainer skips to the same place."""

    def __init__(self, trainer: Trainer, loader: Any) -> None:
        self.trainer = trainer
        self.batches_per_epoch = len(loader) if loader is not None and has_length(loader) else -1

    def position(self, global_step: int) -> dict[str, Any]:
        """What ``Trainer._init_training_state`` computes for ``global_step``."""
        args, n = self.trainer.args, self.batches_per_epoch
        gas = args.gradient_accumulation_steps
        per_epoch = max(n // gas + int(n % gas > 0) if n >= 0 else self.trainer.state.max_steps, 1)
        seed = args.data_seed if args.data_seed is not None else args.seed
        return {
            "global_step": global_step, "epoch": global_step // per_epoch,
            "batches": (global_step % per_epoch) * gas, "batches_per_epoch": n,
            "gradient_accumulation_steps": gas, "seed": seed,
            "world_size": args.world_size,
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return self.position(self.trainer.state.global_step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = self.position(int(state["global_step"]))
        differ = [k for k in now if k in state and now[k] != state[k]]
        if differ:
            was, will = (", ".join(f"{k}={p[k]}" for k in differ) for p in (state, now))
            raise StateMismatchError(
                f"data position: the checkpoint was taken at batch {state['batches']} of epoch "
                f"{state['epoch']} ({was}), but this Trainer would resume at batch "
                f"{now['batches']} of epoch {now['epoch']} ({will}): the data set, batch size, "
                "gradient accumulation, seed or world size changed, so the data order would "
                "differ from the interrupted run",
                step=int(state["global_step"]), phase="restore",
            )  # fmt: skip


@dataclass
class _Resume:
    """The checkpoint a run resumes from, as the partial restore before ``train()`` saw it."""

    step: int
    trainer: dict[str, Any]
    data: dict[str, Any] | None = None

    @property
    def trainer_state(self) -> dict[str, Any]:
        return json.loads(self.trainer["state"])


class PitstopCallback(TrainerCallback):
    """Checkpoints a Trainer run with pitstop; run it with :func:`train`, which resumes.

    ``root``: the run's checkpoint directory (or a :class:`~pitstop.storage.Storage`);
    ``pitstop ls ROOT`` lists it. ``every=k`` checkpoints every k optimizer steps, the
    Trainer's ``global_step`` (deterministic: a crashed and a clean run save the same steps);
    without it, ``policy=`` decides, by default ``CheckFreq``: as often as the measured
    overhead stays under 2 %. The last step is always saved. ``keep_last``, ``retention``
    and ``options`` go to the :class:`~pitstop.CheckpointManager`; ``manager`` is it while
    a :func:`train` call runs. Set ``TrainingArguments(save_strategy="no")``: the Trainer's
    own checkpoints are written synchronously, and a resume uses pitstop's.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        every: int | None = None,
        *,
        policy: CheckpointPolicy | None = None,
        keep_last: int | None = None,
        retention: RetentionPolicy | None = None,
        options: SaveOptions | None = None,
    ) -> None:
        if every is not None and every < 1:
            raise ValueError(f"PitstopCallback: every must be >= 1, got {every}")
        if every is not None and policy is not None:
            raise ValueError("PitstopCallback: give every= or policy=, not both")
        self.root = root
        self.every = every
        self.policy = EveryN(every) if every is not None else policy
        self.keep_last, self.retention, self.options = keep_last, retention, options
        self.manager: CheckpointManager | None = None
        self._trainer: Trainer | None = None
        self._resume: _Resume | None = None
        self._rng = _TrainerRNG()
        self._state: dict[str, Any] | None = None
        self._due: int | None = None  # a finished step whose checkpoint point is still to come
        self._saved: int | None = None  # the newest step a save was started for
        self._loss: float | None = None

    def __repr__(self) -> str:
        return f"PitstopCallback({self.root!r}, every={self.every!r})"

    # ------------------------------------------------------------------ run lifecycle
    def open(self, trainer: Trainer) -> _Resume | None:
        """Before ``trainer.train()`` (:func:`train` calls it): open the manager and read the
        newest checkpoint's Trainer state and generators (None: a fresh run)."""
        if self.manager is not None:
            raise RuntimeError(f"{self!r} is already running a train() call")
        self._trainer, self._due, self._saved, self._state = trainer, None, None, None
        self._rng.loaded = None
        self.manager = CheckpointManager(
            self.root, self.keep_last, retention=self.retention, options=self.options,
            policy=self.policy,
        )  # fmt: skip
        try:
            self._resume = self._peek(self.manager)
        except BaseException:
            self.close()
            raise
        return self._resume

    def _peek(self, mgr: CheckpointManager) -> _Resume | None:
        progress, data = _Holder(), _Holder()
        step = mgr.restore(
            {"trainer": progress, "data": data, "rng": self._rng}, strict=False, rollback=False
        )
        if step is None:
            return None
        if progress.value is None:
            raise StateMismatchError(
                f"step {step} was not saved by pitstop.integrations.hf (it has no 'trainer' "
                "entry): give PitstopCallback a root of its own",
                step=step, path=mgr.url, phase="restore",
            )  # fmt: skip
        return _Resume(step, progress.value, data.value)

    def close(self) -> None:
        """After ``trainer.train()``: wait for saves in flight (a failed one raises) and close."""
        mgr, self.manager = self.manager, None
        self._trainer, self._state, self._resume = None, None, None
        if mgr is not None:
            mgr.close()

    def _train_nothing(self, resume: _Resume) -> TrainOutput:
        """A run whose checkpoint is of its last step: load the weights, train nothing."""
        assert self.manager is not None and self._trainer is not None
        trainer = self._trainer
        self.manager.restore({"model": trainer.model}, resume.step, strict=False, rollback=False)
        trainer.state = TrainerState(**resume.trainer_state)
        _log.info(
            "%s: step %d is the last step of this run (max_steps %d): nothing left to train",
            self.manager.url, resume.step, trainer.state.max_steps, phase="restore",
        )  # fmt: skip
        return TrainOutput(resume.step, float("nan"), {})

    # ------------------------------------------------------------------ Trainer hooks
    def on_train_begin(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        """Build the state to save; on a resume, restore it (optimizer and scheduler exist now)."""
        trainer, mgr = self._trainer, self.manager
        if trainer is None or mgr is None:
            raise UnsupportedSetupError(
                f"{self!r} runs under pitstop.integrations.hf.train(trainer), which resumes from "
                "its root: call that instead of trainer.train()"
            )
        if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
            _log.warning(
                "TrainingArguments.save_strategy is %r: the Trainer also writes its own "
                "synchronous checkpoints to %s; pitstop resumes from its own only "
                "(save_strategy='no' turns the Trainer's off)",
                str(getattr(args.save_strategy, "value", args.save_strategy)), args.output_dir,
                phase="plan",
            )  # fmt: skip
        self._state = self._build_state(trainer, kw.get("train_dataloader"))
        resume = self._resume
        if resume is not None:
            if resume.data is not None:  # a changed setting is refused before anything lands
                self._state["data"].load_state_dict(resume.data)
            if mgr.restore(self._state, resume.step) is None:
                raise CheckpointNotFoundError(
                    f"step {resume.step} vanished before the Trainer restored it",
                    step=resume.step, path=mgr.url, phase="restore",
                )  # fmt: skip
            self._saved = resume.step

    def _build_state(self, trainer: Trainer, loader: Any) -> dict[str, Any]:
        optimizer = trainer.optimizer  # Accelerate's wrapper: the torch optimizer inside it
        state: dict[str, Any] = {
            "model": trainer.model,
            "optimizer": optimizer and hookable_optimizer(optimizer, "optimizer"),
            "scheduler": trainer.lr_scheduler,
            "rng": self._rng,
            "trainer": _TrainerProgress(trainer),
            "data": _DataPosition(trainer, loader),
        }
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def on_step_end(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        self._due = state.global_step

    def on_step_begin(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        self._point(epoch_end=False)

    def on_epoch_begin(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        self._point(epoch_end=True)

    def on_epoch_end(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        if control.should_training_stop:
            self._final()

    def on_log(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        loss = (kw.get("logs") or {}).get("loss")
        if isinstance(loss, (int, float)):
            self._loss = float(loss)  # the policy's view of the loss curve

    def on_evaluate(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        if self.manager is not None:
            self.manager.pause()  # the evaluation's time is not a training iteration's

    def on_train_end(self, args: _Args, state: _State, control: _Control, **kw: Any) -> None:
        """Save the last step if not yet done; wait for every save (a failed one raises)."""
        self._final()
        if self.manager is not None:
            self.manager.wait()

    # ------------------------------------------------------------------ checkpoint points
    def _point(self, *, epoch_end: bool) -> None:
        """The checkpoint point of the step that finished last: the policy decides."""
        step, self._due = self._due, None
        if step is None or self.manager is None or self._state is None:
            return
        result = self.manager.step(step, self._state, loss=self._loss, epoch_end=epoch_end)
        self._loss = None
        if result is StepResult.SAVED:
            self._saved = step

    def _final(self) -> None:
        """The last step of the run: it is always saved."""
        step, self._due = self._due, None
        if step is None or self.manager is None or self._state is None:
            return
        self.manager.hooks.reached(step)
        if self._saved != step:
            try:
                self.manager.async_save(step, self._state)
                self._saved = step
            except CheckpointExistsError as e:  # committed by an earlier run of this timeline
                _log.warning("last step %d not saved again: %s", step, e, phase="plan")


# ---------------------------------------------------------------------- train()
def train(trainer: Trainer, **train_kwargs: Any) -> TrainOutput:
    """Run ``trainer.train(**train_kwargs)`` with its :class:`PitstopCallback`, resuming from
    the newest checkpoint in the callback's root when there is one (exactly: weights,
    optimizer, scheduler, RNG, Trainer state, data position). A run whose newest checkpoint
    is of its last step loads the weights and trains nothing."""
    if "resume_from_checkpoint" in train_kwargs:
        raise TypeError(
            "pitstop.integrations.hf.train() resumes from the PitstopCallback's root itself; "
            "resume_from_checkpoint= is not taken"
        )
    callback = _callback_of(trainer)
    _check_setup(trainer)
    resume = callback.open(trainer)
    try:
        if resume is None:
            output = trainer.train(**train_kwargs)
        elif _finished(trainer.args, resume):
            output = callback._train_nothing(resume)
        else:
            if trainer.args.ignore_data_skip:
                raise UnsupportedSetupError(
                    "TrainingArguments.ignore_data_skip=True: the Trainer would not skip the "
                    f"batches trained on before step {resume.step}; the resume would not be exact"
                )
            with _resume_seam(trainer, resume, callback._rng) as path:
                output = trainer.train(resume_from_checkpoint=path, **train_kwargs)
    except BaseException:
        try:  # the training's error is the one to see; a save's is logged
            callback.close()
        except Exception as e:
            _log.error("closing %r after a failed train(): %s", callback, e, phase="persist")
        raise
    callback.close()
    return output


def _callback_of(trainer: Trainer) -> PitstopCallback:
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PitstopCallback)]
    if len(found) != 1:
        raise ValueError(
            f"pitstop.integrations.hf.train() needs exactly one PitstopCallback on the trainer, "
            f"found {len(found)}: Trainer(..., callbacks=[PitstopCallback(root)])"
        )
    return found[0]


def _check_setup(trainer: Trainer) -> None:
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False):
            raise UnsupportedSetupError(
                f"pitstop.integrations.hf does not checkpoint {name} runs yet (the model and "
                "optimizer are sharded by the engine): use the Trainer's own checkpoints"
            )
    missing = [name for name in _SEAM if not callable(getattr(type(trainer), name, None))]
    if missing:
        raise UnsupportedSetupError(
            f"this transformers' Trainer has no {', '.join(missing)}: pitstop.integrations.hf "
            "resumes through them (transformers >= 4.40)"
        )


def _finished(args: TrainingArguments, resume: _Resume) -> bool:
    """Whether the checkpoint is of the run's last step (the Trainer, resumed there, would
    train one step more)."""
    saved = resume.trainer_state
    if args.max_steps > 0:
        return resume.step >= args.max_steps
    if int(saved.get("num_train_epochs", -1)) != math.ceil(args.num_train_epochs):
        return False
    return resume.step >= int(saved.get("max_steps", 0)) > 0


@contextlib.contextmanager
def _resume_seam(trainer: Trainer, resume: _Resume, rng: _TrainerRNG) -> Iterator[str]:
    """A directory with the checkpoint's ``trainer_state.json`` for ``resume_from_checkpoint``;
    while it is in use the trainer loads the weights from nowhere (pitstop restores them at
    on_train_begin) and the RNG from the checkpoint."""

    def load_model(resume_from_checkpoint: str, model: Any = None) -> None:
        return None  # pitstop restores the model with the rest at on_train_begin

    def load_rng(checkpoint: str | None) -> None:
        rng.reapply()

    before = {name: trainer.__dict__.get(name) for name in _SEAM}
    with tempfile.TemporaryDirectory(prefix="pitstop-hf-resume-") as path:
        with open(os.path.join(path, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(resume.trainer["state"])
        trainer._load_from_checkpoint = load_model  # type: ignore[method-assign]
        trainer._load_rng_state = load_rng  # type: ignore[method-assign]
        try:
            yield path
        finally:
            for name, value in before.items():
                if value is None:
                    trainer.__dict__.pop(name, None)
                else:
                    trainer.__dict__[name] = value
