"""Building Python values from a saved tree (the load side's decoder; see ``state.restore``).

:class:`Builder` turns validated tree nodes into values iteratively (no recursion, so a
deep tree cannot overflow the stack); :func:`materialize` builds a whole tree as fresh
objects; :func:`scan` refuses a pickle the caller did not allow and a bad key map before
anything is built. Plain values (None, bool, int, str, float) stand for themselves: they are
taken over a list or dict at a time, with no key path, stack entry or Python step of their
own, so a saved list of a million floats builds in the time of a list copy.
:func:`walk_objects` visits the other nodes (those that are JSON objects) the same way.

Call sequence: the restore path (training thread), once per load.
"""

from __future__ import annotations

import base64
import collections
import itertools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pitstop.errors import (
    CorruptCheckpointError,
    MissingExtraError,
    PickleRefusedError,
)
from pitstop.state.dtensor import copy_into
from pitstop.state.keys import KeyMap, KeyMapper
from pitstop.state.tree import join_key, node_kind, numpy_module

__all__ = ["Builder", "TensorSource", "materialize", "scan", "walk_objects"]

Node = Any

TensorSource = Callable[[str], torch.Tensor]
"""Returns the saved tensor of a stored key (a view of the read buffer: copy it before keeping it)."""


_SAME: Any = object()  # the part of a stateful's state: its key path is the stateful's


def walk_objects(tree: Node, key: str = "") -> Iterator[tuple[str, str, Node]]:
    """(key path, kind, node) of every node of ``tree`` that is a JSON object (all but plain
    values), in pre-order; iterative, any depth. Plain values are passed over a list or dict
    at a time (no key path of their own), and pending nodes are held as one iterator per
    open container, so memory stays in the depth of the tree."""
    if type(tree) is not dict:
        return
    stack: list[tuple[str, Iterator[tuple[Any, Node]]]] = [(key, iter([(_SAME, tree)]))]
    while stack:
        parent, pending = stack[-1]
        item = next(pending, None)
        if item is None:
            stack.pop()
            continue
        part, node = item
        path = parent if part is _SAME else join_key(parent, part)
        kind = node_kind(node)
        yield path, kind, node
        inner = _objects_inside(node, kind)
        if inner is not None:
            stack.append((path, inner))


def _objects_inside(node: Node, kind: str) -> Iterator[tuple[Any, Node]] | None:
    """(key or index, child) of the children of ``node`` that are JSON objects, lazily."""
    if kind == "dict":
        inner: Iterator[tuple[Any, Node]] = ((k, v) for k, v in node["dict"] if type(v) is dict)
        meta = node.get("meta")
        return itertools.chain(inner, [("_metadata", meta)]) if type(meta) is dict else inner
    if kind in ("list", "tuple"):
        items = node[kind]
        if dict not in set(map(type, items)):
            return None
        return ((i, v) for i, v in enumerate(items) if type(v) is dict)
    if kind == "stateful" and type(node["state"]) is dict:
        return iter([(_SAME, node["state"])])
    return None


def scan(tree: Node, key: str, allow_pickle: bool, keys: KeyMapper) -> None:
    """Refuse a pickle the caller did not allow and a bad key map, before anything is built."""
    for path, kind, node in walk_objects(tree, key):
        if kind == "pickle" and not allow_pickle:
            raise PickleRefusedError(
                f"value at {path!r} ({node['type']}) is stored as a pickle; "
                "pass allow_pickle=True to load it (only for checkpoints you trust)"
            )
        if kind == "dict" and keys.key_map is not None:
            keys.check_dict(path, [k for k, _ in node["dict"]])


class _Meta:
    """A slot that sets a built dict's ``_metadata``."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __setitem__(self, slot: object, value: Any) -> None:
        self.target._metadata = value


_NO_KEYS: dict[str, Any] = {}  # no live dict to match a renamed key against: it is unescaped
_TUPLE = object()  # a stack marker: the tuple's items are built
_LAZY = object()  # a stack marker: an iterator of the tasks of a container's nodes


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
            if task[0] is _LAZY:  # (_LAZY, tasks): the next one first, then the rest
                nxt = next(task[1], None)
                if nxt is not None:
                    stack += [task, nxt]
                continue
            if task[0] is _TUPLE:
                task[2][task[3]] = tuple(task[1])  # (_TUPLE, items, holder, slot)
                continue
            node, key, skey, holder, slot = task
            kind = node_kind(node)
            if kind == "dict":
                holder[slot] = self._dict(node, key, skey, stack)
            elif kind in ("list", "tuple"):
                self._sequence(node[kind], kind == "tuple", (key, skey, holder, slot), stack)
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
        nodes = False
        for k, child in node["dict"]:
            target = self.keys.target(skey, k)
            if target is None:
                continue
            out[self.keys.live_key(target, k, _NO_KEYS)] = child  # a node's place, in order
            nodes = nodes or type(child) is dict  # a plain value stands for itself
        if nodes:
            stack.append((_LAZY, self._dict_tasks(node["dict"], key, skey, out)))
        return out

    def _dict_tasks(
        self, entries: list[Any], key: str, skey: str, out: dict[Any, Any]
    ) -> Iterator[tuple[Any, ...]]:
        """The tasks of a dict node's children that are nodes, made one at a time (their live
        keys again, as ``_dict`` found them: nothing is kept per child meanwhile)."""
        for k, child in entries:
            if type(child) is not dict:
                continue
            target = self.keys.target(skey, k)
            if target is not None:
                live_key = self.keys.live_key(target, k, _NO_KEYS)
                yield child, join_key(key, live_key), join_key(skey, k), out, live_key

    def _sequence(
        self, saved: list[Any], is_tuple: bool, task: tuple[str, str, Any, Any],
        stack: list[tuple[Any, ...]],
    ) -> None:  # fmt: skip
        """Build a list (or tuple) node's items: a copy of them, each node then built in its
        place. ``task``: the node's (key, saved key, holder, slot)."""
        key, skey, holder, slot = task
        items = list(saved)
        if is_tuple:
            stack.append((_TUPLE, items, holder, slot))
        else:
            holder[slot] = items
        if dict in set(map(type, saved)):
            stack.append((_LAZY, (
                (child, join_key(key, i), join_key(skey, i), items, i)
                for i, child in enumerate(saved) if type(child) is dict
            )))  # fmt: skip

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
