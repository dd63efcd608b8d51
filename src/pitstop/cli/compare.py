"""Comparing two loaded states value by value: what ``pitstop diff`` and ``crashtest`` print.

Two states are the same when they have the same structure (dict keys, list and tuple
lengths, and the container kinds themselves: a tuple is not a list), every tensor has the
same dtype, shape and *bytes* (so NaNs compare equal to themselves and -0.0 differs from
0.0: a resume must be bit for bit), and every other value is equal and of the same type.

A tensor here is a ``torch.Tensor`` or a numeric NumPy array (both compared bit for bit).
The tensors compared are those of ``a`` and ``b`` together, by key path, less the ignored
ones: a tensor in one state only, or under a key whose structure differs, is compared (and
differs), so the tensors that differ never outnumber the tensors compared.

Call sequence (the CLI's thread): ``compare(a, b, ignore=...)`` -> a list of
:class:`Difference` in the order a walk of ``a`` meets them (then keys only in ``b``);
``compare_counted`` -> the same and how many tensors were compared;
``format_differences(diffs, limit)`` -> lines to print; ``run_diff(args)`` for ``pitstop diff``.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import pickle
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pitstop.state.tree import join_key

__all__ = [
    "Difference",
    "compare",
    "compare_counted",
    "count_tensors",
    "format_differences",
    "load_ranks",
    "run_diff",
]


@dataclass(frozen=True)
class Difference:
    """One key path at which the two states differ. ``max_abs`` is the largest absolute
    difference of two tensors (or numbers) of the same shape, where it can be computed;
    ``tensors`` how many tensors (of ``a`` and ``b`` together, by key path) the difference
    covers: 1 at a tensor, every tensor beneath a key only in one state or whose structure
    differs; ``is_tensor``: it covers any."""

    key: str
    what: str
    max_abs: float | None = None
    is_tensor: bool = False
    tensors: int = 0


def _array_module(value: Any) -> Any:
    mod = type(value).__module__
    if mod.startswith("numpy"):
        import numpy

        return numpy
    return None


def _max_abs(x: torch.Tensor, y: torch.Tensor) -> float | None:
    if x.numel() == 0 or x.is_complex() or x.dtype == torch.bool:
        return None
    d = (x.double() - y.double()).abs()
    finite = d[~torch.isnan(d)]
    return float(finite.max()) if finite.numel() else math.nan


def _is_tensor(value: Any) -> bool:
    """A value compared as a tensor: a ``torch.Tensor`` or a numeric NumPy array."""
    if isinstance(value, torch.Tensor):
        return True
    np = _array_module(value)
    return np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc"


def _tensor_difference(key: str, x: torch.Tensor, y: torch.Tensor) -> Difference | None:
    if x.dtype != y.dtype or x.shape != y.shape:
        what = f"{x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}"
        return Difference(key, what, is_tensor=True, tensors=1)
    xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if torch.equal(xb, yb):
        return None
    return Difference(key, "values differ", _max_abs(x.cpu(), y.cpu()), is_tensor=True, tensors=1)


def _same_value(x: Any, y: Any) -> bool:
    """Equal as a resume must keep them: floats and NumPy values bit for bit (NaN equals
    NaN, -0.0 is not 0.0), objects without an ``==`` of their own by their pickles."""
    np = _array_module(x)
    if np is not None and isinstance(x, (np.ndarray, np.generic)):
        return bool(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes())
    if isinstance(x, (float, complex)):
        return struct.pack("<2d", *_parts(x)) == struct.pack("<2d", *_parts(y))
    try:
        same = bool(x == y)
    except Exception:  # a value whose == does not give a truth value
        same = False
    if not same and type(x).__eq__ is object.__eq__:  # identity only: compare contents
        try:
            same = pickle.dumps(x) == pickle.dumps(y)
        except Exception:
            same = repr(x) == repr(y)
    return same


def _parts(v: float | complex) -> tuple[float, float]:
    c = complex(v)
    return (c.real, c.imag)


def _leaf_difference(key: str, x: Any, y: Any) -> Difference | None:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return _tensor_difference(key, x, y)
    tensor = _is_tensor(x) or _is_tensor(y)  # e.g. a tensor in A, a number in B
    if type(x) is not type(y) or _is_tensor(x) != _is_tensor(y):
        kinds = (type(x).__name__, type(y).__name__)
        if kinds[0] == kinds[1]:  # NumPy arrays, one numeric, one not
            kinds = (f"{kinds[0]} of {x.dtype}", f"{kinds[1]} of {y.dtype}")
        return Difference(key, f"{kinds[0]} vs {kinds[1]}", is_tensor=tensor, tensors=int(tensor))
    if tensor:  # two numeric NumPy arrays
        return _tensor_difference(key, torch.from_numpy(x), torch.from_numpy(y))
    if _same_value(x, y):
        return None
    detail = f"{_short(x)} vs {_short(y)}"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Difference(key, detail, abs(float(x) - float(y)))
    return Difference(key, detail)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _children(node: Any) -> tuple[str, list[tuple[Any, Any]]] | None:
    if isinstance(node, Mapping):
        return "dict", list(node.items())
    if type(node) in (list, tuple):
        return type(node).__name__, list(enumerate(node))
    return None


def compare(a: Any, b: Any, *, ignore: Iterable[str] = ()) -> list[Difference]:
    """Every difference between ``a`` and ``b`` (loaded states); key paths matching a glob
    of ``ignore`` (``progress/wall_secs``, ``*/timestamp``) are skipped with their subtrees."""
    return compare_counted(a, b, ignore=ignore)[0]


def compare_counted(a: Any, b: Any, *, ignore: Iterable[str] = ()) -> tuple[list[Difference], int]:
    """:func:`compare`'s differences and how many tensors were compared: those of ``a`` and
    ``b`` together, by key path, not ignored (so ``sum(d.tensors for d in diffs)`` is at
    most that many)."""
    patterns = list(ignore)
    out: list[Difference] = []
    compared = 0

    def skipped(key: str) -> bool:
        return bool(key) and any(fnmatch.fnmatchcase(key, p) for p in patterns)

    def covering(key: str, what: str, *sides: Any) -> Difference:
        nonlocal compared
        n = len(set().union(*(_tensor_paths(key, side, skipped) for side in sides)))
        compared += n
        return Difference(key, what, is_tensor=n > 0, tensors=n)

    todo: list[tuple[str, Any, Any]] = [("", a, b)]
    while todo:
        key, x, y = todo.pop()
        if skipped(key):
            continue
        cx, cy = _children(x), _children(y)
        if cx is None or cy is None:
            if cx is not None or cy is not None:
                out.append(covering(key, f"{type(x).__name__} vs {type(y).__name__}", x, y))
            else:
                compared += _is_tensor(x) or _is_tensor(y)
                diff = _leaf_difference(key, x, y)
                if diff is not None:
                    out.append(diff)
            continue
        if cx[0] != cy[0]:
            out.append(covering(key, f"{cx[0]} vs {cy[0]}", x, y))
            continue
        xs, ys = dict(cx[1]), dict(cy[1])
        pending = []
        for k, v in cx[1]:
            sub = join_key(key, k)
            if k in ys:
                pending.append((sub, v, ys[k]))
            elif not skipped(sub):
                out.append(covering(sub, "only in A", v))
        for k, v in cy[1]:
            sub = join_key(key, k)
            if k not in xs and not skipped(sub):
                out.append(covering(sub, "only in B", v))
        todo.extend(reversed(pending))
    return out, compared


def _tensor_paths(key: str, tree: Any, skipped: Any) -> set[str]:
    """The key paths of the tensors in ``tree`` (at ``key``) that ``skipped`` does not skip."""
    paths: set[str] = set()
    todo = [(key, tree)]
    while todo:
        path, node = todo.pop()
        if path != key and skipped(path):
            continue
        if _is_tensor(node):
            paths.add(path)
            continue
        kids = _children(node)
        if kids is not None:
            todo.extend((join_key(path, k), v) for k, v in kids[1])
    return paths


def format_differences(diffs: list[Difference], limit: int = 20) -> list[str]:
    """One line per difference: the first ``limit`` plain values (few, and often what tells:
    a learning rate, a counter), then the first ``limit`` tensors."""
    values = [d for d in diffs if not d.is_tensor]
    tensors = [d for d in diffs if d.is_tensor]
    shown = values[:limit] + tensors[:limit]
    width = min(max((len(d.key) for d in shown), default=10), 70)
    lines = []
    for d in shown:
        extra = "" if d.max_abs is None else f"  max |a-b| = {d.max_abs:.6g}"
        lines.append(f"  {d.key:{width}}  {d.what}{extra}")
    hidden = len(diffs) - len(shown)
    if hidden:
        lines.append(f"  ... and {hidden} more (--show N shows more)")
    return lines


def count_tensors(tree: Any) -> int:
    """Tensors (and numeric NumPy arrays) in a loaded state (one reached twice counts twice)."""
    n, todo = 0, [tree]
    while todo:
        node = todo.pop()
        if _is_tensor(node):
            n += 1
        else:
            kids = _children(node)
            if kids is not None:
                todo.extend(v for _, v in kids[1])
    return n


def run_diff(args: argparse.Namespace) -> int:
    """``pitstop diff A B``: every tensor and value; exit 1 if anything differs (as diff)."""
    from pitstop.oneshot import resolve

    (_, a, ranks_a), (_, b, ranks_b) = (
        load_ranks(*resolve(path, step), allow_pickle=args.allow_pickle)
        for path, step in ((args.a, args.step_a), (args.b, args.step_b))
    )
    if ranks_a != ranks_b:
        print(f"saved by {ranks_a} vs {ranks_b} ranks: the ranks' own values differ in number")
    diffs, compared = compare_counted(a, b, ignore=args.ignore or ())
    for line in format_differences(diffs, limit=args.show):
        print(line)
    differ = sum(d.tensors for d in diffs)  # at most `compared`: counted over the same paths
    others = sum(not d.is_tensor for d in diffs)
    print(
        f"{compared} tensors (in A, B or both) and every other value compared: "
        f"{differ} tensors and {others} other values differ"
    )
    return 1 if diffs else 0


def load_ranks(root: str, step: int | None, *, allow_pickle: bool = False) -> tuple[int, Any, int]:
    """A checkpoint of ``root`` (``step``, or the newest valid one) as one process sees every
    rank of it: the step, the state (a dict ``rank<r>`` -> that rank's state when several
    ranks saved it, each with its own RNG streams and data position), and the rank count."""
    from pitstop.manager import CheckpointManager
    from pitstop.options import SaveOptions

    options = SaveOptions.from_env(allow_pickle=allow_pickle, max_in_flight=1)
    with CheckpointManager(root, options=options) as mgr:
        first = mgr.load(step)
        info = mgr.last_restore
        assert info is not None and info.step is not None and info.manifest is not None
        ranks = info.manifest.world_size
        if ranks == 1:
            return info.step, first, 1
        views = {"rank0": first}
        views.update({f"rank{r}": mgr.load(info.step, rank=r) for r in range(1, ranks)})
        return info.step, views, ranks
