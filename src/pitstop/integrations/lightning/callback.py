"""``PitstopCallback``: the random streams Lightning does not save, restored where a resume
needs them, and the crash-test hook (see the package docstring for the call sequence)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from pitstop.errors import (
    UnsupportedSetupError,
)
from pitstop.integrations.lightning.checkpoint_io import PitstopCheckpointIO, find_io, loaders
from pitstop.integrations.lightning.pointers import STATE_KEY
from pitstop.log import get_logger
from pitstop.state.rng import RNGState

_log = get_logger("pitstop.integrations.lightning")


class PitstopCallback(Callback):
    """Saves what Lightning does not (``checkpoint["pitstop"]``: Python's, NumPy's, torch's and
    CUDA's random generators) and restores it where the resumed run meets the point of the
    save: at the first ``on_train_batch_start`` after a mid-epoch checkpoint, at
    ``on_train_epoch_start`` after one taken at an epoch's last batch or end. Put it first
    among the callbacks (earlier callbacks' batch-start hooks run before the restore).

    Once per optimizer step (``on_train_batch_end``) it calls the IO's crash-test hook. It
    warns about a train loader that cannot resume mid-epoch exactly. The data position itself
    is Lightning's: it saves and reloads the train loader's ``state_dict()``."""

    def __init__(self) -> None:
        self._io: PitstopCheckpointIO | None = None
        self._rng: dict[str, Any] | None = None  # loaded, not yet restored
        self._at_epoch_start = False
        self._reported: int | None = None
        self._val_counts: tuple[int, ...] | None = None  # before Lightning's fast-forward

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise UnsupportedSetupError(
                f"PitstopCallback serves one process; this Trainer runs {trainer.world_size}"
            )
        self._io = find_io(trainer.strategy)
        if self._io is None and stage == "fit":
            _log.warning(
                "no PitstopCheckpointIO in Trainer(plugins=...): RNG state is saved, but "
                "checkpoints are Lightning's own and crashtest cannot kill this run", phase="plan",
            )  # fmt: skip

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        rng = self._rng if self._rng is not None else _portable(RNGState().state_dict())
        progress = trainer.fit_loop.epoch_loop.batch_progress
        checkpoint[STATE_KEY] = {"version": 1, "rng": rng, "epoch_end": progress.is_last_batch}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            return
        saved = checkpoint.get(STATE_KEY)
        if not isinstance(saved, dict) or "rng" not in saved:
            _log.warning("the checkpoint has no RNG state (saved without PitstopCallback): the "
                         "resume is not exact", phase="restore")  # fmt: skip
            return
        self._rng, self._at_epoch_start = saved["rng"], bool(saved.get("epoch_end"))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._io is not None:  # before the first save: where ModelCheckpoint saves "last"
            self._io.fit_starts(_last_path(trainer))
        _load_missed_loader_states(trainer)
        if self._rng is not None:
            self._val_counts = _val_counts(trainer)
        for loader in loaders(trainer.train_dataloader):
            _check_loader(loader)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None and self._at_epoch_start:
            self._restore(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:
            self._restore(trainer)
        if self._val_counts is not None:
            _undo_fast_forward_counts(trainer, self._val_counts)
            self._val_counts = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if self._io is not None and step != self._reported:  # once per optimizer step
            self._reported = step
            self._io.reached(step)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rng = None

    def _restore(self, trainer: pl.Trainer) -> None:
        assert self._rng is not None
        RNGState().load_state_dict(_native(self._rng))
        self._rng = None
        if self._io is not None:  # the whole state is back: crashtest's restore record
            self._io.manager.hooks.resumed(trainer.global_step)


def _portable(rng: dict[str, Any]) -> dict[str, Any]:
    """NumPy's key array as a tensor: ``torch.load(weights_only=True)`` (Lightning's own IO)
    then reads the checkpoint too."""
    if "numpy" not in rng:
        return rng
    name, keys, pos, has_gauss, cached = rng["numpy"]
    return {**rng, "numpy": (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)}


def _native(rng: dict[str, Any]) -> dict[str, Any]:
    if "numpy" not in rng or not isinstance(rng["numpy"][1], torch.Tensor):
        return rng
    name, keys, pos, has_gauss, cached = rng["numpy"]
    return {**rng, "numpy": (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)}


def _check_loader(loader: Any) -> None:
    """Warn about a train loader whose resume mid-epoch is not exact."""
    name = type(loader).__name__
    if not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
        why = "has no state_dict(): a resume mid-epoch starts the epoch's batches over"
    elif type(loader).__module__.startswith("torchdata") and getattr(
        getattr(loader, "sampler", None), "generator", False
    ) in (None, loader.generator):
        why = (
            "shuffles with the loader's own generator: the epochs after a resume come in "
            "another order (give it torchdata's RandomSampler with a generator of its own)"
        )
    elif not hasattr(loader, "__len__"):
        why = "has no len(): Lightning fetches a batch ahead and the resume skips it"
    else:
        return
    _log.warning("train loader %s %s; use pitstop.ResumableLoader", name, why, phase="plan")


def _val_counts(trainer: pl.Trainer) -> tuple[int, ...]:
    c: Any = trainer.fit_loop.epoch_loop.val_loop.batch_progress.current
    return (c.ready, c.started, c.processed, c.completed)


def _undo_fast_forward_counts(trainer: pl.Trainer, before: tuple[int, ...]) -> None:
    """First batch after a resume. A validation due right after the restored checkpoint is
    not run again: Lightning counts it (``increment_progress_to_evaluation_end``) on top of
    the previous validation's ``current`` counts, where a run that validated starts them
    from 0. Count it as a run does, so the checkpoints of both runs agree."""
    val = trainer.fit_loop.epoch_loop.val_loop
    added = [a - b for a, b in zip(_val_counts(trainer), before)]
    batches = [int(m) for m in getattr(val, "max_batches", []) if m != float("inf")]
    if batches and all(n == max(batches) for n in added):
        c: Any = val.batch_progress.current
        c.ready, c.started, c.processed, c.completed = added


def _last_path(trainer: pl.Trainer) -> str | None:
    """Where the first ModelCheckpoint with ``save_last`` will save ``last`` next, as its
    ``_save_last_checkpoint`` names it (None: none, or a name only its metrics tell)."""
    for callback in trainer.checkpoint_callbacks:
        if not (isinstance(callback, ModelCheckpoint) and callback.save_last is True):
            continue  # save_last="link": Lightning links the top-k file, no save to "last"
        name = callback.CHECKPOINT_NAME_LAST
        if callback.dirpath is None or "{" in name:
            return None
        path = callback.format_checkpoint_name({}, name)
        if os.path.exists(path) and path != callback.last_model_path:
            return None  # Lightning writes last-v1.ckpt: not known before it does
        return path
    return None


def _load_missed_loader_states(trainer: pl.Trainer) -> None:
    """Lightning 2.5-2.6 (issue #20550): when ``configure_optimizers`` calls
    ``trainer.estimated_stepping_batches``, the train loader is set up before the restore and
    its saved state is never loaded. Load it now, before the first batch is fetched."""
    loop = trainer.fit_loop
    states = getattr(loop, "_combined_loader_states_to_load", None)
    loader, fetcher = getattr(loop, "_combined_loader", None), getattr(loop, "_data_fetcher", None)
    if not states or loader is None or fetcher is None or not loop.restarting:
        return
    loader._load_state_dicts(states)
    loop._combined_loader_states_to_load = []
    iter(fetcher)  # a new iterator from the loaded position
    _log.info("loaded the train loader's saved position (Lightning #20550)", phase="restore")
