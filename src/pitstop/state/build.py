"""Building Python values from a saved tree (the load side's decoder; see ``state.restore``).

:class:`Builder` turns validated tree nodes into values iteratively (no recursion, so a
deep tree cannot overflow the stack); :func:`materialize` builds a whole tree as fresh
objects; :func:`scan` refuses a pickle the caller did not allow and a bad key map before
anything is built.

Call sequence: the restore path (training thread), once per load.
"""

from __future__ import annotations

import base64
import collections
import pickle
from collections.abc import Callable
from typing import Any

import torch

from pitstop.errors import (
    CorruptCheckpointError,
    MissingExtraError,
    PickleRefusedError,
)
from pitstop.state.dtensor import copy_into
from pitstop.state.keys import KeyMap, KeyMapper
from pitstop.state.tree import children, join_key, node_kind, numpy_module, walk

__all__ = ["Builder", "TensorSource", "materialize", "scan"]

Node = Any

TensorSource = Callable[[str], torch.Tensor]
"""Returns the saved tensor of a stored key (a view of the read buffer: copy it before keeping it)."""


def scan(tree: Node, key: str, allow_pickle: bool, keys: KeyMapper) -> None:
    """Refuse a pickle the caller did not allow and a bad key map, before anything is built."""
    for path, kind, node in walk(tree, key):
        if kind == "pickle" and not allow_pickle:
            raise PickleRefusedError(
                f"value at {path!r} ({node['type']}) is stored as a pickle; "
                "pass allow_pickle=True to load it (only for checkpoints you trust)"
            )
        if kind == "dict":
            keys.check_dict(path, [k for k, _ in node["dict"]])


class _Meta:
    """A slot that sets a built dict's ``_metadata``."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __setitem__(self, slot: object, value: Any) -> None:
        self.target._metadata = value


_TUPLE = object()  # a stack marker: the tuple's items are built


class Builder:
    """Builds Python values from tree nodes, iteratively.

    A saved tensor goes into the live tensor at the same (live) key path when
    ``live`` has one of its shape and dtype (then ``on_copy`` is called), else it
    is cloned, unless ``clone`` (a bool, or a predicate of the stored key) says the
    source's tensor may be kept as it is; a tensor stored once is built once, so
    shared tensors stay shared.
    """

    def __init__(
        self, source: TensorSource, keys: KeyMapper, *, allow_pickle: bool,
        clone: bool | Callable[[str], bool] = True,
        live: dict[str, torch.Tensor | None] | None = None, on_copy: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.source, self.keys, self.allow_pickle = source, keys, allow_pickle
        self.clone = clone if callable(clone) else (lambda _stored: clone)
        self.live, self.on_copy = live or {}, on_copy
        self.built: dict[str, torch.Tensor] = {}

    def build(self, node: Node, key: str, skey: str | None = None) -> Any:
        """The value of ``node``; ``key`` is its live key path, ``skey`` its saved one."""
        out: list[Any] = [None]
        stack: list[tuple[Any, ...]] = [(node, key, key if skey is None else skey, out, 0)]
        while stack:
            task = stack.pop()
            if task[0] is _TUPLE:
                task[2][task[3]] = tuple(task[1])  # (_TUPLE, items, holder, slot)
                continue
            node, key, skey, holder, slot = task
            kind = node_kind(node)
            if kind == "dict":
                holder[slot] = self._dict(node, key, skey, stack)
            elif kind in ("list", "tuple"):
                kids = children(node, kind, skey)
                items = [None] * len(kids)
                if kind == "list":
                    holder[slot] = items
                else:
                    stack.append((_TUPLE, items, holder, slot))
                for i, spath, child in reversed(kids):
                    stack.append((child, join_key(key, i), spath, items, i))
            elif kind == "stateful":
                stack.append((node["state"], key, skey, holder, slot))
            else:
                holder[slot] = self.leaf(node, kind, key)
        return out[0]

    def _dict(self, node: Node, key: str, skey: str, stack: list[tuple[Any, ...]]) -> Any:
        out: dict[Any, Any] = (
            collections.OrderedDict() if node.get("ordered") or "meta" in node else {}
        )
        if "meta" in node:
            meta = join_key(key, "_metadata")
            stack.append((node["meta"], meta, join_key(skey, "_metadata"), _Meta(out), None))
        tasks = []
        escaped: dict[str, Any] = {}
        for k, child in node["dict"]:
            target = self.keys.target(skey, k)
            if target is None:
                continue
            live_key = self.keys.live_key(target, k, escaped)
            out[live_key] = None  # the entry's place, in the saved order
            tasks.append((child, join_key(key, live_key), join_key(skey, k), out, live_key))
        stack.extend(reversed(tasks))
        return out

    def tensor(self, stored: str, key: str) -> torch.Tensor:
        saved = self.source(stored)
        target = self.live.get(key)
        if target is not None and target.shape == saved.shape and target.dtype == saved.dtype:
            if self.on_copy is not None:
                self.on_copy()
            copy_into(target, saved)  # nothing to copy where the bytes landed in place
            self.built.setdefault(stored, target)
            return target
        if stored not in self.built:
            self.built[stored] = saved.clone() if self.clone(stored) else saved
        return self.built[stored]

    def leaf(self, node: Node, kind: str, key: str) -> Any:
        if kind == "value":
            return node
        if kind == "tensor":
            return self.tensor(node["tensor"], key)
        if kind in ("float", "int"):
            return _number(node)
        if kind == "bytes":
            return base64.b64decode(node["bytes"])
        if kind == "ndarray":
            try:
                return self.source(node["ndarray"]).numpy().copy()
            except TypeError as e:  # a dtype NumPy lacks: the objects file and manifest disagree
                raise CorruptCheckpointError(f"array at {key!r} cannot be loaded: {e}") from None
        if kind == "npscalar":
            return _npscalar(node["npscalar"], key)
        assert self.allow_pickle, "_scan refuses pickles first"
        return pickle.loads(base64.b64decode(node["pickle"]))  # the caller opted in


def _number(node: Node) -> Any:
    if isinstance(node, dict):
        return int(node["int"]) if "int" in node else float(node["float"])
    return node


def _npscalar(value: list[Any], key: str) -> Any:
    np = numpy_module()
    if np is None:
        raise MissingExtraError(f"value at {key!r} is a NumPy scalar; install numpy to load it")
    dtype, scalar = value
    make = np.dtype(dtype).type
    if isinstance(scalar, list):
        return make(complex(_number(scalar[0]), _number(scalar[1])))
    return make(_number(scalar))


def materialize(
    node: Node, source: TensorSource, *, allow_pickle: bool, key: str = "",
    clone: bool | Callable[[str], bool] = True, key_map: KeyMap | None = None,
) -> Any:  # fmt: skip
    """Build Python objects from a saved tree; tensors are cloned unless ``clone=False``.

    ``key_map`` renames or drops dict entries as in :func:`restore_into`.
    """
    keys = KeyMapper(key_map)
    scan(node, key, allow_pickle, keys)
    return Builder(source, keys, allow_pickle=allow_pickle, clone=clone).build(node, key)
