"""``pitstop export``, ``pitstop import`` and ``pitstop diff``: checkpoints to and from the
formats of the tools people already use. These commands load tensors, so they import torch."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from pitstop.errors import CheckpointNotFoundError, MissingExtraError, UnsupportedValueError
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


def run_export(args: argparse.Namespace) -> int:
    tree = _select(_load(args.dir, args.step, args.allow_pickle), args.only)
    if args.to == "torch":
        torch.save(tree, args.out)
    elif args.to == "safetensors":
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
        save_file(tensors, args.out, metadata={"format": "pt", "source": "pitstop"})
    elif args.to == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_compatible(tree), checkpoint_id=args.out, no_dist=True)
    print(
        f"exported {args.dir} ({'newest step' if args.step is None else f'step {args.step}'}) to {args.to}: {args.out}"
    )
    return 0


def _dcp_compatible(obj: Any) -> Any:
    """DCP keys must be strings and its sequences lists."""
    if isinstance(obj, Mapping):
        return {str(k): _dcp_compatible(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_dcp_compatible(v) for v in obj]
    return obj


def run_import(args: argparse.Namespace) -> int:
    src = args.src
    if os.path.isdir(src):
        if not os.path.isfile(os.path.join(src, ".metadata")):
            raise CheckpointNotFoundError(f"{src} is a directory without DCP .metadata", path=src)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            converted = os.path.join(tmp, "converted.pt")
            dcp_to_torch_save(src, converted)
            tree = torch.load(converted, map_location="cpu", weights_only=not args.allow_pickle)
    else:
        tree = torch.load(src, map_location="cpu", weights_only=not args.allow_pickle)
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
