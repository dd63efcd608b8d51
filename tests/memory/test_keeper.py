"""The keeper process: seals and persists on request, persists the newest snapshot when the
training process is SIGKILLed, removes the job's segments, and a dead keeper is seen."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import pitstop
from pitstop.engine.catalog import Catalog
from pitstop.engine.verify import verify_checkpoint
from pitstop.levels.keeper import start_keeper
from pitstop.levels.memory import plan_state, stage_into
from pitstop.levels.shm import SHM_DIR, SlotSet, segment_names
from pitstop.storage.local import LocalStorage

from .conftest import assert_same, small_state

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]


def _wait_gone(pid: int, timeout: float = 20.0) -> None:
    """Wait until process ``pid`` (not our child) has exited (a zombie that its new parent
    has not reaped yet has exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"process {pid} still runs after {timeout} s")


def test_keeper_seals_and_persists_on_request(job: str, tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "disk")
    state = small_state(3)
    _, plan = plan_state(state)
    slots = SlotSet.create(job, data_bytes=plan.file_bytes)
    keeper = start_keeper(job, next_dir=root)
    try:
        slot = stage_into(slots, 10, state)
        assert slot is not None
        assert keeper.request_seal(slot.index)
        assert keeper.wait_for("sealed", step=10)["slot"] == slot.index
        assert keeper.request_persist(slot.index)
        keeper.wait_for("persisted", step=10)
        assert keeper.request_persist(slot.index)  # the next level has it: not rewritten
        assert "next level has 10" in keeper.wait_for("skipped", step=10)["why"]
    finally:
        assert keeper.stop(unlink=True) == 0
        slots.close()
    storage = LocalStorage(root)
    (entry,) = Catalog(storage).committed()
    assert entry.manifest is not None and entry.step == 10
    assert verify_checkpoint(storage, entry.name, entry.manifest).ok
    into = small_state(8)
    assert pitstop.load(root, into) == 10
    assert_same(state, into)
    assert not keeper.alive()


CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    sys.path.insert(0, {here!r})
    from conftest import small_state
    from pitstop.levels.keeper import start_keeper
    from pitstop.levels.memory import plan_state, stage_into
    from pitstop.levels.shm import SlotSet

    job, root, last = sys.argv[1], sys.argv[2], sys.argv[3]
    _, plan = plan_state(small_state(0))
    slots = SlotSet.create(job, data_bytes=plan.file_bytes)
    keeper = start_keeper(job, next_dir=root)
    for step in (1, 2):
        slot = stage_into(slots, step, small_state(step))
        keeper.request_seal(slot.index)
        keeper.wait_for("sealed", step=step)
    keeper.request_persist(0)  # step 1 on disk already: the keeper must write a newer one
    keeper.wait_for("persisted", step=1)
    expected = 2
    if last == "staged":  # a consistent snapshot the keeper has not sealed yet
        stage_into(slots, 3, small_state(3))
        expected = 3
    elif last == "staging":  # killed in the middle of a copy: step 2 is the newest whole one
        slots.begin(3)
    print(json.dumps({{"keeper": keeper.pid, "expected": expected}}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("last", ["committed", "staged", "staging"])
def test_a_sigkilled_trainer_leaves_its_newest_step_on_disk(
    job: str, tmp_path: object, last: str
) -> None:
    root = os.path.join(str(tmp_path), "disk")
    script = CHILD.format(here=HERE)
    child = subprocess.run(
        [sys.executable, "-c", script, job, root, last],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    info = json.loads(child.stdout.strip().splitlines()[-1])
    _wait_gone(info["keeper"])  # it persists, removes the segments and exits
    assert not segment_names(SHM_DIR, job)
    into = small_state(9)
    assert pitstop.load(root, into) == info["expected"]
    assert_same(small_state(info["expected"]), into)
    storage = LocalStorage(root)
    assert [e.step for e in Catalog(storage).committed()] == [1, info["expected"]]


def test_a_killed_keeper_is_seen_dead(job: str, tmp_path: object) -> None:
    state = small_state(1)
    _, plan = plan_state(state)
    slots = SlotSet.create(job, data_bytes=plan.file_bytes)
    keeper = start_keeper(job, next_dir=os.path.join(str(tmp_path), "disk"))
    try:
        assert keeper.alive()
        os.kill(keeper.pid, signal.SIGKILL)
        keeper.proc.wait(10)
        assert not keeper.alive()
        slot = stage_into(slots, 1, state)  # training goes on; it seals in-process
        assert slot is not None
        sent = [keeper.request_seal(slot.index) for _ in range(3)]
        assert sent[-1] is False  # the socket's peer is gone
        with pytest.raises(RuntimeError, match="ended"):
            keeper.wait_for("sealed", timeout=5)
    finally:
        keeper.stop()
        slots.close(unlink=True)


def test_an_orphaned_keeper_with_nothing_to_do_exits_and_cleans_up(
    job: str, tmp_path: object
) -> None:
    root = os.path.join(str(tmp_path), "disk")
    script = textwrap.dedent(
        f"""
        import os
        from pitstop.levels.keeper import start_keeper
        from pitstop.levels.shm import SlotSet
        SlotSet.create({job!r}, data_bytes=8192)
        k = start_keeper({job!r}, next_dir={root!r})
        print(k.pid, flush=True)
        os._exit(0)  # a normal exit that never stops the keeper
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    _wait_gone(int(out.stdout.split()[-1]))
    assert not segment_names(SHM_DIR, job)
    assert not os.path.exists(root) or not os.listdir(root)


def test_the_keeper_imports_no_torch(job: str) -> None:
    slots = SlotSet.create(job, data_bytes=8192)
    keeper = start_keeper(job)
    try:
        with open(f"/proc/{keeper.pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps
        assert torch.__version__  # (the test process has it)
    finally:
        keeper.stop(unlink=True)
        slots.close()


def _killed_with_a_lingering_keeper(job: str, next_dir: str | None, linger_secs: float) -> int:
    """A training process that stages step 4, has its keeper seal it and is SIGKILLed; its
    keeper (next level ``next_dir``) lives on, lingering ``linger_secs``: its pid."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {HERE!r})
        from conftest import small_state
        from pitstop.levels.keeper import start_keeper
        from pitstop.levels.memory import plan_state, stage_into
        from pitstop.levels.shm import SlotSet

        _, plan = plan_state(small_state(0))
        slots = SlotSet.create({job!r}, data_bytes=plan.file_bytes)
        keeper = start_keeper({job!r}, next_dir={next_dir!r}, linger_secs={linger_secs!r})
        slot = stage_into(slots, 4, small_state(4))
        keeper.request_seal(slot.index)
        keeper.wait_for("sealed", step=4)
        print(keeper.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    # read its stdout, then wait for it: the lingering keeper holds its stderr open
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    keeper_pid = int(child.stdout.readline())
    assert child.wait(60) == -signal.SIGKILL
    child.stdout.close()
    return keeper_pid


def test_a_restarted_trainer_adopts_the_slots_of_a_lingering_keeper(
    job: str, tmp_path: object
) -> None:
    from pitstop.levels.memory import SlotStorage, restore_from_memory

    root = os.path.join(str(tmp_path), "disk")
    keeper_pid = _killed_with_a_lingering_keeper(job, root, linger_secs=20)
    from pitstop.levels.shm_clean import _stale

    # the lingering keeper holds the job's lock: not stale
    assert _stale(SHM_DIR, job, 0, segment_names(SHM_DIR, job)) is None
    slots = SlotSet.attach(job)  # the restarted process, within the keeper's linger time
    assert slots is not None
    try:
        _wait_gone(keeper_pid)  # it saw the adoption and left the segments
        assert len(segment_names(SHM_DIR, job)) == 3
        into = small_state(9)
        with SlotStorage(SHM_DIR, job) as storage:
            result = restore_from_memory(storage, into)
        assert result.step == 4 and result.level == "memory"
        assert_same(small_state(4), into)
        assert pitstop.load(root, small_state(9)) == 4  # and it was persisted first
    finally:
        slots.close(unlink=True)


@pytest.mark.parametrize("next_level", [True, False])
def test_sigterm_ends_a_lingering_keeper_at_once(
    job: str, tmp_path: object, next_level: bool
) -> None:
    """A keeper lingering for a restart (600 s here) that gets SIGTERM (the job is torn
    down) exits at once: it removes the segments when the next level holds the newest
    snapshot, and leaves them (for pitstop gc) when it is nowhere else. Before, it ignored
    SIGTERM for the whole linger time."""
    root = os.path.join(str(tmp_path), "disk")
    keeper_pid = _killed_with_a_lingering_keeper(job, root if next_level else None, 600)
    try:
        if next_level:  # it persists step 4, then lingers

            def steps() -> list[int | None]:
                return [e.step for e in Catalog(LocalStorage(root)).committed()]

            deadline = time.monotonic() + 30
            while steps() != [4] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert steps() == [4]
        time.sleep(0.5)  # (lingering now)
        assert os.path.exists(f"/proc/{keeper_pid}")
        os.kill(keeper_pid, signal.SIGTERM)
        _wait_gone(keeper_pid, timeout=30.0)  # fails (after a SIGKILL) if it lingers on
        left = segment_names(SHM_DIR, job)
        assert (len(left) == 0) if next_level else (len(left) == 3), left
    finally:
        with contextlib.suppress(Exception):
            attached = SlotSet.attach(job)
            if attached is not None:
                attached.close(unlink=True)


def test_a_keeper_killed_mid_persist_leaves_no_step_and_training_persists_itself(
    job: str, tmp_path: object
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from pitstop.levels.keeper import persist_slot

    root = os.path.join(str(tmp_path), "disk")
    state = small_state(6)
    _, plan = plan_state(state)
    slots = SlotSet.create(job, data_bytes=plan.file_bytes)
    keeper = start_keeper(job, next_dir=root, kill_at="commit.before_rename")
    try:
        slot = stage_into(slots, 6, state)
        assert slot is not None
        keeper.request_persist(slot.index)
        keeper.wait_for("sealed", step=6)
        assert keeper.proc.wait(20) == -signal.SIGKILL  # killed with the manifest unlinked
        assert not keeper.alive()
        assert Catalog(LocalStorage(root)).committed() == []
        with ThreadPoolExecutor(2) as pool:  # the in-process fallback, from the sealed slot
            assert persist_slot(slot, LocalStorage(root), pool=pool) is not None
    finally:
        keeper.stop()
        slots.close(unlink=True)
    into = small_state(9)
    assert pitstop.load(root, into) == 6
    assert_same(state, into)


def test_sigterm_to_the_keeper_persists_and_leaves_a_living_trainers_slots(
    job: str, tmp_path: object
) -> None:
    root = os.path.join(str(tmp_path), "disk")
    state = small_state(7)
    _, plan = plan_state(state)
    slots = SlotSet.create(job, data_bytes=plan.file_bytes)
    keeper = start_keeper(job, next_dir=root)
    try:
        slot = stage_into(slots, 7, state)
        assert slot is not None
        keeper.request_seal(slot.index)
        keeper.wait_for("sealed", step=7)
        os.kill(keeper.pid, signal.SIGTERM)
        assert keeper.proc.wait(20) == 0
        assert len(segment_names(SHM_DIR, job)) == 3  # the trainer still uses them
        assert pitstop.load(root, small_state(9)) == 7
    finally:
        keeper.stop()
        slots.close(unlink=True)
