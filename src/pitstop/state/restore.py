"""Putting a saved tree back into the live state, in place (fresh objects: ``state.build``).

The tree (see ``state.tree``; validated by ``format.objects.parse_objects``) is
decoded in one place: ``tree.node_kind`` knows the node grammar, ``build.walk_objects``
visits the nodes that are JSON objects (the pickle and key-map scan walks with it;
plain values are passed over a list at a time), :class:`Builder` turns nodes into
values, and the restorer pairs the live state with the tree.

:func:`restore_into` works in two passes over the live state beside the tree:

1. **check**: pair every live dict (and nn.Module state dict) with its saved
   dict, applying the key map and the automatic wrapper prefixes; compare
   shapes and dtypes (tensors, module entries, optimizer state, parameter
   groups). Every problem is gathered and raised as one StateMismatchError
   before anything is touched. A pickle without ``allow_pickle`` and a key map
   that leaves its dict are refused here too.
2. **apply**: copy tensors in place and call ``load_state_dict``; objects marked
   ``restore_last`` (RNG state) go after the rest of their dict. A failure
   after something was overwritten is a PartialRestoreError.

With ``strict=True`` keys must match both ways at every level. With
``strict=False`` the keys both sides have are restored, live keys the
checkpoint lacks are left as they are (``missing``) and saved keys the state
lacks are ignored (``skipped``), at every level, nn.Modules included.

The check pass also names, for each stored tensor, the live tensor of the same dtype
and shape its bytes may be read straight into (``RestorePlan.targets``): the engine's
streaming restore lands them there, and the apply pass then has nothing left to copy.

Call sequence: the engine's restore (training thread) calls ``plan_restore`` before it
reads any data, then ``RestorePlan.apply`` (or ``materialize``) once the data is in;
``restore_into`` is the two at once.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pitstop.errors import (
    CorruptCheckpointError,
    MissingExtraError,
    PartialRestoreError,
    StateMismatchError,
)
from pitstop.state.build import Builder, TensorSource, materialize, scan, walk_objects
from pitstop.state.dtensor import copy_into, is_dtensor
from pitstop.state.keys import KeyMap, KeyMapper, wrapper_renames
from pitstop.state.tree import is_stateful, join_key, node_kind

__all__ = [
    "RestorePlan",
    "RestoreReport",
    "TensorMeta",
    "TensorSource",
    "materialize",
    "plan_restore",
    "restore_into",
]

Node = Any

TensorMeta = Callable[[str], tuple[torch.dtype, tuple[int, ...]]]
"""Returns the dtype and shape of a stored key, without reading it."""

_PLAIN = frozenset({type(None), bool, int, float, str, bytes})
"""Live values that hold neither a tensor nor a Stateful (checked a list at a time)."""


@dataclass
class RestoreReport:
    """What a restore did. Key paths are built as in ``state.tree.join_key``.

    ``loaded``: top-level keys restored. ``skipped``: saved key paths not restored
    (the state lacks them, or the key map dropped them). ``missing``: live key
    paths the checkpoint lacks, left untouched. ``renamed``: saved -> live key
    path of each entry restored under another name.
    """

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- restoring into live state

_Pair = tuple[Any, str, str, Node]  # (live key, live key path, saved key path, saved node)


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
            parts.append(f"missing from the checkpoint: {_some(self.missing, ', ')}")
        if self.unexpected:
            parts.append(f"in the checkpoint but not in the state: {_some(self.unexpected, ', ')}")
        if self.mismatched:
            parts.append(f"mismatched: {_some(self.mismatched, '; ')}")
        hint = (
            " (restore(..., strict=False) loads only the keys both have)"
            if self.missing or self.unexpected
            else ""
        )
        err = StateMismatchError(
            "checkpoint does not fit the state: " + " | ".join(parts) + hint, phase="restore"
        )
        err.missing, err.unexpected, err.mismatched = self.missing, self.unexpected, self.mismatched  # type: ignore[attr-defined]
        raise err


def _some(items: list[str], sep: str, limit: int = 20) -> str:
    more = f"{sep}... ({len(items) - limit} more)" if len(items) > limit else ""
    return sep.join(items[:limit]) + more


class _Restorer:
    """The two passes of :func:`restore_into`: ``check`` pairs and compares, ``apply`` writes.

    Both walk the live state beside the tree with two key paths: ``key`` (live
    names) and ``skey`` (saved names, what the key map sees). The check pass
    records each dict's pairing, so the apply pass restores exactly what was checked.
    """

    def __init__(
        self, source: TensorSource, meta: TensorMeta, keys: KeyMapper, allow_pickle: bool,
        strict: bool,
    ) -> None:  # fmt: skip
        self.source, self.meta, self.keys = source, meta, keys
        self.allow_pickle, self.strict = allow_pickle, strict
        self.report, self.problems = RestoreReport(), _Problems()
        self.pairings: dict[int, list[_Pair]] = {}  # id(saved dict node) -> its pairs
        # stored key -> the live tensor its bytes may land in; the memory those take
        self.targets: dict[str, torch.Tensor] = {}
        self._claimed: list[tuple[int, int]] = []
        self.owned: Callable[[str], bool] = lambda _stored: False
        self.touched = False  # something live was overwritten
        self.where = "<state>"

    def mismatch(self, key: str, what: str, node: Node) -> None:
        self.problems.mismatched.append(
            f"{key or '<state>'}: {what} in the state, {_describe(node)} in the checkpoint"
        )

    # ---- pass 1: check
    def check(self, live: Any, node: Node, key: str, skey: str) -> None:
        kind = node_kind(node)
        if is_stateful(live):
            self._check_stateful(live, node, kind, key, skey)
        elif isinstance(live, torch.Tensor):
            if kind != "tensor":
                self.mismatch(key, "a tensor", node)
            else:
                self._check_tensor(live, node["tensor"], key)
        elif isinstance(live, Mapping):
            if kind != "dict":
                self.mismatch(key, "a dict", node)
                return
            for live_key, path, spath, child in self._pair(list(live), node, key, skey):
                self.check(live[live_key], child, path, spath)
        elif isinstance(live, (list, tuple)) and _holds_live(live):
            want = "list" if isinstance(live, list) else "tuple"
            if kind != want or len(node[want]) != len(live):
                self.mismatch(key, f"a {want} of {len(live)}", node)
                return
            for i, (lv, sv) in enumerate(zip(live, node[want])):
                self.check(lv, sv, join_key(key, i), join_key(skey, i))

    def _pair(
        self, live_keys: list[Any], node: Node, key: str, skey: str, *, wrappers: bool = False
    ) -> list[_Pair]:
        """Pair a live dict with a saved dict node; report (or, strict, count) the rest."""
        saved = dict(node["dict"])
        found = self.keys.pair(skey, list(saved), live_keys, wrappers=wrappers)
        pairs = [(lk, join_key(key, lk), join_key(skey, k), saved[k]) for lk, k, _ in found.pairs]
        self.report.renamed.update({p[2]: p[1] for p, (_, _, r) in zip(pairs, found.pairs) if r})
        self.report.skipped.extend(join_key(skey, k) for k in found.dropped)
        missing, unexpected = self.report.missing, self.report.skipped
        if self.strict:
            missing, unexpected = self.problems.missing, self.problems.unexpected
        missing.extend(join_key(key, lk) for lk in found.missing)
        unexpected.extend(join_key(skey, k) for k in found.unexpected)
        self.pairings[id(node)] = pairs
        return pairs

    def _check_tensor(self, live: torch.Tensor, stored: str, key: str) -> None:
        dtype, shape = self.meta(stored)
        if live.device.type == "meta":
            self.problems.mismatched.append(
                f"{key}: the state's tensor is on the meta device and can hold no data "
                "(materialize it first, e.g. module.to_empty(device='cpu'))"
            )
        elif tuple(live.shape) != tuple(shape) or live.dtype != dtype:
            self.problems.mismatched.append(
                f"{key}: state has {live.dtype} {list(live.shape)}, checkpoint has {dtype} {list(shape)}"
            )
        elif stored not in self.targets and _landable(live):
            self._claim(stored, live)

    def _claim(self, stored: str, live: torch.Tensor) -> None:
        """Bytes of ``stored`` may land in ``live`` unless another stored tensor's land in the
        same memory (live weights tied, saved ones not): then the apply pass copies them in
        its order, as ``load_state_dict`` would, and the last one wins on every rank."""
        if live.numel() == 0:
            return
        lo = live.data_ptr()
        hi = lo + live.numel() * live.element_size()
        if any(a < hi and lo < b for a, b in self._claimed):
            return
        self._claimed.append((lo, hi))
        self.targets[stored] = live

    def _check_stateful(self, live: Any, node: Node, kind: str, key: str, skey: str) -> None:
        state = node["state"] if kind == "stateful" else node if kind == "dict" else None
        if state is None:
            self.mismatch(key, f"a {type(live).__name__}", node)
        elif isinstance(live, torch.nn.Module):
            if node_kind(state) != "dict":
                self.mismatch(key, f"a {type(live).__name__}", state)
                return
            live_sd = live.state_dict()
            pairs = self._pair(list(live_sd), state, key, skey, wrappers=True)
            if not pairs and live_sd and state["dict"]:
                shown = ", ".join(str(k) for k, _ in state["dict"][:3])
                self.problems.mismatched.append(
                    f"{key}: none of the {len(live_sd)} keys of the {type(live).__name__} is in "
                    f"the checkpoint (it has {shown}, ...): a different model, or a key_map= "
                    "is needed (e.g. pitstop.strip_prefix(...))"
                )
                return
            for live_key, path, _, child in pairs:
                value = live_sd[live_key]
                if isinstance(value, torch.Tensor) and node_kind(child) != "tensor":
                    self.mismatch(path, "a tensor", child)
                elif isinstance(value, torch.Tensor):
                    self._check_tensor(value, child["tensor"], path)
        elif isinstance(live, torch.optim.Optimizer):
            self._check_optimizer(live, state, key)
        # other Statefuls validate in their own load_state_dict

    def _check_optimizer(self, live: torch.optim.Optimizer, node: Node, key: str) -> None:
        """What Optimizer.load_state_dict would refuse or take wrongly, found before anything is touched."""
        saved: dict[Any, Any] = dict(node["dict"]) if node_kind(node) == "dict" else {}
        groups: Any = saved.get("param_groups")
        if node_kind(groups) != "list":
            self.problems.mismatched.append(f"{key}: the checkpoint holds no optimizer state dict")
            return
        sizes = []
        for group in groups["list"]:
            params: Any = dict(group["dict"]).get("params") if node_kind(group) == "dict" else None
            sizes.append(len(params["list"]) if node_kind(params) == "list" else -1)
        live_sizes = [len(g["params"]) for g in live.param_groups]
        if sizes != live_sizes:
            self.problems.mismatched.append(
                f"{key}: parameter groups of sizes {live_sizes} in the state, {sizes} in the checkpoint"
            )
            return
        live_state = live.state_dict()["state"]
        per_param: Any = saved.get("state")
        for index, state in per_param["dict"] if node_kind(per_param) == "dict" else ():
            have = live_state.get(index)
            if not isinstance(have, Mapping) or node_kind(state) != "dict":
                continue
            for name, value in state["dict"]:
                if isinstance(have.get(name), torch.Tensor) and node_kind(value) == "tensor":
                    path = join_key(join_key(join_key(key, "state"), index), name)
                    self._check_tensor(have[name], value["tensor"], path)

    # ---- pass 2: apply
    def _builder(self, live: dict[str, torch.Tensor | None] | None = None) -> Builder:
        return Builder(
            self.source, self.keys, allow_pickle=self.allow_pickle, live=live, on_copy=self._touch,
            clone=lambda stored: not self.owned(stored),
        )  # fmt: skip

    def _touch(self) -> None:
        self.touched = True

    def apply(self, live: Any, node: Node, key: str, skey: str) -> Any:
        """Restore ``node`` into ``live``; returns the value the parent should hold."""
        self.where = key or "<state>"
        if is_stateful(live):
            self._apply_stateful(live, node, key, skey)
            return live
        if isinstance(live, torch.Tensor):
            self.touched = True
            copy_into(live, self.source(node["tensor"]))
            return live
        if isinstance(live, Mapping):
            pairs = self.pairings[id(node)]
            last = [p for p in pairs if getattr(live[p[0]], "restore_last", False) is True]
            first = [p for p in pairs if getattr(live[p[0]], "restore_last", False) is not True]
            for live_key, path, spath, child in first + last:
                old = live[live_key]
                new = self.apply(old, child, path, spath)
                if new is not old:
                    self.touched = True
                    live[live_key] = new  # type: ignore[index]
            return live
        if isinstance(live, (list, tuple)) and _holds_live(live):
            items = node["list" if isinstance(live, list) else "tuple"]
            values = []
            for i, (lv, sv) in enumerate(zip(live, items)):
                values.append(self.apply(lv, sv, join_key(key, i), join_key(skey, i)))
            return _same_kind(live, values, self._touch)
        value = self._builder().build(node, key, skey)
        return _same_kind(live, value, self._touch) if isinstance(value, list) else value

    def _apply_stateful(self, live: Any, node: Node, key: str, skey: str) -> None:
        state = node["state"] if node_kind(node) == "stateful" else node
        live_sd = live.state_dict()
        live_tensors: dict[str, torch.Tensor | None] = {}
        _live_tensors(live_sd, key, live_tensors)
        builder = self._builder(live_tensors)
        if not isinstance(live, torch.nn.Module):
            live.load_state_dict(builder.build(state, key, skey))
            self.touched = True
            if isinstance(live, torch.optim.Optimizer) and live.state:
                # it stepped before the checkpoint: an LR scheduler stepped next (a resume at
                # an epoch's end) must not warn "lr_scheduler.step() before optimizer.step()"
                live._opt_called = True  # type: ignore[attr-defined]
            return
        sd: Any = collections.OrderedDict()
        for live_key, path, spath, child in self.pairings[id(state)]:
            sd[live_key] = builder.build(child, path, spath)
        if "meta" in state:
            meta = builder.build(
                state["meta"], join_key(key, "_metadata"), join_key(skey, "_metadata")
            )
            live_meta = getattr(live_sd, "_metadata", None)
            if isinstance(meta, dict) and isinstance(live_meta, Mapping):
                renames = wrapper_renames(list(meta), list(live_meta))
                meta = collections.OrderedDict((renames.get(k, k), v) for k, v in meta.items())
            sd._metadata = meta
        live.load_state_dict(sd, strict=self.strict)
        self.touched = True

    def failure(self, error: Exception) -> Exception:
        """The error to raise for ``error`` in the apply pass."""
        what = f"{type(error).__name__}: {error}"
        if self.touched:
            return PartialRestoreError(
                f"restore failed at {self.where!r} ({what}); the live state is partly restored: "
                "do not train from it",
                phase="restore",
            )
        if isinstance(error, StateMismatchError | CorruptCheckpointError | MissingExtraError):
            return error
        return StateMismatchError(
            f"restore failed at {self.where!r} ({what}) before anything else was overwritten",
            phase="restore",
        )


def _same_kind(live: Any, values: list[Any], touch: Callable[[], None]) -> Any:
    """Values for a live list (updated in place, so references stay valid) or tuple."""
    if isinstance(live, list):
        touch()
        live[:] = values
        return live
    return tuple(values) if isinstance(live, tuple) else values


def _describe(node: Node) -> str:
    kind = node_kind(node)
    return f"a {kind}" if kind != "value" else f"the value {str(node)[:60]!r}"


def _landable(t: torch.Tensor) -> bool:
    """Whether restored bytes can be copied straight into live tensor ``t`` (a plain dense
    tensor on the host or a GPU; a DTensor takes its box from the whole tensor later)."""
    return (
        not is_dtensor(t)
        and t.layout == torch.strided
        and t.device.type in ("cpu", "cuda")
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
    )


def _holds_live(value: Any) -> bool:
    """Whether a live container holds tensors or Statefuls (then it is restored element-wise)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor) or is_stateful(v):
            return True
        if isinstance(v, (Mapping, list, tuple)) and id(v) not in seen:
            seen.add(id(v))
            items = list(v.values()) if isinstance(v, Mapping) else v
            if not _PLAIN.issuperset(map(type, items)):  # a list of floats: nothing to look at
                stack.extend(items)
    return False


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


class RestorePlan:
    """A restore checked against the live state, not yet applied (:func:`plan_restore`).

    ``targets`` maps stored tensor keys to the live tensors of the same dtype and shape
    that their bytes may be read straight into; ``used`` is every stored tensor key the
    restore loads (a partial restore reads nothing else); ``report`` says what will be
    loaded.
    """

    def __init__(self, state: Mapping[str, Any], tree: Node, restorer: _Restorer) -> None:
        self._state, self._tree, self._restorer = state, tree, restorer
        self.targets = restorer.targets
        self.report = restorer.report
        self.used = _used_keys(tree, restorer.pairings)

    def apply(
        self,
        source: TensorSource,
        *,
        owned: Callable[[str], bool] | None = None,
        touched: bool = False,
    ) -> RestoreReport:
        """Load into the live state. ``source(stored)`` returns the saved tensor (a target
        itself where its bytes were read into one); ``owned(stored)``: the state may keep
        that tensor without a copy; ``touched``: the live state was written already.
        Raises PartialRestoreError after something was overwritten."""
        restorer = self._restorer
        restorer.source, restorer.touched = source, touched
        if owned is not None:
            restorer.owned = owned
        try:
            with torch.no_grad():
                restorer.apply(self._state, self._tree, "", "")
        except Exception as e:
            raise restorer.failure(e) from e
        return restorer.report


def plan_restore(
    state: Mapping[str, Any],
    tree: Node,
    meta: TensorMeta,
    *,
    allow_pickle: bool = False,
    strict: bool = True,
    key_map: KeyMap | None = None,
) -> RestorePlan:
    """Pair the live ``state`` with a saved tree and check it (see the module docstring);
    raises StateMismatchError (or PickleRefusedError, a bad key map) before anything is
    touched. ``meta(stored_key)`` gives a stored tensor's dtype and shape."""
    keys = KeyMapper(key_map)
    scan(tree, "", allow_pickle, keys)
    restorer = _Restorer(_unread, meta, keys, allow_pickle, strict)
    try:
        restorer.check(state, tree, "", "")
    except RecursionError:
        raise StateMismatchError(
            "the state nests too deeply to restore in place; load it with pitstop.load(path)",
            phase="restore",
        ) from None
    top = restorer.pairings.get(id(tree), [])
    if not strict and state and not top:
        restorer.problems.mismatched.append(
            f"none of the state's keys ({', '.join(map(str, list(state)[:5]))}) is in the "
            f"checkpoint (it has {', '.join(str(k) for k, _ in tree['dict'][:5])}): nothing to load"
        )
    restorer.problems.raise_if_any()
    restorer.report.loaded = [str(pair[0]) for pair in top]
    return RestorePlan(state, tree, restorer)


def _used_keys(tree: Node, pairings: dict[int, list[_Pair]]) -> set[str]:
    """The stored tensor keys under the paired parts of ``tree`` (a dict the check pass
    paired contributes its paired entries only; anything else all of its tensors)."""
    used: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        kind = node_kind(node)
        if kind == "stateful":
            stack.append(node["state"])
        elif id(node) in pairings:
            stack.extend(pair[3] for pair in pairings[id(node)])
            if "meta" in node:
                stack.append(node["meta"])
        else:
            for _, k, n in walk_objects(node):
                if k in ("tensor", "ndarray"):
                    used.add(n[k])
    return used


def _unread(stored: str) -> torch.Tensor:  # pragma: no cover - the check pass reads no tensor
    raise AssertionError(f"tensor {stored!r} read before the restore was applied")


def restore_into(
    state: Mapping[str, Any],
    tree: Node,
    source: TensorSource,
    meta: TensorMeta,
    *,
    allow_pickle: bool = False,
    strict: bool = True,
    key_map: KeyMap | None = None,
) -> RestoreReport:
    """Restore a saved tree into the live ``state`` in place (see the module docstring).

    ``source(stored_key)`` returns the saved tensor (copied, never kept);
    ``meta(stored_key)`` its dtype and shape, so the check pass reads nothing.
    ``key_map`` (see ``state.keys``) renames or drops saved entries. Raises
    StateMismatchError before anything is touched, PartialRestoreError after.
    """
    plan = plan_restore(
        state, tree, meta, allow_pickle=allow_pickle, strict=strict, key_map=key_map
    )
    return plan.apply(source)
