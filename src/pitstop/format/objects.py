"""objects-NNNNN.json: one rank's structure tree and plain values, written and strictly parsed. No torch.

The file wraps the tree that :mod:`pitstop.state.tree` builds::

    {"format": "pitstop-objects", "format_version": 3, "rank": 0, "tree": <node>}

A node is a JSON scalar (null, bool, int, str, finite float), or an object of
exactly one kind (key paths of children are built as in ``state.tree.join_key``)::

    {"dict": [[key, node], ...], "ordered": true, "meta": node}   key: str/int/float/bool/null
    {"list": [node, ...]}        {"tuple": [node, ...]}
    {"tensor": "model/fc.weight"}     {"ndarray": "rng/numpy/1"}   (a key of the manifest)
    {"stateful": "torch.optim.adam.Adam", "state": node, "params": ["model/fc.weight", null]}
    {"float": "nan" | "inf" | "-inf"}     {"bytes": "<base64>"}     {"int": "<decimal>"}
    {"npscalar": ["int64", 3]}   {"npscalar": ["complex64", [re, im]]}
    {"pickle": "<base64>", "type": "mod.Class"}

``params`` (optional, optimizers only) lists the stored key of each parameter in
the order of the optimizer's integer ids, null for one stored nowhere else: at
most :data:`MAX_OPTIMIZER_PARAMS` entries, each a key of the manifest. Restoring
ignores it; ``pitstop export`` names optimizer state by parameter with it.

Version 2 adds ``{"int": ...}`` (integers of 2**53 and more, so JSON tools keep
them exact) and complex NumPy scalars; version 3 adds ``params``. Files of
versions 1 and 2 still parse.

:func:`parse_objects` checks every node against this grammar in one iterative
pass, linear in the file's size, and raises :class:`~pitstop.errors.ManifestError`
naming the file and the key path of the first bad node. The pass visits nodes that
are JSON objects one by one, in pre-order, holding one lazy iterator per open container
(memory in the depth of the tree, none per node; a key path is made only for an error
message); the plain values of a list or dict (a loss history of a million floats) are
checked together, with no Python call of their own. So a file costs little more than its
parse (docs/format.md: 2x its size for small ints, about 25x for small nodes). A file
of more than :data:`~pitstop.format.jsonsafe.MAX_VALUES` values is refused before it
is parsed, and :func:`encode_objects` writes none; one that does not fit in memory is a
ManifestError, not a MemoryError. Code that restores a
parsed tree may rely on it: no node can make it raise ``TypeError``,
``ValueError``, ``KeyError`` or ``IndexError``.

Call sequence: ``encode_objects`` on the persist thread of the saver;
``parse_objects`` wherever an objects file is read (restore on the training
thread, ``pitstop verify``). Both are pure functions, safe in any thread.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
from collections.abc import Callable, Collection, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from pitstop.errors import FormatVersionError, ManifestError, UnsupportedValueError
from pitstop.format.jsonsafe import (
    MAX_VALUES,
    json_shape,
    load_json,
    out_of_memory,
    recursion_room,
)

__all__ = [
    "MAX_INT_DIGITS",
    "MAX_OPTIMIZER_PARAMS",
    "MAX_TREE_DEPTH",
    "NPSCALAR_DTYPES",
    "OBJECTS_FORMAT",
    "OBJECTS_VERSION",
    "check_state_tree",
    "encode_objects",
    "parse_objects",
]

OBJECTS_FORMAT = "pitstop-objects"
OBJECTS_VERSION = 3

MAX_TREE_DEPTH = 512
"""Containers (dict, list, tuple, stateful) a reader accepts around any node; savers stop at 500."""
MAX_OPTIMIZER_PARAMS = 1 << 24
"""Entries of a stateful node's ``params`` (``state.tree`` writes none beyond)."""
MAX_INT_DIGITS = 4000
"""Decimal digits of an ``{"int": ...}`` node (Python itself converts up to 4300)."""
_V1_INT_DIGITS = 4300  # version 1 wrote big ints as JSON numbers, up to Python's own limit

NPSCALAR_DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("b", 8),
    **{f"int{b}": ("i", b) for b in (8, 16, 32, 64)},
    **{f"uint{b}": ("u", b) for b in (8, 16, 32, 64)},
    **{f"float{b}": ("f", b) for b in (16, 32, 64)},
    **{f"complex{b}": ("c", b) for b in (64, 128)},
}
"""NumPy scalar dtypes that a JSON value holds exactly: name -> (kind, bits)."""

_FLOAT_WORDS = frozenset({"nan", "inf", "-inf"})
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_DECIMAL = re.compile(r"-?[0-9]+")
_JSON_LEVELS_PER_NODE = 3  # {"dict": [[key, node]]} nests three JSON levels per tree level
_PLAIN = frozenset({type(None), bool, int, str})  # nodes that need no check (ints: the parser's)
_KEY_TYPES = _PLAIN | {float}

# node kind -> (keys it must have, keys it may have)
_SHAPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "dict": (frozenset({"dict"}), frozenset({"ordered", "meta"})),
    "list": (frozenset({"list"}), frozenset()),
    "tuple": (frozenset({"tuple"}), frozenset()),
    "tensor": (frozenset({"tensor"}), frozenset()),
    "ndarray": (frozenset({"ndarray"}), frozenset()),
    "stateful": (frozenset({"stateful", "state"}), frozenset({"params"})),
    "float": (frozenset({"float"}), frozenset()),
    "bytes": (frozenset({"bytes"}), frozenset()),
    "int": (frozenset({"int"}), frozenset()),
    "npscalar": (frozenset({"npscalar"}), frozenset()),
    "pickle": (frozenset({"pickle", "type"}), frozenset()),
}

_ALONE = frozenset(kind for kind, (required, _) in _SHAPES.items() if required == {kind})
"""Kinds whose node may hold its own key alone: ``{"list": [...]}``."""

_Children = Iterator[tuple[Any, Any]]
"""(key or index, child) of a node's children that the pass visits one by one."""
_SAME: Any = object()  # the part of a stateful's state: its key path is the stateful's


def encode_objects(tree: object, rank: int, *, max_values: int = MAX_VALUES) -> bytes:
    """The objects file of ``rank`` for ``tree`` (compact JSON; non-finite floats refused).

    A tree of more than ``max_values`` values (what a reader accepts) raises
    UnsupportedValueError: pitstop never writes a file that it would not read."""
    doc = {"format": OBJECTS_FORMAT, "format_version": OBJECTS_VERSION, "rank": rank, "tree": tree}
    try:
        text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    except RecursionError:  # a deep tree: the C encoder recurses once per JSON level
        with recursion_room(_JSON_LEVELS_PER_NODE * MAX_TREE_DEPTH + 16):
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    data = text.encode()
    values = json_shape(data).values
    if values > max_values:
        raise UnsupportedValueError(
            f"the objects file of rank {rank} would hold {values} values, more than "
            f"{max_values} values, the limit of a reader (MAX_VALUES): store long lists of "
            "numbers as a tensor or a NumPy array"
        )
    return data


def parse_objects(
    data: bytes,
    *,
    name: str,
    tensor_keys: Collection[str],
    path: str | None = None,
    max_depth: int = MAX_TREE_DEPTH,
    max_values: int = MAX_VALUES,
) -> Any:
    """The validated tree of objects file ``name``, or ManifestError naming the bad node.

    ``tensor_keys`` are the manifest's keys of this rank: a node that refers to
    another key is an error (keys the tree never uses are fine). ``max_depth``
    bounds the containers around any node, ``max_values`` the values of the file
    (checked before it is parsed). A newer format version raises FormatVersionError.
    A file that does not fit in memory raises ManifestError, not MemoryError.
    """
    keys = tensor_keys if isinstance(tensor_keys, AbstractSet) else frozenset(tensor_keys)
    try:
        return _parse_and_check(data, name, path, keys, max_depth, max_values)
    except MemoryError:
        pass  # the tree goes with the error's frames: the message below has room
    raise out_of_memory(name, len(data), path)


def _parse_and_check(
    data: bytes, name: str, path: str | None, keys: AbstractSet[str], max_depth: int,
    max_values: int,
) -> Any:  # fmt: skip
    doc = load_json(
        data, what=name, path=path, max_depth=_JSON_LEVELS_PER_NODE * max_depth + 8,
        max_int_digits=_V1_INT_DIGITS, max_values=max_values,
    )  # fmt: skip
    tree = _check_wrapper(doc, name, path)
    _Validator(name, path, keys, max_depth).run(tree)
    return tree


def check_state_tree(tree: Any, *, name: str, path: str | None = None) -> None:
    """A saved state is a dict of str keys (what ``flatten`` writes): anything else at the top
    of a (validated) tree is damage."""
    items = tree.get("dict") if isinstance(tree, dict) else None
    if not isinstance(items, list) or not all(isinstance(item[0], str) for item in items):
        raise ManifestError(
            f"{name}: the tree is not a dict of named values, as a state is", path=path
        )


def _check_wrapper(doc: Any, name: str, path: str | None) -> Any:
    if not isinstance(doc, dict) or doc.get("format") != OBJECTS_FORMAT:
        raise ManifestError(f"{name}: not a pitstop objects file", path=path)
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ManifestError(
            f"{name}: format_version {_short(version)} is not a positive int", path=path
        )
    if version > OBJECTS_VERSION:
        raise FormatVersionError(
            f"{name} is in objects format {version}; this pitstop reads formats up to "
            f"{OBJECTS_VERSION}: upgrade pitstop",
            path=path,
        )
    expected = {"format", "format_version", "rank", "tree"}
    if set(doc) != expected:
        extra, lacking = sorted(set(doc) - expected), sorted(expected - set(doc))
        raise ManifestError(
            f"{name}: the wrapper has unexpected keys {extra} or lacks {lacking}", path=path
        )
    if not _is_int(doc["rank"]) or doc["rank"] < 0:
        raise ManifestError(
            f"{name}: rank {_short(doc['rank'])} is not a non-negative int", path=path
        )
    return doc["tree"]


def _short(value: object) -> str:
    """A value for a message: ints and short strings as they are, anything else by type (a
    crafted value may be nested too deep for repr)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**30:
        return repr(value)
    if isinstance(value, str) and len(value) < 40:
        return repr(value)
    return f"(a {type(value).__name__})"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _escape(part: object) -> str:
    return str(part).replace("%", "%25").replace("/", "%2F")


class _Validator:
    """One iterative pass over the nodes that are JSON objects, in pre-order.

    Each open container holds one lazy iterator of its children that are JSON objects (and
    its ``meta`` or ``state``), so the pass holds memory in the depth of the tree, not in the
    number of children: nothing is made per child. A check function checks a node and the
    plain values among its children at once and returns that iterator (None if there is
    none). ``parts`` is the key path of the node being checked, one part per open container
    (:data:`_SAME` for a stateful's state, which has no part of its own); a path string is
    made only for an error message.
    """

    def __init__(
        self, name: str, path: str | None, tensor_keys: AbstractSet[str], max_depth: int
    ) -> None:
        self.name, self.file_path, self.tensor_keys = name, path, tensor_keys
        self.max_depth = max_depth
        self.parts: list[Any] = []
        self.checks: dict[str, Callable[[dict[str, Any], int], _Children | None]] = {
            "dict": self._dict,
            "list": self._sequence,
            "tuple": self._sequence,
            "tensor": self._tensor,
            "ndarray": self._tensor,
            "stateful": self._stateful,
            "float": self._float,
            "bytes": self._bytes,
            "int": self._int,
            "npscalar": self._npscalar,
            "pickle": self._pickle,
        }

    def fail(self, what: str, *child: Any) -> ManifestError:
        """The error for the node being checked (or its ``child``, a key or index) and ``what``."""
        parts = [_escape(part) for part in (*self.parts, *child) if part is not _SAME]
        shown = "/".join(parts) or "<state>"
        if len(shown) > 200:
            shown = f"{shown[:120]}...{shown[-60:]}"
        return ManifestError(f"{self.name}: node at {shown!r} {what}", path=self.file_path)

    def too_deep(self, child: Any) -> ManifestError:
        return self.fail(f"lies more than {self.max_depth} containers deep", child)

    def run(self, tree: Any) -> None:
        parts, checks, kind_of = self.parts, self.checks, self._kind
        stack: list[_Children] = [iter(((_SAME, tree),))]
        parts.append(_SAME)
        while stack:
            item = next(stack[-1], None)
            if item is None:
                stack.pop()
                parts.pop()
                continue
            parts[-1], node = item
            kind = type(node)
            if kind is dict:
                inner = checks[kind_of(node)](node, len(stack) - 1)
                if inner is not None:
                    stack.append(inner)
                    parts.append(_SAME)
            elif kind is float:
                if not math.isfinite(node):
                    raise self.fail(f"is the non-finite number {node!r}")
            elif kind not in _PLAIN:
                raise self.fail(f"is a bare JSON {kind.__name__}, not a node")

    def _kind(self, node: dict[str, Any]) -> str:
        if len(node) == 1:  # most nodes: {"list": [...]}, {"tensor": "..."}, ...
            (kind,) = node
            if kind in _ALONE:
                return kind
        kinds = [k for k in node if k in _SHAPES]
        if len(kinds) != 1:
            what = "names no node kind" if not kinds else f"names several node kinds {kinds}"
            raise self.fail(f"{what} (keys {sorted(node)[:8]})")
        kind = kinds[0]
        required, optional = _SHAPES[kind]
        keys = set(node)
        if not required <= keys or not keys <= required | optional:
            raise self.fail(
                f"is a {kind} node with keys {sorted(keys)[:8]}, expected {sorted(required)}"
            )
        return kind

    def _items(self, items: list[Any], depth: int) -> _Children | None:
        """A list node's items: plain values are checked together (a type at a time, in C),
        so a list of a million numbers takes no Python step per number; the items that are
        nodes are returned, lazily."""
        if not items:
            return None
        if depth >= self.max_depth:
            raise self.too_deep(0)
        types = set(map(type, items))
        if float in types:
            floats = items if len(types) == 1 else [v for v in items if type(v) is float]
            if not all(map(math.isfinite, floats)):
                i, bad = next(
                    (i, v) for i, v in enumerate(items)
                    if type(v) is float and not math.isfinite(v)
                )  # fmt: skip
                raise self.fail(f"is the non-finite number {bad!r}", i)
        if list in types:
            i = next(i for i, v in enumerate(items) if type(v) is list)
            raise self.fail("is a bare JSON list, not a node", i)
        if dict not in types:
            return None
        if len(types) == 1:
            return enumerate(items)
        return ((i, v) for i, v in enumerate(items) if type(v) is dict)

    def _dict(self, node: dict[str, Any], depth: int) -> _Children | None:
        items = node["dict"]
        if not isinstance(items, list):
            raise self.fail("is a dict node whose entries are not a list")
        if not isinstance(node.get("ordered", False), bool):
            raise self.fail("is a dict node whose 'ordered' is not a bool")
        has_meta = "meta" in node
        if has_meta and depth >= self.max_depth:
            raise self.too_deep("_metadata")
        seen: set[Any] = set()
        nodes = False
        for i, entry in enumerate(items):
            if type(entry) is not list or len(entry) != 2:
                raise self.fail(f"is a dict node whose entry {i} is not a [key, node] pair")
            key, child = entry
            if type(key) not in _KEY_TYPES:
                raise self.fail(f"is a dict node with a key of JSON type {type(key).__name__}")
            if type(key) is float and not math.isfinite(key):
                raise self.fail(f"is a dict node with the non-finite key {key!r}")
            if key in seen:
                raise self.fail(f"is a dict node that names the key {key!r} twice")
            seen.add(key)
            kind = type(child)
            if kind is dict:
                nodes = True
            elif kind is float:
                if not math.isfinite(child):
                    raise self.fail(f"is the non-finite number {child!r}", key)
            elif kind not in _PLAIN:
                raise self.fail(f"is a bare JSON {kind.__name__}, not a node", key)
        del seen
        if items and depth >= self.max_depth:
            raise self.too_deep(items[0][0])
        inner = ((k, v) for k, v in items if type(v) is dict) if nodes else None
        if not has_meta:
            return inner
        meta = (("_metadata", node["meta"]),)
        return iter(meta) if inner is None else itertools.chain(inner, meta)

    def _sequence(self, node: dict[str, Any], depth: int) -> _Children | None:
        kind = "list" if "list" in node else "tuple"
        items = node[kind]
        if not isinstance(items, list):
            raise self.fail(f"is a {kind} node whose items are not a list")
        return self._items(items, depth)

    def _tensor(self, node: dict[str, Any], depth: int) -> None:
        kind = "tensor" if "tensor" in node else "ndarray"
        key = node[kind]
        if not isinstance(key, str):
            raise self.fail(f"is a {kind} node whose key is not a str")
        if key not in self.tensor_keys:
            raise self.fail(f"refers to tensor {key[:200]!r}, which the manifest lacks")

    def _stateful(self, node: dict[str, Any], depth: int) -> _Children:
        if not isinstance(node["stateful"], str):
            raise self.fail("is a stateful node whose type name is not a str")
        if "params" in node:
            self._params(node["params"])
        if depth >= self.max_depth:
            raise self.too_deep(_SAME)
        return iter(((_SAME, node["state"]),))

    def _params(self, params: Any) -> None:
        if not isinstance(params, list) or len(params) > MAX_OPTIMIZER_PARAMS:
            raise self.fail(
                f"is a stateful node whose 'params' is not a list of at most "
                f"{MAX_OPTIMIZER_PARAMS} keys",
            )  # fmt: skip
        for i, key in enumerate(params):
            if key is not None and not isinstance(key, str):
                raise self.fail(f"is a stateful node whose 'params' entry {i} is not a key or null")
            if key is not None and key not in self.tensor_keys:
                raise self.fail(
                    f"is a stateful node whose 'params' entry {i} names tensor "
                    f"{key[:200]!r}, which the manifest lacks",
                )  # fmt: skip

    def _float(self, node: dict[str, Any], depth: int) -> None:
        if not _float_word(node["float"]):
            raise self.fail(f"is a float node of {_short(node['float'])}, not nan/inf/-inf")

    def _bytes(self, node: dict[str, Any], depth: int) -> None:
        if not _is_base64(node["bytes"]):
            raise self.fail("is a bytes node that is not valid base64")

    def _int(self, node: dict[str, Any], depth: int) -> None:
        if not _is_decimal(node["int"]):
            raise self.fail(
                f"is an int node that is not a decimal of at most {MAX_INT_DIGITS} digits"
            )

    def _pickle(self, node: dict[str, Any], depth: int) -> None:
        if not isinstance(node["type"], str):
            raise self.fail("is a pickle node whose type name is not a str")
        if not _is_base64(node["pickle"]):
            raise self.fail("is a pickle node that is not valid base64")

    def _npscalar(self, node: dict[str, Any], depth: int) -> None:
        value = node["npscalar"]
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
            raise self.fail("is an npscalar node that is not a [dtype, value] pair")
        dtype, scalar = value
        if dtype not in NPSCALAR_DTYPES:
            raise self.fail(f"is an npscalar of dtype {dtype[:40]!r}, which is not allowed")
        kind, bits = NPSCALAR_DTYPES[dtype]
        if not _scalar_fits(kind, bits, scalar):
            raise self.fail(f"is an npscalar whose value does not fit dtype {dtype}")


def _is_base64(value: object) -> bool:
    """Canonical base64 (what the writer produces): the alphabet, padding, and no stray bits."""
    if not (isinstance(value, str) and len(value) % 4 == 0 and _BASE64.fullmatch(value)):
        return False
    return base64.b64encode(base64.b64decode(value)).decode() == value


def _is_decimal(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value.lstrip("-")) <= MAX_INT_DIGITS
        and _DECIMAL.fullmatch(value) is not None
    )


def _real(value: object) -> bool:
    """A float node's value: a finite JSON float or ``{"float": "nan"}``."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, dict) and len(value) == 1 and _float_word(value.get("float"))


def _float_word(value: object) -> bool:
    return isinstance(value, str) and value in _FLOAT_WORDS


def _scalar_fits(kind: str, bits: int, value: object) -> bool:
    if kind == "b":
        return isinstance(value, bool)
    if kind == "f":
        return _real(value)
    if kind == "c":
        return isinstance(value, list) and len(value) == 2 and all(_real(v) for v in value)
    if isinstance(value, dict) and len(value) == 1 and _is_decimal(value.get("int")):
        digits = value["int"]
        if len(digits) > 24:  # wider than any 64-bit integer
            return False
        value = int(digits)
    if not _is_int(value):
        return False
    assert isinstance(value, int)
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if kind == "i" else (0, 1 << bits)
    return low <= value < high
