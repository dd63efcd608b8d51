"""Structured edits that know the checkpoint's fields: ``permute`` (swapped keys, offsets,
entries) and changed ``field`` values (world size, format version, dtype, shape, ...).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence
from typing import Any

from fuzzing.edits import Edit, touches_seal
from fuzzing.jsonpath import (
    JsonPath,
    exists,
    fmt_path,
    get_at,
    pick,
    set_at,
    short,
    walk,
)
from fuzzing.root import DATA, OBJECTS, Pristine
from fuzzing.seal import Subs
from pitstop.format.names import MANIFEST, data_file_name

__all__ = ["edit_field", "edit_permute", "swap"]


def _same_shape_pairs(tensors: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [
        (i, j)
        for i, a in enumerate(tensors)
        for j, b in enumerate(tensors)
        if i < j and a["dtype"] == b["dtype"] and a["shape"] == b["shape"]
    ]


def swap(a: dict[str, Any], b: dict[str, Any], fields: Sequence[str]) -> None:
    for f in fields:
        a[f], b[f] = b[f], a[f]


def _permute_manifest(rng: random.Random, doc: Any) -> Edit:
    tensors = doc["tensors"]
    same = _same_shape_pairs(tensors)
    kind = rng.choice(
        [
            "keys_same_shape",
            "keys_any",
            "offsets",
            "offset_and_checksum",
            "checksums",
            "reverse",
            "shuffle",
            "files",
            "file_sizes",
        ]
    )
    if kind in ("reverse", "shuffle", "files"):
        items = doc["files"] if kind == "files" else tensors
        if kind == "shuffle":
            rng.shuffle(items)
        else:
            items.reverse()
        return Edit(
            doc, f"{kind}: the order of manifest.{'files' if kind == 'files' else 'tensors'}"
        )
    if kind == "file_sizes":
        swap(doc["files"][0], doc["files"][1], ["nbytes"])
        return Edit(doc, "swapped the nbytes of the two files")
    if kind in ("keys_same_shape", "offset_and_checksum"):
        i, j = rng.choice(same)
    else:
        i, j = rng.sample(range(len(tensors)), 2)
    a, b = tensors[i], tensors[j]
    fields = {"keys_same_shape": ["key"], "keys_any": ["key"], "offsets": ["offset"],
              "offset_and_checksum": ["offset", "checksum"], "checksums": ["checksum"]}[kind]  # fmt: skip
    swap(a, b, fields)
    forgery = kind in ("keys_same_shape", "keys_any", "offset_and_checksum")
    return Edit(
        doc, f"swapped {'+'.join(fields)} of {a['key']!r} and {b['key']!r}", forgery=forgery
    )


def _permute_objects(rng: random.Random, doc: Any, p: Pristine) -> Edit:
    kind = rng.choice(["tensor_refs", "dict_pairs", "list_items", "list_tuple"])
    if kind == "tensor_refs":
        by_key = {t["key"]: t for t in p.tensors}
        refs = [
            q for q in walk(doc) if isinstance(get_at(doc, q), dict) and "tensor" in get_at(doc, q)
        ]
        pairs = [
            (a, b) for a in refs for b in refs if repr(a) < repr(b)
            and (ta := by_key.get(get_at(doc, a)["tensor"])) and (tb := by_key.get(get_at(doc, b)["tensor"]))
            and ta["shape"] == tb["shape"] and ta["dtype"] == tb["dtype"] and ta["key"] != tb["key"]
        ]  # fmt: skip
        a, b = rng.choice(pairs)
        x, y = get_at(doc, a), get_at(doc, b)
        x["tensor"], y["tensor"] = y["tensor"], x["tensor"]
        return Edit(doc, f"swapped the tensor references {x['tensor']!r} and {y['tensor']!r}")
    if kind == "dict_pairs":
        path = pick(
            rng,
            doc,
            lambda q, v: (
                isinstance(v, dict) and isinstance(v.get("dict"), list) and len(v["dict"]) > 1
            ),
        )
        if path is None:
            return Edit(doc, "nothing to permute")
        pairs = get_at(doc, path)["dict"]
        i, j = rng.sample(range(len(pairs)), 2)
        pairs[i], pairs[j] = pairs[j], pairs[i]
        return Edit(
            doc,
            f"{fmt_path(path)}: swapped the entries {short(pairs[j][0])} and {short(pairs[i][0])}",
        )
    path = pick(
        rng,
        doc,
        lambda q, v: (
            isinstance(v, dict)
            and any(isinstance(v.get(k), list) and len(v[k]) > 1 for k in ("list", "tuple"))
        ),
    )
    if path is None:
        return Edit(doc, "nothing to permute")
    node = get_at(doc, path)
    kind_now = "list" if "list" in node else "tuple"
    if kind == "list_tuple":
        node["tuple" if kind_now == "list" else "list"] = node.pop(kind_now)
        return Edit(
            doc,
            f"{fmt_path(path)}: a {kind_now} made a {'tuple' if kind_now == 'list' else 'list'}",
        )
    items = node[kind_now]
    i, j = rng.sample(range(len(items)), 2)
    items[i], items[j] = items[j], items[i]
    return Edit(doc, f"{fmt_path(path)}.{kind_now}: swapped items {i} and {j}")


def edit_permute(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    return _permute_manifest(rng, doc) if target == "manifest" else _permute_objects(rng, doc, p)


_ITEMSIZE = {
    "float32": 4,
    "int32": 4,
    "float64": 8,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "uint8": 1,
}


def _field_tensor(rng: random.Random, doc: Any, p: Pristine) -> Edit:
    i = rng.randrange(len(doc["tensors"]))
    t = doc["tensors"][i]
    name = rng.choice(["dtype", "shape", "nbytes", "offset", "file", "checksum", "rank", "key"])
    old = copy.deepcopy(t[name])
    if name == "dtype":
        new, forgery = _new_dtype(rng, t)
    elif name == "shape":
        new, forgery = _new_shape(rng, t)
    else:
        new, forgery = _new_tensor_value(rng, doc, i, name), False
    t[name] = new
    return Edit(
        doc,
        f"tensors[{i}] ({t['key'] if name != 'key' else old!r}).{name}: {short(old)} -> {short(new)}",
        forgery=forgery,
    )


def _new_dtype(rng: random.Random, t: dict[str, Any]) -> tuple[Any, bool]:
    """Another dtype for the tensor entry ``t``, and whether it is a forgery (same size)."""
    size = _ITEMSIZE.get(t["dtype"], 0)
    same = [d for d, s in _ITEMSIZE.items() if s == size and d != t["dtype"]]
    options: list[Any] = [
        *same,
        "float33",
        "Float32",
        "",
        5,
        None,
        "int64" if size != 8 else "int8",
    ]
    new = rng.choice(options)
    return new, new in same


def _new_shape(rng: random.Random, t: dict[str, Any]) -> tuple[Any, bool]:
    """Another shape for the tensor entry ``t``, and whether it is a forgery (same numel)."""
    numel = math.prod(t["shape"])
    options: list[Any] = [
        list(reversed(t["shape"])),
        [numel],
        [numel + 1],
        [-1],
        [2**64],
        [0],
        [[numel]],
        [1] * 100,
        [numel, 1],
        [0.5],
        str(numel),
        [True] * len(t["shape"]),
    ]
    new = rng.choice(options)
    forgery = (
        isinstance(new, list)
        and all(type(d) is int and d >= 0 for d in new)
        and math.prod(new) == numel
    )
    return new, forgery


def _new_tensor_value(rng: random.Random, doc: Any, i: int, name: str) -> Any:
    """Another value for the field ``name`` (not dtype or shape) of ``doc["tensors"][i]``."""
    t = doc["tensors"][i]
    if name == "nbytes":
        return rng.choice(
            [t["nbytes"] + 1, t["nbytes"] - 1, 0, 2**62, 2**64, 2 * t["nbytes"], 3 << 30]
        )
    if name == "offset":
        others = [o["offset"] for o in doc["tensors"] if o is not t]
        return rng.choice(
            [
                t["offset"] + 4096,
                t["offset"] + 1,
                t["offset"] - 4096,
                2**62,
                2**64,
                rng.choice(others),
                -1,
            ]
        )
    if name == "file":
        return rng.choice(
            [
                "../" + DATA,
                "/etc/passwd",
                OBJECTS,
                data_file_name(1),
                DATA + "/..",
                f"./{DATA}",
                MANIFEST,
            ]
        )
    if name == "checksum":
        return rng.choice([[], ["0" * 16], t["checksum"] * 2, [None], t["checksum"][0]])
    if name == "rank":
        return rng.choice([1, -1, "0", 2**24])
    return rng.choice(  # key
        [
            "",
            "model/../x",
            doc["tensors"][(i + 1) % len(doc["tensors"])]["key"],
            "model/0.weight~2",
            t["key"] + "x",
        ]
    )


def _field_manifest(rng: random.Random, doc: Any, p: Pristine) -> Edit:
    if rng.random() < 0.4:
        return _field_tensor(rng, doc, p)
    if rng.random() < 0.25:
        j = rng.randrange(len(doc["files"]))
        f = doc["files"][j]
        name = rng.choice(["nbytes", "name", "checksum", "rank"])
        options: dict[str, list[Any]] = {
            "nbytes": [f["nbytes"] + 1, f["nbytes"] - 1, 0, 2**64, 3 << 30, 2**62],
            "name": ["../" + OBJECTS, MANIFEST, data_file_name(1), "/dev/zero", OBJECTS + "\x00"],
            "checksum": [None, "", "0" * 16, ["0" * 16]],
            "rank": [1, -1, "0"],
        }
        old = f[name]
        f[name] = rng.choice(options[name])
        return Edit(doc, f"files[{j}].{name}: {short(old)} -> {short(f[name])}")
    fields: dict[JsonPath, list[Any]] = {
        ("world_size",): [0, 2, -1, 2**24, 2**31, "1", 1.0, True, None],
        ("format_version",): [0, 1, 2, 3, 99, -1, "2", 2.0, None, 10**400],
        ("step",): [0, 1, 3, -2, 2**63, "2", 2.0, True],
        ("format",): ["pitstop-checkpoin", "", None, 1, "pitstop-objects"],
        ("created_unix_secs",): [-1, 1e308, 0, "now", None],
        ("checksum", "algorithm"): ["crc32", "crc32c", "md5", "", 5, None],
        ("checksum", "segment_bytes"): [0, 1, 4096, 4097, -4096, 2**62, 2**64],
        ("integrity", "algorithm"): ["crc32", "none", None],
        ("integrity", "manifest"): ["0" * 16, "", None, 5],
    }
    path = rng.choice(sorted(fields))
    if not exists(doc, path):
        return Edit(doc, f"{fmt_path(path)} absent: nothing changed")
    old = get_at(doc, path)
    new = rng.choice(fields[path])
    set_at(doc, path, new)
    return Edit(
        doc, f"{fmt_path(path)}: {short(old)} -> {short(new)}", integrity=touches_seal(path)
    )


def edit_field(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    if target == "manifest":
        return _field_manifest(rng, doc, p)
    name = rng.choice(sorted(doc))
    options: dict[str, list[Any]] = {
        "format": ["pitstop-checkpoint", "", None, "pitstop-object"],
        "format_version": [0, 2, 99, "1", None, 2**64],
        "rank": [1, -1, "0", None],
        "tree": [None, [], {}, {"dict": []}, {"list": []}, 0],
    }
    old = doc[name]
    doc[name] = rng.choice(options.get(name, [None]))
    return Edit(doc, f".{name}: {short(old)} -> {short(doc[name])}")
