"""Gathering the user's state into tensors + a JSON tree (the save side; see ``restore``).

The user's state is a dict whose values are Stateful objects (modules,
optimizers, schedulers, GradScaler, samplers, any class with ``state_dict`` and
``load_state_dict``), tensors, NumPy arrays, and nested dict/list/tuple of those
and plain values. :func:`flatten` turns it into

* a list of unique tensors, each under a key path such as ``model/fc.weight``
  (a tensor reached twice, like tied weights, is stored once), and
* a JSON *tree* that records the structure, the container types (tuple vs list,
  int vs str dict keys, OrderedDict with its ``_metadata``) and every plain value.

Tree nodes: a JSON scalar stands for itself; containers are one-key objects::

    {"dict": [[key, node], ...], "ordered": true, "meta": {...}}
    {"list": [node, ...]}      {"tuple": [node, ...]}
    {"tensor": "model/fc.weight"}     {"ndarray": "rng/numpy/1"}
    {"stateful": "torch.optim.adam.Adam", "state": node}
    {"float": "nan"}  {"bytes": "<base64>"}  {"npscalar": ["int64", 3]}
    {"pickle": "<base64>", "type": "mod.Class"}     (only with allow_pickle)
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pitstop.errors import UnsupportedValueError

__all__ = ["Flat", "flatten", "is_stateful", "join_key", "numpy_module"]

Node = Any


def _escape(part: object) -> str:
    return str(part).replace("%", "%25").replace("/", "%2F")


def join_key(prefix: str, part: object) -> str:
    return f"{prefix}/{_escape(part)}" if prefix else _escape(part)


def is_stateful(obj: object) -> bool:
    return (
        not isinstance(obj, (Mapping, torch.Tensor, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _tensor_identity(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
    )


@dataclass
class Flat:
    """The state flattened for one save.

    ``tensors`` maps each stored key to its tensor, in the order they were met.
    ``deferrable`` holds the keys whose tensors only an optimizer step changes
    (parameters the optimizers in the state own, and optimizer state): they may
    finish copying after ``async_save`` returns. ``optimizers`` are those
    optimizers, so the engine can hook their ``step``.
    """

    tree: Node
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    deferrable: set[str] = field(default_factory=set)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.flat = Flat(tree=None)
        self.seen: dict[tuple[Any, ...], str] = {}
        self.owned_params: set[tuple[Any, ...]] = set()
        self.optimizer_state: set[tuple[Any, ...]] = set()

    def run(self, state: Mapping[str, Any]) -> Flat:
        if not isinstance(state, Mapping):
            raise UnsupportedValueError(
                f"state must be a dict of name -> value, got {type(state).__name__}"
            )
        for name, value in state.items():
            if not isinstance(name, str):
                raise UnsupportedValueError(f"state keys must be str, got {name!r}")
            if isinstance(value, torch.optim.Optimizer):
                self._note_optimizer(value)
        self.flat.tree = self.encode(state, "")
        return self.flat

    def _note_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.flat.optimizers.append(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                self.owned_params.add(_tensor_identity(p.detach()))
        for per_param in opt.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    self.optimizer_state.add(_tensor_identity(v))

    def encode(self, obj: Any, key: str) -> Node:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key)
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"float": repr(obj)}
        if isinstance(obj, Mapping):
            return self._mapping(obj, key)
        if type(obj) is list:
            return {"list": [self.encode(v, join_key(key, i)) for i, v in enumerate(obj)]}
        if type(obj) is tuple:
            return {"tuple": [self.encode(v, join_key(key, i)) for i, v in enumerate(obj)]}
        if isinstance(obj, bytes):
            return {"bytes": base64.b64encode(obj).decode()}
        if is_stateful(obj):
            qualname = f"{type(obj).__module__}.{type(obj).__qualname__}"
            return {"stateful": qualname, "state": self.encode(obj.state_dict(), key)}
        numpy_node = self._numpy(obj, key)
        if numpy_node is not None:
            return numpy_node
        return self._pickle(obj, key)

    def _tensor(self, t: torch.Tensor, key: str) -> Node:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(
            t, torch.nn.Parameter
        ):
            raise UnsupportedValueError(
                f"tensor {key!r} is a {type(t).__name__}; pitstop stores plain dense tensors "
                "(sharded tensors arrive with distributed checkpointing)"
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise UnsupportedValueError(
                f"tensor {key!r} has layout {t.layout} on {t.device}; pitstop stores dense strided tensors"
            )
        ident = _tensor_identity(t)
        if ident in self.seen:
            return {"tensor": self.seen[ident]}
        key = self._unique(key)
        self.seen[ident] = key
        self.flat.tensors[key] = t.detach()
        if ident in self.owned_params or ident in self.optimizer_state:
            self.flat.deferrable.add(key)
        return {"tensor": key}

    def _unique(self, key: str) -> str:
        """Key paths of 1 and "1" (or None and "None") look alike: the second gets a suffix."""
        if key not in self.flat.tensors:
            return key
        n = 2
        while f"{key}~{n}" in self.flat.tensors:
            n += 1
        return f"{key}~{n}"

    def _mapping(self, obj: Mapping[Any, Any], key: str) -> Node:
        items = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (str, int, float, bool))):
                if not self.allow_pickle:
                    raise UnsupportedValueError(
                        f"dict at {key or '<state>'!r} has key {k!r} of type {type(k).__name__}; "
                        "keys must be str, int, float, bool or None (or pass allow_pickle=True)"
                    )
                return self._pickle(obj, key)
            items.append([k, self.encode(v, join_key(key, k))])
        node: dict[str, Any] = {"dict": items}
        if isinstance(obj, collections.OrderedDict):
            node["ordered"] = True
        meta = getattr(obj, "_metadata", None)
        if isinstance(meta, Mapping):
            node["meta"] = self.encode(dict(meta), join_key(key, "_metadata"))
        return node

    def _numpy(self, obj: Any, key: str) -> Node | None:
        np = numpy_module()
        if np is None:
            return None
        if isinstance(obj, np.ndarray):
            if obj.dtype == object:
                return None
            try:
                t = torch.from_numpy(obj.copy() if not obj.flags.c_contiguous else obj)
            except (TypeError, ValueError):  # strings, datetimes, non-native byte order
                return None  # stored as a pickle if allowed, else refused with the key named
            key = self._unique(key)
            self.flat.tensors[key] = t
            return {"ndarray": key}
        if isinstance(obj, np.generic) and obj.dtype != object:
            return {"npscalar": [str(obj.dtype), self.encode(obj.item(), key)]}
        return None

    def _pickle(self, obj: Any, key: str) -> Node:
        qualname = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"value at {key!r} is a {qualname}, which JSON cannot hold; "
                "pass allow_pickle=True to store it as a pickle"
            )
        return {
            "pickle": base64.b64encode(pickle.dumps(obj, protocol=5)).decode(),
            "type": qualname,
        }


def numpy_module() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False) -> Flat:
    """Flatten ``state`` (see the module docstring). Called on the training thread."""
    return _Flattener(allow_pickle).run(state)
