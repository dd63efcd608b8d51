"""Which checkpoint a whole-checkpoint command (``export``, ``diff``) reads, said honestly, and
where a command may not write. No torch.

A command reads the step asked for (``--step N`` or a step directory) or the newest step a
restore would try first. It never reads another one in its place unless told to: a damaged
step asked for is damage (exit 1), not "no such checkpoint" (exit 2, bad usage); a damaged
newest step is refused unless the command has a fallback flag and it was given
(``export --fallback``), and then the step read is named as a fallback in the output and in
the exit status (:data:`pitstop.cli.main.EXIT_FALLBACK`).

Nothing is written inside a checkpoint root except by a save (the lifecycle): an output path
inside a root, a step directory of one, or a multi-level tree is refused, naming the path.

Call sequence (the CLI's thread)::

    choice = choose(path, step, fallback=..., retry=...)  # before anything is loaded
    refuse_inside_checkpoint(out, [choice.root], directory=...)
    ... load choice.step (None: the newest that verifies) ...
    on damage while loading: raise explain_damage(choice, error, retry)
    note = fallback_note(choice, loaded_step, skipped)   # None: the step asked for or the newest
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pitstop.cli.main import _open_root, _UsageError
from pitstop.engine.catalog import Entry
from pitstop.errors import CheckpointError, CorruptCheckpointError, FormatVersionError
from pitstop.format.names import LEVELS_FILE, MANIFEST, OWNER_FILE, parse_aside_dir, parse_step_dir

__all__ = [
    "Choice", "choose", "damage_of_newest", "explain_damage", "fallback_note", "none_verifies",
    "refuse_inside_checkpoint",
]  # fmt: skip

_CANDIDATES = ("committed", "damaged", "newer")  # what a restore tries, newest first


@dataclass(frozen=True)
class Choice:
    """The root (its storage url), the step to load (None: the newest that verifies, falling
    back) and the step directory that was the newest candidate, or the one asked for."""

    root: str
    step: int | None
    entry: Entry
    asked: bool  # a step was named (--step, a step directory)


def _steps(path: str, step: int | None) -> tuple[str, int | None, list[Entry]]:
    """The root's url, the step named (by ``step`` or by ``path`` being a step directory) and
    every step directory of the root, oldest first."""
    catalog, only = _open_root(path)
    try:
        if only is not None:
            held = parse_step_dir(only)
            if step is not None and step != held:
                raise _UsageError(f"{path} holds step {held}, not {step}")
            step = held
        return catalog.storage.url, step, [e for e in catalog.scan() if e.is_step_dir]
    finally:
        catalog.close()


def choose(path: str, step: int | None, *, fallback: bool = False, retry: str = "") -> Choice:
    """The checkpoint of ``path`` to read: ``step`` (or the step directory ``path`` is), else
    the newest candidate. A damaged one is refused with CorruptCheckpointError (``retry``: how
    to ask for another, e.g. ``--fallback exports the newest intact step``), unless it is the
    newest and ``fallback`` allows reading an older one; a step that is not there, or is no
    checkpoint (partial, abandoned by a rollback), is bad usage."""
    root, step, entries = _steps(path, step)
    if step is not None:
        here = next((e for e in entries if e.step == step), None)
        if here is None:
            shown = ", ".join(str(e.step) for e in entries[-10:]) or "none"
            raise _UsageError(f"{root}: no checkpoint of step {step} (steps: {shown})")
        if here.status not in _CANDIDATES:
            why = f": {here.error}" if here.error else ""
            raise _UsageError(
                f"{root}: step {step} is {here.status}{why}: not a checkpoint to read"
            )
        _refuse(here, root, "")
        return Choice(root, step, here, asked=True)
    chain = [e for e in entries if e.status in _CANDIDATES]
    if not chain:
        raise _UsageError(f"{root}: no committed checkpoint")
    newest = chain[-1]
    if newest.status != "damaged":
        return Choice(root, None if fallback else newest.step, newest, asked=False)
    if not fallback:
        _refuse(newest, root, retry)
    return Choice(root, None, newest, asked=False)


def _refuse(entry: Entry, root: str, retry: str) -> None:
    path = f"{root}/{entry.name}"
    if entry.status == "newer":
        raise FormatVersionError(f"step {entry.step}: {entry.error}", step=entry.step, path=path)
    if entry.status == "damaged":
        raise damage_of_newest(entry, entry.error or "marked damaged", retry, path)


def damage_of_newest(entry: Entry, why: str, retry: str, path: str) -> CorruptCheckpointError:
    """The error for a damaged step that was asked for or was the newest: nothing was read in
    its place (``retry``: how to read another, said when it was the newest)."""
    which = "the newest step" if retry else "step"
    more = f"; {retry}" if retry else ""
    return CorruptCheckpointError(
        f"{which} {entry.step} is damaged ({why}): nothing read in its place{more}",
        step=entry.step, path=path,
    )  # fmt: skip


def explain_damage(choice: Choice, error: CorruptCheckpointError, retry: str) -> Exception:
    """After a load of ``choice`` failed on damage (which the load marked): the step's damage
    said as :func:`choose` says it, else ``error`` as it is."""
    try:
        _, _, entries = _steps(choice.root, None)
    except (CheckpointError, _UsageError):
        return error
    now = next((e for e in entries if e.name == choice.entry.name), None)
    if now is None or now.status != "damaged":
        return error
    path = f"{choice.root}/{now.name}"
    return damage_of_newest(now, now.error or "marked damaged", "" if choice.asked else retry, path)


def none_verifies(choice: Choice, error: CorruptCheckpointError) -> Exception:
    """After a load with a fallback (``export --fallback``) found no step that verifies: each
    step tried and why, newest first (as the load marked them), else ``error`` as it is."""
    try:
        _, _, entries = _steps(choice.root, None)
    except (CheckpointError, _UsageError):
        return error
    damaged = [e for e in reversed(entries) if e.status == "damaged"]
    if not damaged:
        return error
    said = "; ".join(f"step {e.step} ({e.error or 'marked damaged'})" for e in damaged)
    return CorruptCheckpointError(
        f"no step verifies, so there is none to fall back to: {said}; nothing written",
        step=choice.entry.step, path=choice.root,
    )  # fmt: skip


def fallback_note(choice: Choice, loaded: int | None, skipped: list[tuple[str, str]]) -> str | None:
    """What to say when the step read is not the newest candidate (None: it is, or it was the
    one asked for): which step was read and why the newer ones were not."""
    if choice.asked or loaded == choice.entry.step:
        return None
    why = "; ".join(f"{name}: {reason}" for name, reason in skipped) or "damaged"
    return f"fallback: step {loaded} read in place of the newest step {choice.entry.step} ({why})"


# ---------------------------------------------------------------------- where not to write
def _pitstop_dir(path: str) -> bool:
    """A step directory or a set-aside one that pitstop made (its name, and its files)."""
    name = os.path.basename(path)
    if parse_step_dir(name) is None and parse_aside_dir(name) is None:
        return False
    return any(os.path.lexists(os.path.join(path, n)) for n in (MANIFEST, OWNER_FILE))


def _holds_checkpoints(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return LEVELS_FILE in names or any(
        (parse_step_dir(n) is not None or parse_aside_dir(n) is not None)
        and _pitstop_dir(os.path.join(path, n))
        for n in names
    )


def _checkpoint_around(path: str, roots: list[str]) -> str | None:
    """The checkpoint root (or multi-level tree) that directory ``path`` lies in or is."""
    real = {os.path.realpath(r) for r in roots}
    here = path
    while True:
        if here in real or os.path.isfile(os.path.join(here, LEVELS_FILE)):
            return here
        if _pitstop_dir(here):
            return os.path.dirname(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return path if _holds_checkpoints(path) else None


def refuse_inside_checkpoint(out: str, roots: list[str], *, directory: bool) -> None:
    """Refuse ``out`` (a file, or with ``directory`` a directory that receives files) when what
    would be written lies inside a checkpoint root (``roots`` or any other): only a save
    writes there."""
    target = os.path.realpath(out)  # through symlinks: a link into a root is inside it
    where = _checkpoint_around(target if directory else os.path.dirname(target), roots)
    if where is not None:
        place = "is" if where == target else "lies inside"
        raise _UsageError(
            f"{out} {place} the checkpoint root {where}: nothing but a save writes there "
            "(it would change or hide committed checkpoints); write it outside the root"
        )
