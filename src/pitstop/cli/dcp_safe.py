"""Loading a torch.save file or a torch.distributed.checkpoint (DCP) directory that nobody vouched
for, without running the code a pickle can carry.

A DCP directory keeps its plan in ``.metadata``, a pickle that torch reads with plain
``pickle.load``, and its non-tensor values as ``torch.save`` blobs that torch reads with
``weights_only=False``: either runs whatever the file says. Here ``.metadata`` goes through
``_MetadataUnpickler``, which resolves only the classes DCP's metadata is made of, and every blob
goes through ``load_weights_only``; torch's reader is handed the metadata read this way, so its own
``pickle.load`` never sees the file. ``allow_pickle=True`` (the CLI's ``--allow-pickle``) restores
torch's plain loading, for files the caller trusts. Everything that goes wrong ends in a
``CheckpointError`` that names the file: the CLI prints it as one line.

Call sequence (one process, the caller's thread; no process group)::

    load_torch_file(path)                     # pitstop import FILE
      -> _torch_save_kind(path)               # zip (its directory opens) or pickle, else refused
      -> load_weights_only(path)              # torch.load(weights_only=True) + NumPy globals
    load_dcp(path)                            # pitstop import DIR
      -> read_dcp_metadata(path)              # _MetadataUnpickler, then _check_metadata
      -> torch's _load_state_dict(no_dist=True) with
           _PreloadedReader(path, metadata)   # read_metadata returns the checked metadata
           _CheckedBytesPlanner(path)         # load_bytes -> load_weights_only
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import io
import os
import pathlib
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from pitstop.errors import (
    CheckpointError,
    CheckpointIOError,
    CorruptCheckpointError,
    ManifestError,
    NotACheckpointError,
    PickleRefusedError,
    UnsafePathError,
)

__all__ = [
    "METADATA",
    "load_dcp",
    "load_torch_file",
    "load_weights_only",
    "numpy_safe_globals",
    "read_dcp_metadata",
]

METADATA = ".metadata"
_TRUST_HINT = "pass --allow-pickle only if you trust this file"
_WEIGHTS_ONLY_FAILED = "Weights only load failed"


# --- the allow-lists --------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object, for every global a DCP ``.metadata`` pickle may name.

    All are plain data: dataclasses whose ``__init__``/``__setstate__`` only assign fields, an
    enum, tuple and dict subclasses, path objects (built without touching the file system),
    dtype constants (not callable) and torch's name -> layout lookup.
    """
    md = dcp_metadata
    allowed: dict[tuple[str, str], Any] = {
        (md.__name__, cls.__name__): cls
        for cls in (
            md.Metadata,
            md.MetadataIndex,
            md.StorageMeta,
            md.TensorStorageMetadata,
            md.BytesStorageMetadata,
            md.ChunkStorageMetadata,
            md.TensorProperties,
            md._MEM_FORMAT_ENCODING,
        )
    }
    allowed[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes
        allowed[(module, "PurePosixPath")] = pathlib.PurePosixPath
        allowed[(module, "PureWindowsPath")] = pathlib.PureWindowsPath
        allowed[(module, "WindowsPath")] = pathlib.PureWindowsPath  # not instantiable here
        allowed[(module, "PosixPath")] = pathlib.PurePosixPath
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            allowed[("torch", str(value).removeprefix("torch."))] = value
    return allowed


@functools.lru_cache(maxsize=1)
def _numpy_globals() -> tuple[Any, ...]:
    """NumPy's array, scalar and dtype reconstruction, for ``torch.serialization.safe_globals``.

    ``_reconstruct`` makes an empty ndarray, ``scalar`` a scalar from a dtype and raw bytes,
    ``dtype`` a dtype from its type string; ``__setstate__`` of arrays and dtypes fills them from
    bytes and plain values. An object array holds only what the same restricted unpickler built.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return ()
    try:
        from numpy._core import multiarray
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    out: list[Any] = [np.ndarray, np.dtype]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out += [(multiarray._reconstruct, f"{module}._reconstruct")]
        out += [(multiarray.scalar, f"{module}.scalar")]
    dtype_types = {type(np.dtype(code)) for code in np.typecodes["All"]}
    dtypes_module = getattr(np, "dtypes", None)
    for value in vars(dtypes_module).values() if dtypes_module is not None else ():
        if isinstance(value, type) and issubclass(value, np.dtype):
            dtype_types.add(value)
    return tuple(out + sorted(dtype_types, key=lambda t: t.__name__))


@contextlib.contextmanager
def numpy_safe_globals() -> Iterator[None]:
    """Within: ``torch.load(weights_only=True)`` also rebuilds NumPy arrays, scalars and dtypes."""
    with torch.serialization.safe_globals(list(_numpy_globals())):
        yield


# --- torch.save files and blobs ---------------------------------------------------------------


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _refused_globals(f: str | IO[bytes] | None, error: BaseException) -> str | None:
    """The globals weights_only refused, from a static scan of the file or else torch's message
    (which spells ``builtins.exec`` as ``exec``); None if it refused no global (a malformed
    pickle, or an opcode it does not read)."""
    names: list[str] = []
    if f is not None:
        try:
            if not isinstance(f, str):
                f.seek(0)
            with numpy_safe_globals():
                names = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(f))
        except Exception:  # a legacy (non-zip) file: fall back to the message
            names = []
    if names:
        return ", ".join(names)
    found = re.search(r"GLOBAL (\S+)", str(error))
    if found:  # torch writes builtins.exec as exec
        return found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
    return None


def _unpickler_said(error: BaseException) -> str:
    """The reason torch's weights-only unpickler gave, in one line."""
    _, _, said = str(error).partition("WeightsUnpickler error:")
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    return lines[0][:200] if lines else _first_line(error)


def load_weights_only(f: str | IO[bytes], *, where: str, path: str | None = None) -> Any:
    """``torch.load(weights_only=True)`` that also admits NumPy; a refusal is a PickleRefusedError
    naming the globals, ``where`` (what is being read) and ``--allow-pickle``; a pickle it cannot
    read at all is a CorruptCheckpointError. Warnings (an odd pickle protocol) are not shown."""
    try:
        with numpy_safe_globals(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if _WEIGHTS_ONLY_FAILED not in str(e):
            raise
        where_path = path if path is not None else (f if isinstance(f, str) else None)
        culprit = _refused_globals(f, e)
        if culprit is None:
            raise CorruptCheckpointError(
                f"{where} does not unpickle weights-only ({_unpickler_said(e)}): damaged, or "
                f"written with pickle features only plain loading reads; {_TRUST_HINT}",
                path=where_path,
            ) from None
        raise PickleRefusedError(
            f"refusing to unpickle {culprit} in {where}: weights-only loading does not allow it;"
            f" {_TRUST_HINT}",
            path=where_path,
        ) from None


def _torch_save_kind(path: str) -> str | None:
    """``zip`` (torch.save since 1.6), ``pickle`` (protocol 2 or later: the legacy format) or
    None; a zip archive whose central directory cannot be read (truncated) raises."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        except (zipfile.BadZipFile, EOFError) as e:
            raise CorruptCheckpointError(
                f"a truncated or damaged torch.save file (the zip directory at its end does not"
                f" read: {e})",
                path=path,
            ) from None
        return "zip"
    return "pickle" if head[:1] == b"\x80" else None


def load_torch_file(path: str, *, allow_pickle: bool = False) -> Any:
    """The object of a torch.save file: weights only unless ``allow_pickle``; never a raw error."""
    try:
        if _torch_save_kind(path) is None:
            raise NotACheckpointError(
                "not a torch.save, safetensors or DCP checkpoint: neither a zip archive, a"
                " pickle nor a safetensors header",
                path=path,
            )
        if allow_pickle:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.load(path, map_location="cpu", weights_only=False)
        return load_weights_only(path, where="the torch.save file", path=path)
    except CheckpointError:
        raise
    except OSError as e:
        if e.errno in (None, errno.EINVAL):  # torch's zip reader on bytes it cannot read
            raise CorruptCheckpointError(
                f"cannot load as a torch.save file (damaged: {_first_line(e)})", path=path
            ) from None
        raise CheckpointIOError(
            f"cannot read: {e.strerror or _first_line(e)}", errno=e.errno, path=path
        ) from None
    except Exception as e:
        raise NotACheckpointError(
            f"cannot load as a torch.save file ({_first_line(e)})", path=path
        ) from None


# --- DCP .metadata ----------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of ``_metadata_globals``; it has no
    ``persistent_load`` and no out-of-band buffers, so those opcodes fail as well."""

    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_globals().get((module, name))
        if found is None:
            raise PickleRefusedError(
                f"refusing to unpickle {module}.{name}: DCP metadata may only hold DCP's own"
                f" metadata classes; {_TRUST_HINT}",
                path=self._path,
            )
        return found


def read_dcp_metadata(directory: str, *, allow_pickle: bool = False) -> Metadata:
    """The checked ``Metadata`` of a DCP directory, unpickled with the allow-list unless
    ``allow_pickle`` (then with plain ``pickle.load``, as torch does)."""
    path = os.path.join(directory, METADATA)
    try:
        with open(path, "rb") as f:
            loaded = pickle.load(f) if allow_pickle else _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointIOError(
            f"cannot read DCP metadata: {e.strerror or _first_line(e)}", errno=e.errno, path=path
        ) from None
    except Exception as e:  # truncated, garbage, or a class whose __setstate__ refused the state
        raise ManifestError(f"DCP metadata does not parse ({_first_line(e)})", path=path) from None
    try:
        return _check_metadata(loaded, path)
    except CheckpointError:
        raise
    except Exception as e:  # an attribute missing or of an odd type in a deep place
        raise ManifestError(
            f"DCP metadata does not validate ({_first_line(e)})", path=path
        ) from None


_Bad = Callable[[str], ManifestError]


def _is_int(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low


def _check_metadata(md: Any, path: str) -> Metadata:
    """Every field DCP's reader and planner use has the type they expect; data files lie inside
    the directory. The unpickler allowed only data classes, so this guards against odd data,
    not against code."""

    def bad(what: str) -> ManifestError:
        return ManifestError(f"DCP metadata does not validate: {what}", path=path)

    if type(md) is not Metadata:
        raise bad(f"the top level is a {type(md).__name__}, not a DCP Metadata")
    items = getattr(md, "state_dict_metadata", None)
    if type(items) is not dict:
        raise bad("state_dict_metadata is not a dict")
    for fqn, item in items.items():
        if type(fqn) is not str:
            raise bad(f"key {fqn!r} is not a string")
        if type(item) is dcp_metadata.TensorStorageMetadata:
            _check_tensor(item, fqn, bad)
        elif type(item) is not dcp_metadata.BytesStorageMetadata:
            raise bad(f"{fqn!r} is a {type(item).__name__}")
    _check_storage_data(getattr(md, "storage_data", None), path, bad)
    _check_planner_data(getattr(md, "planner_data", None), len(items), bad)
    if type(getattr(md, "storage_meta", None)) not in (type(None), dcp_metadata.StorageMeta):
        raise bad("storage_meta is not a StorageMeta")
    if type(getattr(md, "version", None)) not in (type(None), str):
        raise bad("version is not a string")
    return md


def _is_shape(x: Any, ndim: int | None = None) -> bool:
    return type(x) is torch.Size and all(_is_int(d) for d in x) and (ndim is None or len(x) == ndim)


def _check_tensor(item: Any, fqn: str, bad: _Bad) -> None:
    size: Any = getattr(item, "size", None)
    props: Any = getattr(item, "properties", None)
    chunks: Any = getattr(item, "chunks", None)
    if not _is_shape(size):
        raise bad(f"{fqn!r}: size is not a shape")
    if type(props) is not dcp_metadata.TensorProperties or not isinstance(
        getattr(props, "dtype", None), torch.dtype
    ):
        raise bad(f"{fqn!r}: no tensor dtype")
    if type(chunks) is not list:
        raise bad(f"{fqn!r}: chunks is not a list")
    for chunk in chunks:
        offsets: Any = getattr(chunk, "offsets", None)
        sizes: Any = getattr(chunk, "sizes", None)
        if (
            type(chunk) is not dcp_metadata.ChunkStorageMetadata
            or not _is_shape(offsets, len(size))
            or not _is_shape(sizes, len(size))
            or any(o + s > d for o, s, d in zip(offsets, sizes, size))
        ):
            raise bad(f"{fqn!r}: a chunk lies outside the tensor")


def _check_storage_data(data: Any, path: str, bad: _Bad) -> None:
    if type(data) is not dict:
        raise bad("storage_data is not a dict")
    for index, info in data.items():
        offset = getattr(index, "offset", None)
        if (
            type(index) is not dcp_metadata.MetadataIndex
            or type(getattr(index, "fqn", None)) is not str
            or not (offset is None or _is_shape(offset))
        ):
            raise bad(f"storage_data key {index!r} is not a MetadataIndex")
        if type(info) is not _StorageInfo:
            raise bad(f"storage_data of {index.fqn!r} is a {type(info).__name__}")
        name = getattr(info, "relative_path", None)
        if (
            type(name) is not str
            or name in ("", ".", "..")
            or os.path.basename(name) != name
            or ("\\" in name or "\0" in name)
        ):
            raise UnsafePathError(
                f"DCP metadata names data file {name!r} for {index.fqn!r}: not a file name in"
                " the checkpoint directory",
                path=path,
            )
        if not (_is_int(getattr(info, "offset", None)) and _is_int(getattr(info, "length", None))):
            raise bad(f"storage_data of {index.fqn!r}: offset and length must be integers >= 0")
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and (
            type(transforms) not in (list, tuple) or any(type(t) is not str for t in transforms)
        ):
            raise bad(f"storage_data of {index.fqn!r}: transform_descriptors are not strings")


def _check_planner_data(data: Any, n_items: int, bad: _Bad) -> None:
    """Each entry is the object path of a flattened key: strings and list indices; an index is
    below the number of items (a list element is an item), so rebuilding a list stays small."""
    if data is None:
        return
    if type(data) is not dict:
        raise bad("planner_data is not a dict")
    for fqn, obj_path in data.items():
        if (
            type(fqn) is not str
            or type(obj_path) not in (list, tuple)
            or not obj_path
            or type(obj_path[0]) is not str
            or any(type(p) is not str and not (_is_int(p) and p < n_items) for p in obj_path)
        ):
            raise bad(f"planner_data of {fqn!r} is not an object path")


# --- DCP data ---------------------------------------------------------------------------------


class _PreloadedReader(FileSystemReader):
    """A FileSystemReader that answers ``read_metadata`` with metadata read and checked before."""

    def __init__(self, directory: str, metadata: Metadata) -> None:
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _CheckedBytesPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the whole state from the metadata, as torch's DCP -> torch.save conversion does,
    but reads non-tensor values weights-only (torch itself uses ``weights_only=False``)."""

    def __init__(self, directory: str, allow_pickle: bool) -> None:
        super().__init__()
        self._directory = directory
        self._allow_pickle = allow_pickle

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        if self._allow_pickle:
            obj = torch.load(value, map_location="cpu", weights_only=False)
        else:
            obj = load_weights_only(value, where=f"DCP item {fqn!r}", path=self._directory)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _unwrap(e: BaseException) -> BaseException:
    """The first rank's error inside torch's CheckpointException, or the error itself."""
    if isinstance(e, CheckpointException):
        for exc, _trace in e.failures.values():
            return _unwrap(exc)
    return e


def load_dcp(directory: str, *, allow_pickle: bool = False) -> dict[str, Any]:
    """The whole state of a DCP directory (nested as it was saved), in this process."""
    metadata = read_dcp_metadata(directory, allow_pickle=allow_pickle)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=_PreloadedReader(directory, metadata),
            planner=_CheckedBytesPlanner(directory, allow_pickle),
            no_dist=True,
        )
    except (Exception, CheckpointException) as raised:
        e = _unwrap(raised)
        if isinstance(e, CheckpointError):
            raise e from None
        if isinstance(e, pickle.UnpicklingError) and _WEIGHTS_ONLY_FAILED in str(e):
            raise PickleRefusedError(
                f"refusing to unpickle a DCP tensor item "
                f"({_refused_globals(None, e) or _unpickler_said(e)}); {_TRUST_HINT}",
                path=directory,
            ) from None
        if isinstance(e, OSError):
            raise CheckpointIOError(
                f"cannot read DCP data: {e.strerror or _first_line(e)}",
                errno=e.errno,
                path=directory,
            ) from None
        raise CorruptCheckpointError(
            f"DCP data does not load ({_first_line(e)})", path=directory
        ) from None
    return state
