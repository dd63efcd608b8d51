"""``pitstop export``, ``pitstop import`` and ``pitstop diff``: checkpoints to and from the
formats of the tools people already use. These commands load tensors, so they import torch.

Import reads files it cannot trust: a torch.save file is loaded weights-only (plus NumPy's array
reconstruction) and a DCP directory through ``dcp_safe``, which never hands a pickle to plain
``pickle.load``; ``--allow-pickle`` lifts both for trusted files. Every bad input ends in a
``CheckpointError`` naming the path, which the CLI prints as one line.

Call sequence (the CLI's thread)::

    run_export(args): _load -> _select -> _check_out -> _EXPORTERS[to] (inside _writing) -> print
    run_import(args): _read_source (dcp_safe.load_dcp | dcp_safe.load_torch_file)
                      -> CheckpointManager.save -> print
    run_diff(args):   _load x2 -> flat_tensors x2 -> compare
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from pitstop.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    MissingExtraError,
    NotACheckpointError,
    UnsupportedValueError,
)
from pitstop.io.files import check_regular
from pitstop.manager import CheckpointManager
from pitstop.oneshot import load as pitstop_load
from pitstop.state.tree import join_key

__all__ = ["flat_tensors", "run_diff", "run_export", "run_import"]


def _load(path: str, step: int | None, allow_pickle: bool) -> Any:
    return pitstop_load(path, step=step, allow_pickle=allow_pickle)


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded state under its key path (``model/fc.weight``), shared ones once each."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flat_tensors(v, join_key(prefix, k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, join_key(prefix, i)))
    return out


def _select(tree: Any, only: str | None) -> Any:
    if only is None:
        return tree
    if not isinstance(tree, Mapping) or only not in tree:
        keys = ", ".join(map(str, tree)) if isinstance(tree, Mapping) else "?"
        raise UnsupportedValueError(
            f"the checkpoint has no top-level key {only!r} (it has: {keys})"
        )
    return {only: tree[only]}


def _export_torch(tree: Any, out: str) -> str | None:
    torch.save(tree, out)
    try:
        unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(out))
    except Exception:  # only a note: the file is written
        return None
    if not unsafe:
        return None
    numpy_only = all(name.startswith("numpy.") for name in unsafe)
    return (
        f"note: torch.load(weights_only=True) refuses {', '.join(unsafe)} unless passed to"
        " torch.serialization.safe_globals"
        + ("; pitstop import reads the file as it is" if numpy_only else "")
    )


def _export_safetensors(tree: Any, out: str) -> str | None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise MissingExtraError(
            "export --to safetensors needs safetensors: pip install safetensors"
        ) from None
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for key, t in flat_tensors(tree).items():
        # safetensors refuses shared storage: a tied tensor is written under each name
        tensors[key] = t.clone() if t.untyped_storage().data_ptr() in seen else t.contiguous()
        seen[t.untyped_storage().data_ptr()] = key
    save_file(tensors, out, metadata={"format": "pt", "source": "pitstop"})
    return None


def _export_dcp(tree: Any, out: str) -> str | None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(_dcp_compatible(tree), checkpoint_id=out, no_dist=True)
        except CheckpointException as e:  # a BaseException holding each rank's error
            raise next(iter(e.failures.values()))[0] from None
    return None


_EXPORTERS: dict[str, Callable[[Any, str], str | None]] = {
    "torch": _export_torch,
    "safetensors": _export_safetensors,
    "dcp": _export_dcp,
}


def _check_out(out: str, to: str) -> None:
    """Fail before loading anything big when the output cannot be written where it is asked."""
    if to == "dcp":
        if os.path.exists(out) and not os.path.isdir(out):
            raise CheckpointIOError(
                "dcp writes a directory, and this exists as a file", errno=errno.ENOTDIR, path=out
            )
        return
    if os.path.isdir(out):
        raise CheckpointIOError(
            f"{to} writes a file, and this is a directory", errno=errno.EISDIR, path=out
        )
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CheckpointIOError(
            f"cannot write: directory {parent} does not exist", errno=errno.ENOENT, path=out
        )


@contextlib.contextmanager
def _writing(out: str) -> Iterator[None]:
    """Whatever the writer raises for a path it cannot write becomes a CheckpointIOError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        code = e.errno if isinstance(e, OSError) else None
        text = str(e).strip().splitlines()
        raise CheckpointIOError(
            f"cannot write ({type(e).__name__}: {text[0][:200] if text else ''})",
            errno=code,
            path=out,
        ) from None


def run_export(args: argparse.Namespace) -> int:
    _check_out(args.out, args.to)
    tree = _select(_load(args.dir, args.step, args.allow_pickle), args.only)
    with _writing(args.out):
        note = _EXPORTERS[args.to](tree, args.out)
    print(
        f"exported {args.dir} ({'newest step' if args.step is None else f'step {args.step}'}) to {args.to}: {args.out}"
    )
    if note:
        print(note)
    return 0


def _dcp_compatible(obj: Any) -> Any:
    """DCP keys must be strings and its sequences lists."""
    if isinstance(obj, Mapping):
        return {str(k): _dcp_compatible(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_dcp_compatible(v) for v in obj]
    return obj


def _read_source(src: str, allow_pickle: bool) -> Any:
    from pitstop.cli.dcp_safe import METADATA, load_dcp, load_torch_file  # DCP takes ~1 s to import

    if not os.path.exists(src):
        raise CheckpointNotFoundError("no such file or directory", path=src)
    if os.path.isdir(src):
        if not os.path.lexists(os.path.join(src, METADATA)):
            raise NotACheckpointError(
                f"a directory without DCP {METADATA}: not a DCP checkpoint", path=src
            )
        for name in os.listdir(src):  # read only regular files: no FIFO, device or symlink
            if name == METADATA or name.endswith(".distcp"):
                check_regular(os.lstat(os.path.join(src, name)), os.path.join(src, name))
        return load_dcp(src, allow_pickle=allow_pickle)
    if not stat.S_ISREG(os.stat(src).st_mode):
        raise NotACheckpointError("not a regular file (a FIFO, device or socket)", path=src)
    return load_torch_file(src, allow_pickle=allow_pickle)


def run_import(args: argparse.Namespace) -> int:
    src = args.src
    tree = _read_source(src, args.allow_pickle)
    if not isinstance(tree, Mapping):
        tree = {"state": tree}
    with CheckpointManager(
        args.to, allow_pickle=args.allow_pickle, max_in_flight=1, overlap=False
    ) as mgr:
        mgr.save(args.step, tree)
    print(f"imported {src} into {args.to} as step {args.step} ({len(flat_tensors(tree))} tensors)")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    a = flat_tensors(_load(args.a, args.step_a, args.allow_pickle))
    b = flat_tensors(_load(args.b, args.step_b, args.allow_pickle))
    differ = 0
    rows = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            rows.append((key, "only in " + ("A" if key in a else "B"), ""))
            differ += 1
            continue
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            rows.append((key, f"{x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}", ""))
            differ += 1
        elif not torch.equal(x, y):
            d = (
                (x.double() - y.double()).abs().max().item()
                if x.numel() and not x.is_complex()
                else float("nan")
            )
            rows.append((key, "differs", f"{d:.6g}"))
            differ += 1
    for key, what, diff in rows:
        print(f"{key:60} {what:30} {diff}")
    print(f"{len(set(a) | set(b))} tensors compared, {differ} differ")
    return 1 if differ else 0
