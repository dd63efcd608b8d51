"""JSON from untrusted files, in bounded time and memory. Importable without torch.

Manifests and objects files are input: a damaged or crafted one must end in a
:class:`~pitstop.errors.ManifestError` that names the file, never in a
``RecursionError``, a hang or a silent reinterpretation. :func:`load_json`
rejects: bytes that are not UTF-8, nesting deeper than ``max_depth`` (found by a
linear scan before the parser recurses), ``NaN``/``Infinity`` constants, objects
that name a key twice, integers longer than ``max_int_digits``, and anything
``json`` refuses.

Call sequence: any thread; pure function.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pitstop.errors import ManifestError

__all__ = ["MAX_DEPTH", "load_json", "nesting_depth"]

MAX_DEPTH = 64
"""Default nesting limit: a manifest nests 4 deep; objects trees are limited separately."""

_SPECIAL = re.compile(r'[\[\]{}"]')


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (outside strings), in linear time
    (strings are skipped with ``str.find``; each backslash before a quote is looked at once)."""
    depth = deepest = i = 0
    while True:
        m = _SPECIAL.search(text, i)
        if m is None:
            return deepest
        c, i = m.group(), m.end()
        if c == '"':
            i = _string_end(text, i)
            if i < 0:
                return deepest  # unterminated: the parser will say so
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1


def _string_end(text: str, i: int) -> int:
    """The index after the quote that closes the string starting at ``i``; -1 if none does."""
    while True:
        j = text.find('"', i)
        if j < 0:
            return -1
        k = j
        while k > i and text[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:  # an even number of backslashes: the quote is not escaped
            return j + 1
        i = j + 1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"an object names the key {twice!r} twice")
    return out


def load_json(
    data: bytes | str,
    *,
    what: str,
    path: str | None = None,
    max_depth: int = MAX_DEPTH,
    max_int_digits: int = 40,
) -> Any:
    """Parse ``data`` (the contents of ``what``, e.g. ``manifest.json``) or raise ManifestError."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"{what} is not UTF-8 (byte {e.start})", path=path) from None
    else:
        text = data
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ManifestError(f"{what} nests {depth} levels deep (limit {max_depth})", path=path)

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > max_int_digits:
            raise ValueError(f"an integer of {len(digits)} digits (limit {max_int_digits})")
        return int(digits)

    try:
        return json.loads(
            text,
            parse_constant=_reject_constant,
            object_pairs_hook=_unique_pairs,
            parse_int=parse_int,
        )
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{what} is not valid JSON: {e}", path=path) from None
