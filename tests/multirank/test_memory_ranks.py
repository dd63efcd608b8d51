"""The memory level under torch.distributed (issue 27): every rank stages its part of each
step into its own slots (its keeper seals them: its data file, its objects, its part of the
manifest), and a restart after every rank was killed joins the parts of the newest step that
every rank holds and restores from memory, bit for bit. A step one rank lacks, or whose part
on one rank is damaged, is passed over for the next older one.

Two ranks on gloo, one node, a private directory under /dev/shm; a "crash" is ``os._exit``
of every rank once its newest memory snapshot is sealed (nothing cleans up: the segments and
the lingering keepers stay, as after a SIGKILL)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pitstop
from conftest import flip_byte, launcher_keeper, make_state, tensors_of
from pitstop.cli.main import main as gc_main
from pitstop.levels.memory_peers import peer_token
from pitstop.levels.shm import (
    COMMITTED,
    DATA_OFFSET,
    SHM_DIR,
    iter_slots,
    new_job_token,
    read_header,
)
from pitstop.testing.distributed import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
TIMEOUT = 30.0
STEPS, EVERY = 7, 4  # durable at step 4; memory snapshots at every other step


def _state(rank: int, seed: int = 1) -> dict[str, Any]:
    state = make_state(seed=seed, steps=1)
    state["local"] = {"t": torch.full((3,), float(rank)), "rank": rank}
    return state


def _advance(state: dict[str, Any], rank: int, step: int) -> None:
    """One deterministic step: equal on every rank (a replicated model, as under DDP) but for
    the per-rank values."""
    torch.manual_seed(1000 + step)
    model, opt = state["model"], state["optimizer"]
    x = torch.randint(0, 10, (8,))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    state["local"]["t"] += step * (rank + 1)


def _digest(state: dict[str, Any]) -> dict[str, list[float]]:
    return {k: v.double().flatten().tolist() for k, v in tensors_of(state).items()}


def _sealed(shm: str, job: str, rank: int) -> dict[int, str]:
    """The rank's committed snapshots: step -> slot file."""
    out = {}
    for path in iter_slots(shm, job, rank):
        fd = os.open(path, os.O_RDONLY)
        try:
            head = read_header(fd)
        finally:
            os.close(fd)
        if head is not None and head.state == COMMITTED and head.step is not None:
            out[head.step] = path
    return out


def _newest_sealed(shm: str, job: str, rank: int) -> int | None:
    return max(_sealed(shm, job, rank), default=None)


def _run(
    rank: int,
    world: int,
    base: str,
    shm: str,
    job: str,
    steps: int,
    crash: bool,
    skip: tuple[int, int] | None = None,
    redundancy: str | None = None,
    wait_sealed: bool = True,
    timeout: float = TIMEOUT,
    keepers_die: bool = False,
    keeper: str | bool = True,
) -> dict[str, Any]:
    """Resume (from whatever is there) and train to ``steps``: memory every step, durable
    every ``EVERY``; ``crash``: every rank dies once its snapshot of ``steps`` is sealed
    (``wait_sealed=False``: at once, its snapshot maybe not staged yet); ``skip`` (rank,
    step): that rank finds no free slot for that step's snapshot; ``timeout``: the ranks'
    ``dist_timeout_secs``; ``keepers_die``: each rank's keeper is SIGKILLed with it (as in a
    kill of the process group: no keeper writes the job's newest step to the disk, what
    memory holds is all there is); ``keeper``: ``Memory(keeper=)``."""
    import torch.distributed as dist

    expected = _state(rank)
    reference = {0: _digest(expected)}
    for s in range(1, steps + 1):  # the uninterrupted run, in this process (its threads)
        _advance(expected, rank, s)
        reference[s] = _digest(expected)
    state = _state(rank)  # what a restore overwrites (step 0's state: a fresh start)
    nodes = None if redundancy is None else [f"n{r}" for r in range(world)]  # a node each
    where = os.path.join(shm, "{node}") if nodes else shm
    ckpt = pitstop.CheckpointManager(
        [
            pitstop.Memory(
                job=job,
                directory=where,
                linger_secs=120,
                redundancy=redundancy or "single",
                keeper=keeper,
            ),
            pitstop.Local(os.path.join(base, "local", "{node}"), redundancy="single"),
        ],
        policy=pitstop.EveryN(EVERY),
        topology=nodes,
        options=pitstop.SaveOptions.from_env(dist_timeout_secs=timeout),
    )
    memory = ckpt.hooks.levels.memory
    if skip is not None and skip[0] == rank:
        begin = memory.begin
        memory.begin = lambda step, **kw: None if step == skip[1] else begin(step, **kw)
    start = ckpt.restore(state) or 0
    info = ckpt.last_restore
    out = {
        "start": start,
        "level": info.level if info is not None else None,
        "restored_ok": _digest(state) == reference[start] if start else None,
        "skipped": [list(s) for s in info.skipped] if info is not None else [],
        "memory_on": memory.active,
    }
    for step in range(start + 1, steps + 1):
        _advance(state, rank, step)
        ckpt.step(step, state)
    out["final_ok"] = _digest(state) == reference[steps]
    if crash:
        if wait_sealed:
            ckpt.wait()  # the durable saves in flight committed (what the disk falls back to)
        mine = os.path.join(shm, f"n{rank}") if nodes else shm
        copies = (peer_token(job), (rank - 1) % world)  # the other rank's, on a ring of 2
        want = steps - 1 if skip is not None and tuple(skip) == (rank, steps) else steps
        deadline = time.monotonic() + (TIMEOUT if wait_sealed else 0.0)
        while time.monotonic() < deadline and (
            _newest_sealed(mine, job, rank) != want
            or (redundancy == "partner" and _newest_sealed(mine, *copies) != steps)
        ):  # fmt: skip
            time.sleep(0.01)
        out["sealed"] = _newest_sealed(mine, job, rank)
        out["copied"] = _newest_sealed(mine, *copies)
        dist.barrier()
        if keepers_die and memory.keeper is not None:
            memory.keeper.proc.kill()
            memory.keeper.proc.wait()
        with open(os.path.join(base, f"crash-{rank}.json"), "w") as f:
            json.dump(out, f)
        os._exit(9)  # no close, no cleanup: as after a SIGKILL of every rank
    ckpt.close()
    out["latest_disk"] = ckpt.latest_step()
    return out


@pytest.fixture
def where() -> Iterator[tuple[str, str, str]]:
    """(a checkpoint directory, a private directory under /dev/shm, a job token); no segment
    may be left in the shm directory when the test ends."""
    base = tempfile.mkdtemp(prefix="pitstop-memranks-")
    shm = tempfile.mkdtemp(prefix="pitstop-test-", dir=SHM_DIR)
    job = "t" + new_job_token()
    yield base, shm, job

    def left() -> list[str]:
        return [f for _, _, files in os.walk(shm) for f in files]

    deadline = time.monotonic() + 10.0  # keepers of the closed run remove theirs as they exit
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    remaining = left()
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    assert not remaining, f"segments left in {shm}: {remaining}"


def _crash(
    base: str,
    shm: str,
    job: str,
    redundancy: str | None = None,
    keepers_die: bool = False,
    keeper: str | bool = True,
) -> list[dict[str, Any]]:
    run_ranks(
        _run, 2, base, shm, job, STEPS, True, None, redundancy, True, TIMEOUT, keepers_die,
        keeper, timeout_secs=TIMEOUT * 3, allow_failures=True,
    )  # fmt: skip
    out = []
    for r in range(2):
        with open(os.path.join(base, f"crash-{r}.json")) as f:
            out.append(json.load(f))
    for r, o in enumerate(out):
        assert o["memory_on"] and o["final_ok"] and o["sealed"] == STEPS, (r, o)
    return out


def _resume(
    base: str, shm: str, job: str, steps: int = STEPS + 3, redundancy: str | None = None
) -> list[dict[str, Any]]:
    return run_ranks(
        _run, 2, base, shm, job, steps, False, None, redundancy, timeout_secs=TIMEOUT * 3
    )


def _slot_of(shm: str, job: str, rank: int, step: int) -> str:
    path = _sealed(shm, job, rank).get(step)
    assert path is not None, f"rank {rank} holds no sealed snapshot of step {step}"
    return path


def test_every_rank_killed_resumes_from_memory_bit_exact(where: tuple[str, str, str]) -> None:
    base, shm, job = where
    _crash(base, shm, job)
    out = _resume(base, shm, job)
    for r, o in enumerate(out):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS, "memory", True), (r, o)
        assert o["final_ok"], (r, o)
        assert o["latest_disk"] == STEPS + 3, (r, o)  # close wrote the newest snapshot
    # closed: the segments are gone; the next run resumes from the disk, bit-exact
    again = _resume(base, shm, job, steps=STEPS + 4)
    for r, o in enumerate(again):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS + 3, "local", True), (r, o)


def test_a_snapshot_one_rank_skips_does_not_upset_the_durable_saves(
    where: tuple[str, str, str],
) -> None:
    """Rank 1 finds no free slot at step 3: it skips that snapshot alone (no rank waits for
    another), and the durable saves after it (step 4, and the newest at close) are still one
    commit round of both ranks."""
    base, shm, job = where
    out = run_ranks(_run, 2, base, shm, job, 6, False, (1, 3), timeout_secs=TIMEOUT * 3)
    for r, o in enumerate(out):
        assert o["final_ok"] and o["latest_disk"] == 6, (r, o)
    again = _resume(base, shm, job, steps=8)
    for r, o in enumerate(again):
        assert (o["start"], o["level"], o["restored_ok"]) == (6, "local", True), (r, o)


def test_a_step_one_rank_lacks_is_passed_over(where: tuple[str, str, str]) -> None:
    """Rank 1's snapshot of the newest step is gone (it skipped it: its slots were busy):
    the step is no checkpoint; the one before it, which both hold, serves from memory."""
    base, shm, job = where
    _crash(base, shm, job, keepers_die=True)  # memory alone holds step 7
    os.unlink(_slot_of(shm, job, 1, STEPS))
    out = _resume(base, shm, job)
    for r, o in enumerate(out):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS - 1, "memory", True), (r, o)
        assert o["final_ok"], (r, o)


def test_a_damaged_part_on_one_rank_falls_back_on_every_rank(where: tuple[str, str, str]) -> None:
    """A flipped byte in rank 1's slot of the newest step: every rank passes the step over
    together (the checksum fails on rank 1 only) and restores the older one, bit-exact."""
    base, shm, job = where
    _crash(base, shm, job, keepers_die=True)  # memory alone holds step 7
    flip_byte(_slot_of(shm, job, 1, STEPS), DATA_OFFSET + 100)
    out = _resume(base, shm, job)
    for r, o in enumerate(out):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS - 1, "memory", True), (r, o)
        assert any(f"step-{STEPS:010d}" in s[0] for s in o["skipped"]), (r, o)
        assert o["final_ok"], (r, o)


def _crash_at(
    base: str, shm: str, job: str, steps: int, skip: tuple[int, int] | None
) -> list[dict[str, Any]]:
    """Every rank trains to ``steps`` and dies once its snapshot of it is sealed (``skip``:
    as in :func:`_run`); what each rank reported."""
    run_ranks(
        _run, 2, base, shm, job, steps, True, skip, timeout_secs=TIMEOUT * 3, allow_failures=True
    )
    out = []
    for r in range(2):
        with open(os.path.join(base, f"crash-{r}.json")) as f:
            out.append(json.load(f))
        assert out[-1]["final_ok"], (r, out[-1])
    return out


def test_rollbacks_of_one_ranks_newer_snapshot_keep_the_step_and_one_timeline(
    where: tuple[str, str, str],
) -> None:
    """Ranks whose newest snapshots differ by one step (one skipped it) restart at the step
    both hold: the rank holding the newer one sets it aside (a rollback on that rank only).
    (1) It keeps the snapshots of the step just restored: before, the next save made its
    slots anew, and a crash before that rank's next seal left no step both held (the
    restart began from the disk). (2) Every rank goes on in one new timeline: before, only
    the rank that set a step aside drew one, so the ranks' parts of every later step
    disagreed on lineage and no later step could be joined (the restart fell back again)."""
    base, shm, job = where
    _crash_at(base, shm, job, STEPS, (1, STEPS))  # rank 1 skips the newest step
    assert (_newest_sealed(shm, job, 0), _newest_sealed(shm, job, 1)) == (STEPS, STEPS - 1)
    # restart: both restore STEPS - 1 (rank 0 sets STEPS aside); rank 0 skips its first
    # snapshot and every rank dies before rank 0 seals another
    _crash_at(base, shm, job, STEPS, (0, STEPS))
    runs = _crash_at(base, shm, job, STEPS + 2, None)
    for r, o in enumerate(runs):  # (1) the step restored first is still in memory on rank 0
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS - 1, "memory", True), (r, o)
        assert o["sealed"] == STEPS + 2, (r, o)
    back = _resume(base, shm, job, steps=STEPS + 3)
    for r, o in enumerate(back):  # (2) the parts of the newest step join: one timeline
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS + 2, "memory", True), (r, o)
        assert o["final_ok"], (r, o)


def _edit_part(path: str, edit: Any) -> None:
    """Rewrite the part of the manifest a sealed slot holds (``edit(body)``), sealed again and
    its header's checksum fixed: a part that is well-formed but disagrees with the others."""
    import dataclasses
    import zlib

    from pitstop.format.manifest import seal as seal_manifest
    from pitstop.levels.shm import write_header

    fd = os.open(path, os.O_RDWR)
    try:
        head = read_header(fd)
        assert head is not None
        before = head.record_bytes + head.objects_bytes
        raw = os.pread(fd, before + head.manifest_bytes, head.meta_offset)
        body = json.loads(raw[before:])
        edit(body)
        algorithm = body.get("integrity", {}).get("algorithm", "xxh3_64")
        new = (json.dumps(seal_manifest(body, algorithm), separators=(",", ":")) + "\n").encode()
        os.pwrite(fd, new, head.meta_offset + before)
        write_header(fd, dataclasses.replace(
            head, seq=head.seq + 1, manifest_bytes=len(new), meta_crc=zlib.crc32(raw[:before] + new)
        ))  # fmt: skip
    finally:
        os.close(fd)


def test_a_part_that_disagrees_is_refused_and_said_in_last_restore(
    where: tuple[str, str, str],
) -> None:
    """Rank 1's part of the newest step claims another timeline (well-formed, sealed again):
    the parts do not join, every rank restores the step before from memory, bit-exact, and
    ``last_restore.skipped`` names the refused step on every rank (before: only a warning
    on rank 0 said it)."""
    base, shm, job = where
    _crash(base, shm, job, keepers_die=True)  # memory alone holds step 7
    _edit_part(
        _slot_of(shm, job, 1, STEPS),
        lambda b: b.__setitem__("lineage", {**b["lineage"], "timeline": "f" * 16}),
    )
    out = _resume(base, shm, job)
    for r, o in enumerate(out):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS - 1, "memory", True), (r, o)
        refused = [s for s in o["skipped"] if f"step-{STEPS:010d}" in s[0]]
        assert refused and "lineage" in refused[0][1], (r, o)


def test_a_lost_node_without_redundancy_says_what_to_do(where: tuple[str, str, str]) -> None:
    """Node n1 is lost with its memory and its disk (no partner copies, Local single): no
    level holds rank 1's files. The restart fails (a fresh start would be silent data loss)
    and says what would have survived it and how to start over."""
    base, shm, job = where
    _crash(base, shm, job, "single")
    for name in os.listdir(os.path.join(shm, "n1")):
        os.unlink(os.path.join(shm, "n1", name))
    shutil.rmtree(os.path.join(base, "local", "n1"))
    out = run_ranks(
        _run, 2, base, shm, job, STEPS + 3, False, None, "single", timeout_secs=TIMEOUT * 3,
        allow_failures=True,
    )  # fmt: skip
    for r, o in enumerate(out):
        assert "CorruptCheckpointError" in str(o) and "cannot be rebuilt" in str(o), (r, o)
        assert "new checkpoint directory" in str(o) and "redundancy='partner'" in str(o), (r, o)
    for node in ("n0", "n1"):  # (the fixture wants no segment left)
        for name in os.listdir(os.path.join(shm, node)):
            os.unlink(os.path.join(shm, node, name))


def _one_node(base: str, shm: str, job: str, every: int, **memory: Any) -> Any:
    """The ranks' manager on one node: memory every step (no linger), the local disk every
    ``every`` steps; ``memory``: more of ``pitstop.Memory``'s arguments."""
    return pitstop.CheckpointManager(
        [pitstop.Memory(job=job, directory=shm, linger_secs=0, **memory),
         pitstop.Local(os.path.join(base, "local"), redundancy="single")],
        policy=pitstop.EveryN(every),
        options=pitstop.SaveOptions.from_env(dist_timeout_secs=TIMEOUT),
    )  # fmt: skip


def _changing(rank: int, world: int, base: str, shm: str, job: str) -> dict[str, Any]:
    """Memory every step, no durable save asked for by the policy; rank 1's state gains a
    value at step 4 (its layout changes: its snapshots cannot use the agreed plan)."""
    state = _state(rank)
    ckpt = _one_node(base, shm, job, 1000)
    results = {}
    for step in range(1, 11):
        _advance(state, rank, step)
        if rank == 1 and step >= 4:
            state["local"]["extra"] = torch.full((1000,), float(step))
        results[step] = ckpt.step(step, state).name
        time.sleep(0.02)
    ckpt.close()
    return {"results": results, "disk": ckpt.steps()}


def test_a_layout_change_on_one_rank_makes_every_rank_save_then_snapshots_go_on(
    where: tuple[str, str, str],
) -> None:
    """Rank 1's state changes its layout at step 4: its memory snapshots cannot use the plan
    every rank agreed on. It asks for a save in the ranks' vote; every rank saves two steps
    later (the vote travels a step ahead), and the snapshots of both go on with the new
    plan. Before, rank 1 skipped every later snapshot without a word, rank 0's overwrote
    the last step both held, and close() wrote nothing: the restart began at step 0."""
    base, shm, job = where
    out = run_ranks(_changing, 2, base, shm, job, timeout_secs=TIMEOUT * 3)
    saved = [[s for s, r in o["results"].items() if r == "SAVED"] for o in out]
    assert saved == [[6], [6]], out
    assert out[1]["results"][4] == "SKIPPED" and out[1]["results"][5] == "SKIPPED", out
    assert all(out[1]["results"][s] == "SNAPSHOT" for s in range(7, 11)), out
    assert out[0]["disk"] == [6, 10], out  # the policy's save, then close() wrote step 10


def _limited(rank: int, world: int, base: str, shm: str, job: str) -> dict[str, Any]:
    """Rank 1's memory level has too small a budget (its level goes off at the first save)."""
    state = _state(rank)
    ckpt = _one_node(base, shm, job, 4, limit_bytes=4096 if rank == 1 else None)
    results = {}
    for step in range(1, 9):
        _advance(state, rank, step)
        results[step] = ckpt.step(step, state).name
    active = ckpt.hooks.levels.memory.active
    ckpt.close()
    return {"results": results, "active": active, "disk": ckpt.steps()}


def test_a_memory_level_off_on_one_rank_goes_off_on_every_rank(
    where: tuple[str, str, str],
) -> None:
    """Rank 1's shared memory cannot hold its slots: its level goes off, and with the next
    vote every rank's does (a step in memory needs every rank's part). Before, rank 0 went
    on paying for snapshots no restart could use. The durable saves go on, together."""
    base, shm, job = where
    out = run_ranks(_limited, 2, base, shm, job, timeout_secs=TIMEOUT * 3)
    assert [o["active"] for o in out] == [False, False], out
    assert all(out[0]["results"][s] == "SKIPPED" for s in (5, 6, 7)), out
    assert out[0]["disk"] == out[1]["disk"] == [4, 8], out


def test_a_rank_killed_while_close_writes_the_newest_step_leaves_it_in_memory(
    where: tuple[str, str, str],
) -> None:
    """Rank 0 is SIGKILLed while ``close()`` writes the newest step (9) from memory to the
    disk (its third commit: steps 4 and 8 were the policy's). Rank 1's close fails when the
    round times out: it leaves its segments as a crash would, and the restart resumes from
    memory at step 9, bit-exact. Before, rank 1 removed its part of step 9: the restart came
    from the disk's step 8."""
    base, shm, job = where
    # rank 1 waits for the dead rank 0 until its round times out: 10 s, not TIMEOUT
    out = run_ranks(
        _run, 2, base, shm, job, 9, False, None, None, True, 10.0, timeout_secs=TIMEOUT * 3,
        allow_failures=True, env={0: {"PITSTOP_KILL_AT": "commit.before_rename:3"}},
    )  # fmt: skip
    assert not isinstance(out[1], dict) or out[1]["latest_disk"] == 8, out
    assert 9 in _sealed(shm, job, 1), "rank 1 removed its part of step 9"
    back = _resume(base, shm, job, steps=11)
    for r, o in enumerate(back):
        assert (o["start"], o["level"], o["restored_ok"]) == (9, "memory", True), (r, o)
        assert o["final_ok"] and o["latest_disk"] == 11, (r, o)


@pytest.mark.parametrize("redundancy", ["partner", "single"])
def test_a_lost_node_restores_from_its_partner_copy_in_memory(
    where: tuple[str, str, str], redundancy: str
) -> None:
    """Two nodes of one rank each; node n1 is lost with everything in its memory (and comes
    back empty). With partner copies, rank 1's snapshot of the newest step comes back from
    the copy in n0's memory: the restart restores it from memory, bit-exact. Without them,
    the restart comes from the local disk's newest durable step."""
    base, shm, job = where
    out = _crash(base, shm, job, redundancy)
    if redundancy == "partner":
        assert [o["copied"] for o in out] == [STEPS, STEPS], out
    for name in os.listdir(os.path.join(shm, "n1")):  # node n1 lost: its memory is gone
        os.unlink(os.path.join(shm, "n1", name))
    back = _resume(base, shm, job, redundancy=redundancy)
    expected = (STEPS, "memory") if redundancy == "partner" else (EVERY, "local")
    for r, o in enumerate(back):
        assert (o["start"], o["level"], o["restored_ok"]) == (*expected, True), (r, o)
        assert o["final_ok"], (r, o)


def test_repeated_kills_of_every_rank_resume_bit_exact_at_most_one_behind(
    where: tuple[str, str, str],
) -> None:
    """A chain of crashes of every rank at random steps, without waiting for the newest
    snapshot's seal (PITSTOP_MEMORY_RANK_KILLS=N, default 3): each restart resumes from
    memory, bit-exact, at most one step behind the step training had completed; the last
    run ends cleanly."""
    import random

    base, shm, job = where
    rng = random.Random(27)
    kills = int(os.environ.get("PITSTOP_MEMORY_RANK_KILLS", "3"))
    reached = 0
    for i in range(kills + 1):
        last = i == kills
        target = reached + rng.randint(2, 7)
        if last:
            out = _resume(base, shm, job, steps=target)
        else:
            run_ranks(
                _run, 2, base, shm, job, target, True, None, None, False,
                timeout_secs=TIMEOUT * 3, allow_failures=True,
            )  # fmt: skip
            out = []
            for r in range(2):
                with open(os.path.join(base, f"crash-{r}.json")) as f:
                    out.append(json.load(f))
                os.unlink(os.path.join(base, f"crash-{r}.json"))
        for r, o in enumerate(out):
            if reached:
                assert o["level"] == "memory" and o["restored_ok"], (i, r, o)
                assert reached - 1 <= o["start"] <= reached, (i, r, o)
            assert o["final_ok"], (i, r, o)
        reached = target


def test_a_restart_with_another_world_size_leaves_the_memory_snapshots(
    where: tuple[str, str, str],
) -> None:
    """After a crash of 2 ranks, a restart with 1 (launched without torchrun by mistake)
    does not take the 2-rank memory snapshots for damage nor remove them: the memory level
    is off for it, saying why; the right restart (2 ranks) still resumes from memory."""
    base, shm, job = where
    _crash(base, shm, job)
    before = sorted(os.listdir(shm))
    wrong = run_ranks(
        _run, 1, base, shm, job, STEPS + 3, False, timeout_secs=TIMEOUT * 3, allow_failures=True
    )
    assert "the local level serves only" in str(wrong[0]) or "world size" in str(wrong[0])
    assert "damaged" not in str(wrong[0]), wrong
    assert sorted(os.listdir(shm)) == before  # every rank's segments stay
    out = _resume(base, shm, job)
    for r, o in enumerate(out):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS, "memory", True), (r, o)


def _keepers(job: str) -> list[int]:
    """The pids of the keepers of ``job`` still running."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"pitstop.levels.keeper" in argv and job.encode() in argv:
            out.append(int(pid))
    return out


@pytest.mark.parametrize("keeper", ["own", "launcher"])
def test_every_rank_killed_the_last_keeper_writes_the_newest_whole_step_to_disk(
    where: tuple[str, str, str], keeper: str
) -> None:
    """Every rank of a one-node job is killed after step 7 (its last durable save: step 4):
    once both trainers are dead, a keeper (rank 0's own, or the launcher's ``pitstop
    keeper``) joins the ranks' parts of step 7 and writes the step to the next level, so a
    restart that comes after the snapshots are gone (the keepers told to go: SIGTERM)
    resumes from the disk at step 7, bit-exact, not at 4. Before, a keeper never wrote a part
    of a step of several ranks: the snapshots newer than the disk went with the linger."""
    base, shm, job = where
    local = os.path.join(base, "local")
    node = os.path.join(local, socket.gethostname())  # the Local level's node directory
    launcher = (
        launcher_keeper(node, shm, job, "--linger-secs", "120") if keeper == "launcher" else None
    )
    try:
        _crash(base, shm, job, keeper="external" if launcher else True)
        manifest = os.path.join(node, f"step-{STEPS:010d}", "manifest.json")
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not os.path.isfile(manifest):
            time.sleep(0.05)
        assert os.path.isfile(manifest), (
            f"step {STEPS} was not written to {node}: {os.listdir(local)}"
        )
        keepers = [launcher.pid] if launcher else _keepers(job)
        assert len(keepers) == (1 if launcher else 2), keepers  # lingering for a restart
        for pid in keepers:
            os.kill(pid, 15)  # the next level holds their newest step: the segments may go
        if launcher:  # it leaves them for a restart: the job torn down, pitstop gc goes
            assert launcher.wait(TIMEOUT) == 0, launcher.communicate()
            assert gc_main(["gc", node, "--shm-dir", shm]) == 0
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and (_keepers(job) or os.listdir(shm)):
            time.sleep(0.05)
        assert not os.listdir(shm), os.listdir(shm)
        out = _resume(base, shm, job)
        for r, o in enumerate(out):
            assert (o["start"], o["level"], o["restored_ok"]) == (STEPS, "local", True), (r, o)
            assert o["final_ok"], (r, o)
    finally:
        if launcher is not None and launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_the_join_passes_a_step_with_a_damaged_part_over_for_the_one_before(
    where: tuple[str, str, str],
) -> None:
    """Rank 1's part of the newest step (7) has a flipped byte when the job's newest whole
    step is written (the keepers died too; the join runs here): step 7 is passed over, said,
    and step 6, which both ranks hold intact, is written; the restart resumes from it
    bit-exact once memory is gone. Before, the join wrote nothing and the intact step 6 went
    with the segments."""
    from concurrent.futures import ThreadPoolExecutor

    from pitstop.levels.keeper_join import persist_joined, remove_dead_parts
    from pitstop.levels.shm import remove_job
    from pitstop.options import IOOptions
    from pitstop.storage.local import LocalStorage

    base, shm, job = where
    _crash(base, shm, job, keepers_die=True)
    flip_byte(_slot_of(shm, job, 1, STEPS), DATA_OFFSET + 100)
    node = os.path.join(base, "local", socket.gethostname())
    with ThreadPoolExecutor(2) as pool, ThreadPoolExecutor(2) as hashers:
        step, what = persist_joined(shm, job, 2, LocalStorage(node, IOOptions()), pool=pool,
                                    hashers=hashers)  # fmt: skip
    assert (step, what.split(" (")[0]) == (STEPS - 1, "written"), what
    assert f"step {STEPS}" in what and "damaged" in what, what
    # rank 0's keeper at its end removes another rank's dead segments only if the disk
    # holds its newest snapshot: not while rank 1 holds step 7, then once that is gone
    storage = LocalStorage(node, IOOptions())
    assert remove_dead_parts(shm, job, 2, storage) == []
    os.unlink(_slot_of(shm, job, 1, STEPS))
    removed = remove_dead_parts(shm, job, 2, storage)
    assert removed and all("-r00001" in n for n in removed), removed
    assert not list(iter_slots(shm, job, 1)) and list(iter_slots(shm, job, 0))
    remove_job(shm, job)
    out = _resume(base, shm, job)
    for r, o in enumerate(out):
        assert (o["start"], o["level"], o["restored_ok"]) == (STEPS - 1, "local", True), (r, o)
