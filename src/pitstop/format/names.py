"""File and directory names of format v1, and the checks that keep them inside a checkpoint.

::

    <root>/
      step-0000001200/          one directory per committed step
        manifest.json           written last: the commit marker
        rank-00000.bin          tensors of rank 0, each at a 4 KiB-aligned offset
        objects-00000.json      the state's structure and non-tensor values of rank 0
      .corrupt-step-0000001100-<id>/   a checkpoint that failed verification, set aside
"""

from __future__ import annotations

import re

from pitstop.errors import UnsafePathError

__all__ = [
    "MANIFEST",
    "MANIFEST_TMP",
    "data_file_name",
    "objects_file_name",
    "parse_step_dir",
    "quarantine_dir_name",
    "step_dir_name",
    "validate_file_name",
]

MANIFEST = "manifest.json"
MANIFEST_TMP = "manifest.json.tmp"

_STEP_DIR = re.compile(r"^step-(\d{10,})$")
_FILE_NAME = re.compile(r"^(rank-\d{5,}\.bin|objects-\d{5,}\.json)$")


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name like ``step-0000001200``; None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def objects_file_name(rank: int) -> str:
    return f"objects-{rank:05d}.json"


def quarantine_dir_name(step: int, nonce: str) -> str:
    return f".corrupt-{step_dir_name(step)}-{nonce}"


def validate_file_name(name: object, *, path: str | None = None) -> str:
    """Return ``name`` if it is a data or objects file name of format v1, else raise.

    Manifests are input: a name like ``../../etc/passwd`` or ``/abs`` must never be
    opened, so only the exact shapes above are accepted.
    """
    if not isinstance(name, str) or not _FILE_NAME.match(name):
        raise UnsafePathError(
            f"manifest names file {name!r}, which is not a pitstop data file name", path=path
        )
    return name
