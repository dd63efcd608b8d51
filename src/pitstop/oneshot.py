"""``pitstop.save`` and ``pitstop.load``: one checkpoint, no manager to keep.

Call sequence: any single thread; each call opens and closes its own engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pitstop.errors import CheckpointNotFoundError, NotACheckpointError
from pitstop.format.names import MANIFEST, parse_aside_dir, parse_step_dir, step_dir_name
from pitstop.manager import CheckpointManager, KeyMap
from pitstop.options import SaveOptions
from pitstop.storage.local import local_path, object_url

__all__ = ["check_root", "load", "resolve", "save"]


def check_root(root: str) -> None:
    """Raise NotACheckpointError for a non-empty directory that holds no pitstop checkpoint."""
    names = os.listdir(root)
    ours = [n for n in names if parse_step_dir(n) is not None or parse_aside_dir(n) is not None]
    if names and not ours:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise NotACheckpointError(
            f"{root} is not a pitstop checkpoint directory: it holds neither {MANIFEST} nor step-* "
            f"directories (it holds {shown})",
            path=root,
        )


def resolve(path: str, step: int | None) -> tuple[str, int | None]:
    """The root and step that ``load(path, step=step)`` reads: ``path`` is a root, or one step
    directory (whose step must agree with ``step`` if both are given). A URL is refused, a
    ``file:`` URL of a local path is that path (``storage.local.local_path``)."""
    if object_url(path) is not None:
        return _resolve_url(path, step)
    path = local_path(path)
    root = path
    if os.path.isfile(os.path.join(path, MANIFEST)):
        dir_step = parse_step_dir(os.path.basename(os.path.normpath(path)))
        if dir_step is not None and step is not None and step != dir_step:
            raise CheckpointNotFoundError(f"{path} holds step {dir_step}, not {step}", path=path)
        root = os.path.dirname(os.path.normpath(path)) or "."
        step = dir_step if dir_step is not None else step
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"no such checkpoint directory: {path}", path=path)
    check_root(root)
    return root, step


def _resolve_url(url: str, step: int | None) -> tuple[str, int | None]:
    """``resolve`` of an object-store URL: a root, or one step "directory" under a root."""
    from pitstop.storage.object_store import step_url

    root, name = step_url(url)
    dir_step = parse_step_dir(name) if name is not None else None
    if dir_step is None:
        return root, step
    if step is not None and step != dir_step:
        raise CheckpointNotFoundError(f"{url} holds step {dir_step}, not {step}", path=url)
    return root, dir_step


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    step: int = 0,
    allow_pickle: bool = False,
) -> str:
    """Save ``state`` under the root ``path`` as ``step``; durable on return. Returns the checkpoint directory."""
    options = SaveOptions.from_env(allow_pickle=allow_pickle, max_in_flight=1, overlap=False)
    with CheckpointManager(path, options=options) as mgr:
        mgr.save(step, state)
        return os.path.join(mgr.url, step_dir_name(step))


def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    allow_pickle: bool = False,
    strict: bool = True,
    key_map: KeyMap | None = None,
    rank: int | None = None,
) -> Any:
    """Load a checkpoint from a root (newest valid step, or ``step``) or from a step directory.

    With ``state``, restores it in place and returns the step loaded (``strict=False``
    loads the keys the state has; ``key_map`` renames saved keys); without, returns the
    saved state as fresh objects (``rank``: with the per-rank values, such as RNG streams
    and data position, of that saved rank; default rank 0). Nothing under the root is moved
    (no rollback).
    """
    root, step = resolve(os.fspath(path), step)
    options = SaveOptions.from_env(allow_pickle=allow_pickle, max_in_flight=1)
    with CheckpointManager(root, options=options) as mgr:
        if state is None:
            return mgr.load(step, rank=rank)
        if rank is not None:
            raise ValueError("load(rank=) applies to loading fresh objects (no state)")
        loaded = mgr.restore(state, step, strict=strict, key_map=key_map, rollback=False)
        if loaded is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {root}", path=root)
        return loaded
