"""One rank-outcome type (pitstop.ranks.outcome): the classifier, the store's bytes, the
exception-robust gather and the decision, in one process (a fake peer stands for rank 1)."""

from __future__ import annotations

import errno
import sys
from typing import Any

import pytest

from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatVersionError,
    ManifestError,
    PartialRestoreError,
    StateMismatchError,
    UnsupportedValueError,
)
from pitstop.ranks import Group
from pitstop.ranks.outcome import Outcome, agree, attempt, classify, describe, dumps, gather, loads


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (CorruptCheckpointError("checksum mismatch"), "damaged"),
        (ManifestError("does not parse"), "damaged"),
        (PartialRestoreError("half loaded"), "partial"),
        (CheckpointExistsError("step 3 is committed"), "refused"),
        (CheckpointNotFoundError("no step 3"), "refused"),
        (StateMismatchError("shapes differ"), "refused"),
        (UnsupportedValueError("a socket"), "refused"),
        (FormatVersionError("format 9"), "refused"),
        (CheckpointIOError("ENOSPC", errno=errno.ENOSPC), "io"),
        (OSError(errno.EIO, "I/O error"), "io"),
        (FileNotFoundError("gone"), "io"),
        (DistributedCheckpointError("rank 1 did not arrive", ranks=[1]), "error"),
        (MemoryError("no memory"), "error"),
        (RuntimeError("a bug"), "error"),
    ],
)
def test_one_classifier_names_every_failure(error: BaseException, kind: str) -> None:
    assert classify(error) == kind
    outcome = Outcome.of(error, 2, "persist")
    assert (outcome.kind, outcome.rank, outcome.failed) == (kind, 2, True)
    assert outcome.error is error and outcome.error_type == type(error).__name__


def test_an_outcome_takes_the_phase_and_words_of_its_error() -> None:
    e = CheckpointIOError("write failed", path="/x/rank-00001.bin", phase="persist", rank=1)
    o = Outcome.of(e, 1, "commit")
    assert o.phase == "persist"  # the error's own phase, where it names one
    assert o.message == "write failed"  # its words, without the [phase=..., path=...] suffix
    assert o.text == "CheckpointIOError: write failed"
    assert Outcome.of(RuntimeError("boom"), 0, "plan").phase == "plan"
    assert not Outcome.ok(0, "plan").failed
    assert not Outcome("vanished", 0, "restore").failed
    assert not Outcome("marked", 0, "restore", "marked damaged").failed


def test_outcomes_round_trip_through_the_stores_bytes() -> None:
    sent = [
        Outcome.ok(0, "persist", {"files": [{"name": "rank-00000.bin"}], "nbytes": 12}),
        Outcome.of(CheckpointIOError("disk full", phase="persist"), 1, "persist"),
        Outcome("marked", 2, "restore", "marked damaged"),
    ]
    data = dumps(sent)
    assert isinstance(data, bytes)
    back = loads(data, 0)
    assert back == sent  # the exception stays on its rank: not compared, never sent
    assert back[1].error is None and sent[1].error is not None
    assert back[1].kind == "io" and back[1].text == "CheckpointIOError: disk full"


@pytest.mark.parametrize("data", [b"", b"garbage", b"{}", b"[]", b'[{"kind": "nope"}]'])
def test_unreadable_bytes_are_an_error_of_the_rank_that_sent_them(data: bytes) -> None:
    [o] = loads(data, 3, "replicate")
    assert (o.kind, o.rank, o.phase) == ("error", 3, "replicate") and "unreadable" in o.message


def test_attempt_never_raises_and_keeps_the_result() -> None:
    assert attempt(lambda: [1, 2], 0, "plan") == Outcome.ok(0, "plan", [1, 2])

    def boom() -> None:
        raise CheckpointExistsError("step 5 is committed", phase="plan")

    o = attempt(boom, 0, "plan")
    assert o.kind == "refused" and isinstance(o.error, CheckpointExistsError)


class _Peer(Group):
    """Rank ``rank`` of two; the other rank's word is ``peer`` (bytes of ``dumps``)."""

    size = 2

    def __init__(self, rank: int, peer: Outcome) -> None:
        super().__init__()
        self.rank, self._peer = rank, peer
        self.sent: list[Any] = []

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        self.sent.append(obj)
        other = dumps([self._peer])
        return [obj, other] if self.rank == 0 else [other, obj]


def test_gather_runs_the_part_and_exchanges_bytes_on_one_process_too() -> None:
    one = gather(Group(), lambda: (1, "a"), "restore")
    assert one == [Outcome.ok(0, "restore", [1, "a"])]  # through JSON: what several ranks see

    def fails() -> None:
        raise StateMismatchError("shapes differ", phase="restore")

    group = _Peer(1, Outcome.ok(0, "restore", 7))
    out = gather(group, fails, "restore")
    assert isinstance(group.sent[0], bytes)  # what was sent is the store's encoding
    assert [o.kind for o in out] == ["ok", "refused"] and out[0].value == 7
    assert isinstance(out[1].error, StateMismatchError)  # its own, with its exception


def test_agree_raises_this_ranks_own_error_naming_the_others() -> None:
    mine = CheckpointIOError("disk full on rank 0", phase="persist")
    outcomes = [
        Outcome.of(mine, 0, "persist"),
        Outcome.of(CheckpointIOError("EIO on rank 1"), 1, "persist"),
        Outcome.ok(2, "persist"),
    ]
    with pytest.raises(CheckpointIOError) as info:
        agree(outcomes, 0, "save of step-1")
    assert info.value is mine
    text = str(info.value)
    assert "disk full on rank 0" in text and "EIO on rank 1" in text, text
    assert "save of step-1 also failed on rank(s) [1]" in text
    # told twice (restore, then recovery), the others' failures are named once
    with pytest.raises(CheckpointIOError):
        agree(outcomes, 0, "restore")
    assert str(mine).count("EIO on rank 1") == 1
    assert Outcome.of(mine, 0, "persist").message == "disk full on rank 0"  # its own words


def test_agree_on_a_rank_that_did_not_fail_names_every_failed_rank() -> None:
    outcomes = [
        Outcome.ok(0, "persist"),
        Outcome.of(CheckpointIOError("EIO on rank 1", phase="persist"), 1, "persist"),
        Outcome.of(MemoryError("no arena"), 2, "stage"),
    ]
    with pytest.raises(DistributedCheckpointError) as info:
        agree(loads(dumps(outcomes), 0), 0, "save of step-1")
    e = info.value
    assert e.ranks == [1, 2] and e.phase == "persist" and e.rank == 0
    assert "rank 1: CheckpointIOError: EIO on rank 1" in e.message
    assert "rank 2: MemoryError: no arena" in e.message
    with pytest.raises(DistributedCheckpointError) as fixed:
        agree(outcomes, 0, "plan", phase="plan")
    assert fixed.value.phase == "plan"
    agree([Outcome.ok(0, "plan"), Outcome("vanished", 1, "restore")], 0, "plan")  # no failure


def test_damage_on_any_rank_is_damage_for_all_where_the_caller_says_so() -> None:
    outcomes = [
        Outcome.ok(0, "restore"),
        Outcome.of(CorruptCheckpointError("checksum of rank-00001.bin"), 1, "verify"),
        Outcome.of(StateMismatchError("shapes differ"), 2, "restore"),
    ]
    with pytest.raises(CorruptCheckpointError) as info:
        agree(outcomes, 0, "restore", phase="restore", damage=True)
    assert info.value.phase == "verify"
    assert "checksum of rank-00001.bin" in str(info.value) and "shapes differ" in str(info.value)
    with pytest.raises(DistributedCheckpointError):
        agree(outcomes, 0, "restore", phase="restore")


def test_a_plain_exception_gets_the_others_as_a_note() -> None:
    mine = MemoryError("no arena")
    outcomes = [Outcome.of(mine, 0, "stage"), Outcome.of(RuntimeError("bug"), 1, "stage")]
    with pytest.raises(MemoryError) as info:
        agree(outcomes, 0, "save")
    assert str(info.value) == "no arena"  # its words are its own
    if sys.version_info >= (3, 11):  # add_note
        notes = getattr(info.value, "__notes__", [])
        assert any("rank(s) [1]: RuntimeError: bug" in n for n in notes), notes


def test_describe_keeps_every_message_and_groups_equal_ones() -> None:
    same = [Outcome.of(CheckpointIOError("ENOSPC"), r, "persist") for r in (1, 3)]
    assert describe(same, "flush") == "flush failed on rank(s) [1, 3]: CheckpointIOError: ENOSPC"
    mixed = [*same, Outcome.of(CheckpointError("other"), 2, "persist"), Outcome.ok(0, "persist")]
    text = describe(mixed, "flush")
    assert text == (
        "flush failed on rank(s) [1, 2, 3]: ranks 1, 3: CheckpointIOError: ENOSPC; "
        "rank 2: CheckpointError: other"
    )
    assert describe([Outcome.ok(0, "persist")], "flush") is None
