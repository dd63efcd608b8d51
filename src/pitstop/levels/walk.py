"""What the one recovery walk (:mod:`pitstop.levels.restart`) needs of every level: the
record of its way down the candidates (:class:`Walk`), the brief of a level's steps that
the ranks all-gather (:func:`brief`), and how a level without nodes serves a step
(:func:`serve_window`: :func:`~pitstop.engine.recovery.recover` over a window of steps).

A level of the walk (``RootLevel``, a flush target, ``NodeLevel``) has ``name``,
``storage`` and ``catalog`` and answers::

    level.lists(group)            # does this rank list the level for the survey?
    level.held(words)             # the briefs every rank sent for it -> (steps, view)
    level.exact                   # True: it serves a step only as agreed across nodes;
                                  #   False: a window of steps, falling back by itself
    level.serve(walk, load, s, window, view, rollback)   # collective: a result or None
    level.fetch(manifest, view, storage)   # after a slower level served: take the step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pitstop.engine.catalog import Catalog, Entry
from pitstop.engine.recovery import RestoreResult, recover
from pitstop.errors import CheckpointNotFoundError, CorruptCheckpointError, PartialRestoreError
from pitstop.format.manifest import manifest_digest
from pitstop.levels.spec import SERVING
from pitstop.ranks.group import Group
from pitstop.storage.base import Storage

__all__ = ["WITH_MANIFEST", "Walk", "brief", "left_by_rollback", "serve_window"]

WITH_MANIFEST = (*SERVING, "abandoned")  # a step directory with a manifest


@dataclass
class Walk:
    """A restore's way down the candidates of every level: what was skipped and why (a
    checkpoint that failed verification or could not be made whole), what a level did not
    hold (``missing``), and whether a failed attempt wrote into the live state."""

    skipped: list[tuple[str, str]] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)
    overwritten: bool = False
    prefixed: bool = True  # several levels: names say which level (``local step-...``)

    def label(self, level: str, name: str) -> str:
        """``name`` of ``level`` in ``skipped`` (``<level> <name>`` with several levels)."""
        return f"{level} {name}" if self.prefixed else name

    def nothing(self, step: int | None, where: str) -> RestoreResult:
        """No level delivered: an empty result when there was nothing, else the error."""
        reasons = "; ".join(f"{name}: {why}" for name, why in self.skipped)
        if self.overwritten:
            raise PartialRestoreError(
                "no checkpoint could be restored and the live state was partly overwritten: "
                f"do not train from it ({reasons})", path=where, phase="restore",
            )  # fmt: skip
        if self.skipped:
            which = f" of step {step}" if step is not None else ""
            hint = ""
            if any("cannot be rebuilt" in why for _, why in self.skipped):
                hint = (
                    ". The files those ranks lost exist on no level: a lost node is survived "
                    "by redundancy='partner' or 'xor', Memory(redundancy='partner') or a "
                    "Shared level; to start over, restart on a new checkpoint directory "
                    "(this one is kept as it is)"
                )
            raise CorruptCheckpointError(
                f"no checkpoint{which} passed verification on any level ({reasons}){hint}",
                step=step, path=where, phase="restore",
            )  # fmt: skip
        if step is not None:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.missing)
            raise CheckpointNotFoundError(
                f"no level can deliver step {step}" + (f" ({reasons})" if reasons else ""),
                step=step, path=where, phase="restore",
            )  # fmt: skip
        return RestoreResult()


def serve_window(
    walk: Walk,
    group: Group,
    name: str,
    catalog: Catalog,
    load: Callable[[Storage, Entry], Any],
    *,
    window: tuple[int | None, int] | None = None,
    step: int | None = None,
    rollback: bool = False,
) -> RestoreResult | None:
    """Collective: ``recover`` on one level; None (and ``walk`` told why) when nothing
    loaded. ``rollback``: the level's newer steps are set aside from the scan it chose from."""
    try:
        result = recover(
            catalog, lambda e: load(catalog.storage, e), group=group, window=window, step=step,
            rollback=rollback, overwritten=walk.overwritten, raise_if_none=False,
        )  # fmt: skip
    except CheckpointNotFoundError as e:
        walk.missing.append((name, str(e)))
        return None
    result.skipped = [(walk.label(name, n), why) for n, why in result.skipped]
    result.set_aside = [f"{name}:{n}" if walk.prefixed else n for n in result.set_aside]
    if result.step is None:
        walk.skipped += result.skipped
        walk.overwritten = result.overwritten
        return None
    result.level = name
    if result.manifest is not None:
        result.sources = {name: result.manifest.nbytes}
    return result


def brief(entries: list[Entry]) -> list[tuple[Any, ...]]:
    """What a restore needs to know of each step directory with a manifest, small enough to
    all-gather: (step, status, manifest digest or "", run, timeline, rollback mark)."""
    out = []
    for e in entries:
        if e.is_step_dir and e.step is not None and e.status in (*WITH_MANIFEST, "newer"):
            lineage = e.manifest.lineage if e.manifest is not None else None
            digest = manifest_digest(e.manifest) if e.manifest is not None else ""
            run, timeline = (lineage.run, lineage.timeline) if lineage else (None, None)
            mark = e.rollback if isinstance(e.rollback, dict) else None
            out.append((e.step, e.status, digest, run, timeline, mark))
    return out


def left_by_rollback(marks: list[dict[str, Any]]) -> Callable[[tuple[Any, ...]], bool]:
    """Whether a brief's step is one a rollback left (newer than the rollback's step, of its
    run and timeline): such a step is no candidate on any level."""

    def left(b: tuple[Any, ...]) -> bool:
        return any(
            isinstance(m.get("after"), int) and b[0] > m["after"]
            and m.get("run") == b[3] and m.get("timeline") == b[4]
            for m in marks
        )  # fmt: skip

    return left
