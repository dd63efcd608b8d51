"""Marker files of a committed step (``DAMAGED``, ``ABANDONED``, ``ROLLBACK``): their schema,
their seal, and the checks that make one evidence. No torch.

A marker is a claim about the step directory that holds it, and restore, gc and a new save
act on it (skip the step, delete it, move it aside), so a marker is input like a manifest:
sealed the same way (``integrity``: the checksum of its canonical body, made by
:func:`pitstop.format.manifest.seal`) and checked against its holder::

    DAMAGED    {"marker": "DAMAGED", "step": 1200, "reason": "...", "time": 1795327370.8,
                "integrity": {"algorithm": "xxh3_64", "manifest": "5be0.."}}
    ABANDONED  {"marker": "ABANDONED", "step": 1250, "after": 1200, "time": ..., "integrity": ...}
    ROLLBACK   {"marker": "ROLLBACK", "step": 1200, "after": 1200, "run": "9c1e..",
                "timeline": "9c1e..", "time": ..., "integrity": ...}

(``integrity.manifest`` is the seal's field name, shared with manifests.) A marker is evidence
only if it is a JSON object, sealed and whole, or else exactly the previous format's unsealed
shape (below); it names its own step (``step``: the directory's); a rollback's ``after`` is its
own step (a rollback to step k marks step k) and its run and timeline are those of the
manifest beside it (the steps it abandons are that run's and timeline's, after k); an
abandonment's ``after`` is below its own step. Anything else (empty, unparseable, a seal that
fails, unsealed with fields only a sealed marker has, inconsistent) is **no evidence**: it is
reported (``pitstop ls`` and ``verify``) and never acted on.

The previous format wrote the same files unsealed, with these fields only, and they are still
honored when consistent (a rollback killed before it finished, years ago, must still hold)::

    DAMAGED    {"reason": str, "time": number}           (time optional)
    ABANDONED  {"after": int}
    ROLLBACK   {"after": int, "run": str|null, "timeline": str|null, "time": number}

A pitstop that predates the seal reads the sealed markers as before (it reads ``after``,
``run``, ``timeline`` and ``reason`` and ignores the rest).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pitstop.format.checksum import ALGORITHMS
from pitstop.format.manifest import seal
from pitstop.format.names import MARKERS

__all__ = ["RunTimeline", "check_marker", "marker_text", "usable_markers"]

RunTimeline = tuple[str | None, str | None]
"""(run, timeline) of the manifest beside a marker (None, None: a format 1 manifest)."""

_OLD_FIELDS = {
    "damaged": ({"reason"}, {"time"}),
    "abandoned": ({"after"}, set()),
    "rollback": ({"after", "run", "timeline"}, {"time"}),
}
"""Required and optional fields of each kind in the previous, unsealed format."""
_SEALED_FIELDS = {
    "damaged": {"marker", "step", "reason", "time", "integrity"},
    "abandoned": {"marker", "step", "after", "time", "integrity"},
    "rollback": {"marker", "step", "after", "run", "timeline", "time", "integrity"},
}


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
    """Why ``doc`` is not a marker of ``kind`` of ``step`` in either format (None: it is)."""
    keys = set(doc)
    if "integrity" in doc:
        problem = _seal_problem(doc)
        if problem is not None:
            return problem
        if doc.get("marker") != MARKERS[kind]:
            return f"it says it is a {doc.get('marker')!r} marker"
        if not _is_int(doc.get("step")) or doc["step"] != step:
            return f"it names step {doc.get('step')!r}, not its own ({step})"
        required = _SEALED_FIELDS[kind] - {"time"}  # more fields: a later pitstop's, vouched for
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


def _claim_problem(
    kind: str, doc: dict[str, Any], step: int, lineage: RunTimeline | None
) -> str | None:
    """Why what ``doc`` claims does not fit its step and manifest (None: it fits)."""
    if kind == "damaged":
        return None if isinstance(doc["reason"], str) else "its reason is not text"
    after = doc["after"]
    if not _is_int(after) or after < 0:
        return f"its after ({after!r}) is not a step"
    if kind == "abandoned":
        return None if after < step else f"it abandons step {step} after step {after}"
    if after != step:
        return f"it rolls back to step {after}, but lies in step {step}"
    run, timeline = doc["run"], doc["timeline"]
    if not all(isinstance(v, (str, type(None))) for v in (run, timeline)):
        return "its run or timeline is not text"
    if lineage is not None and (run, timeline) != lineage:
        return "it names a run and timeline that are not the run and timeline of its step"
    return None


def check_marker(
    kind: str, doc: object, step: int | None, lineage: RunTimeline | None = None
) -> str | None:
    """None if ``doc`` (the parsed marker file ``kind``; ``{}`` when it did not parse) is
    evidence for the step directory of ``step``, else why it is not. ``lineage``: the (run,
    timeline) of the manifest beside it, which a rollback must name (None: not checked)."""
    if not isinstance(doc, dict) or not doc:
        return "it is empty, does not parse or is not a JSON object"
    if step is None:
        return "it does not lie in a step directory"
    problem = _shape_problem(kind, doc, step)
    return problem if problem is not None else _claim_problem(kind, doc, step, lineage)


def usable_markers(
    raw: dict[str, Any], step: int | None, lineage: RunTimeline | None = None
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The markers of ``raw`` (by kind, as storage reads them) that are evidence, and one line
    per marker that is not (``ROLLBACK marker ignored: ...``)."""
    usable: dict[str, dict[str, Any]] = {}
    ignored: list[str] = []
    for kind, doc in raw.items():
        problem = check_marker(kind, doc, step, lineage)
        if problem is None:
            usable[kind] = doc
        else:
            ignored.append(f"{MARKERS.get(kind, kind)} marker ignored: {problem}")
    return usable, ignored
