"""Serializing edited metadata, how a manifest vouches for it (:func:`reseal`), and what the
writer could have produced (:func:`objects_well_formed`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
from typing import Any

from fuzzing.root import OBJECTS, Pristine

__all__ = ["Subs", "dump_manifest", "dump_objects", "objects_well_formed", "reseal"]


class Subs:
    """Text that ``json.dumps`` cannot write (raw literals, duplicate keys), put in place of
    placeholder strings after serialization."""

    def __init__(self) -> None:
        self.table: dict[str, str] = {}

    def raw(self, text: str) -> str:
        """A placeholder value that becomes the JSON text ``text``."""
        token = f"@@fuzz{len(self.table)}@@"
        self.table[json.dumps(token)] = text
        return token

    def key(self, name: str) -> str:
        """A placeholder key that becomes ``name`` (a key the object already has: a duplicate)."""
        return self.raw(json.dumps(name))

    def apply(self, text: str) -> str:
        for token, replacement in self.table.items():
            text = text.replace(token, replacement)
        return text


def dump_manifest(doc: Any, subs: Subs) -> bytes:
    return (subs.apply(json.dumps(doc, indent=1)) + "\n").encode()


def dump_objects(doc: Any, subs: Subs) -> bytes:
    return subs.apply(json.dumps(doc, separators=(",", ":"))).encode()


def _canonical(body: dict[str, Any], subs: Subs) -> bytes:
    """The bytes the manifest's integrity checksum covers (the library's own function when
    it has one)."""
    from pitstop.format import manifest as manifest_format

    library = getattr(manifest_format, "_canonical", None)
    raw = None
    if library is not None:
        with contextlib.suppress(TypeError, ValueError):
            raw = library(body)
    if raw is None:
        plain = {k: v for k, v in body.items() if k != "integrity"}
        raw = json.dumps(plain, sort_keys=True, separators=(",", ":"), default=str).encode()
    return subs.apply(raw.decode()).encode()


def reseal(
    manifest: Any,
    objects: bytes | None,
    algorithm: str,
    subs: Subs | None = None,
    *,
    integrity: bool = True,
) -> None:
    """Make ``manifest`` vouch again for an edited ``objects`` file (its size and checksum in
    ``files``) and for its own body (format 2's ``integrity``). The one place that knows how
    a manifest vouches for its metadata: adapt it when the format changes.

    ``integrity=False`` leaves the seal as it is (an edit of the seal itself)."""
    from pitstop.format.checksum import ALGORITHMS, get_checksum

    if not isinstance(manifest, dict):
        return
    if objects is not None and isinstance(manifest.get("files"), list):
        for entry in manifest["files"]:
            if isinstance(entry, dict) and entry.get("name") == OBJECTS:
                entry["nbytes"] = len(objects)
                entry["checksum"] = get_checksum(algorithm)(objects)
    seal = manifest.get("integrity")
    if integrity and isinstance(seal, dict) and seal.get("algorithm") in ALGORITHMS:
        seal["manifest"] = get_checksum(seal["algorithm"])(_canonical(manifest, subs or Subs()))


_KINDS = ("dict", "list", "tuple", "tensor", "ndarray", "stateful", "float", "bytes", "npscalar")


def objects_well_formed(data: bytes, pristine: Pristine) -> bool:
    """Whether ``data`` is an objects file the writer could have produced for these tensors:
    strict JSON, the pristine header, a tree of known node kinds, known tensor keys. A
    sealed edit that keeps it well formed is a forgery; one that does not is damage."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("duplicate key")
        return out

    def constant(name: str) -> Any:
        raise ValueError(name)

    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (ValueError, RecursionError):
        return False
    header = {k: v for k, v in pristine.objects.items() if k != "tree"}
    if not isinstance(doc, dict) or set(doc) != set(pristine.objects):
        return False
    if any(doc[k] != v or type(doc[k]) is not type(v) for k, v in header.items()):
        return False
    tree = doc["tree"]
    top = tree.get("dict") if isinstance(tree, dict) else None
    if not isinstance(top, list) or not all(
        isinstance(x, list) and x and isinstance(x[0], str) for x in top
    ):
        return False  # the state itself is a dict with str keys
    return _node_ok(tree, pristine.tensor_keys, 0)


def _scalar_ok(v: Any) -> bool:
    return (
        v is None or isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v))
    )


def _node_ok(node: Any, keys: frozenset[str], depth: int) -> bool:
    if depth > 100:
        return False
    if not isinstance(node, dict):
        return _scalar_ok(node)
    kinds = [k for k in node if k in _KINDS]
    if len(kinds) != 1:
        return False
    kind = kinds[0]
    value = node[kind]
    extra = set(node) - {kind}
    if kind == "dict":
        if extra - {"ordered", "meta"} or node.get("ordered", True) is not True:
            return False
        if "meta" in node and not _node_ok(node["meta"], keys, depth + 1):
            return False
        if not isinstance(value, list):
            return False
        seen: set[Any] = set()
        for pair in value:
            if not (isinstance(pair, list) and len(pair) == 2 and _scalar_ok(pair[0])):
                return False
            if pair[0] in seen:  # 1, 1.0 and True are one key too
                return False
            seen.add(pair[0])
            if not _node_ok(pair[1], keys, depth + 1):
                return False
        return True
    if extra - ({"state", "params"} if kind == "stateful" else set()):
        return False
    if kind in ("list", "tuple"):
        return isinstance(value, list) and all(_node_ok(v, keys, depth + 1) for v in value)
    if kind in ("tensor", "ndarray"):
        return isinstance(value, str) and value in keys
    if kind == "stateful":
        params = node.get("params", [])
        return (
            isinstance(value, str)
            and "state" in node
            and _node_ok(node["state"], keys, depth + 1)
            and isinstance(params, list)
            and all(p is None or (isinstance(p, str) and p in keys) for p in params)
        )
    if kind == "float":
        return value in ("nan", "inf", "-inf")
    if kind == "bytes":
        try:
            return (
                isinstance(value, str)
                and base64.b64encode(base64.b64decode(value, validate=True)).decode() == value
            )
        except ValueError:
            return False
    return (  # npscalar
        isinstance(value, list)
        and len(value) == 2
        and value[0] in ("int64", "int32", "float64", "float32", "bool", "uint8")
        and _scalar_ok(value[1])
        and value[1] is not None
    )
