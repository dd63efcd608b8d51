"""Lightning: pitstop's asynchronous, verified checkpoints behind ``Trainer(plugins=...)``, and
the random streams Lightning does not save, restored where a resume needs them.

::

    trainer = L.Trainer(
        plugins=[PitstopCheckpointIO("ckpts")],          # one pitstop root per run
        callbacks=[PitstopCallback(),                     # first: RNG streams, crash-test hook
                   ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_last=True)],
    )
    trainer.fit(model, ckpt_path="last")                  # train_dataloader(): pitstop.ResumableLoader

Every ``.ckpt`` path Lightning saves to is a *pointer*: a small JSON file naming the root
and a step (``global_step``; a second save of a step only adds a pointer). The pointer is
written by a background thread once its step committed, so ``ckpt_path="last"`` (the newest
``last*.ckpt`` on disk) never picks a step a kill cut short; the root's
``.pitstop-lightning.json`` lists the pointer directories (retention sees every pointer) and
the ``last`` path, which the constructor points at the newest committed step if a kill came
after a commit and before ``last`` followed it (unless that step was saved after ``fit``:
its pointer says ``after_fit``). Only a pointer of the root, or nothing, is replaced there; a
registry entry that does not validate is ignored with a warning. A step is kept while a
pointer names it, while it is the newest or in use, or while ``keep_last=``/``retention=``
keep it. docs/integrations/lightning.md says more.

Call sequence (the training thread of global rank 0 unless said otherwise)::

    PitstopCheckpointIO(root)        manager on the root; registry read; ``last`` repaired
    Trainer.fit(ckpt_path="last")    Lightning: newest last*.ckpt by mtime
      PitstopCallback.setup          finds the IO (through wrappers); one process only
      load_checkpoint(path)          pointer -> step; verified load; the run adopted
      PitstopCallback.on_load_checkpoint      RNG state kept aside (fitting only)
      (Lightning restores model, loops with the train loader's state_dict(), optimizers)
      PitstopCallback.on_train_start          fit_starts(ModelCheckpoint's last path): registered;
                                              loader checks, Lightning #20550
      PitstopCallback.on_train_epoch_start / on_train_batch_start   RNG restored (once)
      PitstopCallback.on_train_batch_end      manager.hooks.reached(global_step): crash-test hook
      ModelCheckpoint -> trainer.save_checkpoint
        PitstopCallback.on_save_checkpoint    checkpoint["pitstop"] = RNG streams
        save_checkpoint(checkpoint, path)     async_save(step): returns after the copy
        [pitstop-persist] persist, commit, retention   [pitstop-lightning] pointer at path
      ModelCheckpoint -> remove_checkpoint(path)       pointer deleted
      teardown()                     waits for saves and pointers; raises a failed save's error;
                                     later saves are after fit (trainer.save_checkpoint)
"""

from __future__ import annotations

from pitstop.errors import MissingExtraError

try:
    import lightning.pytorch  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess without lightning
    raise MissingExtraError(
        f"pitstop.integrations.lightning needs Lightning ({e}): pip install 'pitstop[lightning]'"
    ) from e

from pitstop.integrations.lightning.callback import PitstopCallback
from pitstop.integrations.lightning.checkpoint_io import PitstopCheckpointIO

__all__ = ["PitstopCallback", "PitstopCheckpointIO"]
