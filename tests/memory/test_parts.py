"""Manifest parts (several ranks on the memory level): each rank seals its part of a step
alone; a part is never a manifest by itself, and ``join_parts`` makes the step's manifest of
every rank's part only when they agree and the joined manifest validates like any."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pitstop.errors import ManifestError
from pitstop.format.checksum import get_checksum
from pitstop.format.manifest import (
    FileEntry,
    Lineage,
    Manifest,
    TensorEntry,
    join_parts,
    part_dumps,
)

X = get_checksum("xxh3_64")


def _part(rank: int, *, step: int = 5, rows: tuple[int, int] | None = None) -> Manifest:
    """Rank ``rank``'s part of a step of two ranks: rows ``rows`` of a replicated [4, 1024]
    float32 tensor (rank 0: 0-2, rank 1: 2-4) and its own RNG-like value."""
    lo, hi = rows or ((0, 2) if rank == 0 else (2, 4))
    nbytes = (hi - lo) * 1024 * 4
    data = f"rank-{rank:05d}.bin"
    objects = b'{"x": 1}'
    tensors = (
        TensorEntry(
            key="w", dtype="float32", shape=(hi - lo, 1024), file=data, offset=0, nbytes=nbytes,
            checksum=(X(b"a"),), rank=rank, global_shape=(4, 1024), start=(lo, 0),
        ),
        TensorEntry(
            key="rng", dtype="uint8", shape=(16,), file=data, offset=nbytes, nbytes=16,
            checksum=(X(b"b"),), rank=rank, owner=rank,
        ),
    )  # fmt: skip
    files = (
        FileEntry(data, rank, nbytes + 4096),
        FileEntry(f"objects-{rank:05d}.json", rank, len(objects), X(objects)),
    )
    return Manifest(
        step=step, created_unix_secs=1.0 + rank, world_size=2, checksum_algorithm="xxh3_64",
        segment_bytes=1 << 20, files=files, tensors=tensors,
        topology={"world_size": 2, "hosts": [f"h{rank}"]}, lineage=Lineage("run", "tl", 4),
    )  # fmt: skip


def _parts(plan: str = "p1") -> list[bytes]:
    return [part_dumps(_part(r), r, plan) for r in range(2)]


def test_the_parts_join_into_the_steps_manifest() -> None:
    m = join_parts(_parts())
    assert (m.step, m.world_size) == (5, 2)
    assert [f.name for f in m.files] == [
        "rank-00000.bin", "objects-00000.json", "rank-00001.bin", "objects-00001.json",
    ]  # fmt: skip
    assert [(t.key, t.rank) for t in m.tensors] == [("w", 0), ("rng", 0), ("w", 1), ("rng", 1)]
    assert m.topology["hosts"] == ["h0", "h1"] and m.created_unix_secs == 2.0
    assert Manifest.loads(m.dumps()) == m  # a manifest like any


def test_a_part_alone_is_no_manifest() -> None:
    with pytest.raises(ManifestError, match="2 files for 2 ranks"):
        Manifest.loads(_parts()[0])


@pytest.mark.parametrize(
    "case, match",
    [
        ("order", "not that rank's"),
        ("plan", "disagree on part"),
        ("step", "disagree on step"),
        ("flipped", "damaged"),
        ("three", "3 manifest parts for a world of 2"),
        ("gap", "tensor 'w'"),
        ("files", "no list of files"),
        ("none", "no manifest parts"),
    ],
)
def test_parts_that_do_not_make_a_step_are_refused(case: str, match: str) -> None:
    parts = _parts()
    if case == "order":
        parts.reverse()
    elif case == "plan":
        parts[1] = part_dumps(_part(1), 1, "p2")
    elif case == "step":
        parts[1] = part_dumps(_part(1, step=6), 1, "p1")
    elif case == "flipped":
        parts[1] = parts[1].replace(b'"h1"', b'"h2"')
    elif case == "three":
        parts.append(part_dumps(replace(_part(1)), 2, "p1"))
    elif case == "gap":  # rank 1 holds rows 3-4 only: row 2 is nobody's
        parts[1] = part_dumps(replace(_part(1, rows=(3, 4))), 1, "p1")
    elif case == "files":
        body = json.loads(parts[1])
        body["files"] = {"rank-00001.bin": 1}
        from pitstop.format.manifest import seal

        parts[1] = json.dumps(seal(body)).encode()
    elif case == "none":
        parts = []
    with pytest.raises(ManifestError, match=match):
        join_parts(parts)
