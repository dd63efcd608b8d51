"""``CheckpointManager([pitstop.Memory(...), pitstop.Local(dir)])`` used as a user would (issue
27): memory snapshots between the policy's durable saves, the restart from memory, the
bad situations (a killed keeper, /dev/shm too small, a damaged snapshot, two jobs on one
node, a rollback, a killed job and ``pitstop gc``) and bad input. Every test works in a
private directory under /dev/shm with its own job token; none may leave a segment.

Subprocess runs use ``memory_worker.py`` (a small model, Adam, ``pitstop.RNGState``, random
batches); "bit-exact" compares with the uninterrupted run without checkpoints."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import time
from typing import Any

import pytest
import torch

import pitstop
from conftest import flip_byte
from pitstop.cli.main import main
from pitstop.levels.shm import (
    COMMITTED,
    DATA_OFFSET,
    SlotSet,
    iter_slots,
    new_job_token,
    open_slot,
    remove_job,
)
from pitstop.levels.shm_header import job_token

from . import memory_worker as w

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]

STEPS, EVERY = 40, 20  # the subprocess runs: 40 steps, durable every 20


@functools.cache
def _ref() -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    return w.reference(STEPS)


def _levels(job: str, shm: str, root: str, **kw: Any) -> list[Any]:
    return [
        pitstop.Memory(job=job, directory=shm, **kw),
        pitstop.Local(root, redundancy="single"),
    ]


def _train(ckpt: Any, state: dict[str, Any], steps: range, digests: dict[int, str]) -> None:
    for step in steps:
        w.train_step(state, step)
        time.sleep(0.005)  # a step's compute: the keeper seals meanwhile
        ckpt.step(step, state)
        digests[step] = w.digest(state)


def _newest_committed(memory: Any, at_least: int, timeout: float = 30.0) -> int | None:
    """The step of the newest committed memory snapshot once it is ``at_least`` (or the
    deadline passed): a staged snapshot is committed when the keeper (or a thread) sealed it."""
    deadline = time.monotonic() + timeout
    while True:
        newest = memory.slots.newest(COMMITTED)
        step = newest[1].step if newest is not None else None
        if (step is not None and step >= at_least) or time.monotonic() > deadline:
            return step
        time.sleep(0.01)


def _restore_fresh(root: str) -> tuple[int | None, str]:
    """Restore ``root`` (its disk level only) into a fresh state: (step, digest)."""
    state = w.build(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        step = ckpt.restore(state)
    return step, w.digest(state)


def _assert_final(path: str) -> None:
    got, (_, want) = torch.load(path), _ref()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# ---------------------------------------------------------------------- one process
def test_lifecycle_snapshots_each_step_durable_every_n_close_writes_newest(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    state, digests = w.build(), {}
    ckpt = pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(10))
    _train(ckpt, state, range(1, 26), digests)
    ckpt.wait()
    memory = ckpt.hooks.levels.memory
    assert memory is not None and memory.active
    taken = sorted({h.step for h in ckpt.history})
    assert set(taken) - {10, 20}, f"no memory snapshot between the durable saves: {taken}"
    assert ckpt.steps() == [10, 20]  # only the policy's saves are on disk
    assert _newest_committed(memory, 25) in (24, 25)
    assert os.listdir(shm_dir)  # the slots and the lock file
    keeper = memory.keeper.pid if memory.keeper is not None else None
    assert keeper is not None
    ckpt.close()
    w.wait_gone(keeper)
    assert os.listdir(shm_dir) == []  # close() removed the segments
    step, digest = _restore_fresh(root)  # close() wrote the newest snapshot to disk
    assert step == 25 and digest == digests[25]


def test_step_says_which_steps_were_snapshot_into_memory(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """``ckpt.step`` returns SNAPSHOT (falsy: no save started) for a step staged into memory,
    SAVED for the policy's durable save, SKIPPED off the memory level's schedule. Before,
    a snapshot step read as SKIPPED, like a step with no checkpoint at all."""
    from pitstop.loop import StepResult

    root = os.path.join(str(tmp_path), "ck")
    state = w.build()
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, root, every=2), policy=pitstop.EveryN(10)
    )
    results = {}
    for step in range(1, 13):
        w.train_step(state, step)
        time.sleep(0.005)
        results[step] = ckpt.step(step, state)
    ckpt.wait()
    assert results[10] is StepResult.SAVED
    assert all(results[s] is StepResult.SKIPPED for s in range(1, 13, 2)), results
    snapshots = {s for s, r in results.items() if r is StepResult.SNAPSHOT}
    assert snapshots and not any(results[s] for s in snapshots), results
    assert snapshots == {h.step for h in ckpt.history} - {10}, (results, ckpt.history)
    ckpt.close()


def test_a_state_that_grows_keeps_the_newest_snapshot_until_a_larger_one_commits(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """An optimizer that gains state late (a layer trained from step 6 on: Adam's moments of
    it appear then) needs larger slots. The slots are made larger one by one, the one holding
    the newest committed snapshot last: while step 6 is staged, step 5 is still committed in
    memory (a crash then restarts from it). Before, every slot was made anew at once, the
    only copy of step 5 with them: a crash while step 6 was staged restarted from the disk,
    or from step 0."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "late": torch.nn.Linear(64, 64)})
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": opt}

    def train(step: int) -> None:
        opt.zero_grad()
        loss = model["a"](torch.randn(4, 16)).sum()
        if step >= 6:
            loss = loss + model["late"](torch.randn(4, 64)).sum()
        loss.backward()
        opt.step()

    def committed() -> set[int]:
        assert memory.slots is not None
        return {h.step for h in memory.slots.headers() if h is not None and h.state == COMMITTED}

    root = os.path.join(str(tmp_path), "ck")
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, root, keeper=False), policy=pitstop.EveryN(100)
    )
    memory = ckpt.hooks.levels.memory
    try:
        for step in range(1, 6):
            train(step)
            ckpt.step(step, state)
        assert _newest_committed(memory, 5) == 5
        small = max(s.nbytes for s in memory.slots.slots)
        train(6)
        assert ckpt.step(6, state).name == "SNAPSHOT"  # staged into a larger slot
        assert 5 in committed() or 6 in committed(), committed()
        assert max(s.nbytes for s in memory.slots.slots) > small
        assert _newest_committed(memory, 6) == 6
        for step in range(7, 10):  # the slot of step 5 is made larger in its turn
            train(step)
            ckpt.step(step, state)
        assert _newest_committed(memory, 9) == 9
        assert min(s.nbytes for s in memory.slots.slots) > small
    finally:
        ckpt.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "late": torch.nn.Linear(64, 64)})
    again = {"model": fresh, "optimizer": torch.optim.Adam(fresh.parameters())}
    assert pitstop.load(root, again) == 9  # close() wrote the newest snapshot
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)


def test_a_durable_save_goes_through_when_no_slot_could_be_made_larger_yet(
    job: str, shm_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state grew and every slot holds a step that is the only copy (or is being
    written), so none could be made larger yet: the policy's durable save still goes to
    disk, through the plain arena; the memory snapshot of such a step is skipped."""
    from pitstop.levels.shm import SlotSet
    from pitstop.loop import StepResult

    root = os.path.join(str(tmp_path), "ck")
    state = w.build()
    ckpt = pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(6))
    try:
        for step in range(1, 5):
            w.train_step(state, step)
            ckpt.step(step, state)
        ckpt.wait()
        monkeypatch.setattr(SlotSet, "grow", lambda self, *a, **k: 0)  # none may grow
        state["progress"]["extra"] = torch.arange(100_000, dtype=torch.float32)  # it grew
        w.train_step(state, 5)
        assert ckpt.step(5, state) is StepResult.SKIPPED  # no slot large enough
        w.train_step(state, 6)
        assert ckpt.step(6, state) is StepResult.SAVED
        ckpt.wait()
        assert 6 in ckpt.steps()
    finally:
        ckpt.close()


def test_an_exception_in_the_with_block_leaves_the_snapshots_for_the_restart(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """Training raises inside ``with CheckpointManager(...)``: close(flush=False) leaves the
    memory level as a crash would. The keeper writes the newest snapshot to the disk and
    keeps the segments for a restart; a new manager in the same process (a notebook)
    restores from memory, bit-exact, and its close removes them. Before, the snapshots
    newer than the disk were removed with the exception."""
    root = os.path.join(str(tmp_path), "ck")
    state, digests = w.build(), {}
    with (
        pytest.raises(RuntimeError, match="diverged"),
        pitstop.CheckpointManager(
            _levels(job, shm_dir, root, linger_secs=60), policy=pitstop.EveryN(10)
        ) as ckpt,
    ):
        _train(ckpt, state, range(1, 14), digests)
        newest = _newest_committed(ckpt.hooks.levels.memory, 13)
        keeper = ckpt.hooks.levels.memory.keeper.pid
        raise RuntimeError("loss diverged")
    assert newest in (12, 13)
    deadline = time.monotonic() + 30  # the keeper writes it to the disk
    while newest not in _disk_steps(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert newest in _disk_steps(root)
    assert os.listdir(shm_dir)  # left for the restart
    again = w.build(seed=5)
    with pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(10)) as ck:
        assert ck.restore(again) == newest
        assert ck.last_restore.level == "memory"
        assert w.digest(again) == digests[newest]
        w.wait_gone(
            keeper, timeout=20
        )  # the lingering keeper saw this process take the segments over
        assert ck.hooks.levels.memory.slots is not None
        assert all(os.path.exists(s.path) for s in ck.hooks.levels.memory.slots.slots)
        _train(ck, again, range(newest + 1, newest + 3), digests)
    deadline = time.monotonic() + 10
    while os.listdir(shm_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(shm_dir) == []


def _disk_steps(root: str) -> list[int]:
    with pitstop.CheckpointManager(root) as ckpt:
        return ckpt.steps()


def test_a_killed_keeper_training_goes_on_in_process(
    job: str, shm_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    state, digests = w.build(), {}
    ckpt = pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(10))
    memory = ckpt.hooks.levels.memory
    try:
        _train(ckpt, state, range(1, 6), digests)
        assert memory.keeper is not None
        pid = memory.keeper.pid
        os.kill(pid, signal.SIGKILL)
        w.wait_gone(pid)
        with caplog.at_level(logging.WARNING, logger="pitstop"):
            _train(ckpt, state, range(6, 16), digests)
            durable = [h for h in ckpt.history if h.step == 10]
            assert durable, [h.step for h in ckpt.history]
            durable[0].wait(timeout=5)  # committed in ms; a bound, not a timing assertion
            _train(ckpt, state, range(16, 36), digests)
            ckpt.wait()
        assert "keeper ended" in caplog.text, caplog.text
        assert {20, 30} <= set(ckpt.steps())  # durable saves landed without the keeper
        assert _newest_committed(memory, 35) in (34, 35)  # sealed (in-process or a keeper)
        ckpt.save(36, state)  # and an explicit save
        digests[36] = w.digest(state)
        assert ckpt.steps()[-1] == 36
    finally:
        _close_or_abandon(ckpt, memory, job, shm_dir)
    assert os.listdir(shm_dir) == []
    assert _restore_fresh(root) == (36, digests[36])


def test_a_hung_keeper_is_killed_and_training_goes_on_in_process(
    job: str, shm_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper stops answering (SIGSTOP: a hung process) while it holds a slot it was
    sealing: after 10 s without an answer it is killed, said, and this process seals and
    writes from then on; the durable saves go on. Before, no snapshot found a free slot and
    the next durable save waited 120 s, then failed training (no word before)."""
    root = os.path.join(str(tmp_path), "ck")
    state, digests = w.build(), {}
    ckpt = pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(10))
    memory = ckpt.hooks.levels.memory
    try:
        _train(ckpt, state, range(1, 6), digests)
        assert memory.keeper is not None
        keeper = memory.keeper
        os.kill(keeper.pid, signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="pitstop"):
            step = 6
            deadline = time.monotonic() + 60  # a bound: it is killed after about 10 s
            while keeper.proc.poll() is None and time.monotonic() < deadline:
                _train(ckpt, state, range(step, step + 1), digests)
                step += 1
                time.sleep(0.02)
            assert keeper.proc.poll() is not None, "the stopped keeper was never killed"
            _train(ckpt, state, range(step, step + 25), digests)
            ckpt.wait()
        assert "has not answered for" in caplog.text, caplog.text
        last = step + 24
        assert max(ckpt.steps()) >= last - 10  # durable saves landed after it
        assert _newest_committed(memory, last) in (last - 1, last)  # sealed in-process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper.pid, signal.SIGCONT)
        _close_or_abandon(ckpt, memory, job, shm_dir)
    assert os.listdir(shm_dir) == []


def _close_or_abandon(ckpt: Any, memory: Any, job: str, shm_dir: str) -> None:
    """``ckpt.close()``; if it hangs (a bug), end its keeper and remove the job's segments so
    that the test fails instead of hanging (its thread is left behind)."""
    import threading

    closer = threading.Thread(target=ckpt.close, daemon=True)
    closer.start()
    closer.join(5)
    if closer.is_alive():
        keeper = memory.keeper
        if keeper is not None:
            keeper.proc.kill()
            keeper.proc.wait()
        remove_job(shm_dir, job)
        raise AssertionError("ckpt.close() hangs")


def test_shm_too_small_warns_and_saves_go_to_the_next_level(
    job: str, shm_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    state, digests = w.build(), {}
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        ckpt = pitstop.CheckpointManager(
            _levels(job, shm_dir, root, limit_bytes=4096), policy=pitstop.EveryN(5)
        )
        _train(ckpt, state, range(1, 13), digests)
        ckpt.save(12, state)
        ckpt.wait()
        assert os.listdir(shm_dir) == []  # no slot was made
        ckpt.close()
    assert "memory level is off" in caplog.text, caplog.text
    assert _restore_fresh(root) == (12, digests[12])
    fresh = w.build(seed=5)
    with pitstop.CheckpointManager(_levels(job, shm_dir, root, limit_bytes=4096)) as again:
        assert again.restore(fresh) == 12
        assert again.last_restore is not None and again.last_restore.level != "memory"
        assert again.steps() == [10, 12]
    assert w.digest(fresh) == digests[12]
    assert os.listdir(shm_dir) == []


def test_two_jobs_on_one_node_restore_their_own(job: str, shm_dir: str, tmp_path: Any) -> None:
    other = "t" + new_job_token()
    roots = [os.path.join(str(tmp_path), n) for n in ("a", "b")]
    a = pitstop.CheckpointManager(_levels(job, shm_dir, roots[0]), policy=pitstop.EveryN(100))
    b = pitstop.CheckpointManager(_levels(other, shm_dir, roots[1]), policy=pitstop.EveryN(100))
    sa, sb, da, db = w.build(0), w.build(1), {}, {}
    try:
        for step in range(1, 8):
            _train(a, sa, range(step, step + 1), da)
            if step <= 5:
                _train(b, sb, range(step, step + 1), db)
        a.wait(), b.wait()
        assert _newest_committed(a.hooks.levels.memory, 7) in (6, 7)
        assert _newest_committed(b.hooks.levels.memory, 5) in (4, 5)
        for ckpt, digests in ((a, da), (b, db)):
            fresh = w.build(seed=9)
            step = ckpt.restore(fresh)
            assert ckpt.last_restore is not None and ckpt.last_restore.level == "memory"
            assert step is not None and w.digest(fresh) == digests[step]
        a.close()
        assert os.listdir(shm_dir), "closing one job removed the other's segments"
        fresh = w.build(seed=9)
        step = b.restore(fresh)
        assert b.last_restore.level == "memory" and w.digest(fresh) == db[step]
    finally:
        a.close()
        b.close()
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize(
    "build",
    [
        lambda j, s, r: [pitstop.Memory(slots=1, job=j, directory=s), pitstop.Local(r)],
        lambda j, s, r: [pitstop.Memory(every=0, job=j, directory=s), pitstop.Local(r)],
        lambda j, s, r: [pitstop.Memory(job="bad token!", directory=s), pitstop.Local(r)],
        lambda j, s, r: [pitstop.Local(r), pitstop.Memory(job=j, directory=s)],
        lambda j, s, r: [pitstop.Memory(job=j, directory=s)],
    ],
    ids=["slots=1", "every=0", "job", "memory-after-local", "memory-alone"],
)
def test_bad_input_is_a_value_error_naming_it(
    job: str, shm_dir: str, tmp_path: Any, build: Any, request: pytest.FixtureRequest
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    names = {"slots=1": "slots=", "every=0": "every=", "job": "job="}
    with pytest.raises(ValueError) as info:
        pitstop.CheckpointManager(build(job, shm_dir, root))
    named = names.get(request.node.callspec.id, "pitstop.Memory()")
    assert named in str(info.value), str(info.value)
    assert not os.path.exists(root) and os.listdir(shm_dir) == []  # refused before anything


# ---------------------------------------------------------------------- killed training
def test_sigkill_of_the_trainer_resumes_from_memory_bit_exact(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    root, out = os.path.join(str(tmp_path), "ck"), os.path.join(str(tmp_path), "final.pt")
    digests, _ = _ref()
    # a step's compute: the keeper seals meanwhile (with none, see test_memory_kills)
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--kill-at", "25", "--step-secs", "0.02")
    assert code == -signal.SIGKILL, err
    keeper, taken = w.first(lines, "keeper"), w.first(lines, "taken")
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--final", out)
    assert code == 0, err
    start = lines[0]
    assert start["level"] == "memory", start
    assert start["restored"] >= 24, (start, taken)
    assert start["digest"] == digests[start["restored"]]
    w.wait_gone(keeper)  # the old keeper saw the adoption and left
    _assert_final(out)
    assert os.listdir(shm_dir) == []


def test_sigkill_of_the_process_group_resumes_from_disk_bit_exact(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    root, out = os.path.join(str(tmp_path), "ck"), os.path.join(str(tmp_path), "final.pt")
    digests, _ = _ref()
    code, lines, err = w.run(
        root, shm_dir, job, STEPS, "--kill-at", "25", "--kill-group", "--settle", group=True
    )
    assert code == -signal.SIGKILL, err
    w.wait_gone(w.first(lines, "keeper"))
    with pitstop.CheckpointManager(root) as disk:
        newest_disk = disk.latest_step()
    assert newest_disk == 20
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--final", out)
    assert code == 0, err
    start = lines[0]
    assert start["restored"] >= newest_disk, start
    assert start["digest"] == digests[start["restored"]]
    _assert_final(out)
    assert os.listdir(shm_dir) == []


def test_a_damaged_memory_snapshot_falls_back(job: str, shm_dir: str, tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ck")
    digests, _ = _ref()
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--kill-at", "25")
    assert code == -signal.SIGKILL, err
    keeper = w.first(lines, "keeper")
    # the lingering keeper seals the newest snapshot and writes it to disk: wait for that
    deadline, newest = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        newest = _newest_slot(shm_dir, job)
        if newest is not None and _on_disk(root, newest[1]):
            break
        time.sleep(0.05)
    assert newest is not None
    path, step = newest
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, DATA_OFFSET + 100)
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), DATA_OFFSET + 100)
    finally:
        os.close(fd)
    code, lines, err = w.run(root, shm_dir, job, STEPS)
    assert code == 0, err
    start = lines[0]
    assert any("memory" in " ".join(map(str, s)) or "pitstop-mem" in " ".join(map(str, s))
               for s in start["skipped"]), start  # fmt: skip
    assert start["restored"] is not None and start["restored"] <= step
    assert not (start["level"] == "memory" and start["restored"] == step), start
    assert start["digest"] == digests[start["restored"]]
    w.wait_gone(keeper)
    assert os.listdir(shm_dir) == []


def _newest_slot(shm: str, job: str) -> tuple[str, int] | None:
    """(path, step) of the job's newest committed slot, read without adopting the slots."""
    best = None
    for path in iter_slots(shm, job, 0):
        slot = open_slot(path, job=job, rank=0, populate=False)
        try:
            head = slot.header()
        finally:
            slot.close()
        ok = head is not None and head.state == COMMITTED and head.step is not None
        if ok and (best is None or head.gen > best[0]):  # type: ignore[union-attr]
            best = (head.gen, path, head.step)  # type: ignore[union-attr]
    return None if best is None else (best[1], best[2])


def _on_disk(root: str, step: int) -> bool:
    with pitstop.CheckpointManager(root) as disk:
        return step in disk.steps()


def test_a_rollback_drops_newer_memory_snapshots(job: str, shm_dir: str, tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ck")
    log = os.path.join(str(tmp_path), "digests")
    code, _, err = w.run(
        root, shm_dir, job, STEPS, "--rollback-at", "30", "--rollback-to", "20",
        "--kill-at", "24", "--digests", log,
    )  # fmt: skip
    assert code == -signal.SIGKILL, err
    seen = w.read_digests(log)
    new = dict(seen[30:])  # the new timeline: 21..24 after the rollback to 20
    old = dict(seen[:30])
    assert sorted(new) == [21, 22, 23, 24] and all(new[s] != old[s] for s in new)
    code, lines, err = w.run(root, shm_dir, job, 25)
    assert code == 0, err
    start = lines[0]
    assert start["restored"] in (23, 24), start  # never the abandoned 25..30
    assert start["digest"] == new[start["restored"]], start
    assert os.listdir(shm_dir) == []


def test_gc_removes_the_segments_of_a_killed_job_and_the_restart_reads_disk(
    job: str, shm_dir: str, tmp_path: Any, capsys: Any
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    code, lines, err = w.run(
        root, shm_dir, job, STEPS, "--kill-at", "25", "--kill-group", "--settle", group=True
    )
    assert code == -signal.SIGKILL, err
    w.wait_gone(w.first(lines, "keeper"))
    assert os.listdir(shm_dir), "the killed job left no segment: nothing to test"
    capsys.readouterr()
    assert main(["gc", root, "--shm-dir", shm_dir, "--dry-run"]) == 0
    said = capsys.readouterr().out  # the job's newest state is named before it goes
    assert re.search(f"job {job}: its newest memory snapshot, step 2[45], would be gone", said)
    assert main(["gc", root, "--shm-dir", shm_dir]) == 0
    assert os.listdir(shm_dir) == []
    with pitstop.CheckpointManager(root) as disk:
        assert disk.steps() == [20]  # gc of shared memory took nothing from disk
    out = os.path.join(str(tmp_path), "final.pt")
    code, lines, err = w.run(root, shm_dir, job, STEPS, "--final", out)
    assert code == 0, err
    start = lines[0]  # memory gone: the newest step on disk, bit-exact
    assert (start["restored"], start["level"]) == (20, "local"), start
    assert start["digest"] == _ref()[0][20]
    _assert_final(out)
    assert os.listdir(shm_dir) == []


@pytest.mark.parametrize("case", ["plain", "discard", "damaged"])
def test_gc_writes_a_killed_jobs_newest_memory_step_to_its_directory_before_removing_it(
    shm_dir: str, tmp_path: Any, capsys: Any, case: str
) -> None:
    """The job that wrote to ROOT (its default job token) was killed with its keeper after
    step 25 (the disk's newest: 20): ``pitstop gc ROOT`` writes the newest memory step to
    ROOT (sealing it if the keeper died first), then removes the segments, and the restart
    resumes from it, bit-exact. Before, gc removed the only copy of steps 21-25.
    ``--discard-memory`` (to start over) removes them without writing. ``damaged``: the
    newest snapshot has a flipped byte: gc passes it over and writes the one before (before:
    it wrote nothing and removed that one too)."""
    discard = case == "discard"
    root = os.path.join(str(tmp_path), "ck")
    job = job_token(os.path.abspath(root))
    try:
        code, lines, err = w.run(
            root, shm_dir, job, STEPS, "--kill-at", "25", "--kill-group", "--settle", group=True
        )
        assert code == -signal.SIGKILL, err
        w.wait_gone(w.first(lines, "keeper"))
        newest = None
        if case == "damaged":  # sealed first (the dead keeper's work), then a byte flipped
            slots = SlotSet.attach(job, directory=shm_dir)
            assert slots is not None
            newest = slots.newest()
            assert newest is not None
            flip_byte(newest[0].path, DATA_OFFSET + 100)
            newest = newest[1].step
            slots.close(unlink=False)
        capsys.readouterr()
        assert main(["gc", root, "--shm-dir", shm_dir, "--dry-run"]) == 0
        assert f"would write job {job}'s newest memory step (2" in capsys.readouterr().out
        with pitstop.CheckpointManager(root) as disk:
            assert disk.steps() == [20]  # a dry run writes nothing
        if discard:
            assert main(["gc", root, "--shm-dir", shm_dir, "--discard-memory"]) == 0
            assert "wrote" not in capsys.readouterr().out and os.listdir(shm_dir) == []
            with pitstop.CheckpointManager(root) as disk:
                assert disk.steps() == [20]
            return
        assert main(["gc", root, "--shm-dir", shm_dir]) == 0
        said = capsys.readouterr().out
        written = re.search(f"wrote job {job}'s memory step (2[2-5]) to ", said)
        assert written, said
        if newest is not None:  # the damaged one was passed over, said
            assert int(written.group(1)) < newest and f"step {newest}" in said, said
        assert os.listdir(shm_dir) == []
        out = os.path.join(str(tmp_path), "final.pt")
        code, lines, err = w.run(root, shm_dir, job, STEPS, "--final", out)
        assert code == 0, err
        start = lines[0]  # memory gone: the step gc wrote, bit-exact
        assert (start["restored"], start["level"]) == (int(written.group(1)), "local"), start
        assert start["digest"] == _ref()[0][start["restored"]]
        _assert_final(out)
    finally:
        remove_job(shm_dir, job)


def test_ls_shows_the_memory_snapshots_of_the_directory(
    shm_dir: str, tmp_path: Any, capsys: Any
) -> None:
    """``pitstop ls DIR`` also says which steps the memory level of the job writing to DIR
    holds on this host (found by the default job token); after ``close()`` it holds none."""
    root = str(tmp_path / "ckpt")
    state = {"model": torch.nn.Linear(4, 4)}
    ckpt = pitstop.CheckpointManager(
        [pitstop.Memory(directory=shm_dir), pitstop.Local(root, redundancy="single")],
        policy=pitstop.EveryN(3),
    )
    try:
        for step in range(1, 6):
            ckpt.step(step, state)
        ckpt.wait()
        assert _newest_committed(ckpt.hooks.levels.memory, 5) == 5
        capsys.readouterr()
        assert main(["ls", root, "--shm-dir", shm_dir]) == 0
        out = capsys.readouterr().out
        assert "memory level on this host" in out and "5 (committed)" in out, out
    finally:
        ckpt.close()
    assert main(["ls", root, "--shm-dir", shm_dir]) == 0
    assert "memory level" not in capsys.readouterr().out
