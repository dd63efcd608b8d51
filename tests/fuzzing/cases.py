"""A case: one mutation, as actions on files, and one operation; the case directory the
actions are applied to, and what changed outside the root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Any

from fuzzing.root import DATA, OBJECTS, STEP2, Pristine
from pitstop.format.names import MANIFEST

__all__ = [
    "OPS",
    "OP_WEIGHTS",
    "SPARSE_BYTES",
    "Action",
    "Case",
    "Mutation",
    "diff_snapshots",
    "in_step",
    "prepare_case",
    "snapshot",
]

OPS = ("restore", "load", "verify", "ls", "inspect")
OP_WEIGHTS = (4, 2, 2, 1, 1)
SPARSE_BYTES = 3 << 30


@dataclass(frozen=True)
class Action:
    """One change to a case directory. ``path`` is relative to the case directory (which
    holds ``root/`` and ``outside/``); a ``target`` starting with ``@/`` is too."""

    kind: str  # write, remove, fifo, symlink, mkdir, sparse, move, copytree
    path: str
    data: bytes = b""
    target: str = ""


@dataclass(frozen=True)
class Mutation:
    family: str
    target: str  # manifest, objects, data or step
    what: str
    sealed: bool = False
    forgery: bool = False
    """Sealed and consistent: a checkpoint of other values that no reader can tell apart."""
    actions: tuple[Action, ...] = ()

    def describe(self) -> str:
        sealed = ", sealed" if self.sealed else ""
        forged = ", forgery" if self.forgery else ""
        return f"{self.family} {self.target}{sealed}{forged}: {self.what}"


@dataclass(frozen=True)
class Case:
    index: int
    mutation: Mutation
    op: str


def in_step(name: str, step: str = STEP2) -> str:
    return f"root/{step}/{name}"


def _resolve(case_dir: str, target: str) -> str:
    return os.path.join(case_dir, target[2:]) if target.startswith("@/") else target


def prepare_case(case_dir: str, p: Pristine, mutation: Mutation) -> None:
    """Copy the pristine root into ``case_dir/root``, make ``case_dir/outside`` (files a
    symlink may point at), and apply the mutation."""
    shutil.copytree(p.root, os.path.join(case_dir, "root"), symlinks=True)
    outside = os.path.join(case_dir, "outside")
    os.mkdir(outside)
    with open(os.path.join(outside, "secret.txt"), "wb") as f:
        f.write(b"not a checkpoint: must be neither read into a state nor modified\n")
    for name in (MANIFEST, OBJECTS, DATA):
        shutil.copyfile(os.path.join(p.root, STEP2, name), os.path.join(outside, name))
    for a in mutation.actions:
        path = os.path.join(case_dir, a.path)
        if a.kind == "write":
            with open(path, "wb") as f:
                f.write(a.data)
        elif a.kind == "remove":
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        elif a.kind == "fifo":
            os.mkfifo(path)
        elif a.kind == "symlink":
            os.symlink(_resolve(case_dir, a.target), path)
        elif a.kind == "mkdir":
            os.mkdir(path)
        elif a.kind == "sparse":
            with open(path, "wb") as f:
                f.truncate(SPARSE_BYTES)
        elif a.kind == "copytree":
            shutil.copytree(_resolve(case_dir, a.target), path, symlinks=True)
        else:
            raise ValueError(f"unknown action {a.kind!r}")


def snapshot(directory: str) -> dict[str, tuple[Any, ...]]:
    """What is under ``directory`` (nothing followed, nothing but regular files opened)."""
    out: dict[str, tuple[Any, ...]] = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(parent, name)
            st = os.lstat(path)
            rel = os.path.relpath(path, directory)
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    out[rel] = ("file", st.st_size, hashlib.sha256(f.read()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            else:
                out[rel] = (stat.S_IFMT(st.st_mode),)
    return out


def diff_snapshots(before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]) -> str:
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = [
        f"{label}: {', '.join(names[:5])}"
        for label, names in (("deleted", gone), ("created", new), ("modified", changed))
        if names
    ]
    return "; ".join(parts)
