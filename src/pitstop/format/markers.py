"""Marker files of a committed step (``DAMAGED``, ``ABANDONED``, ``ROLLBACK``): their schema,
their seal, and the checks that make one evidence. No torch.

A marker is a claim about the checkpoint beside it, and restore, gc and a new save act on it
(skip the step, delete it, move it aside), so a marker is input like a manifest: sealed the
same way (``integrity``: the checksum of its canonical body, made by
:func:`pitstop.format.manifest.seal`), and checked against what it claims::

    DAMAGED    {"marker": "DAMAGED", "step": 1200, "reason": "...", "manifest_digest": "3f0a..",
                "time": 1795327370.8, "integrity": {"algorithm": "xxh3_64", "manifest": "5be0.."}}
    ABANDONED  {"marker": "ABANDONED", "step": 1250, "after": 1200, "run": "9c1e..",
                "timeline": "9c1e..", "manifest_digest": "77d2..", "time": ..., "integrity": ...}
    ROLLBACK   {"marker": "ROLLBACK", "step": 1200, "after": 1200, "run": "9c1e..",
                "timeline": "9c1e..", "time": ..., "integrity": ...}

(``integrity.manifest`` is the seal's field name, shared with manifests; ``manifest_digest``
is :func:`pitstop.format.manifest.manifest_digest` of the manifest beside the marker.)

**What is evidence.** A marker is a JSON object, sealed and whole (or exactly the unsealed
shape of the first format, below), naming its own step. Then, by kind:

* ``DAMAGED`` names the checkpoint it lies beside: its ``manifest_digest`` is that manifest's.
  A DAMAGED marker copied from another checkpoint (another run's step of the same number) is
  no evidence, and neither is one without a digest (both earlier formats): the restore then
  verifies the step again as it reads it, and marks it anew if it is damaged.
* ``ROLLBACK``: ``after`` is its own step (a rollback to step k marks step k) and its run and
  timeline are those of the manifest beside it; every newer checkpoint of that run and
  timeline is abandoned from then on.
* ``ABANDONED`` claims that a rollback to step ``after`` (below its own) left this checkpoint
  while it was in use. Its ``manifest_digest``, ``run`` and ``timeline`` (when it has them:
  today's format) are those of the manifest beside it, and the rollback must be found
  (:func:`abandonment_problem`): a ``ROLLBACK`` marker at step ``after`` of the same run,
  of its timeline or written after this checkpoint; or a checkpoint of the same run on another
  timeline, written after this one, that continues a step below it (the new timeline, once
  retention removed the step the rollback restored). Markers of both earlier formats count
  under the same check, so a rollback made by an older pitstop still holds.

Anything else (empty, unparseable, not a regular file, a seal that fails, unsealed with fields
only a sealed marker has, inconsistent, naming another checkpoint, a rollback nowhere to be
found) is **no evidence**: reported (``pitstop ls`` and ``verify``) and never acted on.

Earlier formats: the first wrote the markers unsealed with these fields only; the second
sealed them as above without ``manifest_digest`` (and ABANDONED without run and timeline)::

    DAMAGED    {"reason": str, "time": number}           (time optional)
    ABANDONED  {"after": int}
    ROLLBACK   {"after": int, "run": str|null, "timeline": str|null, "time": number}

A pitstop of an earlier format reads today's markers as before (it reads ``after``, ``run``,
``timeline`` and ``reason`` and ignores the rest).
"""

from __future__ import annotations

import json
import math
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pitstop.format.checksum import ALGORITHMS
from pitstop.format.manifest import Manifest, manifest_digest, seal
from pitstop.format.names import MARKERS

__all__ = [
    "MAX_MARKER_BYTES", "Beside", "RunTimeline", "Unreadable", "abandonment_problem",
    "check_marker", "ignored_line", "marker_text", "not_a_marker", "usable_markers",
]  # fmt: skip

MAX_MARKER_BYTES = 65536
"""A marker file larger than this is not read (pitstop writes a few hundred bytes)."""

RunTimeline = tuple[str | None, str | None]
"""(run, timeline) of a manifest (None, None: a format 1 manifest)."""


class Unreadable(str):
    """What storage reads for a marker file it cannot take as JSON: what the file is
    (``a FIFO``, ``a directory``, ``empty``, ``209715200 bytes, ...``, ``not JSON (...)``)."""


def not_a_marker(mode: int, size: int) -> str | None:
    """What a marker file of ``mode`` (``st_mode``) and ``size`` bytes is when it cannot hold a
    marker: ``a FIFO``, ``empty``, ... (None: a regular file that may)."""
    kinds = (
        (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
    )  # fmt: skip
    for test, what in kinds:
        if test(mode):
            return what
    if not stat.S_ISREG(mode):
        return "not a regular file"
    if size == 0:
        return "empty"
    if size > MAX_MARKER_BYTES:
        return f"{size} bytes, more than a marker ever holds ({MAX_MARKER_BYTES})"
    return None


@dataclass(frozen=True)
class Beside:
    """A step directory a marker lies in: its step, its manifest (None: none that parses) and,
    as a witness for other steps' abandonments, its ROLLBACK marker if that is evidence."""

    step: int
    manifest: Manifest | None = None
    rollback: dict[str, Any] | None = None

    @property
    def lineage(self) -> RunTimeline:
        lineage = self.manifest.lineage if self.manifest is not None else None
        return (lineage.run, lineage.timeline) if lineage is not None else (None, None)


_OLD_FIELDS = {
    "damaged": ({"reason"}, {"time"}),
    "abandoned": ({"after"}, set()),
    "rollback": ({"after", "run", "timeline"}, {"time"}),
}
"""Required and optional fields of each kind in the first, unsealed format."""
_SEALED_FIELDS = {
    "damaged": {"marker", "step", "reason", "integrity"},
    "abandoned": {"marker", "step", "after", "integrity"},
    "rollback": {"marker", "step", "after", "run", "timeline", "integrity"},
}
"""Required fields of each kind, sealed (the second format's; today's add _BOUND)."""
_BOUND = {"damaged": {"manifest_digest"}, "abandoned": {"manifest_digest", "run", "timeline"}}
"""Fields by which today's markers name the checkpoint beside them (all or none)."""


def marker_text(kind: str, step: int, **fields: Any) -> str:
    """The sealed JSON of marker ``kind`` of step ``step`` (``fields``: as the schema says)."""
    body = {"marker": MARKERS[kind], "step": step, **fields}
    return json.dumps(seal(body), allow_nan=False)


def _is_int(value: object) -> bool:
    return type(value) is int


def _seal_problem(doc: dict[str, Any]) -> str | None:
    """Why the seal of ``doc`` does not vouch for it (None: it does)."""
    integrity = doc.get("integrity")
    if not isinstance(integrity, dict) or not isinstance(integrity.get("manifest"), str):
        return "its seal is malformed"
    algorithm = integrity.get("algorithm")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        return f"its seal uses an algorithm this pitstop does not know ({algorithm!r})"
    try:
        expected = seal(doc, algorithm)["integrity"]
    except Exception as e:  # a value JSON cannot canonicalize, a missing checksum package
        return f"its seal cannot be checked ({type(e).__name__}: {e})"
    if expected != integrity:
        return "its checksum does not match its body (damaged)"
    return None


def _shape_problem(kind: str, doc: dict[str, Any], step: int) -> str | None:
    """Why ``doc`` is not a marker of ``kind`` of ``step`` in any format (None: it is)."""
    keys = set(doc)
    if "integrity" in doc:
        problem = _seal_problem(doc)
        if problem is not None:
            return problem
        if doc.get("marker") != MARKERS[kind]:
            return f"it says it is a {doc.get('marker')!r} marker"
        if not _is_int(doc.get("step")) or doc["step"] != step:
            return f"it names step {doc.get('step')!r}, not its own ({step})"
        required = _SEALED_FIELDS[kind]  # more fields: a later pitstop's, vouched for
        bound = _BOUND.get(kind, set())
        required = required | bound if keys & bound else required
    else:
        required, optional = _OLD_FIELDS[kind]
        extra = sorted(keys - required - optional)
        if extra:
            return f"it is unsealed and has fields no unsealed marker had ({', '.join(extra)})"
    if not required <= keys:
        return f"it lacks {', '.join(sorted(required - keys))}"
    time_ = doc.get("time", 0.0)
    if type(time_) not in (int, float) or not math.isfinite(time_):
        return "its time is not a number"
    return None


def _names_problem(doc: dict[str, Any], beside: Beside, required: bool) -> str | None:
    """Why ``doc`` does not name the checkpoint beside it (None: it does, or it names none and
    need not, ``required`` False)."""
    if "manifest_digest" not in doc:
        return (
            "it names no checkpoint (an earlier pitstop's, or a copy): a restore verifies the "
            "step again"
            if required
            else None
        )
    if beside.manifest is None:
        return "there is no manifest beside it to check it against"
    if doc["manifest_digest"] != manifest_digest(beside.manifest):
        return "it names another checkpoint (its manifest_digest is not this manifest's)"
    if "run" in doc and (doc["run"], doc["timeline"]) != beside.lineage:
        return "it names a run and timeline that are not the run and timeline of its step"
    return None


def _claim_problem(kind: str, doc: dict[str, Any], beside: Beside) -> str | None:
    """Why what ``doc`` claims does not fit its step and manifest (None: it fits)."""
    step = beside.step
    if kind == "damaged":
        if not isinstance(doc["reason"], str):
            return "its reason is not text"
        return _names_problem(doc, beside, required=True)
    after = doc["after"]
    if not _is_int(after) or after < 0:
        return f"its after ({after!r}) is not a step"
    if kind == "abandoned":
        if after >= step:
            return f"it abandons step {step} after step {after}"
        return _names_problem(doc, beside, required=False)
    if after != step:
        return f"it rolls back to step {after}, but lies in step {step}"
    run, timeline = doc["run"], doc["timeline"]
    if not all(isinstance(v, (str, type(None))) for v in (run, timeline)):
        return "its run or timeline is not text"
    if beside.manifest is not None and (run, timeline) != beside.lineage:
        return "it names a run and timeline that are not the run and timeline of its step"
    return None


def check_marker(kind: str, doc: object, beside: Beside | None) -> str | None:
    """None if ``doc`` (marker file ``kind`` as storage read it) is evidence as far as its own
    step directory ``beside`` tells (None: it lies in none), else why it is not. An ABANDONED
    marker also needs :func:`abandonment_problem`: whether its rollback happened."""
    if isinstance(doc, Unreadable):
        return f"it is {doc}"
    if not isinstance(doc, dict):
        return f"it is not a JSON object (a JSON {type(doc).__name__})"
    if not doc:
        return "it is an empty JSON object"
    if beside is None:
        return "it does not lie in a step directory"
    problem = _shape_problem(kind, doc, beside.step)
    return problem if problem is not None else _claim_problem(kind, doc, beside)


def usable_markers(
    raw: dict[str, Any], beside: Beside | None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The markers of ``raw`` (by kind, as storage reads them) that are evidence as far as their
    step directory tells (:func:`check_marker`), and one line per marker that is not
    (``ROLLBACK marker ignored: ...``)."""
    usable: dict[str, dict[str, Any]] = {}
    ignored: list[str] = []
    for kind, doc in raw.items():
        problem = check_marker(kind, doc, beside)
        if problem is None:
            usable[kind] = doc
        else:
            ignored.append(ignored_line(kind, problem))
    return usable, ignored


def ignored_line(kind: str, problem: str) -> str:
    """How a marker that is no evidence is said: ``DAMAGED marker ignored: <why>``."""
    return f"{MARKERS.get(kind, kind)} marker ignored: {problem}"


def abandonment_problem(
    doc: dict[str, Any], beside: Beside, others: Iterable[Beside]
) -> str | None:
    """Why the rollback that ABANDONED marker ``doc`` (usable as far as ``beside``, its step
    directory, tells) claims is not found among ``others``, the root's other step directories
    with a manifest (None: it is). Found: a usable ROLLBACK at step ``after`` of the same run,
    of the same timeline or written after this checkpoint; or a checkpoint of the same run on
    another timeline, written after this one, continuing a step below this one (the timeline
    the rollback started, after retention removed the step it restored)."""
    if beside.manifest is None:
        return "there is no manifest beside it"
    for other in others:
        if _rolled_back(other, doc["after"], beside) or _went_on(other, beside):
            return None
    return f"no rollback to step {doc['after']} of its run is found under this root"


def _rolled_back(other: Beside, after: int, beside: Beside) -> bool:
    """``other`` is step ``after`` and holds a rollback that left ``beside``: one of its run,
    and of its timeline or made after it was written."""
    mark = other.rollback
    if mark is None or other.step != after or beside.manifest is None:
        return False
    run, timeline = beside.lineage
    made = mark.get("time", -math.inf)
    return mark["run"] == run and (
        mark["timeline"] == timeline or made >= beside.manifest.created_unix_secs
    )


def _went_on(other: Beside, beside: Beside) -> bool:
    """``other`` is a checkpoint of the run of ``beside`` on another timeline, written after it,
    that continues a step below it: the run went on without ``beside`` (left by a rollback)."""
    (run, timeline), (o_run, o_timeline) = beside.lineage, other.lineage
    if other.manifest is None or beside.manifest is None or run is None:
        return False
    if o_run != run or o_timeline == timeline:
        return False
    lineage = other.manifest.lineage
    parent = lineage.parent if lineage is not None and lineage.parent is not None else other.step
    written_after = other.manifest.created_unix_secs > beside.manifest.created_unix_secs
    return written_after and min(other.step, parent) < beside.step
