"""The memory level's kill suite (issue 27): one job trained by a chain of processes, each
SIGKILLed at a random step; every restart must resume bit-exact.

* A SIGKILL of the training process (its keeper lives and lingers): the restart resumes from
  memory, at most one step behind the step training had completed.
* A SIGKILL of the whole process group (the keeper too): the restart resumes from at least
  the newest step on disk.

``PITSTOP_MEMORY_KILLS=N[,G]`` sets the number of trainer kills and group kills (default 6,2;
the closing note's run: 50,20); ``PITSTOP_MEMORY_KILLS_SEED`` the seed;
``PITSTOP_MEMORY_KILLS_STEP_SECS`` a step's compute time (default 0.02 s). Plus the keeper's
own kill points (``keeper.seal``, ``keeper.persist``), given through ``start_keeper(kill_at=)``
or, for the training process persisting itself, ``PITSTOP_KILL_AT``."""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import pytest
import torch

import pitstop
from pitstop.engine.catalog import Catalog
from pitstop.levels.keeper import start_keeper
from pitstop.levels.memory import plan_state, stage_into
from pitstop.levels.shm import SlotSet
from pitstop.storage.local import LocalStorage

from . import memory_worker as w

pytestmark = [pytest.mark.fault, pytest.mark.timeout(3600)]


# a step's compute, during which the keeper seals the previous snapshot; with none (0) a
# snapshot is at times skipped (no free slot) and a kill can lose two steps or more
STEP_SECS = float(os.environ.get("PITSTOP_MEMORY_KILLS_STEP_SECS", "0.02"))


def _counts() -> tuple[int, int]:
    raw = os.environ.get("PITSTOP_MEMORY_KILLS", "6,2")
    trainer, _, group = raw.partition(",")
    return int(trainer), int(group or 2)


def _disk_newest(root: str) -> int | None:
    storage = LocalStorage(root)
    committed = Catalog(storage).committed()
    return committed[-1].step if committed else None


def test_random_kills_resume_bit_exact(job: str, shm_dir: str, tmp_path: Any) -> None:
    trainer_kills, group_kills = _counts()
    seed = int(os.environ.get("PITSTOP_MEMORY_KILLS_SEED", "27"))
    rng = random.Random(seed)
    kinds = ["trainer"] * trainer_kills + ["group"] * group_kills
    rng.shuffle(kinds)
    total = 25 * (len(kinds) + 2)
    digests, final = w.reference(total)
    root, out = os.path.join(str(tmp_path), "ck"), os.path.join(str(tmp_path), "final.pt")
    keepers: list[int] = []
    resumed, done, on_disk, log, taken = 0, 0, 0, [], None
    for i, kind in enumerate([*kinds, "end"]):
        extra = ["--every", "20", "--step-secs", str(STEP_SECS)]
        if kind == "end":
            extra += ["--final", out]
        else:
            kill = min(resumed + rng.randint(2, 30), total - 1)
            extra += ["--kill-at", str(kill), "--kill-delay", f"{rng.uniform(0, 0.005):.4f}"]
            extra += ["--kill-group"] if kind == "group" else []
        code, lines, err = w.run(root, shm_dir, job, total, *extra, group=kind == "group")
        assert lines, err
        start = lines[0]
        keepers += [x["keeper"] for x in lines if x.get("keeper")]
        if i > 0:  # what the previous kill left
            prev = kinds[i - 1]
            at = f"restart {i} after a {prev} kill at step {done} ({start}; taken: {taken})"
            assert start["restored"] is not None, at
            assert start["digest"] == digests[start["restored"]], "not bit-exact: " + at
            if prev == "trainer":
                assert start["level"] == "memory", at
                assert start["restored"] >= done - 1, at
            else:
                assert start["restored"] >= on_disk, f"{at}; newest on disk: {on_disk}"
            log.append((prev, done, start["restored"], start["level"]))
        if kind == "end":
            assert code == 0, err
            break
        taken = w.first(lines, "taken")
        assert code == -signal.SIGKILL, f"incarnation {i} ({kind}): exit {code}\n{err}"
        resumed = done = kill
        if kind == "group":
            for pid in keepers:  # the whole group died: no keeper writes to disk any more
                w.wait_gone(pid)
            on_disk = _disk_newest(root) or 0
    got = torch.load(out)
    assert got.keys() == final.keys()
    for k in final:
        assert torch.equal(got[k], final[k]), k
    for pid in keepers:
        w.wait_gone(pid)
    assert os.listdir(shm_dir) == []
    print("kills (kind, killed after step, resumed at, level):", log)


# ---------------------------------------------------------------------- the keeper's kill points
def _trained(step: int) -> dict[str, Any]:
    state = w.build(seed=step)
    for s in range(1, step + 1):
        w.train_step(state, s)
    return state


def _stage(slots: SlotSet, step: int) -> tuple[Any, dict[str, Any]]:
    state = _trained(step)
    slot = stage_into(slots, step, state)
    assert slot is not None
    return slot, state


def _restart(job: str, shm_dir: str, root: str) -> tuple[int | None, str | None, str]:
    """A restarted training process (this one): (step, level, digest) of its restore; it
    closes (the segments go)."""
    fresh = w.build(seed=99)
    levels = [pitstop.Memory(job=job, directory=shm_dir), pitstop.Local(root, redundancy="single")]
    with pitstop.CheckpointManager(levels) as ckpt:
        step = ckpt.restore(fresh)
        level = ckpt.last_restore.level if ckpt.last_restore is not None else None
    return step, level, w.digest(fresh)


def test_keeper_killed_mid_seal_loses_no_snapshot(job: str, shm_dir: str, tmp_path: Any) -> None:
    root = os.path.join(str(tmp_path), "ck")
    _, plan = plan_state(_trained(1))
    slots = SlotSet.create(job, data_bytes=plan.file_bytes, directory=shm_dir)
    keeper = start_keeper(job, shm_dir=shm_dir, next_dir=root, kill_at="keeper.seal:2")
    try:
        slot, _ = _stage(slots, 3)
        keeper.request_seal(slot.index)
        keeper.wait_for("sealed", step=3)
        slot, state = _stage(slots, 4)  # staged, its seal never done: the keeper dies
        keeper.request_seal(slot.index)
        assert keeper.proc.wait(20) == -signal.SIGKILL
    finally:
        keeper.stop()
        slots.close()  # the training process ends too, without removing anything
    assert os.listdir(shm_dir)
    step, level, digest = _restart(job, shm_dir, root)
    assert (step, level) == (4, "memory")  # the restart sealed the staged snapshot
    assert digest == w.digest(state)
    assert os.listdir(shm_dir) == []


def test_keeper_killed_mid_persist_leaves_no_step_on_disk(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    _, plan = plan_state(_trained(1))
    slots = SlotSet.create(job, data_bytes=plan.file_bytes, directory=shm_dir)
    keeper = start_keeper(job, shm_dir=shm_dir, next_dir=root, kill_at="keeper.persist:1")
    try:
        slot, state = _stage(slots, 5)
        keeper.request_persist(slot.index)
        assert keeper.proc.wait(20) == -signal.SIGKILL
        assert os.listdir(root)  # its data was written...
        assert _disk_newest(root) is None  # ...and nothing committed
    finally:
        keeper.stop()
        slots.close()
    step, level, digest = _restart(job, shm_dir, root)
    assert (step, level) == (5, "memory") and digest == w.digest(state)
    assert _disk_newest(root) == 5  # close() wrote the snapshot over the debris
    assert os.listdir(shm_dir) == []


def test_trainer_persisting_itself_killed_mid_persist(
    job: str, shm_dir: str, tmp_path: Any
) -> None:
    """Memory(keeper=False): the training process writes its durable saves itself and is
    killed with a step's data written, not committed; the restart resumes from memory."""
    root = os.path.join(str(tmp_path), "ck")
    digests, _ = w.reference(30)
    code, _, err = w.run(
        root, shm_dir, job, 30, "--no-keeper", env={"PITSTOP_KILL_AT": "keeper.persist:1"}
    )
    assert code == -signal.SIGKILL, err
    assert _disk_newest(root) is None
    code, lines, err = w.run(root, shm_dir, job, 30, "--no-keeper")
    assert code == 0, err
    start = lines[0]
    assert start["level"] == "memory" and start["restored"] >= 19, start
    assert start["digest"] == digests[start["restored"]]
    assert os.listdir(shm_dir) == []
