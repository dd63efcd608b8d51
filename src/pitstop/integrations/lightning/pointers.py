"""Pointer files: what Lightning sees at each ``.ckpt`` path (a root and a step; saves made
after ``fit`` say so), the root's registry of pointer directories, and the retention that
keeps every step a pointer names.

Every file here is read as untrusted: only a regular file is opened (never blocking on a
FIFO or device put at a pointer path), at most 64 KiB of it; the registry is used only as
far as it validates (see ``read_registry``); a temporary file is deleted only if it is one a
killed pointer or registry write left (``is_own_tmp``)."""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from pitstop.errors import (
    CheckpointError,
    FormatVersionError,
    NotACheckpointError,
)
from pitstop.faults import killpoint
from pitstop.format.names import parse_aside_dir, parse_step_dir
from pitstop.io.files import fsync_dir, write_bytes_durable
from pitstop.log import get_logger
from pitstop.policy.retention import CheckpointInfo, RetentionPolicy

POINTER = "lightning-pointer"
REGISTRY = ".pitstop-lightning.json"
REGISTRY_KIND = "lightning-registry"
ROOT_MARK = "{pitstop_root}"
STATE_KEY = "pitstop"
ABSENT = "absent"
_MAX_POINTER_BYTES = 64 << 10
_TMP_NAME = re.compile(r".+\.[0-9]+\.pitstop-tmp")  # _put_pointer's and write_json's names

_log = get_logger("pitstop.integrations.lightning")


@dataclass(frozen=True)
class Pointer:
    root: str
    step: int
    after_fit: bool = False  # saved after Lightning's teardown (trainer.save_checkpoint(...))


def is_last(path: str) -> bool:
    """Whether Lightning's ``ckpt_path="last"`` would consider ``path`` (its own test)."""
    stem, ext = os.path.splitext(os.path.basename(path))
    name = pl.callbacks.ModelCheckpoint.CHECKPOINT_NAME_LAST
    return ext == ".ckpt" and re.match(rf"^{re.escape(name)}(-(\d+))?", stem) is not None


def special_file(path: str, *, follow: bool = True) -> str | None:
    """What ``path`` is if it exists and is neither a regular file nor a directory ("a FIFO",
    "a device", ...; with ``follow=False`` also "a symbolic link"); None otherwise."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else _kind(mode)


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


def _read_small(path: str) -> tuple[bytes | None, str]:
    """The bytes of ``path`` if it is a regular file of at most 64 KiB, else None and why
    (``ABSENT`` if there is nothing). Never blocks: a FIFO swapped in after the check is opened
    with O_NONBLOCK and refused. Other OSErrors (permissions) are raised."""
    try:
        why = _not_small_file(os.stat(path))
        if why:
            return None, why
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        return None, ABSENT
    try:
        why = _not_small_file(os.fstat(fd))
        return (None, why) if why else (os.read(fd, _MAX_POINTER_BYTES + 1), "")
    finally:
        os.close(fd)


def _not_small_file(info: os.stat_result) -> str:
    if not stat.S_ISREG(info.st_mode):
        return f"not a regular file ({_kind(info.st_mode)})"
    return f"larger than {_MAX_POINTER_BYTES} bytes" if info.st_size > _MAX_POINTER_BYTES else ""


def inspect_json(path: str, kind: str) -> tuple[dict[str, Any] | None, str]:
    """The small JSON file ``path`` if it is a pitstop file of ``kind``; else None and why
    (``ABSENT``, "not a regular file (a FIFO)", "not JSON", ...). A file of ``kind`` in
    another version raises FormatVersionError."""
    data, why = _read_small(path)
    if data is None:
        return None, why
    if len(data) > _MAX_POINTER_BYTES:
        return None, f"larger than {_MAX_POINTER_BYTES} bytes"
    try:
        obj = json.loads(data)
    except ValueError:
        return None, "not JSON"
    if not isinstance(obj, dict) or obj.get("pitstop") != kind:
        return None, f"not a pitstop {kind}"
    if obj.get("version") != 1:
        raise FormatVersionError(f"{kind} of version {obj.get('version')!r}", path=path)
    return obj, ""


def read_json(path: str, kind: str) -> dict[str, Any] | None:
    """The small JSON file ``path`` if it is a pitstop file of ``kind``, else None."""
    return inspect_json(path, kind)[0]


def write_json(path: str, obj: dict[str, Any]) -> None:
    """Replace ``path`` atomically and durably with ``obj``."""
    tmp = f"{path}.{threading.get_ident()}.pitstop-tmp"
    write_bytes_durable(tmp, json.dumps(obj, indent=1).encode())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def inspect_pointer(path: str) -> tuple[Pointer | None, str]:
    """The pointer at ``path``, or None and why not (``ABSENT``, "not a regular file (a
    FIFO)", "not a pitstop lightning-pointer", ...). A pointer with bad fields raises
    NotACheckpointError, one of another version FormatVersionError."""
    obj, why = inspect_json(path, POINTER)
    if obj is None:
        return None, why
    step, rel, absolute = obj.get("step"), obj.get("root"), obj.get("root_abs")
    if not (isinstance(step, int) and step >= 0 and isinstance(rel, str)):
        raise NotACheckpointError(f"pitstop pointer with bad fields: {obj}", path=path)
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), rel))
    if not os.path.isdir(root) and isinstance(absolute, str) and os.path.isdir(absolute):
        root = absolute  # the pointer moved without its root
    return Pointer(root, step, obj.get("after_fit") is True), ""


def read_pointer(path: str) -> Pointer | None:
    return inspect_pointer(path)[0]


def is_own_tmp(path: str) -> bool:
    """Whether ``path`` is a temporary file that a killed pointer or registry write left: named
    as they name theirs, a regular file (not a link), empty or a pitstop pointer or registry.
    Only such files are deleted from a pointer directory."""
    if not _TMP_NAME.fullmatch(os.path.basename(path)):
        return False
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode):
            return False
        return info.st_size == 0 or any(read_json(path, k) for k in (POINTER, REGISTRY_KIND))
    except (CheckpointError, OSError):
        return False


# ---------------------------------------------------------------- the registry
def read_registry(root: str) -> tuple[set[str], str | None]:
    """The pointer directories and the ``last`` path (absolute) that the root's registry
    names, as far as they validate. What does not is ignored with a warning naming the file
    and why: a registry that does not parse, ``dirs`` that is no list of paths, an entry in
    a checkpoint directory, a ``last`` that is no ``last*.ckpt`` path in a listed directory."""
    path = os.path.join(root, REGISTRY)
    obj, why = inspect_json(path, REGISTRY_KIND)
    if obj is None:
        if why != ABSENT:
            _ignored(path, f"it is {why}")
        return set(), None
    dirs = _registry_dirs(root, path, obj.get("dirs", []))
    return dirs, _registry_last(root, path, obj.get("last"), dirs)


def _registry_dirs(root: str, path: str, dirs: Any) -> set[str]:
    if not isinstance(dirs, list):
        _ignored(path, f'its "dirs" is {type(dirs).__name__}, not a list of paths')
        return set()
    valid = set()
    for entry in dirs:
        full = os.path.normpath(os.path.join(root, entry)) if isinstance(entry, str) else ""
        if not (entry and full):
            _ignored(path, f'its "dirs" entry {entry!r} is not a path')
        elif in_checkpoint_dir(root, full):
            _ignored(path, f'its "dirs" entry {entry!r} lies in a checkpoint directory')
        else:
            valid.add(full)
    return valid


def _registry_last(root: str, path: str, last: Any, dirs: set[str]) -> str | None:
    if last is None:
        return None
    full = os.path.normpath(os.path.join(root, last)) if isinstance(last, str) and last else ""
    if not full:
        why = "is not a path"
    elif not is_last(full):
        why = "is not a last*.ckpt path"
    elif os.path.dirname(full) not in dirs:
        why = "is not in a pointer directory the registry lists"
    elif in_checkpoint_dir(root, full):
        why = "lies in a checkpoint directory"
    else:
        return full
    _ignored(path, f'its "last" {last!r} {why}')
    return None


def _ignored(path: str, why: str) -> None:
    _log.warning("%s: %s: ignored", path, why, phase="restore")


def in_checkpoint_dir(root: str, path: str) -> bool:
    """Whether ``path`` is or lies in a step directory of ``root`` (or one set aside:
    ``.writing-step-...``), symbolic links resolved: pitstop's own files, never a pointer."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    parts = rel.split(os.sep)
    if parts[0] == os.pardir:
        return False
    return any(parse_step_dir(p) is not None or parse_aside_dir(p) is not None for p in parts)


def write_registry(root: str, dirs: set[str], last: str | None) -> None:
    """Replace the root's registry: ``dirs`` and ``last`` relative to ``root``. Kill point
    ``lightning.registry`` once written."""
    os.makedirs(root, exist_ok=True)
    rel = sorted(os.path.relpath(d, root) for d in dirs)
    body = {"pitstop": REGISTRY_KIND, "version": 1, "dirs": rel, "last": None}
    body["last"] = os.path.relpath(last, root) if last else None
    write_json(os.path.join(root, REGISTRY), body)
    killpoint("lightning.registry")


def check_last_file(path: str) -> tuple[Pointer | None, str]:
    """Before the registered ``last`` path is pointed at the newest step: the pointer there
    (None: nothing there) and "", or None and why the file must be left as it is: its
    directory is gone, it is a symbolic link or no regular file, it is no pitstop pointer
    (a file of Lightning's own), or its pointer does not parse."""
    if not os.path.isdir(os.path.dirname(path)):
        return None, "is in a directory that is gone"
    kind = special_file(path, follow=False)
    if kind is not None:
        return None, f"is not a regular file ({kind})"
    try:
        pointer, why = inspect_pointer(path)
    except (CheckpointError, OSError) as e:
        return None, f"cannot be read as a pointer: {e}"
    return pointer, "" if pointer is not None or why == ABSENT else f"is {why}"


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
