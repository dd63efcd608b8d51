"""Whether a committed step directory stands in a new save's way as damaged or abandoned:
the evidence check every storage's ``prepare`` makes before it moves one aside (written once,
on the :class:`~pitstop.storage.base.Storage` methods, for directories and object stores)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pitstop.errors import CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from pitstop.format.manifest import Manifest
from pitstop.format.markers import Beside, abandonment_problem, usable_markers
from pitstop.format.names import parse_step_dir

__all__ = ["aside_kind", "witnesses"]


def aside_kind(storage: Any, directory: str) -> str | None:
    """``damaged`` or ``abandoned`` when the evidence says committed ``directory`` is (a
    manifest that does not parse; a DAMAGED marker of this checkpoint; an ABANDONED marker
    of it whose rollback is found), else None (see :mod:`pitstop.format.markers`)."""
    step = parse_step_dir(directory)
    try:
        manifest = Manifest.loads(storage.read_manifest(directory))
    except (FormatVersionError, CheckpointNotFoundError):
        return None  # newer: never touched; gone: nothing to move
    except CorruptCheckpointError:
        return "damaged"  # its own evidence, found now
    if step is None or manifest.step != step:
        return "damaged"
    beside = Beside(step, manifest)
    markers, _ = usable_markers(storage.read_markers(directory), beside)
    if "damaged" in markers:
        return "damaged"
    claim = markers.get("abandoned")
    if claim is not None and abandonment_problem(claim, beside, witnesses(storage)) is None:
        return "abandoned"
    return None


def witnesses(storage: Any) -> list[Beside]:
    """Every step directory of the root with a manifest that parses, and its ROLLBACK
    marker if that is evidence: where an ABANDONED marker's rollback is looked for."""
    out = []
    for name in storage.entries():
        step = parse_step_dir(name)
        if step is None or storage.entry_kind(name) != "dir" or not storage.has_manifest(name):
            continue
        try:
            here = Beside(step, Manifest.loads(storage.read_manifest(name)))
        except (CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError):
            continue
        raw = {k: v for k, v in storage.read_markers(name).items() if k == "rollback"}
        marks, _ = usable_markers(raw, here)
        out.append(dataclasses.replace(here, rollback=marks.get("rollback")))
    return out
