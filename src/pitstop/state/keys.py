"""Key paths and key maps: restoring a checkpoint whose keys are named differently.

A key path joins the keys from the state's top level down with ``/`` (a ``/`` or
``%`` inside a key is escaped as ``%2F``, ``%25``): ``model/fc.weight``,
``optimizer/state/0/exp_avg``. A *key map* is a callable that receives the saved
key path of every entry of every dict in a checkpoint and returns the key path
it should be restored under, or None to leave it out. It may only rename the
last component: an entry stays in its dict.

:func:`strip_prefix` and :func:`add_prefix` build the usual key maps;
:func:`wrapper_renames` finds the renames between two nn.Module state dicts
that differ only by the prefixes that wrappers add (``module.`` of DDP and
DataParallel, ``_orig_mod.`` of torch.compile).

Call sequence: ``restore_into``/``materialize`` (training thread) make one
:class:`KeyMapper` per restore and ask it about each saved dict entry.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from pitstop.state.tree import join_key

__all__ = [
    "WRAPPER_PREFIXES",
    "KeyMap",
    "KeyMapper",
    "Pairing",
    "add_prefix",
    "escape_key",
    "strip_prefix",
    "strip_wrappers",
    "unescape_key",
    "wrapper_renames",
]

KeyMap = Callable[[str], "str | None"]
"""Saved key path -> key path to restore it under (same parent), or None to drop the entry."""

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""State-dict key prefixes of DDP/DataParallel (``module.``) and torch.compile (``_orig_mod.``)."""

SAME: Any = object()
"""What :meth:`KeyMapper.target` returns for an entry the key map leaves as it is."""


def escape_key(part: object) -> str:
    """One component of a key path, as :func:`pitstop.state.tree.join_key` writes it."""
    return join_key("", part)


def unescape_key(part: str) -> str:
    return part.replace("%2F", "/").replace("%25", "%")


def _in_scope(parent: str, under: str | None) -> bool:
    return parent != "" if under is None else parent == under


def strip_prefix(prefix: str, *, under: str | None = None) -> KeyMap:
    """A key map that removes ``prefix`` from the last component of each key path.

    ``strip_prefix("module.")`` maps ``model/module.fc.weight`` to ``model/fc.weight``.
    Top-level keys are left alone; with ``under="model"`` only the entries of
    ``model``'s dict are renamed.
    """
    escaped = escape_key(prefix)

    def key_map(path: str) -> str | None:
        parent, _, last = path.rpartition("/")
        if not _in_scope(parent, under) or not last.startswith(escaped) or last == escaped:
            return path
        return join_key(parent, "") + last[len(escaped) :] if parent else last[len(escaped) :]

    return key_map


def add_prefix(prefix: str, *, under: str | None = None) -> KeyMap:
    """A key map that puts ``prefix`` before the last component of each key path.

    ``add_prefix("module.", under="model")`` maps ``model/fc.weight`` to
    ``model/module.fc.weight``. Top-level keys are left alone; without ``under``
    every nested dict is renamed (optimizer state too), so name the one you mean.
    """
    escaped = escape_key(prefix)

    def key_map(path: str) -> str | None:
        parent, _, last = path.rpartition("/")
        if not _in_scope(parent, under):
            return path
        return f"{parent}/{escaped}{last}"

    return key_map


def strip_wrappers(key: str) -> str:
    """``key`` without the wrapper prefixes at its start (any number, in any order)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, stripped = key[len(prefix) :], True
    return key


def _by_stripped(keys: Collection[Any]) -> dict[str, str] | None:
    out: dict[str, str] = {}
    for k in keys:
        if isinstance(k, str):
            stripped = strip_wrappers(k)
            if stripped in out:
                return None  # two keys differ only by a wrapper prefix: ambiguous
            out[stripped] = k
    return out


def wrapper_renames(saved: Collection[Any], live: Collection[Any]) -> dict[str, str]:
    """Saved key -> live key, for state-dict keys that differ only by wrapper prefixes.

    Empty unless the pairing is one-to-one (no two keys of a side differ only
    by a prefix) and it pairs more keys than the names do as they are.
    """
    live_set = set(live)
    exact = sum(1 for k in saved if k in live_set)
    if exact == len(saved) == len(live_set):
        return {}
    saved_by, live_by = _by_stripped(saved), _by_stripped(live_set)
    if saved_by is None or live_by is None:
        return {}
    pairs = {s: live_by[n] for n, s in saved_by.items() if n in live_by}
    if len(pairs) <= exact:
        return {}
    return {s: v for s, v in pairs.items() if s != v}


class KeyMapper:
    """Asks a key map about each saved dict entry once, and checks its answers.

    ``target(parent, key)`` returns :data:`SAME`, None (drop the entry) or the
    new last component (escaped). ``check_dict`` checks a whole dict first, so a
    bad key map raises ValueError before anything is restored.
    """

    def __init__(self, key_map: KeyMap | None) -> None:
        self.key_map = key_map
        self.memo: dict[str, Any] = {}

    def target(self, parent: str, key: Any) -> Any:
        if self.key_map is None:
            return SAME
        path = join_key(parent, key)
        if path in self.memo:
            return self.memo[path]
        new = self.key_map(path)
        result: Any
        if new is None:
            result = None
        elif not isinstance(new, str):
            raise ValueError(f"key_map returned {new!r} for {path!r}: expected a key path or None")
        elif new == path:
            result = SAME
        else:
            new_parent, _, last = new.rpartition("/")
            if new_parent != parent or not last:
                raise ValueError(
                    f"key_map maps {path!r} to {new!r}, outside its dict {parent or '<state>'!r}: "
                    "a key map may only rename an entry within the same dict"
                )
            result = last
        self.memo[path] = result
        return result

    def check_dict(self, parent: str, keys: list[Any]) -> None:
        if self.key_map is None:
            return
        renamed: dict[str, Any] = {}
        kept = {escape_key(k) for k in keys if self.target(parent, k) is SAME}
        for k in keys:
            new = self.target(parent, k)
            if new is None or new is SAME:
                continue
            if new in renamed or new in kept:
                other = renamed.get(new, unescape_key(new))
                raise ValueError(
                    f"key_map maps {join_key(parent, k)!r} onto {join_key(parent, new)!r}, "
                    f"which {join_key(parent, other)!r} already takes"
                )
            renamed[new] = k

    def live_key(self, target: Any, saved_key: Any, live: Mapping[str, Any]) -> Any:
        """The live key that a saved entry goes to (``live``: escaped live key -> key)."""
        if target is SAME:
            return saved_key
        return live.get(target, unescape_key(target))

    def pair(
        self, parent: str, saved: list[Any], live: list[Any], *, wrappers: bool = False
    ) -> Pairing:
        """Pair the keys of a saved dict (at ``parent``) with a live dict's keys.

        The key map goes first; with ``wrappers`` (an nn.Module's state dict) the
        names that then differ only by wrapper prefixes are paired too.
        """
        out = Pairing()
        escaped: dict[str, Any] = {}
        names: list[tuple[Any, Any, bool]] = []  # (live name, saved key, renamed)
        for k in saved:
            target = self.target(parent, k)
            if target is None:
                out.dropped.append(k)
                continue
            if target is not SAME and not escaped:
                escaped = {escape_key(lk): lk for lk in sorted(live, key=_str_first)}
            names.append((self.live_key(target, k, escaped), k, target is not SAME))
        renames = wrapper_renames([n for n, _, _ in names], live) if wrappers else {}
        live_set, used = set(live), set()
        for name, k, renamed in names:
            if isinstance(name, str) and name in renames:
                name, renamed = renames[name], True
            if name not in live_set or name in used:
                out.unexpected.append(k)
                continue
            used.add(name)
            out.pairs.append((name, k, renamed))
        out.missing = [lk for lk in live if lk not in used]
        return out


@dataclass
class Pairing:
    """A saved dict's keys paired with a live dict's: ``pairs`` of (live key, saved key,
    renamed); saved keys the key map ``dropped`` or the live dict lacks (``unexpected``);
    live keys the saved dict lacks (``missing``)."""

    pairs: list[tuple[Any, Any, bool]] = field(default_factory=list)
    dropped: list[Any] = field(default_factory=list)
    unexpected: list[Any] = field(default_factory=list)
    missing: list[Any] = field(default_factory=list)


def _str_first(key: Any) -> tuple[bool, str]:
    return (not isinstance(key, str), str(key))
