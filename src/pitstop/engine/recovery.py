"""recovery: choose the checkpoint to resume from, load it, fall back on damage.

Call sequence (training thread)::

    result = recover(catalog, load, step=None, rollback=True)

Candidates are tried newest first, each pinned while it is read (retention and gc
cannot remove it). Only evidence of damage (CorruptCheckpointError: checksum, size,
parse, validation) makes recovery mark the checkpoint ``DAMAGED`` and try the next
older one; a CheckpointIOError (after the storage's retries), a StateMismatchError
found before anything was touched (an older one would not fit either) and a
FormatVersionError (nothing is resumed silently from behind a newer checkpoint) are
raised as they are. A load that failed after overwriting part of the live state is
followed by the older checkpoints too, each of which overwrites everything it loads;
if none succeeds, PartialRestoreError says the live state was partly overwritten.

With ``rollback=True`` (the manager's restore), checkpoints newer than the one
restored stop being candidates: healthy ones are set aside as ``abandoned``, damaged
ones as ``damaged`` (their step names are free for the new timeline's saves).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pitstop.engine.catalog import Catalog, Entry
from pitstop.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatVersionError,
    PartialRestoreError,
)
from pitstop.format.manifest import Manifest
from pitstop.log import get_logger
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import Outcome, agree, gather

__all__ = ["RestoreResult", "agree_on_step", "recover"]

_log = get_logger("pitstop.recovery")
_RESCANS = 5
_RAISED = frozenset({"refused", "io", "error"})  # outcomes no older checkpoint answers


@dataclass
class RestoreResult:
    """What a restore did: ``step`` loaded (None: no checkpoint), the checkpoints ``skipped``
    and why, the ones ``set_aside`` by a rollback, and the load's own report (``keys``:
    loaded, skipped and missing key paths of a partial restore)."""

    step: int | None = None
    name: str | None = None
    manifest: Manifest | None = field(default=None, repr=False)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    keys: Any = None
    secs: float = 0.0
    value: Any = field(default=None, repr=False)
    level: str | None = None  # the level that served: "root" (one directory), "local", a name
    sources: dict[str, int] = field(default_factory=dict)  # bytes by source (own, partner, ...)
    repaired: list[str] = field(default_factory=list)  # multi-level: what was rebuilt
    overwritten: bool = False  # a failed attempt wrote into the live state
    # a rollback that set steps aside starts this timeline (the same id on every rank); None:
    # the restored checkpoint's timeline goes on
    timeline: str | None = None


def _chain(
    entries: list[Entry], step: int | None, window: tuple[int | None, int] | None = None
) -> list[Entry]:
    """Step directories that could hold the checkpoint, newest first."""
    lo, hi = window if window is not None else (None, None)
    out = [
        e
        for e in entries
        if e.is_step_dir
        and e.status in ("committed", "damaged", "newer")
        and (step is None or e.step == step)
        and (hi is None or (e.step or 0) <= hi)
        and (lo is None or (e.step or 0) > lo)
    ]
    return sorted(out, key=lambda e: e.step or 0, reverse=True)


def recover(
    catalog: Catalog,
    load: Callable[[Entry], Any],
    *,
    step: int | None = None,
    rollback: bool = False,
    group: Group | None = None,
    window: tuple[int | None, int] | None = None,
    overwritten: bool = False,
    raise_if_none: bool = True,
) -> RestoreResult:
    """Load the newest checkpoint that verifies (or ``step``) with ``load(entry)``;
    ``window=(lo, hi)``: only steps above ``lo`` (None: any) and at most ``hi`` (the shared
    level of :mod:`pitstop.levels`, between the local level's candidates).
    ``overwritten``: an attempt before this call wrote into the live state (another level);
    ``raise_if_none=False``: when no candidate loads, return a result without a step (its
    ``skipped`` and ``overwritten`` say what happened) instead of raising.

    Several ranks (``group``): collective. Rank 0's scan decides the candidates; every rank
    loads the same one (``load`` agrees with the others before it touches the live state);
    the outcomes are gathered and all ranks move on together: to the next older checkpoint
    when any rank found damage (rank 0 marks it), or all raise. Only rank 0 marks and sets
    aside."""
    group = group if group is not None else Group()
    t0 = time.perf_counter()
    result = RestoreResult()
    partial = overwritten  # a load failed after overwriting part of the live state
    for _ in range(_RESCANS):
        entries = catalog.scan()
        words = group.all_gather(
            (step, _chain(entries, step, window) if group.coordinator else []), "restore"
        )
        agree_on_step([w[0] for w in words], group.rank)
        chain = words[0][1]
        if step is not None and not any(e.status != "damaged" for e in chain):
            why = f" ({chain[0].error})" if chain else ""
            raise CheckpointNotFoundError(
                f"no committed checkpoint of step {step}{why}", step=step, path=catalog.storage.url
            )
        result.skipped, vanished = [], False
        for entry in chain:
            if entry.status == "newer":
                raise FormatVersionError(
                    f"{entry.name}: {entry.error}; no older checkpoint is resumed in its place",
                    step=entry.step, path=f"{catalog.storage.url}/{entry.name}", phase="restore",
                )  # fmt: skip
            if entry.status == "damaged":
                result.skipped.append((entry.name, f"damaged: {entry.error}"))
                continue
            outcome, value, loaded = _try(catalog, entry, load, group.rank)
            error = outcome.error
            partial = partial or bool(getattr(error, "live_overwritten", False))
            outcomes = gather(group, outcome, "restore")
            kinds = {o.kind for o in outcomes}
            if kinds & _RAISED:  # every rank raises: its own error, or one naming the others
                if partial and isinstance(error, CheckpointError):
                    _say_overwritten(error)
                agree(outcomes, group.rank, f"restore of {entry.name}", phase="restore")
            if "vanished" in kinds:
                vanished = True  # removed, moved or replaced since the scan: look again
                break
            if kinds & {"damaged", "marked"}:
                why = _first(outcomes, "damaged") or _first(outcomes, "marked")
                if group.coordinator and "damaged" in kinds:
                    catalog.mark_damaged(entry.name, why)
                result.skipped.append((entry.name, f"damaged: {why}"))
                _log.warning(
                    "%s failed verification, trying an older one: %s", entry.name, why,
                    phase="verify",
                )  # fmt: skip
                continue
            if "partial" in kinds:
                partial = True
                why = _first(outcomes, "partial")
                result.skipped.append((entry.name, f"load failed part way: {why}"))
                continue
            entry = loaded if loaded is not None else entry
            missing = list(getattr(value[1], "missing", None) or []) if value else []
            if partial and missing:  # a damaged newer one may have written what this one lacks
                raise PartialRestoreError(
                    f"restored {entry.name}, but a newer checkpoint that failed verification "
                    f"had already written into the live state, and {entry.name} lacks "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: they may hold "
                    f"its bytes; do not train from it ({_reasons(result.skipped)})",
                    step=entry.step, path=catalog.storage.url, phase="restore",
                )  # fmt: skip
            result.value = value
            result.step, result.name, result.manifest = entry.step, entry.name, entry.manifest
            if rollback:
                damaged = {name for name, why in result.skipped if why.startswith("damaged")}
                # the scan this restore chose from: a save that commits later is not abandoned
                aside = catalog.start_timeline(entry, entries, damaged) if group.coordinator else []
                result.set_aside = group.broadcast(aside, "restore")
                for name in result.set_aside if group.coordinator else []:
                    _log.warning(
                        "%s set aside: a new timeline starts at %s", name, entry.name,
                        phase="restore",
                    )  # fmt: skip
            result.secs = time.perf_counter() - t0
            _report(catalog, result)
            return result
        if not vanished:
            break
    result.overwritten = partial
    if not result.skipped or not raise_if_none:
        return result  # no checkpoint at all, or the caller goes on to another level
    reasons = _reasons(result.skipped)
    if partial:
        raise PartialRestoreError(
            f"no checkpoint could be restored and the live state was partly overwritten: "
            f"do not train from it ({reasons})", path=catalog.storage.url, phase="restore",
        )  # fmt: skip
    raise CorruptCheckpointError(
        f"no checkpoint passed verification ({reasons})", path=catalog.storage.url, phase="restore"
    )


def agree_on_step(asked: list[int | None], rank: int) -> None:
    """Every rank asks for the same step (restores are collective), or every rank raises;
    ``asked``: each rank's step in rank order (None: the newest)."""
    if len(set(asked)) > 1:
        raise DistributedCheckpointError(
            f"ranks disagree on the step to restore: {asked} (rank order; None: the newest); "
            "restores are collective: every rank asks for the same step",
            ranks=[r for r, a in enumerate(asked) if a != asked[0]], rank=rank, phase="restore",
        )  # fmt: skip


def _say_overwritten(error: CheckpointError) -> None:
    """An older candidate failed after a newer one had written into the live state."""
    if not error.live_overwritten:
        error.live_overwritten = True
        error.message += (
            "; a newer checkpoint that failed verification had already written into the "
            "live state: do not train from it"
        )
        error.args = (error.message,)


def _first(outcomes: list[Outcome], kind: str) -> str:
    """The first message of ``kind``; another rank's is prefixed with its rank."""
    for o in outcomes:
        if o.kind == kind:
            return o.message if o.rank == 0 or len(outcomes) == 1 else f"rank {o.rank}: {o.message}"
    return ""


def _try(
    catalog: Catalog, entry: Entry, load: Callable[[Entry], Any], rank: int
) -> tuple[Outcome, Any, Entry | None]:
    """Pin ``entry``, look at it as it is now and load it: (outcome, value, entry). The
    outcome is what the other ranks learn: ``ok``, ``vanished``, ``marked`` (marked damaged
    before), or the load's error as the classifier names it (``damaged``: found now, to be
    marked; ``partial``; ``refused``, ``io`` or ``error``: raised)."""
    with catalog.pin(entry.name) as alive:
        fresh = catalog.refresh(entry.name) if alive else None
        if fresh is None or fresh.status not in ("committed", "damaged"):
            return Outcome("vanished", rank, "restore"), None, None
        if fresh.status == "damaged":
            return Outcome("marked", rank, "restore", fresh.error or "marked damaged"), None, fresh
        try:
            value = load(fresh)
        except Exception as e:
            return Outcome.of(e, rank, "restore"), None, fresh
        return Outcome.ok(rank, "restore"), value, fresh


def _reasons(skipped: list[tuple[str, str]]) -> str:
    """``name: why`` per checkpoint; checkpoints that failed the same way share one line."""
    groups: dict[str, list[str]] = {}
    for name, why in skipped:
        groups.setdefault(why, []).append(name)
    return "; ".join(
        f"{names[0]}{f' and {len(names) - 1} older' if len(names) > 1 else ''}: {why}"
        for why, names in groups.items()
    )


def _report(catalog: Catalog, result: RestoreResult) -> None:
    skipped = "; ".join(f"{name} ({why})" for name, why in result.skipped)
    _log.info(
        "restored step %d from %s in %.3f s%s",
        result.step, catalog.storage.url, result.secs, f"; skipped: {skipped}" if skipped else "",
        phase="restore",
    )  # fmt: skip
    if skipped:
        _log.warning("restored step %d; skipped %s", result.step, skipped, phase="restore")
