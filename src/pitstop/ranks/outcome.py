"""One rank's outcome of a collective step, and the one way the ranks share and act on them.

Call sequence (every rank of the group, the same steps in the same order)::

    outcomes = gather(group, part, phase)     # training thread: run this rank's part (or take
                                              #   its Outcome), never raise alone, all-gather
    agree(outcomes, group.rank, what)         # all ok, or raise: this rank's own error if it
                                              #   failed, else one naming every failed rank
    describe(outcomes, what)                  # the same words, for a step that goes on

    group.post(key, dumps([attempt(fn, group.rank, phase)]))   # persist or flush thread:
    loads(group.read(key, phase), source)                      #   the same outcomes as the
                                                               #   store's bytes

An :class:`Outcome` says what one rank's part came to: ``ok`` (with an optional JSON value)
or a failure classified once, by :func:`classify`, from its exception:

==========  =================================================================================
kind        meaning
==========  =================================================================================
ok          the part succeeded; ``value`` is its result
damaged     evidence of damage (CorruptCheckpointError): an older checkpoint may serve
partial     a restore failed after writing into the live state (PartialRestoreError)
refused     the request does not fit what is there (exists, not found, mismatch, ...)
io          the storage or the OS failed (CheckpointIOError, OSError)
error       anything else (a peer that did not arrive, a bug, MemoryError, ...)
marked      recovery: the checkpoint was already marked damaged (no exception)
vanished    recovery: the checkpoint was removed or replaced since the scan (no exception)
==========  =================================================================================

The exception itself stays on its rank (``Outcome.error``, never sent): the rank that failed
raises what it met, the others a DistributedCheckpointError (or, for damage where the caller
says so, a CorruptCheckpointError) that names every failed rank with its message. Nothing
here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatVersionError,
    NotACheckpointError,
    PartialRestoreError,
    PickleRefusedError,
    StateMismatchError,
    UnsupportedSetupError,
    UnsupportedValueError,
)
from pitstop.ranks.group import Group

__all__ = [
    "FAILURES",
    "KINDS",
    "Outcome",
    "agree",
    "attempt",
    "classify",
    "describe",
    "dumps",
    "gather",
    "loads",
    "outcomes_of",
]

Kind = Literal["ok", "damaged", "partial", "refused", "io", "error", "marked", "vanished"]
KINDS: tuple[Kind, ...] = (
    "ok",
    "damaged",
    "partial",
    "refused",
    "io",
    "error",
    "marked",
    "vanished",
)
FAILURES: frozenset[str] = frozenset({"damaged", "partial", "refused", "io", "error"})
MAX_MESSAGE = 2000  # characters of a message that travel to the other ranks

_REFUSALS = (
    CheckpointExistsError, CheckpointNotFoundError, NotACheckpointError, StateMismatchError,
    UnsupportedValueError, PickleRefusedError, FormatVersionError, UnsupportedSetupError,
)  # fmt: skip
_NOTED = "_pitstop_noted"  # on an exception: (its own message, the failures already added to it)


def classify(error: BaseException) -> Kind:
    """The kind of failure ``error`` is (see the module docstring); the only place that
    decides it."""
    if isinstance(error, CorruptCheckpointError):
        return "damaged"
    if isinstance(error, PartialRestoreError):
        return "partial"
    if isinstance(error, _REFUSALS):  # before OSError: exists/not found derive from it
        return "refused"
    if isinstance(error, OSError):
        return "io"
    return "error"


@dataclass(frozen=True)
class Outcome:
    """What rank ``rank``'s part of ``phase`` came to (see the module docstring).
    ``message``: the error's own words (a CheckpointError's message, without its where-suffix);
    ``error_type``: its class name; ``error``: the exception, on its own rank only."""

    kind: Kind
    rank: int
    phase: str
    message: str = ""
    value: Any = None
    error_type: str = ""
    error: BaseException | None = field(default=None, repr=False, compare=False)

    @classmethod
    def ok(cls, rank: int, phase: str, value: Any = None) -> Outcome:
        return cls("ok", rank, phase, value=value)

    @classmethod
    def of(cls, error: BaseException, rank: int, phase: str, value: Any = None) -> Outcome:
        """The outcome of a part that raised ``error`` (its own phase, where it names one)."""
        if isinstance(error, CheckpointError):
            noted = getattr(error, _NOTED, None)
            message = noted[0] if noted else error.message
            phase = error.phase or phase
        else:
            message = str(error) or type(error).__name__
        return cls(
            classify(error), rank, phase, message[:MAX_MESSAGE], value, type(error).__name__,
            error,
        )  # fmt: skip

    @property
    def failed(self) -> bool:
        """A failure (not ``ok``, nor one of recovery's ``marked`` and ``vanished``)."""
        return self.kind in FAILURES

    @property
    def text(self) -> str:
        """``Type: message`` (the message alone where there is no exception)."""
        return f"{self.error_type}: {self.message}" if self.error_type else self.message

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "rank": self.rank, "phase": self.phase}
        if self.message:
            out["message"] = self.message
        if self.error_type:
            out["type"] = self.error_type
        if self.value is not None:
            out["value"] = self.value
        return out

    @classmethod
    def from_json(cls, raw: Any, source: int, phase: str = "commit") -> Outcome:
        """An outcome another rank sent; anything unreadable is an ``error`` of ``source``
        (in ``phase``)."""
        try:
            kind = raw["kind"]
            if kind not in KINDS:
                raise ValueError(kind)
            return cls(
                kind, int(raw["rank"]), str(raw["phase"]), str(raw.get("message", "")),
                raw.get("value"), str(raw.get("type", "")),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return cls("error", source, phase, f"an unreadable outcome: {str(raw)[:200]}")


def dumps(outcomes: Sequence[Outcome]) -> bytes:
    """Outcomes as the bytes one rank posts to the store (or all-gathers): a JSON list."""
    return json.dumps([o.to_json() for o in outcomes]).encode()


def loads(data: bytes, source: int, phase: str = "commit") -> list[Outcome]:
    """The outcomes of :func:`dumps`; bytes that are not are an ``error`` of rank ``source``
    (the rank that posted them) in ``phase``."""
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raw = None
    if not isinstance(raw, list) or not raw:
        return [Outcome("error", source, phase, f"an unreadable word: {data[:200]!r}")]
    return [Outcome.from_json(r, source, phase) for r in raw]


def outcomes_of(error: BaseException, rank: int, phase: str) -> list[Outcome]:
    """What ``error`` tells of the ranks: a DistributedCheckpointError naming ranks (ones that
    did not report in time) stands for their outcomes, as far as this rank knows them; any
    other error for this rank's own."""
    if isinstance(error, DistributedCheckpointError) and error.ranks:
        message = error.message[:MAX_MESSAGE]
        kind: Kind = "error"
        return [
            Outcome(kind, r, error.phase or phase, message, None, type(error).__name__)
            for r in error.ranks
        ]
    return [Outcome.of(error, rank, phase)]


def attempt(fn: Callable[[], Any], rank: int, phase: str) -> Outcome:
    """``fn()`` as an Outcome: ok with its (JSON-able) result, or its error, classified. A
    rank's part of a collective step never raises alone (the others would wait for it)."""
    try:
        return Outcome.ok(rank, phase, fn())
    except Exception as e:
        return Outcome.of(e, rank, phase)


def gather(group: Group, part: Callable[[], Any] | Outcome, phase: str) -> list[Outcome]:
    """Collective (every rank of ``group``, one thread at a time: the training thread): run
    this rank's ``part`` (or take its Outcome), all-gather every rank's outcome through
    :func:`dumps` (one process too, so its words are the ones several ranks exchange) and
    return them in rank order, each as every rank sees it (this rank's own keeps its
    exception)."""
    mine = part if isinstance(part, Outcome) else attempt(part, group.rank, phase)
    words = group.all_gather(dumps([mine]), phase)
    out = [loads(w, r, phase)[0] for r, w in enumerate(words)]
    out[group.rank] = replace(out[group.rank], error=mine.error)
    return out


def describe(outcomes: Sequence[Outcome], what: str) -> str | None:
    """``"<what> failed on rank(s) [..]: ..."`` with every failed rank's message (ranks that
    failed alike share one), or None when none failed."""
    failed = [o for o in outcomes if o.failed]
    if not failed:
        return None
    by_text: dict[str, list[int]] = {}
    for o in failed:
        by_text.setdefault(o.text, []).append(o.rank)
    if len(by_text) == 1:
        details = next(iter(by_text))
    else:
        details = "; ".join(
            f"rank {rs[0]}: {t}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}: {t}"
            for t, rs in by_text.items()
        )
    return f"{what} failed on rank(s) {sorted({o.rank for o in failed})}: {details}"


def agree(
    outcomes: Sequence[Outcome],
    rank: int,
    what: str,
    *,
    phase: str | None = None,
    damage: bool = False,
) -> None:
    """Every rank, after :func:`gather` (or after reading the coordinator's word): return if
    no outcome failed. Else this rank raises its own error if it failed (the other failed
    ranks' messages added to it), and otherwise a DistributedCheckpointError in ``phase``
    (None: the first failed rank's) naming every failed rank with its message; with
    ``damage``, a CorruptCheckpointError (phase ``verify``) when any failure is damage, so
    that the ranks fall back to an older checkpoint together."""
    failed = [o for o in outcomes if o.failed]
    if not failed:
        return
    own = next((o for o in failed if o.rank == rank and o.error is not None), None)
    if own is not None and own.error is not None:
        raise _noting(own.error, [o for o in failed if o.rank != rank], what)
    text = describe(failed, what)
    ranks = sorted({o.rank for o in failed})
    if damage and any(o.kind == "damaged" for o in failed):
        raise CorruptCheckpointError(str(text), rank=rank, phase="verify")
    raise DistributedCheckpointError(
        str(text), ranks=ranks, rank=rank, phase=phase or failed[0].phase
    )


def _noting(error: BaseException, others: list[Outcome], what: str) -> BaseException:
    """``error`` with the failures of the other ranks it does not name yet added to its
    message (a CheckpointError's; a note on any other exception). Its own message, as an
    Outcome reports it, stays what it was."""
    own, seen = getattr(error, _NOTED, (None, frozenset()))
    new = [o for o in others if (o.rank, o.text) not in seen]
    if not new:
        return error
    seen = seen | {(o.rank, o.text) for o in new}
    note = str(describe(new, f"{what} also"))
    if isinstance(error, CheckpointError):
        setattr(error, _NOTED, (own if own is not None else error.message, seen))
        error.message += f"; {note}"
        error.args = (error.message,)
    else:
        setattr(error, _NOTED, (None, seen))
        add_note = getattr(error, "add_note", None)  # Python 3.11+; 3.10 keeps its words
        if add_note is not None:
            add_note(note)
    return error
