"""Paths into a parsed JSON document: walk, get, set, pick one at random, and print them."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["JsonPath", "exists", "fmt_path", "get_at", "pick", "set_at", "short", "walk"]

JsonPath = tuple[str | int, ...]


def walk(doc: Any, path: JsonPath = ()) -> Iterator[JsonPath]:
    stack: list[tuple[Any, JsonPath]] = [(doc, path)]
    while stack:
        value, p = stack.pop()
        yield p
        if isinstance(value, dict):
            stack.extend((v, (*p, k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, (*p, i)) for i, v in enumerate(value))


def get_at(doc: Any, path: JsonPath) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def set_at(doc: Any, path: JsonPath, value: Any) -> Any:
    """Set the value at ``path``; returns the (possibly new) document."""
    if not path:
        return value
    get_at(doc, path[:-1])[path[-1]] = value
    return doc


def pick(rng: random.Random, doc: Any, ok: Callable[[JsonPath, Any], bool]) -> JsonPath | None:
    """A random path whose value passes ``ok``: a random shape of path first (list indices
    as '#'), so that 600 RNG integers do not drown the dozen manifest fields."""
    groups: dict[tuple[Any, ...], list[JsonPath]] = {}
    for p in walk(doc):
        if ok(p, get_at(doc, p)):
            groups.setdefault(tuple("#" if isinstance(x, int) else x for x in p), []).append(p)
    if not groups:
        return None
    shapes = sorted(groups, key=repr)
    return rng.choice(groups[rng.choice(shapes)])


def fmt_path(path: JsonPath) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path) or "<document>"


def short(value: Any) -> str:
    text = value if isinstance(value, str) and value.startswith("@@fuzz") else repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} chars)"


def exists(doc: Any, path: JsonPath) -> bool:
    try:
        get_at(doc, path)
    except (KeyError, IndexError, TypeError):
        return False
    return True
