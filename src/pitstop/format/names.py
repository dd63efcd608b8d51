"""File and directory names of the format, and the checks that keep them inside a checkpoint.

::

    <root>/
      step-0000001200/              one directory per committed step
        manifest.json               written last: the commit marker
        rank-00000.bin              tensors of rank 0, each at a 4 KiB-aligned offset
        objects-00000.json          the state's structure and non-tensor values of rank 0
        partner-rank-00003.bin      node-local level only: a partner's copy of rank 3's files
        xor-00002.bin / .json       node-local level only: the parity block rank 2 holds for
                                    its XOR set, and what it covers (see pitstop.levels)
        DAMAGED                     only after it failed verification: why (sealed JSON)
        ABANDONED / ROLLBACK        only after a rollback (see MARKERS, format.markers)
      .writing-step-0000001300-<id>/  a save being created; renamed to step-* before any data
      .retired-step-0000001000-<id>/  retention's: uncommitted and moved, files deleted next
      .abandoned-step-0000001250-<id>/  a newer step that a rollback left (timeline ended)
      .damaged-step-0000001100-<id>/    a damaged checkpoint moved out of a new save's way
      .corrupt-step-0000001100-<id>/    format v1's name for a damaged one (still recognised)

Every name pitstop writes is spelled here and nowhere else.
"""

from __future__ import annotations

import re

from pitstop.errors import UnsafePathError

__all__ = [
    "ASIDE_KINDS",
    "DAMAGED_MARKER",
    "LEVELS_FILE",
    "MANIFEST",
    "MANIFEST_TMP",
    "MARKERS",
    "OWNER_FILE",
    "aside_dir_name",
    "data_file_name",
    "objects_file_name",
    "parity_file_names",
    "parse_aside_dir",
    "parse_step_dir",
    "partner_copy_name",
    "step_dir_name",
    "validate_file_name",
    "writing_dir_name",
]

MANIFEST = "manifest.json"
MANIFEST_TMP = "manifest.json.tmp"
DAMAGED_MARKER = "DAMAGED"
MARKERS = {"damaged": DAMAGED_MARKER, "abandoned": "ABANDONED", "rollback": "ROLLBACK"}
"""Marker files a checkpoint directory may get after its commit (JSON, sealed and checked
against their step: :mod:`pitstop.format.markers`): why it failed verification; that a rollback
abandoned it; that a rollback to it abandoned the newer steps of its timeline (written first,
so a rollback killed half-way still holds)."""
OWNER_FILE = ".owner"

ASIDE_KINDS = ("abandoned", "damaged", "corrupt", "writing", "retired")
"""Prefixes of directories set aside (``.KIND-step-N-ID``); ``writing`` is a save in creation,
``retired`` a checkpoint retention removed (uncommitted, its files deleted right after)."""

_STEP_DIR = re.compile(r"step-([0-9]{10,})")
_ASIDE_DIR = re.compile(
    r"\.(abandoned|damaged|corrupt|writing|retired)-step-([0-9]{10,})-([0-9a-f]+)"
)
_FILE_NAME = re.compile(r"rank-[0-9]{5,}\.bin|objects-[0-9]{5,}\.json")


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name like ``step-0000001200``; None for anything else."""
    m = _STEP_DIR.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) else None  # one name per step: no 0-padding games


def aside_dir_name(kind: str, step: int, nonce: str) -> str:
    """``.abandoned-step-N-ID`` and its kin (see ASIDE_KINDS)."""
    if kind not in ASIDE_KINDS:
        raise ValueError(f"unknown set-aside kind {kind!r}")
    return f".{kind}-{step_dir_name(step)}-{nonce}"


def writing_dir_name(step: int, nonce: str) -> str:
    return aside_dir_name("writing", step, nonce)


def parse_aside_dir(name: str) -> tuple[str, int] | None:
    """(kind, step) of a set-aside directory name; None for anything else."""
    m = _ASIDE_DIR.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else None


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def objects_file_name(rank: int) -> str:
    return f"objects-{rank:05d}.json"


def partner_copy_name(name: str) -> str:
    """The name under which a partner node keeps its copy of another rank's file ``name``."""
    validate_file_name(name)
    return f"partner-{name}"


def parity_file_names(rank: int) -> tuple[str, str]:
    """The parity block rank ``rank`` holds for its XOR set, and its description (JSON)."""
    return f"xor-{rank:05d}.bin", f"xor-{rank:05d}.json"


LEVELS_FILE = "levels.json"
"""Under a root of a multi-level setup: its levels, redundancy and nodes (``pitstop ls``)."""


def validate_file_name(name: object, *, path: str | None = None) -> str:
    """Return ``name`` if it is a data or objects file name of the format, else raise.

    Manifests are input: a name like ``../../etc/passwd`` or ``/abs`` must never be
    opened, so only the exact shapes above are accepted.
    """
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name):
        raise UnsafePathError(
            f"manifest names file {name!r}, which is not a pitstop data file name", path=path
        )
    return name
