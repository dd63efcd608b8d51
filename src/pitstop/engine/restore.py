"""restore: read and verify one checkpoint into a buffer, then copy it into the live state.

Call sequence (training thread; io pool threads read and hash extents)::

    load_checkpoint(storage, directory, manifest, state, view, buffer, pool=...)

Every file's real size is checked, the objects file is read, checked and its tree
validated against the manifest, then the data file is read with large parallel reads
into ``view`` and every segment's checksum checked; only then is anything in the
live state touched. Tensors are views of the buffer until they are copied into the
live objects (or cloned, where the live object has no tensor of that shape).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import torch

from pitstop.engine.verify import check_sizes, raise_problems, read_objects, read_verified
from pitstop.errors import CheckpointError, CorruptCheckpointError, UnsupportedSetupError
from pitstop.format.codec import dtype_from_name, tensor_view
from pitstop.format.manifest import Manifest, TensorEntry
from pitstop.format.names import data_file_name

if TYPE_CHECKING:
    from pitstop.engine.catalog import Entry
    from pitstop.engine.saver import Saver
from pitstop.state.restore import RestoreReport, materialize, restore_into
from pitstop.storage.base import Storage

__all__ = ["load_checkpoint", "load_entry", "read_checkpoint"]

KeyMap = Callable[[str], "str | None"]


def read_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    view: memoryview,
    *,
    pool: Executor,
    rank: int = 0,
) -> tuple[Any, dict[str, TensorEntry]]:
    """Read and verify rank ``rank``'s part; returns (tree, entries by key). Raises
    CorruptCheckpointError listing every problem found."""
    path = f"{storage.url}/{directory}"
    problems: list[str] = []
    check_sizes(storage, directory, manifest, problems)
    tree = None if problems else read_objects(storage, directory, manifest, rank, problems)
    if not problems:
        read_verified(
            storage, directory, manifest, data_file_name(rank), view, pool=pool, problems=problems
        )
    raise_problems(problems, step=manifest.step, path=path)
    return tree, {t.key: t for t in manifest.tensors if t.rank == rank}


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
    key_map: KeyMap | None = None,
) -> tuple[Any, RestoreReport | None]:
    """Restore into ``state`` in place (returns it and what was loaded or skipped), or build
    fresh objects when ``state`` is None (returns them and None)."""
    if manifest.world_size != 1:
        raise UnsupportedSetupError(
            f"checkpoint was written by {manifest.world_size} ranks; restoring it in one process "
            "arrives with distributed checkpointing",
            step=manifest.step, phase="restore",
        )  # fmt: skip
    tree, entries = read_checkpoint(storage, directory, manifest, view, pool=pool)

    def source(key: str) -> torch.Tensor:
        t = entries[key]  # parse_objects checked that every key the tree names is here
        return tensor_view(buffer, t.offset, t.nbytes, dtype_from_name(t.dtype), t.shape)

    def meta(key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        t = entries[key]
        return dtype_from_name(t.dtype), t.shape

    path = f"{storage.url}/{directory}"
    try:
        if state is None:
            return materialize(tree, source, allow_pickle=allow_pickle), None
        report = restore_into(
            state, tree, source, meta, allow_pickle=allow_pickle, strict=strict, key_map=key_map
        )
    except CheckpointError as e:
        e.step, e.path = manifest.step, e.path or path
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RuntimeError) as e:
        # a verified tree that still cannot be built: damage the checks did not name
        raise CorruptCheckpointError(
            f"cannot load: {e!r}", step=manifest.step, path=path, phase="restore"
        ) from e
    return state, report


def load_entry(
    storage: Storage,
    entry: Entry,
    state: Mapping[str, Any] | None,
    *,
    saver: Saver,
    allow_pickle: bool,
    strict: bool = True,
    key_map: KeyMap | None = None,
) -> tuple[Any, RestoreReport | None]:
    """:func:`load_checkpoint` of a catalog entry into an arena the saver lends (kept for
    later saves); the data file's real size is checked before the arena is allocated."""
    assert entry.manifest is not None
    manifest, name = entry.manifest, data_file_name(0)
    claimed = manifest.file(name).nbytes if name in {f.name for f in manifest.files} else 0
    actual = storage.file_size(entry.name, name) if claimed else 0
    if actual != claimed:
        raise CorruptCheckpointError(
            f"{name}: {actual} bytes on storage, manifest says {claimed}",
            step=entry.step, path=f"{storage.url}/{entry.name}",
        )  # fmt: skip
    with saver.borrow_buffer(claimed) as (view, buffer):
        return load_checkpoint(
            storage, entry.name, manifest, state, view, buffer, pool=saver.io_pool,
            allow_pickle=allow_pickle, strict=strict, key_map=key_map,
        )  # fmt: skip
