"""restore: read and verify one checkpoint into a buffer, then copy it into the live state.

Call sequence (training thread; io pool threads read and hash extents)::

    load_checkpoint(storage, directory, manifest, state, view, buffer, pool=...)

The objects file is read and checked first (it is small), then the data file
is read with large parallel reads into ``view`` and every segment's checksum
checked; only then is anything in the live state touched. Tensors are views of
the buffer until they are copied into the live objects (or cloned, where the
live object has no tensor of that shape to receive them).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

import torch

from pitstop.engine.verify import read_objects, read_verified
from pitstop.errors import CorruptCheckpointError, StateMismatchError
from pitstop.format.codec import dtype_from_name, tensor_view
from pitstop.format.manifest import Manifest, TensorEntry
from pitstop.format.names import data_file_name
from pitstop.state.restore import materialize, restore_into
from pitstop.storage.base import Storage

__all__ = ["load_checkpoint", "read_checkpoint"]


def read_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    view: memoryview,
    buffer: torch.Tensor,
    *,
    pool: Executor,
    rank: int = 0,
) -> tuple[Any, dict[str, TensorEntry]]:
    """Read and verify rank ``rank``'s part; returns (tree, entries by key). Raises CorruptCheckpointError."""
    path = f"{storage.url}/{directory}"
    problems: list[str] = []
    tree = read_objects(storage, directory, manifest, rank, problems)
    if not problems:
        read_verified(
            storage, directory, manifest, data_file_name(rank), view, pool=pool, problems=problems
        )
    if problems:
        raise CorruptCheckpointError(
            "; ".join(problems), step=manifest.step, path=path, phase="verify"
        )
    entries = {t.key: t for t in manifest.tensors if t.rank == rank}
    return tree, entries


def _source(buffer: torch.Tensor, entries: dict[str, TensorEntry], step: int) -> Any:
    def source(key: str) -> torch.Tensor:
        try:
            t = entries[key]
        except KeyError:
            raise CorruptCheckpointError(
                f"objects file refers to tensor {key!r}, not in the manifest", step=step
            ) from None
        return tensor_view(buffer, t.offset, t.nbytes, dtype_from_name(t.dtype), t.shape)

    return source


def load_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    state: Mapping[str, Any] | None,
    view: memoryview,
    buffer: torch.Tensor,
    *,
    pool: Executor,
    allow_pickle: bool = False,
    strict: bool = True,
) -> Any:
    """Restore into ``state`` in place (returns it), or build fresh objects when ``state`` is None."""
    if manifest.world_size != 1:
        raise StateMismatchError(
            f"checkpoint was written by {manifest.world_size} ranks; restoring it in one process "
            "arrives with distributed checkpointing",
            step=manifest.step, phase="restore",
        )  # fmt: skip
    tree, entries = read_checkpoint(storage, directory, manifest, view, buffer, pool=pool)
    source = _source(buffer, entries, manifest.step)

    def meta(key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = entries[key]
        return dtype_from_name(t.dtype), t.shape

    if state is None:
        return materialize(tree, source, allow_pickle=allow_pickle)
    try:
        restore_into(state, tree, source, meta, allow_pickle=allow_pickle, strict=strict)
    except StateMismatchError as e:
        e.step = manifest.step
        e.path = f"{storage.url}/{directory}"
        raise
    return state
