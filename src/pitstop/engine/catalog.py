"""The catalog: what a storage root holds and the lifecycle of each checkpoint. No torch.

Statuses of the names under a root (``pitstop ls`` shows them):

==========  ==================================================================
committed   ``step-N`` whose manifest parses and validates: a restore candidate
partial     ``step-N`` without a manifest: a save in progress or its debris
writing     ``.writing-step-N-ID``: a save being created (or its debris)
retired     ``.retired-step-N-ID``: retention uncommitted it; its files are deleted next
damaged     failed verification (``DAMAGED`` marker), a manifest that does not
            parse or validate, or ``.damaged-``/``.corrupt-step-N-ID`` set aside
abandoned   ``.abandoned-step-N-ID`` or a step a rollback left (``ROLLBACK`` marker of
            an older step, ``ABANDONED`` marker): newer than a step a rollback restored
newer       written in a newer format than this pitstop reads: never touched
foreign     a ``step-N`` that is a symlink or a file: never followed or removed
other       anything else (not pitstop's)
==========  ==================================================================

Only markers that are evidence count (:mod:`pitstop.format.markers`: whole, naming the
checkpoint they lie beside, an abandonment only where its rollback is found among the other
steps); the others are listed in ``Entry.ignored``. gc deletes a step marked damaged, or a
``.damaged-*`` directory, only if it fails verification again, and an abandoned step only if
the evidence still holds.

Pins: a checkpoint being restored, loaded, exported or verified is pinned (a shared
lock, :meth:`Catalog.pin`); retention, gc and set-aside take it exclusively without
waiting and skip it when it is pinned. A save holds its directory until it commits.

Call sequence: the manager's training thread (scan, pin, mark, set aside) and its
persist thread (``retire`` after each commit); the CLI; any process at the same time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pitstop.engine.verify import verify_checkpoint
from pitstop.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
)
from pitstop.faults import killpoint
from pitstop.format.manifest import Lineage, Manifest, manifest_digest
from pitstop.format.markers import (
    Beside,
    abandonment_problem,
    ignored_line,
    marker_text,
    usable_markers,
)
from pitstop.format.names import MANIFEST, aside_dir_name, parse_aside_dir, parse_step_dir
from pitstop.io.locks import DirLock
from pitstop.log import get_logger
from pitstop.policy.retention import CheckpointInfo, RetentionPolicy
from pitstop.storage.base import Storage

__all__ = ["STATUSES", "Catalog", "Entry", "RunIdentity", "read_manifest"]

_log = get_logger("pitstop.catalog")

STATUSES = (
    "committed", "partial", "writing", "retired", "damaged", "abandoned", "newer", "foreign",
    "other",
)  # fmt: skip
_ASIDE_STATUS = {
    "abandoned": "abandoned",
    "damaged": "damaged",
    "corrupt": "damaged",
    "writing": "writing",
    "retired": "retired",
}
PIN_WAIT_SECS = 30.0


@dataclass(frozen=True)
class Entry:
    """One name under the root; ``step`` is the step it holds (None for ``other``)."""

    name: str
    step: int | None
    status: str
    manifest: Manifest | None = field(default=None, repr=False)
    error: str | None = None
    rollback: Any = field(default=None, repr=False)  # a ROLLBACK marker: newer steps abandoned
    ignored: tuple[str, ...] = ()  # markers that are no evidence (format.markers), and why
    claim: Any = field(default=None, repr=False)  # an ABANDONED marker, its rollback unchecked

    @property
    def is_step_dir(self) -> bool:
        return parse_step_dir(self.name) is not None


@dataclass
class RunIdentity:
    """Which checkpoints are this manager's: its run (stable across restarts: a restore adopts
    the run it resumes), its timeline (new after a rollback) and the step its next save
    continues. Retention only ever removes checkpoints of its own run."""

    run: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    timeline: str = ""
    parent: int | None = None
    owns_unlabelled: bool = False  # format 1 wrote no lineage: ours once we resumed one
    warned_others: bool = False
    checked_root: bool = False

    def __post_init__(self) -> None:
        self.timeline = self.timeline or self.run

    def lineage_for(self, step: int) -> Lineage:
        lineage = Lineage(self.run, self.timeline, self.parent)
        self.parent = step
        return lineage

    def owns(self, manifest: Manifest) -> bool:
        if manifest.lineage is None:
            return self.owns_unlabelled
        return manifest.lineage.run == self.run

    def adopt(self, manifest: Manifest | None, step: int, *, new_timeline: str | None) -> None:
        """Continue ``manifest``'s run from ``step``; ``new_timeline``: the id of the timeline a
        rollback starts (every rank passes the same), None: the manifest's goes on."""
        self.checked_root = True
        lineage = manifest.lineage if manifest is not None else None
        self.owns_unlabelled = lineage is None
        if lineage is not None:
            self.run = lineage.run
            self.timeline = new_timeline or lineage.timeline
        elif new_timeline:
            self.timeline = new_timeline
        self.parent = step


def _run_of(entry: Entry) -> tuple[str | None, str | None]:
    lineage = entry.manifest.lineage if entry.manifest is not None else None
    return (lineage.run, lineage.timeline) if lineage is not None else (None, None)


def _apply_rollbacks(entries: list[Entry]) -> list[Entry]:
    """Committed checkpoints newer than a rollback's target, of its run and old timeline, are
    abandoned (even where the rollback was killed before it could mark or move them)."""
    marks = [e.rollback for e in entries if isinstance(e.rollback, dict)]
    if not marks:
        return entries
    out = []
    for e in entries:
        run, timeline = _run_of(e)
        gone = e.status == "committed" and any(
            isinstance(m.get("after"), int) and (e.step or 0) > m["after"]
            and m.get("run") == run and m.get("timeline") == timeline
            for m in marks
        )  # fmt: skip
        out.append(
            dataclasses.replace(e, status="abandoned", error="a rollback left it") if gone else e
        )
    return out


def _settle_claims(entries: list[Entry]) -> list[Entry]:
    """A committed checkpoint with an ABANDONED marker is abandoned if the rollback the marker
    claims is found among the other step directories (format.markers.abandonment_problem);
    else the marker is no evidence, and said."""
    if not any(e.claim is not None for e in entries):
        return entries
    witnesses = [_beside(e) for e in entries if e.is_step_dir and e.manifest is not None]
    out = []
    for e in entries:
        if e.claim is None or e.status != "committed":
            out.append(e)
            continue
        problem = abandonment_problem(e.claim, _beside(e), witnesses)
        if problem is None:
            why = f"a rollback to step {e.claim['after']} left it (in use then)"
            out.append(dataclasses.replace(e, status="abandoned", error=why))
        else:
            ignored = (*e.ignored, ignored_line("abandoned", problem))
            out.append(dataclasses.replace(e, ignored=ignored))
    return out


def _abandoned_text(e: Entry, after: int, now: float) -> str:
    """The ABANDONED marker of ``e``, left by a rollback to ``after``: naming its checkpoint."""
    assert e.step is not None and e.manifest is not None
    run, timeline = _run_of(e)
    return marker_text(
        "abandoned", e.step, after=after, run=run, timeline=timeline,
        manifest_digest=manifest_digest(e.manifest), time=now,
    )  # fmt: skip


def _beside(e: Entry) -> Beside:
    assert e.step is not None
    return Beside(e.step, e.manifest, e.rollback if isinstance(e.rollback, dict) else None)


def read_manifest(storage: Storage, directory: str) -> Manifest:
    """Parse the manifest of ``directory`` (a step directory, or one set aside); raises
    CheckpointNotFoundError, ManifestError, FormatVersionError or CheckpointIOError."""
    return _parse_manifest(storage, directory, storage.read_manifest(directory))


def _parse_manifest(storage: Storage, directory: str, data: bytes) -> Manifest:
    path = f"{storage.url}/{directory}/{MANIFEST}"
    manifest = Manifest.loads(data, path=path)
    aside = parse_aside_dir(directory)
    expected = parse_step_dir(directory) if aside is None else aside[1]
    if expected is not None and manifest.step != expected:
        raise CorruptCheckpointError(
            f"manifest says step {manifest.step} but lies in {directory}", path=path
        )
    return manifest


_PARSED_MAX = 256  # parsed manifests a catalog keeps (of names it listed recently)

UNLOCKED_DEBRIS_SECS = 60.0
"""On a storage without locks (an object store), an uncommitted step whose newest object is
younger than this is kept by gc whatever ``min_age`` says: a save on another host may be
writing it (one of this host's, alive or dead, the storage tells by its owner's pid)."""


class Catalog:
    """The checkpoints under one storage root and their lifecycle (see the module docstring)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._purger: ThreadPoolExecutor | None = None
        self._purger_lock = threading.Lock()
        self._parsed: dict[str, tuple[bytes, Manifest]] = {}  # name -> (its bytes, parsed)

    def _read_manifest(self, name: str) -> Manifest:
        """:func:`read_manifest` of ``name``, read every time; parsed again only when its
        bytes differ from the last ones read under that name (a restart scans the root
        two or three times, and retention after every commit: each manifest was parsed
        as often, a few ms each). Training and persist threads (one dict operation each)."""
        data = self.storage.read_manifest(name)
        cached = self._parsed.get(name)
        if cached is not None and cached[0] == data:
            return cached[1]
        manifest = _parse_manifest(self.storage, name, data)
        if len(self._parsed) >= _PARSED_MAX:
            self._parsed.clear()
        self._parsed[name] = (bytes(data), manifest)
        return manifest

    def close(self) -> None:
        """Wait for the deletes of retired checkpoints still running."""
        with self._purger_lock:
            purger, self._purger = self._purger, None
        if purger is not None:
            purger.shutdown(wait=True)

    # ------------------------------------------------------------------ listing
    def scan(self) -> list[Entry]:
        """Every entry under the root, sorted by step. I/O errors are raised, not hidden."""
        out = [e for e in (self._entry(n) for n in self.storage.entries()) if e is not None]
        out = _settle_claims(_apply_rollbacks(out))
        return sorted(out, key=lambda e: (e.step is None, e.step or 0, e.name))

    def refresh(self, name: str) -> Entry | None:
        """``name`` as it is now (after a pin took hold: another process may have replaced it)."""
        return self._entry(name)

    def _entry(self, name: str) -> Entry | None:
        """``name`` as it is, its markers checked as far as its own directory tells (an
        ABANDONED marker's rollback is checked by ``scan``, against the other steps)."""
        step = parse_step_dir(name)
        if step is None:
            aside = parse_aside_dir(name)
            if aside is None:
                return Entry(name, None, "other")
            kind = self.storage.entry_kind(name)
            if kind == "missing":
                return None
            if kind != "dir":
                return Entry(name, aside[1], "foreign", error=f"a {kind}: never touched")
            return Entry(name, aside[1], _ASIDE_STATUS[aside[0]])
        kind = self.storage.entry_kind(name)
        if kind == "missing":
            return None
        if kind != "dir":
            return Entry(name, step, "foreign", error=f"a {kind}, not a directory: never touched")
        if not self.storage.has_manifest(name):
            return Entry(name, step, "partial")
        try:
            manifest = self._read_manifest(name)
        except CheckpointNotFoundError:
            return None  # removed while we looked
        except FormatVersionError as e:
            return Entry(name, step, "newer", error=e.message)
        except CorruptCheckpointError as e:
            return Entry(name, step, "damaged", error=e.message)
        return self._marked(name, step, manifest)

    def _marked(self, name: str, step: int, manifest: Manifest) -> Entry:
        """The committed checkpoint ``name`` as its markers that are evidence say."""
        markers, ignored = usable_markers(self.storage.read_markers(name), Beside(step, manifest))
        entry = Entry(
            name, step, "committed", manifest, rollback=markers.get("rollback"),
            ignored=tuple(ignored), claim=markers.get("abandoned"),
        )  # fmt: skip
        if "damaged" in markers:
            why = markers["damaged"]["reason"] or "marked damaged"
            return dataclasses.replace(entry, status="damaged", error=why, claim=None)
        return entry

    def committed(self) -> list[Entry]:
        """Committed checkpoints, oldest first."""
        return [e for e in self.scan() if e.status == "committed"]

    # ------------------------------------------------------------------ pins
    @contextmanager
    def pin(self, name: str) -> Iterator[bool]:
        """Hold ``name`` against retention and gc while reading it. Yields False if it is no
        longer committed (removed just before the pin took hold)."""
        deadline = time.monotonic() + PIN_WAIT_SECS
        while True:
            try:
                lock = self.storage.lock(name, exclusive=False)
            except CheckpointNotFoundError:
                yield False
                return
            if lock is not None:
                break
            if time.monotonic() > deadline:
                raise CheckpointIOError(
                    f"{name} is held by another process (being removed or moved) for "
                    f"{PIN_WAIT_SECS:.0f} s", path=f"{self.storage.url}/{name}", phase="restore",
                )  # fmt: skip
            time.sleep(0.01)
        with lock:
            yield self.storage.has_manifest(name)

    # ------------------------------------------------------------------ damage and timelines
    def mark_damaged(self, name: str, reason: str) -> None:
        """Record why ``name`` failed verification; nothing is moved or deleted."""
        step = parse_step_dir(name)
        if step is None:
            return
        try:  # the marker names this checkpoint: a copy of it elsewhere is no evidence
            digest = manifest_digest(read_manifest(self.storage, name))
            text = marker_text(
                "damaged", step, reason=reason[:4000], manifest_digest=digest, time=time.time()
            )
            self.storage.mark(name, "damaged", text)
        except CheckpointError as e:  # a manifest that does not parse says it by itself
            _log.warning("could not mark %s damaged: %s", name, e, phase="verify")

    def start_timeline(self, restored: Entry, entries: list[Entry], damaged: set[str]) -> list[str]:
        """A rollback to ``restored``: the newer checkpoints of its run stop being candidates.
        First a ROLLBACK marker in ``restored`` (one atomic write: a rollback killed half-way
        still holds, and scan applies it), then each newer one is marked and set aside (renamed:
        its step name is free for the new timeline) unless it is in use, when the mark holds."""
        assert restored.step is not None and restored.manifest is not None
        run, timeline = _run_of(restored)
        newer = [
            e for e in entries
            if e.is_step_dir and (e.step or 0) > restored.step
            and e.status in ("committed", "damaged", "abandoned")
            and (_run_of(e)[0] == run or e.manifest is None)  # unreadable: whose is unknown
        ]  # fmt: skip
        if not newer:
            return []
        k, now = restored.step, time.time()
        mark = marker_text("rollback", k, after=k, run=run, timeline=timeline, time=now)
        self.storage.mark(restored.name, "rollback", mark)
        moved = []
        for e in newer:
            kind = "damaged" if e.status == "damaged" or e.name in damaged else "abandoned"
            try:
                if kind == "abandoned" and e.step is not None and e.manifest is not None:
                    self.storage.mark(e.name, "abandoned", _abandoned_text(e, k, now))
                target = self.set_aside(e, kind)
            except CheckpointNotFoundError:
                continue  # another process set it aside first
            moved.append(target or e.name)
        return moved

    def set_aside(self, entry: Entry, kind: str) -> str | None:
        """Move ``entry`` out of the restore candidates and out of a new save's way
        (``kind``: abandoned or damaged). Returns the new name; None if it is pinned."""
        assert entry.step is not None
        lock = self._hold(entry.name, "in use elsewhere; not set aside", phase="restore", warn=True)
        if lock is None:
            return None
        target = aside_dir_name(kind, entry.step, uuid.uuid4().hex[:8])
        with lock:
            now = self._entry(entry.name)  # still the checkpoint that was scanned?
            if now is None or now.manifest != entry.manifest:
                return None
            self.storage.rename(entry.name, target)
        return target

    def warn_other_runs(self, identity: RunIdentity) -> None:
        """Before a run's first save without a restore: say so if the root holds another run's
        checkpoints (a second job in the same directory, or a restart that forgot restore())."""
        others = [e for e in self.committed() if e.manifest and not identity.owns(e.manifest)]
        if others:
            identity.warned_others = True
            _log.warning(
                "%s already holds %d committed checkpoints of another run (newest: step %s) and "
                "this manager restored none: its saves go beside them (call restore() to continue "
                "that run; retention leaves other runs alone)",
                self.storage.url, len(others), others[-1].step, phase="plan",
            )  # fmt: skip

    # ------------------------------------------------------------------ retention and gc
    def retire(self, policy: RetentionPolicy, *, newest: int, identity: RunIdentity) -> list[str]:
        """Persist thread, right after ``newest`` committed: retire the committed checkpoints of
        this run up to ``newest`` that ``policy`` does not keep, unless pinned. Checkpoints of
        other runs are left alone (with one warning). Returns the retired names (to ``purge``)."""
        entries = [e for e in self.committed() if e.step is not None and e.step <= newest]
        mine = [e for e in entries if e.manifest is not None and identity.owns(e.manifest)]
        others = [str(e.step) for e in entries if e not in mine]
        if others and not identity.warned_others:
            identity.warned_others = True
            _log.warning(
                "%d committed checkpoints under %s belong to another run (steps %s); retention "
                "leaves them alone (restore() continues the run it resumes)",
                len(others), self.storage.url, ", ".join(others[:5]), phase="gc",
            )  # fmt: skip
        infos = [
            CheckpointInfo(e.step, e.manifest.created_unix_secs, dict(e.manifest.metrics))
            for e in mine
            if e.step is not None and e.manifest is not None
        ]
        keep = policy.keep(infos) | {newest}
        retired = []
        for e in mine:
            if e.step in keep or e.step is None:
                continue
            name = self._retire_one(e.name, e.step)
            if name is not None:
                retired.append(name)
        return retired

    def _retire_one(self, name: str, step: int) -> str | None:
        """Uncommit ``name`` (manifest first, durably) and move it to ``.retired-step-N-ID``: from
        here it is no checkpoint. The files are deleted by :meth:`purge`, after ``save()``
        returned. None if it is pinned."""
        lock = self._hold(name, "pinned; retention leaves it for later")
        if lock is None:
            return None
        target = aside_dir_name("retired", step, uuid.uuid4().hex[:8])
        with lock:
            self.storage.uncommit(name)
            killpoint("retention.mid")
            if not getattr(self.storage, "renames_in_place", True):
                self.storage.remove(name)  # an object store's rename copies every byte
                return None
            self.storage.rename(name, target)
        return target

    def _hold(
        self, name: str, busy: str, *, phase: str = "gc", warn: bool = False
    ) -> DirLock | None:
        """``name`` held exclusively, without waiting; None if it is gone, or if someone holds
        it (logged with ``busy``, as a warning if ``warn``)."""
        try:
            lock = self.storage.lock(name, exclusive=True)
        except CheckpointNotFoundError:
            return None
        if lock is None:
            log = _log.warning if warn else _log.info
            log("%s is %s", name, busy, phase=phase)
        return lock

    def purge_later(self, names: list[str]) -> None:
        """Delete what retention retired on this catalog's own thread: deleting a large
        checkpoint takes time (about 0.13 s per GB here) that no save should wait for.
        :meth:`close` waits for it; ``gc`` removes whatever a crash left."""
        if not names:
            return
        with self._purger_lock:
            if self._purger is None:
                self._purger = ThreadPoolExecutor(1, thread_name_prefix="pitstop-purge")
            self._purger.submit(self.purge, names)

    def purge(self, names: list[str]) -> None:
        """Delete what retention retired."""
        for name in names:
            try:
                self._remove_held(name, uncommit=False, point=None)
            except CheckpointError as e:  # gc removes it later
                _log.warning("could not delete retired %s: %s", name, e, phase="gc")

    def _remove_held(
        self, name: str, *, uncommit: bool, point: str | None, debris: bool = False
    ) -> bool:
        """Remove ``name`` if nobody holds it; False if pinned or being written. ``debris``:
        only if it still has no manifest once held (a save may have committed since the scan)."""
        lock = self._hold(name, "pinned or being written; left for later")
        if lock is None:
            return False
        with lock:
            if debris and self.storage.has_manifest(name):
                return False  # committed after the scan: not debris
            if uncommit:
                self.storage.uncommit(name)
            if point is not None:
                killpoint(point)
            self.storage.remove(name)
        return True

    def _collect_one(self, e: Entry, min_age_secs: float, now: float, dry_run: bool) -> str:
        debris = e.status in ("partial", "writing", "retired")
        min_age = max(min_age_secs, 10.0) if e.status == "writing" else min_age_secs
        unlocked = debris and not getattr(self.storage, "locks", True)
        if unlocked:
            min_age = max(min_age, UNLOCKED_DEBRIS_SECS)  # a save elsewhere may be running
        if debris and min_age > 0:
            age = max(0.0, now - self.storage.mtime(e.name))
            if age < min_age:
                if unlocked and min_age > min_age_secs:  # the floor of a storage without locks
                    return (
                        f"kept: written to {age:.0f} s ago (no locks on {self.storage.url}: a "
                        f"save on another host may be writing it; removed once {min_age:.0f} s "
                        "old)"
                    )
                return f"kept: written to {age:.0f} s ago (a save may be running)"
        if e.status == "damaged" or (e.is_step_dir and e.status == "abandoned"):
            return self._collect_step(e, dry_run)
        if dry_run:
            return "would remove"
        if self._remove_held(e.name, uncommit=e.status == "damaged", point="gc.mid", debris=debris):
            return "removed"
        return "kept: in use by a running save or reader, or committed meanwhile"

    def _collect_step(self, e: Entry, dry_run: bool) -> str:
        """A step gc was asked to delete as damaged or abandoned, or a checkpoint set aside as
        damaged: only if the evidence holds."""
        lock = None if dry_run else self._hold(e.name, "pinned or being written; left for later")
        if lock is None and not dry_run:
            return "kept: in use by a running save or reader"
        with lock if lock is not None else contextlib.nullcontext():
            doubt = self._doubt(e)
            if doubt is not None or dry_run:
                return f"kept: {doubt}" if doubt is not None else "would remove"
            self.storage.uncommit(e.name)
            killpoint("gc.mid")
            self.storage.remove(e.name)
        return "removed"

    def _doubt(self, e: Entry) -> str | None:
        """Why the evidence that ``e`` is damaged or abandoned does not hold now (None: it does):
        markers and rollbacks checked again, a step marked damaged verified again."""
        if not e.is_step_dir:
            return self._aside_doubt(e)
        now = next((x for x in self.scan() if x.name == e.name), None)
        if now is None:
            raise CheckpointNotFoundError(f"{e.name} is gone", path=f"{self.storage.url}/{e.name}")
        if now.status != e.status or now.manifest != e.manifest:
            return f"it changed since it was listed (now {now.status})"
        marked = now.manifest if now.status == "damaged" else None
        if marked is not None and verify_checkpoint(self.storage, now.name, marked).ok:
            return f"marked damaged ({now.error}), but it verifies now"
        return None

    def _aside_doubt(self, e: Entry) -> str | None:
        """Why a checkpoint set aside as damaged may not be (None: it may): it verifies now
        (set aside on a DAMAGED marker that was wrong, or copied), or is of a newer format."""
        try:
            manifest = read_manifest(self.storage, e.name)
        except CheckpointNotFoundError:
            return None  # no manifest: no checkpoint
        except FormatVersionError as err:
            return f"written in a newer format, not verified ({err.message})"
        except CorruptCheckpointError:
            return None  # its manifest is the evidence
        if verify_checkpoint(self.storage, e.name, manifest).ok:
            return f"set aside as damaged, but its checkpoint (step {manifest.step}) verifies"
        return None

    def collect(
        self,
        *,
        abandoned: bool = False,
        damaged: bool = False,
        min_age_secs: float = 0.0,
        busy: frozenset[str] = frozenset(),
        dry_run: bool = False,
    ) -> list[tuple[Entry, str]]:
        """gc: remove debris of dead saves (and, when asked, abandoned or damaged checkpoints).
        A save in progress (its directory held), a pinned checkpoint or debris written to
        within ``min_age_secs`` is kept. Returns (entry, what happened) pairs."""
        wanted = {"partial", "writing", "retired"} | ({"abandoned"} if abandoned else set())
        wanted |= {"damaged"} if damaged else set()
        out: list[tuple[Entry, str]] = []
        now = time.time()
        for e in self.scan():
            if e.status not in wanted or e.name in busy:
                continue
            try:
                out.append((e, self._collect_one(e, min_age_secs, now, dry_run)))
            except CheckpointNotFoundError:
                continue  # gone while we looked (a save renamed or committed it)
            except CheckpointError as err:  # one odd entry does not stop the rest
                out.append((e, f"kept: {err.message}"))
        return out
