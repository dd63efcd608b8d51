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
    {"stateful": "torch.optim.adam.Adam", "state": node, "params": ["model/fc.weight", null]}
    {"float": "nan"}  {"bytes": "<base64>"}  {"int": "<decimal>"}  (ints of 2**53 and more)
    {"npscalar": ["int64", 3]}  {"npscalar": ["complex64", [re, im]]}
    {"pickle": "<base64>", "type": "mod.Class"}     (only with allow_pickle)

An optimizer's node has ``params``: the stored key of each of its parameters in the
order of its state dict's integer ids (the i-th parameter over ``param_groups`` is id
i), null for one the state holds nowhere else, so that an export can name optimizer
state by parameter (``pitstop export --to dcp``). Restoring ignores it.

``pitstop.format.objects`` writes and strictly parses this grammar. Every value
the file cannot carry exactly is refused here, on the caller's thread, with
its key path and the reason: reference cycles, nesting deeper than
:data:`MAX_NESTING`, NumPy scalars other than plain bool/int/float/complex,
integers of more than 4000 digits, dict keys that are not finite JSON scalars,
and tensors that are not dense and strided (quantized, sparse, nested, meta).

Call sequence: ``flatten(state)`` on the training thread, in ``async_save``.
The restore side reads a tree back with :func:`node_kind`, :func:`children` and
:func:`walk` (the one place, with this docstring, that knows the grammar).
"""

from __future__ import annotations

import base64
import collections
import math
import pickle
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pitstop.errors import UnsupportedValueError
from pitstop.state.dtensor import is_dtensor, unsupported_placement

__all__ = [
    "MAX_INT_DIGITS",
    "MAX_NESTING",
    "MAX_OPTIMIZER_PARAMS",
    "Flat",
    "children",
    "flatten",
    "hookable_optimizer",
    "is_stateful",
    "join_key",
    "node_kind",
    "numpy_module",
    "walk",
]

Node = Any

MAX_NESTING = 500
"""Containers (dict, list, tuple, Stateful) one inside another that a state may hold."""
MAX_OPTIMIZER_PARAMS = 1 << 24
"""Parameters of one optimizer beyond which its node records no ``params``."""
MAX_INT_DIGITS = 4000
"""Decimal digits of the largest integer stored (as ``{"int": "..."}``)."""
EXACT_INT = 1 << 53
"""Integers this large or larger are stored as decimal strings, so every JSON tool keeps them."""
NPSCALAR_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64", "complex64", "complex128"]
)  # fmt: skip
"""NumPy scalar dtypes stored as JSON values (the reader's allow-list)."""
_SPARSE = {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}


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
    if is_dtensor(t):  # a DTensor is the same one if its local tensor is
        return ("dtensor", tuple(t.shape), *_tensor_identity(t.to_local()))  # type: ignore[attr-defined]
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
    )


def _shown(key: str) -> str:
    """A key path for a message: long ones (deep nesting) keep their two ends."""
    key = key or "<state>"
    return repr(key if len(key) <= 200 else f"{key[:120]}...{key[-60:]}")


@dataclass
class Flat:
    """The state flattened for one save.

    ``tensors`` maps each stored key to its tensor, in the order they were met.
    ``deferrable`` holds the keys whose tensors only an optimizer step changes
    (parameters the optimizers in the state own, and optimizer state): they may
    finish copying after ``async_save`` returns. ``optimizers`` are those
    optimizers, so the engine can hook their ``step``. Under torch.distributed,
    ``shared`` keys (tensors of nn.Modules and optimizers: equal on every rank under DDP)
    may be written once for all ranks; ``dtensors`` are sharded, each rank holding a box;
    every other tensor (RNG state, loose tensors) is the rank's own value.
    """

    tree: Node
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    deferrable: set[str] = field(default_factory=set)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    shared: set[str] = field(default_factory=set)
    dtensors: set[str] = field(default_factory=set)


_EXIT = object()  # a stack marker: the container it carries is left (cycle tracking)


class _Flattener:
    """Encodes the state depth-first with an explicit stack (no recursion limit to hit).

    A task ``(obj, key, level, holder, slot)`` stores ``obj``'s node in
    ``holder[slot]``; a container's node is made with empty slots, and its
    children are pushed as tasks, so tensors are met in the same order as a
    recursive pre-order walk would meet them.
    """

    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.np = numpy_module()
        self.flat = Flat(tree=None)
        self.seen: dict[tuple[Any, ...], str] = {}
        self.owned_params: set[tuple[Any, ...]] = set()
        self.optimizer_state: set[tuple[Any, ...]] = set()
        self.stack: list[tuple[Any, ...]] = []
        self.active: set[int] = set()  # ids of the containers on the current path
        self.shared_prefixes: set[str] = set()
        self.optimizer_nodes: list[tuple[dict[str, Any], torch.optim.Optimizer]] = []

    def run(self, state: Mapping[str, Any]) -> Flat:
        if not isinstance(state, Mapping):
            raise UnsupportedValueError(
                f"state must be a dict of name -> value, got {type(state).__name__}"
            )
        for name, value in state.items():
            if not isinstance(name, str):
                raise UnsupportedValueError(f"state keys must be str, got {name!r}")
            if isinstance(value, torch.optim.Optimizer):
                self._note_optimizer(value, name)
        root: list[Node] = [None]
        self.stack.append((state, "", 1, root, 0))
        while self.stack:
            task = self.stack.pop()
            if task[0] is _EXIT:
                self.active.discard(id(task[1]))
                continue
            obj, key, level, holder, slot = task
            holder[slot] = self.encode(obj, key, level)
        self.flat.tree = root[0]
        self._name_params()
        return self.flat

    def _name_params(self) -> None:
        """Give each optimizer node the stored key of each of its parameters, in id order.

        Done once the walk is over: a parameter is met as a module's tensor, often after
        the optimizer (``{"optimizer": opt, "model": model}``)."""
        for node, opt in self.optimizer_nodes:
            params = [p for group in opt.param_groups for p in group["params"]]
            if len(params) <= MAX_OPTIMIZER_PARAMS:
                node["params"] = [self.seen.get(_tensor_identity(p.detach())) for p in params]

    def _note_optimizer(self, opt: torch.optim.Optimizer, key: str) -> None:
        self.flat.optimizers.append(hookable_optimizer(opt, key))
        for group in opt.param_groups:
            for p in group["params"]:
                self.owned_params.add(_tensor_identity(p.detach()))
        for per_param in opt.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    self.optimizer_state.add(_tensor_identity(v))

    def encode(self, obj: Any, key: str, level: int) -> Node:
        """The node of ``obj``; a container's children are pushed as tasks."""
        kind = type(obj)
        if obj is None or kind is bool or kind is str:
            return obj
        if kind is int:
            return self._int(obj, key)
        if kind is float:
            return _real(obj)
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key)
        if isinstance(obj, Mapping) or kind is list or kind is tuple or is_stateful(obj):
            return self._container(obj, key, level)
        numpy_node = self._numpy(obj, key)  # before str, bytes and float: NumPy subclasses them
        if numpy_node is not None:
            return numpy_node
        for base in (str, int, float):  # enums and other subclasses would come back plain
            if isinstance(obj, base):
                return self._pickle(
                    obj, key, f"is a {_qualname(obj)}, which would come back as a plain "
                    f"{base.__name__}; store {base.__name__}(value)",
                )  # fmt: skip
        if type(obj) is bytes:
            return {"bytes": base64.b64encode(obj).decode()}
        iterating = _iterator_advice(obj)  # cannot be pickled either: allow_pickle is no way out
        if iterating is not None:
            raise UnsupportedValueError(f"value at {_shown(key)} {iterating}")
        if isinstance(obj, torch.utils.data.DataLoader) and not self.allow_pickle:
            raise UnsupportedValueError(
                f"value at {_shown(key)} is a plain torch.utils.data.DataLoader, which keeps no "
                "position to resume from: put pitstop.ResumableLoader(loader) in the state "
                "instead (it resumes at the next batch; torchdata's StatefulDataLoader works too)"
            )
        return self._pickle(obj, key, f"is a {_qualname(obj)}, which JSON cannot hold")

    def _int(self, value: int, key: str) -> Node:
        if -EXACT_INT < value < EXACT_INT:
            return value
        if _too_long(value):
            return self._pickle(
                value, key,
                f"is an integer of more than {MAX_INT_DIGITS} digits, which cannot be carried "
                "exactly; store it as a str",
            )  # fmt: skip
        return {"int": str(int(value))}

    def _container(self, obj: Any, key: str, level: int) -> Node:
        if id(obj) in self.active:
            raise UnsupportedValueError(
                f"value at {_shown(key)} contains itself (a reference cycle); pitstop stores trees"
            )
        if level > MAX_NESTING:
            raise UnsupportedValueError(
                f"value at {_shown(key)} nests containers more than {MAX_NESTING} levels deep, "
                "deeper than a checkpoint may hold"
            )
        children: list[tuple[Any, str, Any, Any]]
        if isinstance(obj, Mapping) and type(obj) not in (dict, collections.OrderedDict):
            node, children = self._pickle(
                obj, key, f"is a {_qualname(obj)}, which would come back as a plain dict; "
                "store dict(value)",
            ), []  # fmt: skip
        elif isinstance(obj, Mapping):
            node, children = self._mapping(obj, key)
        elif type(obj) in (list, tuple):
            plain = _plain_items(obj)  # a list of floats: no task (and key path) per item
            items: list[Node] = [None] * len(obj) if plain is None else plain
            node = {"list" if type(obj) is list else "tuple": items}
            children = [] if plain is not None else [
                (v, join_key(key, i), items, i) for i, v in enumerate(obj)
            ]  # fmt: skip
        else:
            node = {"stateful": _qualname(obj), "state": None}
            children = [(obj.state_dict(), key, node, "state")]
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                self.shared_prefixes.add(key)
            if isinstance(obj, torch.optim.Optimizer):
                self.optimizer_nodes.append((node, obj))
        if "pickle" not in node:
            self.active.add(id(obj))
            self.stack.append((_EXIT, obj))
            for child, child_key, holder, slot in reversed(children):
                self.stack.append((child, child_key, level + 1, holder, slot))
        return node

    def _mapping(self, obj: Mapping[Any, Any], key: str) -> tuple[Node, list[Any]]:
        for k in obj:
            reason = _bad_key(k)
            if reason is not None:
                return self._pickle(obj, key, f"is a dict with {reason}"), []
        items: list[list[Any]] = []
        children: list[Any] = []
        for k, v in obj.items():
            items.append([k, None])
            children.append((v, join_key(key, k), items[-1], 1))
        node: dict[str, Any] = {"dict": items}
        if isinstance(obj, collections.OrderedDict):
            node["ordered"] = True
        meta = getattr(obj, "_metadata", None)
        if isinstance(meta, Mapping):
            node["ordered"] = True  # only an OrderedDict (or subclass) can carry it back
            children.append((dict(meta), join_key(key, "_metadata"), node, "meta"))
        return node, children

    def _tensor(self, t: torch.Tensor, key: str) -> Node:
        sharded = is_dtensor(t)
        reason = unsupported_placement(t) if sharded else _unsupported_tensor(t)
        if reason is None and sharded:
            reason = _unsupported_tensor(t.to_local())  # type: ignore[attr-defined]
        if reason is not None:
            raise UnsupportedValueError(f"tensor {_shown(key)} {reason}")
        ident = _tensor_identity(t)
        if ident in self.seen:
            return {"tensor": self.seen[ident]}
        key = self._unique(key)
        self.seen[ident] = key
        self.flat.tensors[key] = t.detach()
        if ident in self.owned_params or ident in self.optimizer_state:
            self.flat.deferrable.add(key)
        if sharded:
            self.flat.dtensors.add(key)
        elif any(key == p or key.startswith(p + "/") or not p for p in self.shared_prefixes):
            self.flat.shared.add(key)
        return {"tensor": key}

    def _unique(self, key: str) -> str:
        """Key paths of 1 and "1" (or None and "None") look alike: the second gets a suffix."""
        if key not in self.flat.tensors:
            return key
        n = 2
        while f"{key}~{n}" in self.flat.tensors:
            n += 1
        return f"{key}~{n}"

    def _numpy(self, obj: Any, key: str) -> Node | None:
        np = self.np
        if np is None:
            return None
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj, key)
        if not isinstance(obj, np.generic):
            return None
        name = obj.dtype.name
        if name not in NPSCALAR_DTYPES:
            return self._pickle(
                obj, key,
                f"is a NumPy {type(obj).__name__} scalar (dtype {obj.dtype}), which JSON cannot "
                "carry exactly; only bool, int, uint, float16/32/64 and complex64/128 scalars are "
                "stored",
            )  # fmt: skip
        value = obj.item()
        if isinstance(value, complex):
            return {"npscalar": [name, [_real(value.real), _real(value.imag)]]}
        if isinstance(value, float):
            return {"npscalar": [name, _real(value)]}
        return {"npscalar": [name, self._int(value, key) if type(value) is int else value]}

    def _ndarray(self, obj: Any, key: str) -> Node:
        reason = f"is a NumPy array of dtype {obj.dtype}, which pitstop cannot store as a tensor"
        if type(obj) is not self.np.ndarray:
            reason = f"is a {_qualname(obj)} (an ndarray subclass whose extra state would be lost)"
        elif obj.dtype != object:
            try:
                t = torch.from_numpy(obj.copy() if not obj.flags.c_contiguous else obj)
            except (TypeError, ValueError):  # strings, datetimes, non-native byte order
                pass
            else:
                key = self._unique(key)
                self.flat.tensors[key] = t
                return {"ndarray": key}
        return self._pickle(obj, key, reason)

    def _pickle(self, obj: Any, key: str, reason: str) -> Node:
        if not self.allow_pickle:
            raise UnsupportedValueError(
                f"value at {_shown(key)} {reason}; to store it as a pickle, pass "
                "options=pitstop.SaveOptions(allow_pickle=True) (pitstop.save(..., "
                "allow_pickle=True))"
            )
        return {
            "pickle": base64.b64encode(pickle.dumps(obj, protocol=5)).decode(),
            "type": _qualname(obj),
        }


def _iterator_advice(obj: Any) -> str | None:
    """What to say of an iterator no checkpoint can hold (``iter(loader)``, a generator: not even
    pickle saves them); None for anything else."""
    loader_iter = getattr(torch.utils.data.dataloader, "_BaseDataLoaderIter", None)
    if isinstance(loader_iter, type) and isinstance(obj, loader_iter):
        return (
            f"is an iterator of a DataLoader ({_qualname(obj)}), which cannot be saved, not "
            "even as a pickle: put the loader itself in the state, as "
            "pitstop.ResumableLoader(loader) (it resumes at the next batch), and iterate over "
            "it in the training loop"
        )
    if isinstance(obj, types.GeneratorType):
        return (
            "is a generator, which cannot be saved, not even as a pickle: save what it "
            "iterates over (batches: pitstop.ResumableLoader(loader) in the state)"
        )
    return None


def hookable_optimizer(opt: torch.optim.Optimizer, key: str) -> torch.optim.Optimizer:
    """The optimizer whose ``step`` the engine hooks: ``opt``, or the one a wrapper that never
    ran ``Optimizer.__init__`` holds as ``.optimizer`` (Accelerate's AcceleratedOptimizer)."""
    seen = 0
    while not hasattr(opt, "_optimizer_step_pre_hooks"):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or seen > MAX_NESTING:
            raise UnsupportedValueError(
                f"optimizer {_shown(key)} is a {_qualname(opt)} that torch.optim.Optimizer never "
                "initialized (a wrapper?), so its steps cannot be hooked; put the optimizer it "
                "wraps in the state"
            )
        opt, seen = inner, seen + 1
    return opt


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _real(value: float) -> Node:
    return value if math.isfinite(value) else {"float": repr(value)}


_PLAIN_TYPES = frozenset({type(None), bool, str, int, float})


def _plain_items(seq: list[Any] | tuple[Any, ...]) -> list[Any] | None:
    """``seq``'s items as they are if each is its own node (None, bool, str, an int below
    2**53, a finite float), checked a type at a time in C; else None (item by item)."""
    types = set(map(type, seq))
    if not types <= _PLAIN_TYPES:
        return None
    if float in types:
        floats = seq if len(types) == 1 else [v for v in seq if type(v) is float]
        if not all(map(math.isfinite, floats)):
            return None
    if int in types:
        ints = seq if len(types) == 1 else [v for v in seq if type(v) is int]
        if min(ints) <= -EXACT_INT or max(ints) >= EXACT_INT:
            return None
    return list(seq)


def _too_long(value: int) -> bool:
    """More than MAX_INT_DIGITS decimal digits (found without converting a huge int to str)."""
    bits = value.bit_length()
    if bits <= 13_000:  # 2**13000 has 3914 digits
        return False
    return bits > 14_000 or len(str(abs(int(value)))) > MAX_INT_DIGITS


def _bad_key(k: object) -> str | None:
    """Why dict key ``k`` cannot be a JSON key of the tree, or None."""
    if k is None or type(k) in (str, bool):
        return None
    if type(k) not in (int, float):
        return (
            f"key {str(k)[:80]!r} of type {type(k).__name__} (it would come back as a plain "
            "str, int or float); keys must be str, int, float, bool or None"
        )
    if isinstance(k, int):
        if _too_long(k):
            return f"an integer key of more than {MAX_INT_DIGITS} digits"
        return None
    if isinstance(k, float):
        return None if math.isfinite(k) else f"the non-finite key {k!r}, which JSON cannot carry"
    return f"key {str(k)[:80]!r} of type {type(k).__name__}; keys must be str, int, float, bool or None"


def _unsupported_tensor(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` cannot be stored as dense bytes, or None."""
    if t.is_nested:
        return "is a nested tensor; store t.unbind() (a list of tensors) or t.to_padded_tensor(0)"
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return f"is a {type(t).__name__}; pitstop stores plain dense tensors and DTensors"
    if t.is_quantized:
        return (
            f"is quantized ({t.qscheme()}); store t.int_repr() with its scale and zero point, "
            "or t.dequantize()"
        )
    if t.layout in _SPARSE:
        return f"is sparse (layout {t.layout}); store t.to_dense() or its indices and values"
    if t.device.type == "meta":
        return "is on the meta device and holds no data to store; materialize it first"
    if t.layout != torch.strided:
        return f"has layout {t.layout}; pitstop stores dense strided tensors (t.to_dense())"
    return None


# ---------------------------------------------------------------- reading a tree back

_KINDS = ("dict", "list", "tuple", "stateful", "tensor", "ndarray", "float", "int", "bytes",
          "npscalar", "pickle")  # fmt: skip


def node_kind(node: Node) -> str:
    """The kind of a tree node (``"value"`` for a JSON scalar)."""
    if isinstance(node, dict):
        for kind in _KINDS:
            if kind in node:
                return kind
    return "value"


def children(node: Node, kind: str, key: str) -> list[tuple[Any, str, Node]]:
    """(key or index, key path, child) of a container node, its ``_metadata`` last."""
    if kind == "dict":
        out = [(k, join_key(key, k), v) for k, v in node["dict"]]
        if "meta" in node:
            out.append(("_metadata", join_key(key, "_metadata"), node["meta"]))
        return out
    if kind in ("list", "tuple"):
        return [(i, join_key(key, i), v) for i, v in enumerate(node[kind])]
    if kind == "stateful":
        return [(None, key, node["state"])]
    return []


def walk(node: Node, key: str = "") -> Iterator[tuple[str, str, Node]]:
    """Every node of a tree in pre-order as (key path, kind, node); iterative, any depth."""
    stack = [(key, node)]
    while stack:
        key, node = stack.pop()
        kind = node_kind(node)
        yield key, kind, node
        stack.extend((path, child) for _, path, child in reversed(children(node, kind, key)))


def numpy_module() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False) -> Flat:
    """Flatten ``state`` (see the module docstring). Called on the training thread."""
    return _Flattener(allow_pickle).run(state)
