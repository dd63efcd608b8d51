"""pitstop: frequent, cheap, exact checkpoints for PyTorch training.

::

    import pitstop
    ckpt = pitstop.CheckpointManager("ckpts", keep_last=3)
    state = {"model": model, "optimizer": opt, "rng": pitstop.RNGState()}
    start = ckpt.restore(state)            # newest valid step, loaded in place; None if none
    ckpt.async_save(step, state)           # stalls only for a memory copy
    ckpt.save(step, state)                 # durable and committed when it returns

Names that need torch are imported on first use, so ``pitstop.errors``,
``pitstop.format`` and the CLI's torch-free commands work without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pitstop._version import __version__
from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatVersionError,
    ManifestError,
    MissingExtraError,
    NotACheckpointError,
    PartialRestoreError,
    PickleRefusedError,
    ShmSpaceError,
    StateMismatchError,
    UnsafePathError,
    UnsupportedSetupError,
    UnsupportedValueError,
)
from pitstop.options import IOOptions, SaveOptions
from pitstop.policy import (
    AnyPolicy,
    CheckFreq,
    Every,
    EveryEpoch,
    EveryN,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    ValueAware,
    YoungDaly,
)

__all__ = [
    "AnyPolicy",
    "CheckFreq",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointIOError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "Every",
    "EveryEpoch",
    "EveryN",
    "FormatVersionError",
    "IOOptions",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "Local",
    "ManifestError",
    "Memory",
    "MissingExtraError",
    "NotACheckpointError",
    "ObjectStorage",
    "PartialRestoreError",
    "PickleRefusedError",
    "RNGState",
    "ResumableLoader",
    "ResumableSampler",
    "SaveHandle",
    "SaveOptions",
    "Shared",
    "ShmSpaceError",
    "StateMismatchError",
    "StepResult",
    "UnsafePathError",
    "UnsupportedSetupError",
    "UnsupportedValueError",
    "ValueAware",
    "YoungDaly",
    "__version__",
    "add_prefix",
    "load",
    "save",
    "strip_prefix",
]

_LAZY = {
    "CheckpointManager": "pitstop.manager",
    "Local": "pitstop.levels.spec",
    "Memory": "pitstop.levels.spec",
    "Shared": "pitstop.levels.spec",
    "ObjectStorage": "pitstop.storage.object_store",
    "RNGState": "pitstop.state.rng",
    "ResumableLoader": "pitstop.state.data",
    "ResumableSampler": "pitstop.state.data",
    "SaveHandle": "pitstop.engine.handle",
    "StepResult": "pitstop.loop",
    "add_prefix": "pitstop.state.keys",
    "strip_prefix": "pitstop.state.keys",
    "load": "pitstop.oneshot",
    "save": "pitstop.oneshot",
}

if TYPE_CHECKING:
    from pitstop.engine.handle import SaveHandle
    from pitstop.levels.spec import Local, Memory, Shared
    from pitstop.loop import StepResult
    from pitstop.manager import CheckpointManager
    from pitstop.oneshot import load, save
    from pitstop.state.data import ResumableLoader, ResumableSampler
    from pitstop.state.keys import add_prefix, strip_prefix
    from pitstop.state.rng import RNGState
    from pitstop.storage.object_store import ObjectStorage


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pitstop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
