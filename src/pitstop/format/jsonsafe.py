"""JSON from untrusted files, in bounded time and memory. Importable without torch.

Manifests and objects files are input: a damaged or crafted one must end in a
:class:`~pitstop.errors.ManifestError` that names the file, never in a
``RecursionError``, a hang or a silent reinterpretation. :func:`load_json`
rejects: bytes that are not UTF-8, more than ``max_values`` values and nesting
deeper than ``max_depth`` (both found by :func:`json_shape` before the parser
allocates or recurses), ``NaN``/``Infinity`` constants, objects that name a key
twice, integers longer than ``max_int_digits``, and anything ``json`` refuses.

Cost: :func:`json_shape` works with bytes operations that run in C (replace,
translate, count; at worst a C iterator over the brackets), never a Python step per
byte or per value, in about a copy of the file; the parse makes one Python object per
value (numbers, strings, one list or dict per container: 56-184 bytes for as little as 2
bytes of JSON). A file of plain values thus costs a few times its size (2x for small ints,
5-7x for floats), one of small nodes about 25x, one of nothing but tiny or nested
containers 35-50x (the worst, 50x: nested one-item arrays), and never more than
:data:`MAX_VALUES` objects, whatever its size: at most about 200 bytes a value, 6.6 GB
(docs/format.md lists measurements). A parse that runs out of memory raises ManifestError
naming the file.

Call sequence: any thread; pure functions (:func:`recursion_room` serializes the
interpreter's recursion limit around a deep parse or encode).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pitstop.errors import ManifestError

__all__ = [
    "MAX_DEPTH",
    "MAX_VALUES",
    "JsonShape",
    "json_shape",
    "load_json",
    "nesting_depth",
    "out_of_memory",
    "recursion_room",
]

MAX_DEPTH = 64
"""Default nesting limit: a manifest nests 4 deep; objects trees are limited separately."""
MAX_VALUES = 1 << 25
"""Values a manifest or objects file may hold (33,554,432), as :func:`json_shape` counts them.

A plain list of that many numbers takes 64 MiB or more of JSON; longer sequences belong in a
tensor. pitstop writes no file beyond it (``encode_objects`` refuses the state)."""

_WORST_RATIO = 50
"""About the most memory, in multiples of its size, that parsing and checking a file takes
(one of nothing but small containers: a Python object each; docs/format.md)."""

_ROOM_DEPTH = 200  # deeper than this, the parser may need more than Python's 1000 frames
_MARKS = b'"[]{},:'
_NOT_MARKS = bytes(c for c in range(256) if c not in _MARKS)
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_STEP = tuple(1 if c == ord("[") else -1 for c in range(256))


@dataclass(frozen=True)
class JsonShape:
    """What :func:`json_shape` measures of a JSON text, outside its strings.

    ``depth``: the deepest nesting of arrays and objects (``[[]]`` is 2). ``values``: one for
    the top value, one for each array and object and one for each comma, so an array of n
    items counts n (one if empty) and an object of n members n (a member is a key and its
    value).
    """

    depth: int
    values: int


def json_shape(data: bytes | str) -> JsonShape:
    """The depth and the number of values of the JSON text ``data`` (see :class:`JsonShape`).

    Linear, in C-speed passes: a text that is not JSON gets numbers the parser will not
    contradict before it fails (an unterminated string runs to the end)."""
    marks = _outside_strings(
        data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    )
    brackets = marks.translate(_BRACKETS, b",:")
    return JsonShape(depth=_depth(brackets), values=_values(marks, brackets))


def nesting_depth(text: bytes | str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (outside strings), in linear time."""
    return json_shape(text).depth


def _outside_strings(data: bytes) -> bytes:
    """The structural characters (``"[]{},:``) of ``data`` that lie outside strings.

    Escaped backslashes go first, then escaped quotes, so every quote left opens or closes a
    string; a string with no structural character inside is then a bare ``""``, since a
    string is followed by one of ``,:]}`` (or space) in JSON; the quotes of the rest split
    the text."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = plain.translate(None, _NOT_MARKS).replace(b'""', b"")
    if b'"' in marks:  # strings holding brackets, commas or colons: odd pieces are inside
        marks = b"".join(marks.split(b'"')[::2])
    return marks


def _values(marks: bytes, brackets: bytes) -> int:
    return marks.count(b",") + brackets.count(b"[") + 1


def _depth(brackets: bytes) -> int:
    """The deepest nesting of a text of ``[`` and ``]`` (``{}`` mapped to ``[]``).

    Each pass drops the innermost pairs (``[]``): the leaves of the tree of containers, one
    level of depth, in C. Once a pass takes less than 1/32 of the text (long chains of
    containers, each pass taking two brackets of one), the rest is summed bracket by bracket.
    Either way each bracket costs at most about 32 C steps or one Python-level step."""
    passes = 0
    while brackets:
        inner = brackets.replace(b"[]", b"")
        if (len(brackets) - len(inner)) * 32 < len(brackets):
            return passes + max(0, max(itertools.accumulate(map(_STEP.__getitem__, brackets))))
        passes, brackets = passes + 1, inner
    return passes


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"an object names the key {twice!r} twice")
    return out


def _int_parser(max_int_digits: int) -> Callable[[str], int] | None:
    """What parses JSON integers: None (the C parser's own, which refuses more digits than
    Python's ``int_max_str_digits``) where that limit is ours, else a Python function."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    if limit == max_int_digits:
        return None

    def parse_int(digits: str) -> int:
        if len(digits.lstrip("-")) > max_int_digits:
            raise ValueError(f"an integer of {len(digits)} digits (limit {max_int_digits})")
        return int(digits)

    return parse_int


def load_json(
    data: bytes | str,
    *,
    what: str,
    path: str | None = None,
    max_depth: int = MAX_DEPTH,
    max_int_digits: int = 40,
    max_values: int = MAX_VALUES,
) -> Any:
    """Parse ``data`` (the contents of ``what``, e.g. ``manifest.json``) or raise ManifestError
    (also for a file that does not fit in memory: never MemoryError)."""
    try:
        return _load_json(data, what, path, max_depth, max_int_digits, max_values)
    except MemoryError:
        pass  # what the parse made goes with the error's frames: the message below has room
    raise out_of_memory(what, len(data), path)


def out_of_memory(what: str, nbytes: int, path: str | None) -> ManifestError:
    """The error for file ``what`` (``nbytes`` long) when parsing or checking it ran out of
    memory (a MemoryError, e.g. under an address-space limit)."""
    return ManifestError(
        f"{what} ({nbytes} bytes) cannot be parsed and checked in the memory available "
        f"(MemoryError; parsing takes up to {_WORST_RATIO}x the size of a file)", path=path,
    )  # fmt: skip


def _load_json(
    data: bytes | str, what: str, path: str | None, max_depth: int, max_int_digits: int,
    max_values: int,
) -> Any:  # fmt: skip
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    marks = _outside_strings(raw)
    brackets = marks.translate(_BRACKETS, b",:")
    values = _values(marks, brackets)
    if values > max_values:
        raise ManifestError(
            f"{what} holds more than {max_values} values, the limit (MAX_VALUES; it holds "
            f"{values}): refused before parsing", path=path,
        )  # fmt: skip
    del marks
    depth = _depth(brackets)
    if depth > max_depth:
        raise ManifestError(f"{what} nests {depth} levels deep (limit {max_depth})", path=path)
    try:
        text = raw.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise ManifestError(f"{what} is not UTF-8 (byte {e.start})", path=path) from None
    room = recursion_room(depth + 16) if depth > _ROOM_DEPTH else contextlib.nullcontext()
    try:
        with room:
            return json.loads(
                text,
                parse_constant=_reject_constant,
                object_pairs_hook=_unique_pairs,
                parse_int=_int_parser(max_int_digits),
            )
    except (ValueError, RecursionError) as e:
        reason = str(e)
        if "integer string conversion" in reason:  # the C parser's own limit (ours)
            reason = f"an integer of more than {max_int_digits} digits"
        raise ManifestError(f"{what} is not valid JSON: {reason}", path=path) from None


_ROOM_LOCK = threading.Lock()


@contextlib.contextmanager
def recursion_room(levels: int) -> Iterator[None]:
    """Raise Python's recursion limit so that the C json codec can nest ``levels`` more deep.

    The codec counts its nesting against the interpreter's limit (1000 by default),
    below what a valid deep tree needs; the limit is raised only for the call."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back  # type: ignore[assignment]
    need = depth + levels + 100
    with _ROOM_LOCK:
        old = sys.getrecursionlimit()
        if need > old:
            sys.setrecursionlimit(need)
        try:
            yield
        finally:
            if need > old:
                sys.setrecursionlimit(old)
