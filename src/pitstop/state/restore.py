"""Putting a saved tree back: into the live state in place, or as fresh objects.

:func:`restore_into` walks the live state beside a saved tree in two passes:
first it checks everything (missing and unexpected keys, shapes, dtypes) and
raises a :class:`StateMismatchError` naming every problem before anything is
touched; then it copies tensors in place and calls ``load_state_dict``.
Objects marked ``restore_last`` (RNG state) are restored after the rest. A live
Stateful may be restored from a saved plain dict (an imported state dict).
"""

from __future__ import annotations

import base64
import collections
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pitstop.errors import PickleRefusedError, StateMismatchError, UnsupportedValueError
from pitstop.state.tree import is_stateful, join_key, numpy_module

__all__ = ["TensorSource", "materialize", "restore_into"]

Node = Any


TensorSource = Callable[[str], torch.Tensor]
"""Returns the saved tensor of a stored key (a view of the read buffer: copy it before keeping it)."""


def materialize(
    node: Node, source: TensorSource, *, allow_pickle: bool, key: str = "", clone: bool = True
) -> Any:
    """Build Python objects from a saved tree; tensors are cloned unless ``clone=False``."""
    return _Materializer(source, allow_pickle, clone, live={}).build(node, key)


class _Materializer:
    def __init__(
        self,
        source: TensorSource,
        allow_pickle: bool,
        clone: bool,
        live: dict[str, torch.Tensor | None],
    ) -> None:
        self.source, self.allow_pickle, self.clone, self.live = source, allow_pickle, clone, live
        self.built: dict[str, torch.Tensor] = {}  # stored key -> tensor, so shared stays shared

    def tensor(self, stored: str, key: str) -> torch.Tensor:
        saved = self.source(stored)
        target = self.live.get(key)
        if target is not None and target.shape == saved.shape and target.dtype == saved.dtype:
            target.copy_(saved)
            self.built.setdefault(stored, target)
            return target
        if stored not in self.built:
            self.built[stored] = saved.clone() if self.clone else saved
        return self.built[stored]

    def build(self, node: Node, key: str) -> Any:
        if not isinstance(node, dict):
            return node
        if "tensor" in node:
            return self.tensor(node["tensor"], key)
        if "dict" in node:
            out: dict[Any, Any] = collections.OrderedDict() if node.get("ordered") else {}
            for k, v in node["dict"]:
                out[k] = self.build(v, join_key(key, k))
            if "meta" in node:
                out._metadata = self.build(node["meta"], join_key(key, "_metadata"))  # type: ignore[attr-defined]
            return out
        if "list" in node:
            return [self.build(v, join_key(key, i)) for i, v in enumerate(node["list"])]
        if "tuple" in node:
            return tuple(self.build(v, join_key(key, i)) for i, v in enumerate(node["tuple"]))
        if "stateful" in node:
            return self.build(node["state"], key)
        if "float" in node:
            return float(node["float"])
        if "bytes" in node:
            return base64.b64decode(node["bytes"])
        if "ndarray" in node:
            return self.source(node["ndarray"]).numpy().copy()
        if "npscalar" in node:
            np = numpy_module()
            if np is None:
                raise UnsupportedValueError(
                    f"value at {key!r} is a NumPy scalar; install numpy to load it"
                )
            dtype, value = node["npscalar"]
            return np.dtype(dtype).type(self.build(value, key))
        if "pickle" in node:
            if not self.allow_pickle:
                raise PickleRefusedError(
                    f"value at {key!r} ({node.get('type', '?')}) is stored as a pickle; "
                    "pass allow_pickle=True to load it (only for checkpoints you trust)"
                )
            return pickle.loads(base64.b64decode(node["pickle"]))  # the caller opted in
        raise UnsupportedValueError(f"unknown node at {key!r}: keys {sorted(node)}")


def _live_tensors(obj: Any, key: str, out: dict[str, torch.Tensor | None]) -> None:
    """Every tensor of a live state_dict-like tree, by key path (None where two paths look alike:
    such a tensor is not received in place, so nothing lands in the wrong one)."""
    if isinstance(obj, torch.Tensor):
        out[key] = None if key in out else obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _live_tensors(v, join_key(key, k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _live_tensors(v, join_key(key, i), out)


def _saved_tensors(node: Node, key: str, out: dict[str, str]) -> None:
    """Key path -> stored key of every tensor in a saved tree."""
    if not isinstance(node, dict):
        return
    if "tensor" in node:
        out[key] = node["tensor"]
    elif "dict" in node:
        for k, v in node["dict"]:
            _saved_tensors(v, join_key(key, k), out)
    elif "list" in node or "tuple" in node:
        for i, v in enumerate(node["list"] if "list" in node else node["tuple"]):
            _saved_tensors(v, join_key(key, i), out)
    elif "stateful" in node:
        _saved_tensors(node["state"], key, out)


@dataclass
class _Problems:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    def raise_if_any(self) -> None:
        if not (self.missing or self.unexpected or self.mismatched):
            return
        parts = []
        if self.missing:
            parts.append(f"missing from the checkpoint: {', '.join(self.missing)}")
        if self.unexpected:
            parts.append(f"in the checkpoint but not in the state: {', '.join(self.unexpected)}")
        if self.mismatched:
            parts.append(f"mismatched: {'; '.join(self.mismatched)}")
        err = StateMismatchError(
            "checkpoint does not fit the state: " + " | ".join(parts), phase="restore"
        )
        err.missing, err.unexpected, err.mismatched = self.missing, self.unexpected, self.mismatched  # type: ignore[attr-defined]
        raise err


class _Restorer:
    def __init__(
        self,
        source: TensorSource,
        meta: Callable[[str], tuple[torch.dtype, tuple[int, ...]]],
        allow_pickle: bool,
        strict: bool,
    ) -> None:
        self.source, self.meta, self.allow_pickle, self.strict = source, meta, allow_pickle, strict
        self.problems = _Problems()

    # ---- pass 1: check
    def check(self, live: Any, node: Node, key: str) -> None:
        if is_stateful(live):
            state_node = _state_of(node)
            if state_node is None:
                self.problems.mismatched.append(
                    f"{key}: a {type(live).__name__} in the state, {_describe(node)} in the checkpoint"
                )
                return
            self._check_stateful(live, state_node, key)
        elif isinstance(live, torch.Tensor):
            if not (isinstance(node, dict) and "tensor" in node):
                self.problems.mismatched.append(
                    f"{key}: a tensor in the state, {_describe(node)} in the checkpoint"
                )
                return
            self._check_tensor(live, node["tensor"], key)
        elif isinstance(live, Mapping):
            if not (isinstance(node, dict) and "dict" in node):
                self.problems.mismatched.append(
                    f"{key or '<state>'}: a dict in the state, {_describe(node)} in the checkpoint"
                )
                return
            saved = {k: v for k, v in node["dict"]}
            both_ways = self.strict or not key  # top-level keys always match both ways
            for k in live:
                if k in saved:
                    self.check(live[k], saved[k], join_key(key, k))
                elif both_ways:
                    self.problems.missing.append(join_key(key, k) or "<state>")
            for k in saved:
                if k not in live and both_ways:
                    self.problems.unexpected.append(join_key(key, k))
        elif isinstance(live, (list, tuple)) and _holds_live(live):
            kind = "list" if isinstance(live, list) else "tuple"
            items = node.get(kind) if isinstance(node, dict) else None
            if items is None or len(items) != len(live):
                self.problems.mismatched.append(
                    f"{key}: a {kind} of {len(live)} in the state, {_describe(node)} in the checkpoint"
                )
                return
            for i, (lv, sv) in enumerate(zip(live, items)):
                self.check(lv, sv, join_key(key, i))

    def _check_tensor(self, live: torch.Tensor, stored: str, key: str) -> None:
        dtype, shape = self.meta(stored)
        if tuple(live.shape) != shape or live.dtype != dtype:
            self.problems.mismatched.append(
                f"{key}: state has {live.dtype} {list(live.shape)}, checkpoint has {dtype} {list(shape)}"
            )

    def _check_optimizer(self, live: torch.optim.Optimizer, node: Node, key: str) -> None:
        """What Optimizer.load_state_dict would refuse, found before anything is touched."""
        saved = dict(node["dict"]) if isinstance(node, dict) and "dict" in node else {}
        groups = saved.get("param_groups")
        items = groups.get("list") if isinstance(groups, dict) else None
        if items is None:
            self.problems.mismatched.append(f"{key}: the checkpoint holds no optimizer state dict")
            return
        sizes = []
        for group in items:
            params = dict(group.get("dict", [])).get("params") if isinstance(group, dict) else None
            sizes.append(
                len(params["list"]) if isinstance(params, dict) and "list" in params else -1
            )
        live_sizes = [len(g["params"]) for g in live.param_groups]
        if sizes != live_sizes:
            self.problems.mismatched.append(
                f"{key}: parameter groups of sizes {live_sizes} in the state, {sizes} in the checkpoint"
            )

    def _check_stateful(self, live: Any, node: Node, key: str) -> None:
        if isinstance(live, torch.optim.Optimizer):
            self._check_optimizer(live, node, key)
            return
        if not isinstance(live, torch.nn.Module):
            return  # other Statefuls validate in their own load_state_dict
        live_sd = live.state_dict()
        saved: dict[str, str] = {}
        _saved_tensors(node, "", saved)
        saved_keys = (
            {k for k, _ in node["dict"]} if isinstance(node, dict) and "dict" in node else set()
        )
        for k in live_sd:
            if k not in saved_keys:
                self.problems.missing.append(join_key(key, k))
        for k in saved_keys:
            if k not in live_sd:
                self.problems.unexpected.append(join_key(key, k))
        for k, t in live_sd.items():
            path = join_key("", k)
            if k in saved_keys and isinstance(t, torch.Tensor) and path in saved:
                self._check_tensor(t, saved[path], join_key(key, k))

    # ---- pass 2: apply
    def apply(self, live: Any, node: Node, key: str) -> Any:
        """Restore ``node`` into ``live``; returns the value the parent should hold."""
        if is_stateful(live):
            live_tensors: dict[str, torch.Tensor | None] = {}
            _live_tensors(live.state_dict(), key, live_tensors)
            sd = _Materializer(self.source, self.allow_pickle, True, live_tensors).build(
                _state_of(node), key
            )
            try:
                live.load_state_dict(sd)
            except (RuntimeError, ValueError, KeyError, TypeError) as e:
                raise StateMismatchError(
                    f"{key}: load_state_dict failed: {e}", phase="restore"
                ) from e
            return live
        if isinstance(live, torch.Tensor):
            live.copy_(self.source(node["tensor"]))
            return live
        if isinstance(live, Mapping):
            return self._apply_mapping(live, node, key)
        if isinstance(live, (list, tuple)) and _holds_live(live):
            kind = "list" if isinstance(live, list) else "tuple"
            values = [
                self.apply(lv, sv, join_key(key, i))
                for i, (lv, sv) in enumerate(zip(live, node[kind]))
            ]
            if isinstance(live, list):
                live[:] = values
                return live
            return tuple(values)
        value = _Materializer(self.source, self.allow_pickle, True, {}).build(node, key)
        if isinstance(live, list) and isinstance(value, list):
            live[:] = value  # plain lists are updated in place, so references stay valid
            return live
        return value

    def _apply_mapping(self, live: Any, node: Node, key: str) -> Any:
        saved = {k: v for k, v in node["dict"]}
        last = [k for k in saved if k in live and getattr(live[k], "restore_last", False) is True]
        for k in [k for k in saved if k not in last] + last:
            if k in live:
                live[k] = self.apply(live[k], saved[k], join_key(key, k))
            elif key:  # nested plain dicts take keys the checkpoint adds
                live[k] = _Materializer(self.source, self.allow_pickle, True, {}).build(
                    saved[k], join_key(key, k)
                )
        return live


def _state_of(node: Node) -> Node | None:
    """The saved state of a Stateful: its recorded state, or a plain dict (an imported state dict)."""
    if isinstance(node, dict) and "stateful" in node:
        return node["state"]
    if isinstance(node, dict) and "dict" in node:
        return node
    return None


def _describe(node: Node) -> str:
    if isinstance(node, dict) and node:
        return f"a {next(iter(node))}"
    return f"the value {node!r}"


def _holds_live(value: Any) -> bool:
    """Whether a live container holds tensors or Statefuls (then it is restored element-wise)."""
    if isinstance(value, torch.Tensor) or is_stateful(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_live(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_live(v) for v in value)
    return False


def _refuse_pickles(node: Node, key: str) -> None:
    """Raise before anything is restored if the tree holds a pickle the caller did not allow."""
    if isinstance(node, dict):
        if "pickle" in node:
            raise PickleRefusedError(
                f"value at {key!r} ({node.get('type', '?')}) is stored as a pickle; "
                "pass allow_pickle=True to load it (only for checkpoints you trust)"
            )
        if "dict" in node:
            for k, v in node["dict"]:
                _refuse_pickles(v, join_key(key, k))
        for kind in ("list", "tuple"):
            for i, v in enumerate(node.get(kind, ())):
                _refuse_pickles(v, join_key(key, i))
        if "stateful" in node:
            _refuse_pickles(node["state"], key)


def restore_into(
    state: Mapping[str, Any],
    tree: Node,
    source: TensorSource,
    meta: Callable[[str], tuple[torch.dtype, tuple[int, ...]]],
    *,
    allow_pickle: bool = False,
    strict: bool = True,
) -> None:
    """Restore a saved tree into the live ``state`` in place (see the module docstring).

    ``source(stored_key)`` returns the saved tensor (a view of the read buffer);
    ``meta(stored_key)`` its dtype and shape, so the check pass reads nothing.
    Top-level keys must match both ways; with ``strict=False`` nested plain
    dicts may have keys that the checkpoint lacks.
    """
    restorer = _Restorer(source, meta, allow_pickle, strict)
    if not allow_pickle:
        _refuse_pickles(tree, "")
    restorer.check(state, tree, "")
    restorer.problems.raise_if_any()
    try:
        with torch.no_grad():
            restorer.apply(state, tree, "")
    except PickleRefusedError:
        raise
    except Exception as e:  # a Stateful's own load_state_dict refused, after others were loaded
        raise StateMismatchError(
            f"restore failed part way ({e}); the live state is partly restored: do not train from it",
            phase="restore",
        ) from e
