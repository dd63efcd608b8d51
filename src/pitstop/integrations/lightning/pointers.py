"""Pointer files: what Lightning sees at each ``.ckpt`` path (a root and a step; saves made
after ``fit`` say so), the root's registry of pointer directories, and the retention that
keeps every step a pointer names."""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from pitstop.errors import (
    FormatVersionError,
    NotACheckpointError,
)
from pitstop.io.files import fsync_dir, write_bytes_durable
from pitstop.policy.retention import CheckpointInfo, RetentionPolicy

POINTER = "lightning-pointer"
REGISTRY = ".pitstop-lightning.json"
ROOT_MARK = "{pitstop_root}"
STATE_KEY = "pitstop"
_MAX_POINTER_BYTES = 64 << 10


@dataclass(frozen=True)
class _Pointer:
    root: str
    step: int
    after_fit: bool = False  # saved after Lightning's teardown (trainer.save_checkpoint(...))


def is_last(path: str) -> bool:
    """Whether Lightning's ``ckpt_path="last"`` would consider ``path`` (its own test)."""
    stem, ext = os.path.splitext(os.path.basename(path))
    name = pl.callbacks.ModelCheckpoint.CHECKPOINT_NAME_LAST
    return ext == ".ckpt" and re.match(rf"^{re.escape(name)}(-(\d+))?", stem) is not None


def read_json(path: str, kind: str) -> dict[str, Any] | None:
    """The small JSON file ``path`` if it is a pitstop file of ``kind``, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_POINTER_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if len(data) > _MAX_POINTER_BYTES or not data.lstrip().startswith(b"{"):
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("pitstop") != kind:
        return None
    if obj.get("version") != 1:
        raise FormatVersionError(f"{kind} of version {obj.get('version')!r}", path=path)
    return obj


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Replace ``path`` atomically and durably with ``obj``."""
    tmp = f"{path}.{threading.get_ident()}.pitstop-tmp"
    write_bytes_durable(tmp, json.dumps(obj, indent=1).encode())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def read_pointer(path: str) -> _Pointer | None:
    obj = read_json(path, POINTER)
    if obj is None:
        return None
    step, rel, absolute = obj.get("step"), obj.get("root"), obj.get("root_abs")
    if not (isinstance(step, int) and step >= 0 and isinstance(rel, str)):
        raise NotACheckpointError(f"pitstop pointer with bad fields: {obj}", path=path)
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), rel))
    if not os.path.isdir(root) and isinstance(absolute, str) and os.path.isdir(absolute):
        root = absolute  # the pointer moved without its root
    return _Pointer(root, step, obj.get("after_fit") is True)


def map_strings(obj: Any, fn: Callable[[str], str]) -> Any:
    """``obj`` with ``fn`` applied to every string, dict keys included. Containers are copied
    only where something changed: Lightning's live objects (``best_k_models``) are never edited."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        items = [(fn(k) if isinstance(k, str) else k, map_strings(v, fn)) for k, v in obj.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(items, obj.items())):
            return obj
        try:
            return type(obj)(items)
        except TypeError:  # a dict subclass with another constructor (defaultdict)
            return dict(items)
    if type(obj) in (list, tuple):
        out = [map_strings(v, fn) for v in obj]
        return obj if all(a is b for a, b in zip(out, obj)) else type(obj)(out)
    return obj


def from_mark(s: str, root: str) -> str:
    """``s`` with ``ROOT_MARK`` (a path under the root, as saved) made a path under ``root``."""
    if s == ROOT_MARK:
        return root
    if s.startswith(ROOT_MARK + "/"):
        return os.path.join(root, *s[len(ROOT_MARK) + 1 :].split("/"))
    return s


def as_last_file(checkpoint: dict[str, Any], path: str) -> None:
    """Lightning saves a step to its top-k file, then to ``last.ckpt``; the two dicts differ
    only in ModelCheckpoint's ``last_model_path``, set to ``last.ckpt`` in the second. The step
    holds the first: loaded through a ``last`` file, it says what that file would have."""
    for state in (checkpoint.get("callbacks") or {}).values():
        if not (isinstance(state, dict) and {"dirpath", "last_model_path"} <= state.keys()):
            continue
        dirpath = state["dirpath"]
        if isinstance(dirpath, str) and os.path.realpath(dirpath) == os.path.realpath(
            os.path.dirname(path)
        ):
            state["last_model_path"] = os.path.join(dirpath, os.path.basename(path))


class ReferencedSteps:
    """Retention of a Lightning run: keep what a pointer names, and what ``user`` keeps.
    Called by the manager on the persist thread right after each commit (the newest, the
    pinned and the in-flight checkpoints are kept by the catalog itself)."""

    def __init__(self, referenced: Callable[[], set[int]], user: RetentionPolicy | None) -> None:
        self.referenced, self.user = referenced, user

    def __repr__(self) -> str:
        return f"Referenced(pointers{f' | {self.user!r}' if self.user else ''})"

    def keep(self, checkpoints: Sequence[CheckpointInfo]) -> set[int]:
        kept = self.referenced()
        return kept | self.user.keep(checkpoints) if self.user is not None else kept
