"""Two-phase saves: handles, consistency while training goes on, bounded memory, errors."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import pitstop
from conftest import assert_same_tensors, make_state, tensors_of
from pitstop.errors import CheckpointIOError
from pitstop.storage import LocalStorage
from pitstop.testing import FaultyStorage


def _bn_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024),
        nn.BatchNorm1d(1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.BatchNorm1d(1024),
    )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(seed))
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_async_save_handle_lifecycle(root: str) -> None:
    state = make_state(steps=2)
    with pitstop.CheckpointManager(root) as ckpt:
        handle = ckpt.async_save(7, state)
        assert handle.step == 7
        handle.wait(timeout=30)
        assert handle.done() and handle.staged and handle.committed
        assert handle.stats.nbytes > 0 and handle.stats.stall_secs <= handle.stats.total_secs
        assert ckpt.steps() == [7]
        h2 = ckpt.save(8, state)
        assert h2.committed and ckpt.steps() == [7, 8]


@pytest.mark.parametrize("overlap", [True, False])
def test_snapshot_equals_state_at_the_step_while_training_goes_on(root: str, overlap: bool) -> None:
    model, opt = _bn_model()
    state = {"model": model, "optimizer": opt}
    _train(model, opt, 0)
    with pitstop.CheckpointManager(
        root, options=pitstop.SaveOptions.from_env(overlap=overlap)
    ) as ckpt:
        for step in range(1, 4):
            expected = tensors_of(state)
            handle = ckpt.async_save(step, state)
            # training goes on at once: forward changes BatchNorm statistics, step() changes weights
            for i in range(3):
                _train(model, opt, step * 10 + i)
            handle.wait()
            got = pitstop.CheckpointManager(root).load(step)
            assert_same_tensors(expected, tensors_of(got))
        items = ckpt._saver._plans._plan.items  # type: ignore[union-attr]
        deferred = {i.key for i in items if i.deferrable}
        assert ("model/0.weight" in deferred) is overlap  # parameters owned by the optimizer
        assert "model/1.running_mean" not in deferred  # buffers: copied before async_save returns


def test_optimizer_step_waits_for_the_deferred_copy(root: str) -> None:
    """Hold the stage thread so the deferred copy cannot run; optimizer.step() must wait for it."""
    import threading
    import time

    model, opt = _bn_model()
    state = {"model": model, "optimizer": opt}
    _train(model, opt, 0)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(0, state)  # warm up: arena, plan, hooks
        gate = threading.Event()
        ckpt._saver._stage_pool.submit(gate.wait)  # the single stage thread is now busy
        expected = tensors_of(state)
        handle = ckpt.async_save(1, state)
        assert not handle.staged
        threading.Timer(0.3, gate.set).start()
        t0 = time.perf_counter()
        _train(model, opt, 1)  # forward runs at once; step() blocks until the copy is done
        assert time.perf_counter() - t0 >= 0.25
        handle.wait()
        assert_same_tensors(expected, tensors_of(pitstop.CheckpointManager(root).load(1)))


def test_reserve_allocates_the_arena_before_the_first_save(root: str) -> None:
    model, opt = _bn_model()
    state = {"model": model, "optimizer": opt}
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.host_bytes == 0
        reserved = ckpt.reserve(state)
        assert ckpt.host_bytes == reserved > 0
        ckpt.save(1, state)
        assert ckpt.host_bytes == reserved  # the first save used the reserved arena
        assert ckpt._saver._plans.misses == 1


def test_restore_waits_for_a_save_still_copying(root: str) -> None:
    """A rollback while a save of the newer state is in flight must not leak into that save."""
    import threading

    model, opt = _bn_model()
    state = {"model": model, "optimizer": opt}
    _train(model, opt, 0)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, state)
        old = tensors_of(state)
        _train(model, opt, 1)
        newer = tensors_of(state)
        gate = threading.Event()
        ckpt._saver._stage_pool.submit(gate.wait)  # hold the deferred copy of step 2
        handle = ckpt.async_save(2, state)
        threading.Timer(0.2, gate.set).start()
        # waits for step 2's copy before writing (rollback=False: step 2 stays a candidate)
        assert ckpt.restore(state, step=1, rollback=False) == 1
        handle.wait()
        assert_same_tensors(old, tensors_of(state))
    assert_same_tensors(newer, tensors_of(pitstop.CheckpointManager(root).load(2)))


def test_a_failed_copy_fails_its_save_but_not_training(root: str) -> None:
    model, opt = _bn_model()
    state = {"model": model, "optimizer": opt}
    _train(model, opt, 0)
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, state)

        def broken_copy(*args: object) -> None:
            raise RuntimeError("copy failed")

        real_submit = ckpt._saver._stage_pool.submit
        ckpt._saver._stage_pool.submit = lambda fn, *a: real_submit(broken_copy)  # type: ignore[method-assign]
        handle = ckpt.async_save(2, state)
        ckpt._saver._stage_pool.submit = real_submit  # type: ignore[method-assign]
        with pytest.raises(pitstop.CheckpointError, match="copy failed"):
            handle.wait()
        for i in range(3):
            _train(model, opt, 10 + i)  # optimizer.step() is not blocked by the failed copy
        ckpt.save(3, state)
        assert ckpt.steps() == [1, 3]


def test_policy_counts_from_the_restored_step(root: str) -> None:
    from pitstop.policy import EveryN

    state = {"x": torch.zeros(3)}
    with pitstop.CheckpointManager(root, policy=EveryN(5)) as ckpt:
        assert [s for s in range(1, 11) if ckpt.step(s, state)] == [5, 10]
    with pitstop.CheckpointManager(root, policy=EveryN(5)) as ckpt:
        assert ckpt.restore(state) == 10
        assert [s for s in range(11, 21) if ckpt.step(s, state)] == [15, 20]


def test_arenas_are_reused_and_bounded(root: str) -> None:
    model, opt = _bn_model()
    state = {"model": model, "optimizer": opt}
    _train(model, opt, 0)
    with pitstop.CheckpointManager(
        root, keep_last=2, options=pitstop.SaveOptions.from_env(max_in_flight=2)
    ) as ckpt:
        ckpt.save(0, state)
        one = ckpt.host_bytes
        for step in range(1, 9):
            ckpt.async_save(step, state)
            _train(model, opt, step)
            assert ckpt.host_bytes <= 2 * one
        ckpt.wait()
        assert ckpt._saver._plans.misses == 1  # the plan was computed once
        assert ckpt.steps() == [7, 8]


def test_background_error_is_raised_once_and_older_checkpoints_survive(root: str) -> None:
    storage = FaultyStorage(LocalStorage(root), fail={"persist": [3]}, errno=errno.ENOSPC)
    state = {"x": torch.arange(10.0)}
    with pitstop.CheckpointManager(storage) as ckpt:
        ckpt.save(1, state)  # data + objects: persist calls 1 and 2
        handle = ckpt.async_save(2, state)
        with pytest.raises(CheckpointIOError) as info:
            handle.wait()
        assert info.value.errno == errno.ENOSPC and info.value.step == 2
        ckpt.wait()  # already reported: not raised again
        assert ckpt.steps() == [1]
        assert not os.path.exists(os.path.join(root, "step-0000000002"))  # debris removed
        ckpt.save(3, state)
        assert ckpt.steps() == [1, 3]


def test_unwaited_background_error_surfaces_on_the_next_call(root: str) -> None:
    # EIO is retried (IOOptions.retries = 3 attempts): fail all three
    storage = FaultyStorage(LocalStorage(root), fail={"commit": [1, 2, 3]}, errno=errno.EIO)
    with pitstop.CheckpointManager(storage) as ckpt:
        handle = ckpt.async_save(1, {"x": torch.ones(3)})
        handle._finished.wait()
        with pytest.raises(CheckpointIOError, match=r"injected EIO.*after 3 attempts"):
            ckpt.async_save(2, {"x": torch.ones(3)})
        ckpt.save(2, {"x": torch.ones(3)})
        assert ckpt.steps() == [2]


def test_close_waits_for_saves_in_flight(root: str) -> None:
    ckpt = pitstop.CheckpointManager(root)
    handles = [ckpt.async_save(s, {"x": torch.randn(100_000)}) for s in range(3)]
    ckpt.close()
    assert all(h.committed for h in handles)
    with pytest.raises(pitstop.CheckpointError, match="closed"):
        ckpt.async_save(9, {"x": torch.ones(1)})


def test_ram_storage_round_trip() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import shutil
    import tempfile

    from pitstop.storage import RamStorage

    root = tempfile.mkdtemp(dir="/dev/shm", prefix="pitstop-test-")
    try:
        state = make_state(steps=1)
        with pitstop.CheckpointManager(RamStorage(root)) as ckpt:
            handle = ckpt.save(1, state)
            assert not handle.stats.direct_io  # RAM storage never asks for O_DIRECT
            fresh = make_state(seed=5, steps=0)
            assert ckpt.restore(fresh) == 1
        assert_same_tensors(tensors_of(state), tensors_of(fresh))
    finally:
        shutil.rmtree(root)


@pytest.fixture
def ramfs(tmp_path: object) -> object:
    """A ramfs mount: a file system that refuses O_DIRECT (needs root and mount rights)."""
    path = os.path.join(str(tmp_path), "ramfs")
    os.mkdir(path)
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", path], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a ramfs here")
    yield path
    subprocess.run(["umount", path], capture_output=True)


def test_o_direct_refused_falls_back_to_buffered_io(
    ramfs: str, caplog: pytest.LogCaptureFixture
) -> None:
    from pitstop.io import parallel

    parallel._warned_devices.clear()  # the fallback is logged once per device and process
    state = make_state(steps=1)
    with (
        caplog.at_level(logging.WARNING, logger="pitstop"),
        pitstop.CheckpointManager(ramfs) as ckpt,
    ):
        handle = ckpt.save(1, state)
        handle2 = ckpt.save(2, state)
        fresh = make_state(seed=5, steps=0)
        assert ckpt.restore(fresh) == 2
    assert not handle.stats.direct_io and not handle2.stats.direct_io
    assert_same_tensors(tensors_of(state), tensors_of(fresh))
    assert sum("O_DIRECT refused" in r.message for r in caplog.records) == 1  # said once


def test_process_exit_with_saves_in_flight_leaves_no_partial_commit(tmp_path: object) -> None:
    root = os.path.join(str(tmp_path), "ck")
    script = textwrap.dedent(
        f"""
        import os, torch, pitstop
        ckpt = pitstop.CheckpointManager({root!r})
        for s in range(4):
            ckpt.async_save(s, {{"x": torch.full((2_000_000,), float(s))}})
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    from pitstop.cli.main import main

    assert main(["verify", root]) == 0  # whatever committed is complete
    for step in pitstop.CheckpointManager(root).steps():
        assert pitstop.load(root, step=step)["x"][0].item() == float(step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_round_trip_through_pinned_arena(root: str) -> None:  # pragma: no cover
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).cuda()
    opt = torch.optim.Adam(model.parameters())
    state = {"model": model, "optimizer": opt}
    x = torch.randn(8, 64, device="cuda")
    model(x).sum().backward()
    opt.step()
    with pitstop.CheckpointManager(root) as ckpt:
        expected = {k: v.cpu() for k, v in tensors_of(state).items()}
        handle = ckpt.async_save(1, state)
        model(x).sum().backward()
        opt.step()
        handle.wait()
        assert ckpt._saver._arenas[0].pinned
    got = pitstop.CheckpointManager(root).load(1)
    assert_same_tensors(expected, tensors_of(got))
