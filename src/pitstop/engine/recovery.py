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
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    PartialRestoreError,
)
from pitstop.format.manifest import Manifest
from pitstop.log import get_logger

__all__ = ["RestoreResult", "recover"]

_log = get_logger("pitstop.recovery")
_RESCANS = 5


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


def _chain(entries: list[Entry], step: int | None) -> list[Entry]:
    """Step directories that could hold the checkpoint, newest first."""
    out = [
        e
        for e in entries
        if e.is_step_dir
        and e.status in ("committed", "damaged", "newer")
        and (step is None or e.step == step)
    ]
    return sorted(out, key=lambda e: e.step or 0, reverse=True)


def recover(
    catalog: Catalog,
    load: Callable[[Entry], Any],
    *,
    step: int | None = None,
    rollback: bool = False,
) -> RestoreResult:
    """Load the newest checkpoint that verifies (or ``step``) with ``load(entry)``."""
    t0 = time.perf_counter()
    result = RestoreResult()
    partial: PartialRestoreError | None = None
    for _ in range(_RESCANS):
        entries = catalog.scan()
        chain = _chain(entries, step)
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
            with catalog.pin(entry.name) as alive:
                fresh = catalog.refresh(entry.name) if alive else None
                if fresh is None or fresh.status not in ("committed", "damaged"):
                    vanished = True  # removed, moved or replaced since the scan: look again
                    break
                if fresh.status == "damaged":
                    result.skipped.append((entry.name, f"damaged: {fresh.error}"))
                    continue
                entry = fresh  # what is there now, under the pin (not what the scan saw)
                try:
                    result.value = load(entry)
                except PartialRestoreError as e:
                    partial = e
                    result.skipped.append((entry.name, f"load failed part way: {e.message}"))
                    continue
                except CorruptCheckpointError as e:
                    catalog.mark_damaged(entry.name, e.message)
                    result.skipped.append((entry.name, f"damaged: {e.message}"))
                    _log.warning(
                        "%s failed verification, trying an older one: %s",
                        entry.name,
                        e,
                        phase="verify",
                    )
                    continue
            result.step, result.name, result.manifest = entry.step, entry.name, entry.manifest
            if rollback:
                damaged = {name for name, why in result.skipped if why.startswith("damaged")}
                # the scan this restore chose from: a save that commits later is not abandoned
                result.set_aside = catalog.start_timeline(entry, entries, damaged)
                for name in result.set_aside:
                    _log.warning(
                        "%s set aside: a new timeline starts at %s",
                        name,
                        entry.name,
                        phase="restore",
                    )
            result.secs = time.perf_counter() - t0
            _report(catalog, result)
            return result
        if not vanished:
            break
    if not result.skipped:
        return result  # no checkpoint at all
    reasons = _reasons(result.skipped)
    if partial is not None:
        raise PartialRestoreError(
            f"no checkpoint could be restored and the live state was partly overwritten: "
            f"do not train from it ({reasons})", path=catalog.storage.url, phase="restore",
        )  # fmt: skip
    raise CorruptCheckpointError(
        f"no checkpoint passed verification ({reasons})", path=catalog.storage.url, phase="restore"
    )


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
