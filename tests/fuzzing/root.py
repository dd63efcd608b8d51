"""The pristine root (two committed steps of a small training state) and the digests that
tell their values apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pitstop.format.names import MANIFEST, data_file_name, objects_file_name, step_dir_name

__all__ = [
    "BN_KEYS",
    "DATA",
    "OBJECTS",
    "STEP1",
    "STEP2",
    "Expected",
    "Pristine",
    "build_state",
    "digest_state",
    "make_root",
]

OBJECTS = objects_file_name(0)
DATA = data_file_name(0)
STEP1, STEP2 = step_dir_name(1), step_dir_name(2)
BN_KEYS = ("model/1.weight", "model/1.bias")
"""Two tensors of the same dtype and shape: the weight and bias of the model's BatchNorm."""


@dataclass(frozen=True)
class Expected:
    """Per-top-level-key digests of steps 1 and 2: as restored into a live state, and as
    returned by ``pitstop.load`` (fresh objects)."""

    restore: dict[int, dict[str, str]]
    load: dict[int, dict[str, str]]


def build_state(seed: int, steps: int, *, fresh: bool = False) -> dict[str, Any]:
    """A small training state: Linear + BatchNorm1d + Linear, Adam after ``steps`` steps,
    RNG streams and plain values. ``fresh`` gives other plain values (a restore target)."""
    import numpy as np
    import torch
    from torch import nn

    import pitstop

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    extra: dict[str, Any] = (
        {"epoch": 0, "name": "fresh", "vals": [], "t": (0, 0)}
        if fresh
        else {"epoch": 3, "name": "x", "vals": [1.5, 2, None], "t": (1, 2)}
    )
    return {"model": model, "optimizer": opt, "rng": pitstop.RNGState(), "extra": extra}


def make_root(directory: str) -> Expected:
    """Save steps 1 and 2 (different values) under ``directory``; check that both round-trip
    exactly; return their digests."""
    import logging

    logger = logging.getLogger("pitstop")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the roll back of a check below warns
    try:
        return _make_root(directory)
    finally:
        logger.setLevel(level)


def _make_root(directory: str) -> Expected:
    import pitstop

    originals: dict[int, dict[str, str]] = {}
    with pitstop.CheckpointManager(directory) as mgr:
        for step in (1, 2):
            state = build_state(seed=step, steps=step + 1)
            mgr.save(step, state)
            originals[step] = digest_state(state)
    loaded: dict[int, dict[str, str]] = {}
    for step in (1, 2):  # on a copy: restoring step 1 rolls back (sets step 2 aside)
        scratch = tempfile.mkdtemp(
            prefix=".check-", dir=os.path.dirname(os.path.abspath(directory))
        )
        try:
            copy_root = os.path.join(scratch, "root")
            shutil.copytree(directory, copy_root, symlinks=True)
            loaded[step] = digest_state(pitstop.load(copy_root, step=step))
            fresh = build_state(seed=100 + step, steps=0, fresh=True)
            with pitstop.CheckpointManager(copy_root) as mgr:
                got = mgr.restore(fresh, step=step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if got != step or digest_state(fresh) != originals[step]:
            raise RuntimeError(f"the pristine step {step} does not round-trip exactly")
    return Expected(restore=originals, load=loaded)


@dataclass(frozen=True)
class Pristine:
    """Step 2's metadata files of the pristine root, as bytes and parsed."""

    root: str
    manifest_bytes: bytes
    objects_bytes: bytes
    manifest: dict[str, Any]
    objects: dict[str, Any]

    @classmethod
    def read(cls, root: str) -> Pristine:
        step = os.path.join(root, STEP2)
        with open(os.path.join(step, MANIFEST), "rb") as f:
            manifest_bytes = f.read()
        with open(os.path.join(step, OBJECTS), "rb") as f:
            objects_bytes = f.read()
        return cls(
            root,
            manifest_bytes,
            objects_bytes,
            json.loads(manifest_bytes),
            json.loads(objects_bytes),
        )

    @property
    def algorithm(self) -> str:
        return str(self.manifest["checksum"]["algorithm"])

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return list(self.manifest["tensors"])

    @property
    def tensor_keys(self) -> frozenset[str]:
        return frozenset(t["key"] for t in self.tensors)


class _TooDeep(Exception):
    pass


def digest_state(state: Mapping[str, Any]) -> dict[str, str]:
    """sha256 per top-level key over every tensor's dtype, shape and bytes and every plain
    value's type and repr, in key order (Statefuls through their ``state_dict``)."""
    out = {}
    for key, value in state.items():
        h = hashlib.sha256()
        try:
            _feed(h, value, 0)
        except _TooDeep:
            out[str(key)] = "too-deep"
            continue
        out[str(key)] = h.hexdigest()
    return out


def _feed(h: Any, v: Any, depth: int) -> None:
    if depth > 200:
        raise _TooDeep
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif np is not None and isinstance(v, np.ndarray):
        h.update(f"N{v.dtype}{v.shape}:".encode())
        h.update(np.ascontiguousarray(v).tobytes())
    elif (
        not isinstance(v, (Mapping, type))
        and callable(getattr(v, "state_dict", None))
        and torch is not None
    ):
        h.update(b"S")
        _feed(h, v.state_dict(), depth + 1)
    elif isinstance(v, Mapping):
        h.update(f"M{type(v).__name__}{len(v)}:".encode())
        for k, x in v.items():
            _feed(h, k, depth + 1)
            _feed(h, x, depth + 1)
        meta = getattr(v, "_metadata", None)
        if meta is not None:
            h.update(b"meta")
            _feed(h, meta, depth + 1)
    elif isinstance(v, (list, tuple)):
        h.update(f"L{type(v).__name__}{len(v)}:".encode())
        for x in v:
            _feed(h, x, depth + 1)
    elif isinstance(v, bool) or v is None:
        h.update(f"V{v}".encode())
    elif isinstance(v, int):
        h.update(f"I{type(v).__name__}{v:x};".encode())  # hex: no limit on digits
    elif isinstance(v, str):
        h.update(b"s%d:" % len(v) + v.encode("utf-8", "surrogatepass"))
    elif isinstance(v, (bytes, bytearray)):
        h.update(b"B%d:" % len(v) + bytes(v))
    else:
        h.update(f"V{type(v).__name__}:{v!r};".encode())
