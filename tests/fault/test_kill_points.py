"""A process SIGKILLed at each named point of a save leaves restore on the last committed step."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import pitstop
from conftest import assert_same_tensors, tensors_of
from pitstop.cli.main import main
from pitstop.faults import KILL_POINTS
from pitstop.testing.crash import digest, state_for

pytestmark = pytest.mark.fault

CHILD = "-m", "pitstop.testing.crash"
# kill during the third save (keep_last=2): what must be committed afterwards
EXPECTED = {
    "stage.mid:3": 2,
    "persist.mid:3": 2,
    "persist.after_data:3": 2,
    "commit.before_rename:3": 2,
    "commit.after_rename:3": 3,
    "retention.mid:1": 3,  # the first retention runs after step 3 commits
    "gc.mid:1": 5,  # gc of debris after five saves
}
MODES = {"gc.mid:1": "gc"}  # default: sync


def _run_child(root: str, mode: str, steps: int, kill_at: str | None, timeout: float = 120) -> int:
    env = dict(os.environ)
    env.pop("PITSTOP_KILL_AT", None)
    if kill_at:
        env["PITSTOP_KILL_AT"] = kill_at
    return subprocess.run(
        [sys.executable, *CHILD, root, mode, str(steps)], env=env, timeout=timeout
    ).returncode


def _check_restore(root: str, expected_step: int) -> None:
    ckpt = pitstop.CheckpointManager(root)
    assert ckpt.latest_step() == expected_step
    fresh = state_for(999)
    assert ckpt.restore(fresh) == expected_step
    assert_same_tensors(tensors_of(state_for(expected_step)), tensors_of(fresh))
    assert fresh["extra"]["step"] == expected_step  # type: ignore[index]
    assert main(["verify", root]) == 0
    ckpt.close()


# kill points of the multi-level save, killed on one rank of four emulated nodes there
MULTILEVEL = {"replicate.mid", "flush.mid"}
# kill points of the Lightning integration, killed in tests/integrations/test_lightning.py
LIGHTNING = {"lightning.pointer", "lightning.registry"}
# kill points of the memory level's keeper, killed in tests/memory/test_memory_kills.py
KEEPER = {"keeper.seal", "keeper.persist"}


def test_every_kill_point_is_covered() -> None:
    covered = {k.split(":")[0] for k in EXPECTED} | MULTILEVEL | LIGHTNING | KEEPER
    assert covered == set(KILL_POINTS)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(here, "multilevel", "test_multilevel.py")) as f:
        text = f.read()
    assert all(f'"PITSTOP_KILL_AT": "{name}:' in text for name in MULTILEVEL)
    with open(os.path.join(here, "integrations", "test_lightning.py")) as f:
        text = f.read()
    assert all(f'    "{name}:' in text for name in LIGHTNING)
    with open(os.path.join(here, "memory", "test_memory_kills.py")) as f:
        text = f.read()
    assert all(f'kill_at="{name}:' in text for name in KEEPER)


@pytest.mark.parametrize("kill_at", sorted(EXPECTED))
def test_kill_at_named_point(tmp_path: object, kill_at: str) -> None:
    root = os.path.join(str(tmp_path), "ck")
    code = _run_child(root, MODES.get(kill_at, "sync"), 5, kill_at)
    assert code == -signal.SIGKILL, f"child was not killed at {kill_at} (exit {code})"
    _check_restore(root, EXPECTED[kill_at])
    # the run goes on: a save of the interrupted step succeeds (debris is replaced)
    with pitstop.CheckpointManager(root, keep_last=2) as ckpt:
        assert ckpt.restore(state_for(999)) == EXPECTED[kill_at]
        step = EXPECTED[kill_at] + 1
        ckpt.save(step, state_for(step))
        assert ckpt.steps() == [step - 1, step]  # the resumed run's retention holds


@pytest.mark.parametrize("kill_at", sorted(k for k in EXPECTED if k not in MODES))
def test_kill_at_named_point_during_async_saves(tmp_path: object, kill_at: str) -> None:
    """With saves in flight the committed step is not fixed; what is fixed: the newest committed
    one is restored, its bytes are what the child recorded for that step, and verify passes."""
    root = os.path.join(str(tmp_path), "ck")
    env = dict(os.environ, PITSTOP_KILL_AT=kill_at)
    code = subprocess.run(
        [sys.executable, *CHILD, root, "async", "8", "2"], env=env, timeout=120
    ).returncode
    assert code == -signal.SIGKILL
    recorded = dict(line.split() for line in open(root + ".digests").read().splitlines())
    ckpt = pitstop.CheckpointManager(root)
    steps = ckpt.steps()
    fresh = state_for(999)
    if not steps:  # killed before the first commit: nothing may be loaded
        assert ckpt.restore(fresh) is None
    else:
        assert ckpt.restore(fresh) == steps[-1]
        assert digest(fresh) == recorded[str(steps[-1])]
    assert main(["verify", root]) == 0
    ckpt.close()


def test_unknown_kill_point_is_an_error(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "ck")
    env = dict(os.environ, PITSTOP_KILL_AT="persist.nowhere")
    proc = subprocess.run(
        [sys.executable, *CHILD, root, "sync", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "unknown kill point 'persist.nowhere'" in proc.stderr


@pytest.mark.parametrize("trial", range(3))
def test_kill_at_random_time_during_async_saves(tmp_path: object, trial: int) -> None:
    root = os.path.join(str(tmp_path), "ck")
    env = dict(os.environ)
    env.pop("PITSTOP_KILL_AT", None)
    proc = subprocess.Popen(
        [sys.executable, *CHILD, root, "async", "400", "3"], env=env, stdout=subprocess.DEVNULL
    )
    rng = random.Random(trial)
    deadline = time.time() + 60
    while time.time() < deadline:  # let it reach its steady state: a few saves recorded
        if os.path.exists(root + ".digests") and open(root + ".digests").read().count("\n") >= 3:
            break
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    recorded = dict(
        line.split() for line in open(root + ".digests").read().splitlines() if " " in line
    )
    ckpt = pitstop.CheckpointManager(root)
    steps = ckpt.steps()
    assert steps, "nothing committed although saves were recorded"
    fresh = state_for(999)
    restored = ckpt.restore(fresh)
    assert restored == steps[-1]
    assert digest(fresh) == recorded[str(restored)]
    assert main(["verify", root]) == 0
    ckpt.close()


def test_torch_is_deterministic_for_state_for() -> None:
    assert digest(state_for(3)) == digest(state_for(3))
    assert not torch.equal(state_for(3)["extra"]["blob"], state_for(4)["extra"]["blob"])  # type: ignore[index]
