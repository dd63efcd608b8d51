"""The memory level against what a hostile review found (issue 27): a rollback with a newer
snapshot still staged, two processes of one job started at once, damaged slot files and
lock files, a directory that is a file, shared memory that fills after the slots were made.
In one process, each test in a private directory under /dev/shm with its own job token."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import pitstop
from pitstop.levels.shm import STAGED, iter_slots, lock_name, open_slot, read_header

from . import memory_worker as w


def _levels(job: str, shm: str, root: str, **kw: Any) -> list[Any]:
    return [pitstop.Memory(job=job, directory=shm, **kw), pitstop.Local(root, redundancy="single")]


def _slot_paths(shm: str, job: str) -> dict[str, tuple[int | None, str]]:
    """Every slot file of the job's rank 0: (its step, its state)."""
    out = {}
    for path in iter_slots(shm, job, 0):
        fd = os.open(path, os.O_RDONLY)
        try:
            head = read_header(fd)
        finally:
            os.close(fd)
        if head is not None:
            out[path] = (head.step, head.state)
    return out


def _slot_steps(shm: str, job: str) -> dict[int, str]:
    return {step: state for step, state in _slot_paths(shm, job).values() if step is not None}


def test_a_rollback_removes_newer_snapshots_even_staged_ones(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """A newer snapshot still awaiting its seal (staged) is removed by a rollback too: were
    it left, the keeper would seal it and a crash would resume the abandoned timeline."""
    root = os.path.join(str(tmp_path), "ck")
    state = w.build()
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, root, keeper=False), policy=pitstop.EveryN(10)
    )
    for step in range(1, 14):
        w.train_step(state, step)
        ckpt.step(step, state)
    ckpt.wait()
    slots = ckpt.hooks.levels.memory.slots
    newest = max(_slot_steps(shm_dir, job))
    victim = next(s for s in slots.slots if s.header() and s.header().step == newest)
    head = victim.header()
    from dataclasses import replace

    from pitstop.levels.shm import write_header

    write_header(victim.fd, replace(head, state=STAGED, seq=head.seq + 1))  # not sealed yet
    assert _slot_steps(shm_dir, job)[newest] == STAGED
    assert ckpt.restore(state, step=10) == 10
    assert all(s <= 10 for s in _slot_steps(shm_dir, job)), _slot_steps(shm_dir, job)
    assert any("memory:" in name for name in ckpt.last_restore.set_aside)
    w.train_step(state, 11)
    ckpt.step(11, state)
    ckpt.wait()
    ckpt.close()


def test_two_processes_of_one_job_the_second_stays_off(
    job: str, shm_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The first manager names its process in the job's lock file when it is made, before
    any save: a second one made at once (same job token) runs without the memory level."""
    root = os.path.join(str(tmp_path), "ck")
    first = pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(10))
    state = w.build()
    for step in range(1, 14):
        w.train_step(state, step)
        first.step(step, state)
    first.wait()
    before = _slot_steps(shm_dir, job)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    p = ctx.Process(target=_second, args=(job, shm_dir, root, q))
    p.start()
    active = q.get(timeout=120)
    p.join(60)
    assert active is False
    assert first.hooks.levels.memory.active
    assert max(_slot_steps(shm_dir, job)) == max(before)  # its restore took none of ours
    for step in range(14, 21):  # and the first goes on: snapshots and a durable save
        w.train_step(state, step)
        first.step(step, state)
    first.wait()
    assert 20 in first.steps() and max(_slot_steps(shm_dir, job)) >= 19
    first.close()


def _second(job: str, shm: str, root: str, q: Any) -> None:
    ckpt = pitstop.CheckpointManager(_levels(job, shm, root), policy=pitstop.EveryN(10))
    active = ckpt.hooks.levels.memory.active
    ckpt.restore(w.build(seed=2))  # a rollback restore: of disk only, never the first's memory
    q.put(active)
    ckpt.close()


@pytest.mark.parametrize("damage", ["truncate", "symlink"])
def test_a_damaged_slot_file_never_stops_the_job(
    job: str, shm_dir: str, tmp_path: Any, damage: str
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    state = w.build()
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, root, keeper=False, linger_secs=0), policy=pitstop.EveryN(5)
    )
    for step in range(1, 8):
        w.train_step(state, step)
        ckpt.step(step, state)
    ckpt.wait()
    paths = sorted(iter_slots(shm_dir, job, 0))
    ckpt.hooks.levels.memory.slots.close()  # a crash: the slots stay
    ckpt.hooks.levels.memory.slots = None
    ckpt.close(flush=False)
    victim = paths[0]
    if damage == "truncate":
        os.truncate(victim, 4096 * 3)
    else:
        os.unlink(victim)
        os.symlink("/etc/hostname", victim)
    fresh = w.build(seed=1)
    again = pitstop.CheckpointManager(_levels(job, shm_dir, root, keeper=False))
    got = again.restore(fresh)  # from the slots left whole, or from disk
    assert got is not None and got >= 5
    again.close()
    for p in paths:  # close() removed what it could; the rest goes here
        if os.path.lexists(p):
            os.unlink(p)


def test_a_lock_file_that_is_a_fifo_turns_the_level_off(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    os.mkfifo(os.path.join(shm_dir, lock_name(job, 0)))
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, os.path.join(str(tmp_path), "ck")), policy=pitstop.EveryN(2)
    )
    try:
        assert ckpt.hooks.levels.memory.active is False
        state = w.build()
        for step in range(1, 5):
            w.train_step(state, step)
            ckpt.step(step, state)
        ckpt.wait()
        assert ckpt.steps() == [2, 4]
    finally:
        ckpt.close()
        os.unlink(os.path.join(shm_dir, lock_name(job, 0)))


def test_a_directory_that_is_a_file_turns_the_level_off(job: str, tmp_path: Any) -> None:
    a_file = os.path.join(str(tmp_path), "not-a-dir")
    open(a_file, "w").close()
    root = os.path.join(str(tmp_path), "ck")
    ckpt = pitstop.CheckpointManager(
        [pitstop.Memory(job=job, directory=a_file), pitstop.Local(root, redundancy="single")],
        policy=pitstop.EveryN(2),
    )
    state = w.build()
    for step in range(1, 3):
        w.train_step(state, step)
        ckpt.step(step, state)
    ckpt.close()
    assert ckpt.hooks.levels.memory.active is False
    assert pitstop.CheckpointManager(root).latest_step() == 2


def test_shared_memory_that_fills_after_the_slots_were_made_loses_no_durable_save(
    job: str, shm_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A slot whose record cannot be written (shared memory full, simulated: the write
    fails with ENOSPC) turns the level off; the durable save is written from the slot's
    data by the plain commit round, and later saves go to disk as without the level."""
    root = os.path.join(str(tmp_path), "ck")
    state = w.build()
    ckpt = pitstop.CheckpointManager(  # snapshots only at the durable saves: step 5's finds
        _levels(job, shm_dir, root, every=1000),
        policy=pitstop.EveryN(5),  # the full memory
    )
    for step in range(1, 4):
        w.train_step(state, step)
        ckpt.step(step, state)
    ckpt.wait()
    ckpt.reserve(state)  # the slots of the state as it is now (after the background one)
    slots = ckpt.hooks.levels.memory.slots

    def full(*args: Any, **kwargs: Any) -> None:
        raise pitstop.ShmSpaceError("cannot reserve: /dev/shm is full (simulated)")

    slots.staged = full  # every record write from now on
    expected = {}
    for step in range(4, 12):
        w.train_step(state, step)
        ckpt.step(step, state)
        expected[step] = {k: v.clone() for k, v in w.tensors(state).items()}
    ckpt.wait()
    assert ckpt.hooks.levels.memory.active is False
    assert ckpt.steps() == [5, 10]
    ckpt.close()
    fresh = w.build(seed=3)
    again = pitstop.CheckpointManager(root)
    assert again.restore(fresh) == 10  # the durable saves landed; off, memory holds no more
    again.close()
    got = w.tensors(fresh)
    for k, v in expected[10].items():
        assert torch.equal(got[k], v), k


def test_slot_files_renamed_to_each_others_names_are_left_out_and_training_goes_on(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """Two slot files swapped by name after a crash (each header names the other's index):
    they are no slots of the names they bear, so the restart leaves them out (the disk or
    the slot left whole serves) and the training that follows, with its keeper, takes
    snapshots and saves as before. Before, the trainer went by the headers and its keeper
    by the names: every slot looked busy, and the first durable save failed after 120 s."""
    root = os.path.join(str(tmp_path), "ck")
    state = w.build()
    ckpt = pitstop.CheckpointManager(_levels(job, shm_dir, root, linger_secs=0),
                                     policy=pitstop.EveryN(5))  # fmt: skip
    for step in range(1, 8):
        w.train_step(state, step)
        ckpt.step(step, state)
    ckpt.wait()
    memory = ckpt.hooks.levels.memory
    paths = sorted(iter_slots(shm_dir, job, 0))
    memory.keeper.detach()  # a crash: the slots stay (the keeper lets them go)
    memory.keeper = None
    memory.slots.close()
    memory.slots = None
    ckpt.close(flush=False)
    a, b = paths[0], paths[1]
    os.rename(a, a + ".x")
    os.rename(b, a)
    os.rename(a + ".x", b)
    with pytest.raises(pitstop.CheckpointError, match="is named slot 0 but its header says"):
        open_slot(a, job=job, rank=0)
    fresh = w.build(seed=1)
    again = pitstop.CheckpointManager(_levels(job, shm_dir, root), policy=pitstop.EveryN(5))
    try:
        got = again.restore(fresh)
        assert got is not None and got >= 5
        for step in range(got + 1, got + 13):
            w.train_step(fresh, step)
            again.step(step, fresh)
        again.wait()
        assert max(again.steps()) >= got + 10  # its durable saves went on
    finally:
        again.close()


def test_a_fifo_named_like_a_slot_of_a_job_without_a_lock_file_hangs_nothing(
    shm_dir: str, tmp_path: Any
) -> None:
    """A FIFO in shared memory with a slot's name and no lock file beside it (anyone may
    make one in /dev/shm): the cleanup that every start of the memory level runs, and
    ``pitstop gc``, pass it by. Before, opening it to read its header waited for a writer
    for ever: no trainer on the node could start."""
    import threading

    from pitstop.levels.shm import remove_stale

    fifo = os.path.join(shm_dir, "pitstop-mem-deadjob-r00000-s0")
    os.mkfifo(fifo)
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(remove_stale(shm_dir)), daemon=True)
    t.start()
    t.join(20)
    hung = t.is_alive()
    if hung:  # let the blocked open go (a writer appears) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not hung, "remove_stale waited on a FIFO named like a slot"
    assert done[0] == [os.path.basename(fifo)]  # a dead job's debris: no owner is alive


def test_a_lock_file_naming_a_reused_pid_that_nobody_holds_is_a_dead_jobs(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """The job's lock file names a pid that is running (here: pid 1, of this host and boot)
    but nobody holds the lock: every process of the job is dead and the pid was reused (a
    container's pid 1). The level adopts the segments; before, it took pid 1 for a second
    process of the job and turned itself off for the whole run."""
    import json
    import socket

    from pitstop.levels.shm_header import boot_id

    with open(os.path.join(shm_dir, lock_name(job, 0)), "w") as f:
        json.dump({"job": job, "host": socket.gethostname(), "pid": 1, "boot": boot_id()}, f)
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, os.path.join(str(tmp_path), "ck")), policy=pitstop.EveryN(2)
    )
    try:
        assert ckpt.hooks.levels.memory.active is True
    finally:
        ckpt.close()


def test_a_launchers_keeper_that_stops_mid_seal_never_stops_training(
    job: str, shm_dir: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The launcher's keeper (``Memory(keeper="external")``) stops while it holds a staged
    slot (SIGSTOP mid-seal: simulated by holding that slot's flock, with the keeper's own
    flock held so that it seems to run) and seals nothing more: once no slot has been free
    for 10 s, the training process seals the newest staged snapshot itself whenever none is
    free, and says so; snapshots and durable saves go on. Before, every slot stayed busy and
    the durable save at step 20 failed training after 120 s."""
    import fcntl
    import logging

    from pitstop.levels.keeper_watch import keeper_file

    keeper = os.open(keeper_file(shm_dir, job), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(keeper, fcntl.LOCK_EX)  # "pitstop keeper" runs (it never seals)
    held = -1
    root = os.path.join(str(tmp_path), "ck")
    ckpt = pitstop.CheckpointManager(
        _levels(job, shm_dir, root, keeper="external"), policy=pitstop.EveryN(10)
    )
    try:
        state = w.build()
        with caplog.at_level(logging.WARNING, logger="pitstop"):
            for step in range(1, 26):
                w.train_step(state, step)
                ckpt.step(step, state)
                if step == 5:  # the keeper stops while sealing step 5's snapshot
                    ckpt.wait()
                    (path,) = (p for p, s in _slot_paths(shm_dir, job).items() if s == (5, STAGED))
                    held = os.open(path, os.O_RDWR)
                    fcntl.flock(held, fcntl.LOCK_EX)
            ckpt.wait()
        assert "has sealed nothing for" in caplog.text, caplog.text
        assert ckpt.steps() == [10, 20]
        ckpt.close()  # writes the newest snapshot: it was taken and sealed
        assert pitstop.CheckpointManager(root).steps()[-1] == 25
    finally:
        ckpt.close()
        if held >= 0:
            os.close(held)
        os.close(keeper)
        os.unlink(keeper_file(shm_dir, job))


def test_a_slot_header_naming_another_rank_is_no_slot_and_the_level_stays_on(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """A rank-0 slot whose header was edited to name rank 1 (crafted, or a file renamed): it
    is no slot of either, so a one-process restart neither takes the job for one of two
    ranks (it turned the level off, telling the user to restart with 2) nor counts it."""
    import dataclasses

    from pitstop.levels.shm import SlotSet, write_header
    from pitstop.levels.shm_clean import job_slots

    slots = SlotSet.create(job, data_bytes=4096, directory=shm_dir)
    path = slots.slots[0].path
    slots.close(unlink=False)
    fd = os.open(path, os.O_RDWR)
    try:
        head = read_header(fd)
        assert head is not None
        write_header(fd, dataclasses.replace(head, rank=1, seq=head.seq + 1))
    finally:
        os.close(fd)
    assert [h.rank for h in job_slots(shm_dir, job)] == [0]  # the edited one is left out
    ckpt = pitstop.CheckpointManager(_levels(job, shm_dir, os.path.join(str(tmp_path), "ck")))
    try:
        assert ckpt.hooks.levels.memory.active is True
    finally:
        ckpt.close()
    for p in iter_slots(shm_dir, job, 0):  # the one it could not take as a slot
        os.unlink(p)
