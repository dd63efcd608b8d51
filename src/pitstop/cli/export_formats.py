"""The three files ``pitstop export`` writes, each loadable with its tool's own standard recipe.

* ``torch``: ``torch.save`` of the state as fresh objects, with NumPy arrays turned into
  tensors and NumPy scalars into Python values, so that plain
  ``torch.load(path, weights_only=True)`` reads it (the note lists what was converted).
* ``safetensors``: every tensor under its key path (``/`` between levels, ``/`` inside a key
  escaped as ``%2F``); with ``--only KEY`` the paths start below KEY (``fc.weight``), so
  ``model.load_state_dict(safetensors.torch.load_file(path))`` works. Every other leaf goes
  into the header's metadata: ``pitstop.values`` holds one JSON object of key path -> value.
  A tensor that shares storage with another (tied weights) is written once per name.
* ``dcp``: ``torch.distributed.checkpoint.save`` of the state, with string keys; a tuple that
  holds a tensor becomes a list (DCP keeps any tuple as one pickled object), other tuples stay.

Call sequence (the CLI's thread, ``run_export``, inside ``convert._writing``)::

    notes = EXPORTERS[to](value, out, only)      # value: the state (or {only: ...}) to write
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pitstop.errors import MissingExtraError
from pitstop.state.tree import join_key, numpy_module

__all__ = ["EXPORTERS", "VALUES_KEY", "dcp_compatible", "torch_compatible"]

VALUES_KEY = "pitstop.values"
"""The safetensors metadata entry that holds the non-tensor values as one JSON object."""

_SHOWN = 8  # key paths a note names before "and N more"


def _shown(paths: list[str]) -> str:
    more = f" and {len(paths) - _SHOWN} more" if len(paths) > _SHOWN else ""
    return ", ".join(paths[:_SHOWN]) + more


def _as_tensor(array: Any) -> torch.Tensor | None:
    """A NumPy array as a tensor (a copy), or None for dtypes torch lacks."""
    try:
        return torch.from_numpy(array.copy())
    except (TypeError, ValueError):
        return None


def torch_compatible(obj: Any, key: str, np: Any, converted: list[str]) -> Any:
    """``obj`` with NumPy arrays as tensors and NumPy scalars as Python values (dicts and lists
    changed in place, so OrderedDicts keep their ``_metadata``); ``converted`` gets their key
    paths."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            obj[k] = torch_compatible(v, join_key(key, k), np, converted)  # type: ignore[index]
        return obj
    if isinstance(obj, list):
        obj[:] = [torch_compatible(v, join_key(key, i), np, converted) for i, v in enumerate(obj)]
        return obj
    if isinstance(obj, tuple):
        return tuple(
            torch_compatible(v, join_key(key, i), np, converted) for i, v in enumerate(obj)
        )
    if np is not None and isinstance(obj, np.ndarray):
        tensor = _as_tensor(obj)
        if tensor is not None:
            converted.append(key)
            return tensor
    if np is not None and isinstance(obj, np.generic):
        converted.append(key)
        return obj.item()
    return obj


def export_torch(value: Any, out: str, only: str | None) -> list[str]:
    converted: list[str] = []
    value = torch_compatible(value, "", numpy_module(), converted)
    torch.save(value, out)
    notes = []
    if converted:
        notes.append(
            "note: NumPy values converted (arrays to tensors, scalars to Python values) so that "
            f"torch.load(weights_only=True) reads the file: {_shown(converted)}"
        )
    try:
        unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(out))
    except Exception:  # only a note: the file is written
        unsafe = []
    if unsafe:
        notes.append(
            f"note: torch.load(weights_only=True) refuses {', '.join(unsafe)} unless passed to "
            "torch.serialization.safe_globals (pickled values, saved with allow_pickle)"
        )
    return notes


class _Split:
    """A state cut into safetensors' two parts: tensors by key path and JSON leaves."""

    def __init__(self) -> None:
        self.np = numpy_module()
        self.tensors: dict[str, torch.Tensor] = {}
        self.values: dict[str, Any] = {}
        self.lost: list[str] = []

    def add(self, obj: Any, key: str) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensors[key] = obj
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                self.add(v, join_key(key, k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self.add(v, join_key(key, i))
        elif self.np is not None and isinstance(obj, self.np.ndarray):
            tensor = _as_tensor(obj)
            if tensor is None:
                self.lost.append(f"{key} (a NumPy array of dtype {obj.dtype})")
            else:
                self.tensors[key] = tensor
        elif self.np is not None and isinstance(obj, self.np.generic):
            self.add(obj.item(), key)
        elif obj is None or type(obj) in (bool, int, str) or _finite(obj):
            self.values[key] = obj
        else:
            self.lost.append(
                f"{key} (a {type(obj).__name__}{': not finite' if type(obj) is float else ''})"
            )


def _finite(obj: Any) -> bool:
    return type(obj) is float and math.isfinite(obj)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage: each one after the first is a copy."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone() if ptr in seen else t.contiguous()
        seen.add(ptr)
    return out


def export_safetensors(value: Any, out: str, only: str | None) -> list[str]:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise MissingExtraError(
            "export --to safetensors needs safetensors: pip install safetensors"
        ) from None
    split = _Split()
    if only is None:
        split.add(value, "")
    elif isinstance(value[only], (Mapping, list, tuple)):
        split.add(value[only], "")  # key paths below --only: fc.weight
    else:
        split.add(value[only], only)
    metadata = {"format": "pt", "source": "pitstop"}
    if split.values:
        metadata[VALUES_KEY] = json.dumps(split.values, allow_nan=False)
    save_file(_unshared(split.tensors), out, metadata=metadata)
    mask = os.umask(0o022)  # safetensors writes 0600: give it the mode any new file gets
    os.umask(mask)
    os.chmod(out, 0o666 & ~mask)
    if not split.lost:
        return []
    return ["note: safetensors holds tensors and JSON values; not carried: " + _shown(split.lost)]


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def dcp_compatible(obj: Any) -> Any:
    """DCP keys must be strings; a tuple that holds a tensor becomes a list (so that its
    tensors are DCP tensors, not pickled), any other tuple stays one value."""
    if isinstance(obj, Mapping):
        return {str(k): dcp_compatible(v) for k, v in obj.items()}
    if isinstance(obj, list) or (isinstance(obj, tuple) and _holds_tensor(obj)):
        return [dcp_compatible(v) for v in obj]
    return obj


def export_dcp(value: Any, out: str, only: str | None) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(dcp_compatible(value), checkpoint_id=out, no_dist=True)
        except CheckpointException as e:  # a BaseException holding each rank's error
            raise next(iter(e.failures.values()))[0] from None
    return []


EXPORTERS: dict[str, Callable[[Any, str, str | None], list[str]]] = {
    "torch": export_torch,
    "safetensors": export_safetensors,
    "dcp": export_dcp,
}
