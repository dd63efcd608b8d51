"""Structured edits of any JSON value: retyped, huge numbers, long strings, deep nesting,
duplicate keys, removed and extra fields. Each is an :data:`EditFn`.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuzzing.jsonpath import JsonPath, fmt_path, get_at, pick, set_at, short
from fuzzing.root import BN_KEYS, Pristine
from fuzzing.seal import Subs, dump_objects

__all__ = [
    "Edit",
    "EditFn",
    "edit_deep",
    "edit_duplicate",
    "edit_extra",
    "edit_huge",
    "edit_long_string",
    "edit_remove",
    "edit_retype",
    "retyped",
    "touches_seal",
]


@dataclass
class Edit:
    doc: Any
    what: str
    forgery: bool = False
    integrity: bool = False  # the edit touched the manifest's seal itself


EditFn = Callable[[random.Random, Any, Subs, str, Pristine], Edit]


def _leaf(p: JsonPath, v: Any) -> bool:
    return bool(p) and not isinstance(v, (dict, list))


def touches_seal(path: JsonPath) -> bool:
    return bool(path) and path[0] == "integrity"


def retyped(rng: random.Random, v: Any) -> Any:
    if isinstance(v, bool):
        options: list[Any] = [int(v), str(v).lower(), None, [v]]
    elif isinstance(v, int):
        options = [str(v), float(v), [v], {"value": v}, None, True, v + 0.5]
    elif isinstance(v, float):
        options = [str(v), int(v), None, [v], True]
    elif isinstance(v, str):
        options = [0, 1, [v], {v: v}, None, True]
    elif isinstance(v, list):
        options = [{str(i): x for i, x in enumerate(v)}, "list", len(v), None, {}]
    elif isinstance(v, dict):
        options = [list(v.values()), [[k, x] for k, x in v.items()], "dict", None, []]
    else:
        options = [0, "", "null", [], {}, False]
    return rng.choice(options)


def edit_retype(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    path = pick(rng, doc, lambda q, v: bool(q)) or ()
    old = get_at(doc, path)
    new = retyped(rng, old)
    return Edit(
        set_at(doc, path, new),
        f"{fmt_path(path)}: {short(old)} -> {short(new)}",
        integrity=touches_seal(path),
    )


_HUGE: tuple[Any, ...] = (
    2**64, 2**63, 2**63 - 1, -1, -(2**63), 10**400, 1e308, -1e308, 5e-324, 2**53 + 1, 0.5,
    4096.000001, 1 << 62, (1 << 62) + 4096,
    "raw:1e999", "raw:-1e999", "raw:" + "1" * 5000, "raw:-0", "raw:1E400", "raw:NaN", "raw:Infinity",
)  # fmt: skip


def _huge(rng: random.Random, subs: Subs) -> Any:
    value = rng.choice(_HUGE)
    if isinstance(value, str) and value.startswith("raw:"):
        return subs.raw(value[4:])
    return value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def edit_huge(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    numeric = rng.random() < 0.85
    path = (
        pick(rng, doc, lambda q, v: bool(q) and (_is_number(v) if numeric else _leaf(q, v))) or ()
    )
    old = get_at(doc, path)
    new = _huge(rng, subs)
    return Edit(
        set_at(doc, path, new),
        f"{fmt_path(path)}: {short(old)} -> {short(subs.table.get(json.dumps(new), new))}",
        integrity=touches_seal(path),
    )


def _long_string(rng: random.Random) -> tuple[str, str]:
    n = rng.choice([10**3, 10**5, 10**7])
    options = [
        ("A" * n, f"'A' * {n}"),
        ("x/" * (n // 2), f"'x/' * {n // 2}"),
        ("\x00", "NUL"),
        ("é" * (n // 10), f"'é' * {n // 10}"),
        ("\ud800", "a lone surrogate"),
        ("../" * 50 + "etc/passwd", "'../' * 50 + 'etc/passwd'"),
        ("", "''"),
        ("%2F" * 1000, "'%2F' * 1000"),
    ]
    return rng.choice(options)


def edit_long_string(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    path = pick(rng, doc, lambda q, v: bool(q) and isinstance(v, str)) or ()
    new, label = _long_string(rng)
    return Edit(set_at(doc, path, new), f"{fmt_path(path)} = {label}", integrity=touches_seal(path))


def _deep_text(rng: random.Random, target: str, n: int) -> tuple[str, str]:
    forms = [
        ("[" * n + "]" * n, f"[ * {n}"),
        ('{"a":' * n + "0" + "}" * n, f'{{"a": * {n}'),
    ]
    if target == "objects":
        forms.append(('{"list":[' * n + "]}" * n, f'{{"list":[ * {n} (a well-formed tree)'))
    return rng.choice(forms)


def edit_deep(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    n = rng.choice([65, 1000, 10**5, 10**5])
    text, label = _deep_text(rng, target, n)
    if rng.random() < 0.15:  # the whole document, wrapped
        inner = dump_objects(doc, subs).decode()
        return Edit(subs.raw("[" * n + inner + "]" * n), f"the document inside [ * {n}")
    path = pick(rng, doc, lambda q, v: bool(q)) or ()
    return Edit(
        set_at(doc, path, subs.raw(text)),
        f"{fmt_path(path)} = {label}",
        integrity=touches_seal(path),
    )


def edit_duplicate(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    if target == "objects" and rng.random() < 0.4:  # a dict node that names a key twice
        path = pick(
            rng,
            doc,
            lambda q, v: (
                isinstance(v, dict) and isinstance(v.get("dict"), list) and bool(v["dict"])
            ),
        )
        if path is not None:
            pairs = get_at(doc, path)["dict"]
            i = rng.randrange(len(pairs))
            dup = copy.deepcopy(pairs[i])
            if rng.random() < 0.5:
                dup[1] = retyped(rng, dup[1])
            pairs.insert(rng.randrange(len(pairs) + 1), dup)
            return Edit(
                doc, f"{fmt_path(path)}.dict names {short(dup[0])} twice (second: {short(dup[1])})"
            )
    path = pick(rng, doc, lambda q, v: isinstance(v, dict) and bool(v)) or ()
    obj = get_at(doc, path)
    name = rng.choice(sorted(obj, key=str))
    value = copy.deepcopy(obj[name]) if rng.random() < 0.5 else retyped(rng, obj[name])
    items = list(obj.items())
    obj.clear()
    first = rng.random() < 0.5
    if first:
        obj[subs.key(name)] = value
    obj.update(items)
    if not first:
        obj[subs.key(name)] = value
    where = "first" if first else "last"
    return Edit(
        doc,
        f"{fmt_path(path)} names {name!r} twice ({where}: {short(value)})",
        integrity=touches_seal((*path, name)),
    )


def edit_remove(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    path = pick(rng, doc, lambda q, v: bool(q)) or ()
    parent = get_at(doc, path[:-1])
    del parent[path[-1]]
    return Edit(doc, f"removed {fmt_path(path)}", integrity=touches_seal(path))


def edit_extra(rng: random.Random, doc: Any, subs: Subs, target: str, p: Pristine) -> Edit:
    path = pick(rng, doc, lambda q, v: isinstance(v, (dict, list))) or ()
    obj = get_at(doc, path)
    value: Any = rng.choice(
        [1, "x", None, [], {}, True, 2**64, {"tensor": BN_KEYS[0]}, {"list": []}]
    )
    if isinstance(obj, list):
        item = copy.deepcopy(rng.choice(obj)) if obj and rng.random() < 0.6 else value
        obj.insert(rng.randrange(len(obj) + 1), item)
        return Edit(
            doc, f"{fmt_path(path)} gains an element {short(item)}", integrity=touches_seal(path)
        )
    names = [
        "fuzz_extra",
        "tensors2",
        "list",
        "tensor",
        "state",
        "meta",
        "ordered",
        "integrity",
        "checksum",
    ]
    name = rng.choice([n for n in names if n not in obj] or ["fuzz_extra"])
    obj[name] = value
    return Edit(
        doc,
        f"{fmt_path(path)} gains a field {name!r}: {short(value)}",
        integrity=touches_seal((*path, name)),
    )
