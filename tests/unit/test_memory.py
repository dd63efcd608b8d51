"""Host memory of saves: one arena by default, a ring under host_memory_bytes, reserved early."""

from __future__ import annotations

import errno
import time
from typing import Any

import pytest
import torch
from torch import nn

import pitstop
import pitstop.engine.saver as saver_mod
from pitstop.errors import CheckpointIOError
from pitstop.io.arena import Arena
from pitstop.options import SaveOptions
from pitstop.policy import EveryN
from pitstop.storage import LocalStorage
from pitstop.testing import FaultyStorage

MIB = 1 << 20


def _big(seed: int) -> dict[str, Any]:
    """About 100 MiB: 48 MiB of weights, 48 MiB of momentum, a BatchNorm's buffers."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.BatchNorm1d(2048)
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, seed)
    return {"model": model, "opt": opt}


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(8, 2048, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _bits(state: dict[str, Any]) -> list[bytes]:
    out = [v.numpy().tobytes() for v in state["model"].state_dict().values()]
    for s in state["opt"].state_dict()["state"].values():
        out += [v.numpy().tobytes() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(len(b) for b in _bits(state))


class _Arenas:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        sizes = self.sizes

        class Recording(Arena):
            def __init__(self, nbytes: int) -> None:
                super().__init__(nbytes)
                sizes.append(self.nbytes)

        monkeypatch.setattr(saver_mod, "Arena", Recording)


def test_saves_hold_one_arena_of_the_state_by_default(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arenas = _Arenas(monkeypatch)
    state = _big(0)
    with pitstop.CheckpointManager(root) as ckpt:
        for step in range(1, 5):
            ckpt.async_save(step, state)  # the next waits for the previous persist
            _train(state["model"], state["opt"], step)
        ckpt.wait()
        assert ckpt.host_bytes <= 1.1 * _state_bytes(state)
    assert len(arenas.sizes) == 1, arenas.sizes  # main held two


@pytest.mark.parametrize("overlap", [True, False])
def test_a_state_larger_than_host_memory_bytes_is_saved_in_pieces(
    root: str, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    arenas = _Arenas(monkeypatch)
    state = _big(0)
    budget = 64 * MIB
    assert _state_bytes(state) > budget
    expected = []
    options = SaveOptions(host_memory_bytes=budget, overlap=overlap)
    with pitstop.CheckpointManager(root, options=options) as ckpt:
        for step in (1, 2):
            expected.append(_bits(state))
            ckpt.async_save(step, state)
            _train(state["model"], state["opt"], 10 + step)  # waits in the optimizer hook
        ckpt.wait()
        assert ckpt.host_bytes <= budget
    assert arenas.sizes and max(arenas.sizes) <= budget, arenas.sizes  # never past it
    for step in (1, 2):
        fresh = _big(9)
        pitstop.load(root, fresh, step=step)
        assert _bits(fresh) == expected[step - 1]


def test_a_failed_write_in_pieces_fails_the_save_and_hangs_nothing(root: str) -> None:
    state = _big(0)
    faulty = FaultyStorage(LocalStorage(root), fail={"write_data": [1]}, errno=errno.ENOSPC)
    options = SaveOptions(host_memory_bytes=64 * MIB, overlap=False)
    with pitstop.CheckpointManager(faulty, options=options) as ckpt:
        # every tensor is eager and the ring is smaller than the state: the call itself waits
        # for the writers, and raises their error
        with pytest.raises(CheckpointIOError, match="ENOSPC"):
            ckpt.async_save(1, state)
        ckpt.save(2, state)  # the next save works
        assert ckpt.steps() == [2]
    options = SaveOptions(host_memory_bytes=64 * MIB)  # deferred tensors: the handle reports it
    faulty = FaultyStorage(LocalStorage(root), fail={"write_data": [1]}, errno=errno.ENOSPC)
    with pitstop.CheckpointManager(faulty, options=options) as ckpt:
        try:
            handle = ckpt.async_save(3, state)
        except CheckpointIOError:
            pass  # the error came before the eager part was staged
        else:
            _train(state["model"], state["opt"], 1)  # the hook must not wait for ever
            with pytest.raises(CheckpointIOError):
                handle.wait(timeout=60)
        ckpt.save(4, state)
        assert ckpt.steps() == [2, 4]


def test_the_arena_is_reserved_in_the_background_at_the_first_step(root: str) -> None:
    state = _big(0)
    with pitstop.CheckpointManager(root, policy=EveryN(3)) as ckpt:
        assert ckpt.host_bytes == 0
        ckpt.step(1, state)  # no save yet: the arena fills in behind the loop
        deadline = time.monotonic() + 30
        while ckpt.host_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ckpt.host_bytes >= _state_bytes(state)
        for step in (2, 3):
            _train(state["model"], state["opt"], step)
            ckpt.step(step, state)
        ckpt.wait()
        first = ckpt.history[0].stats
        assert first.step == 3 and first.alloc_secs < 0.01  # it found its arena ready


def test_allocation_is_not_counted_as_stall(root: str) -> None:
    state = _big(0)
    with pitstop.CheckpointManager(root, policy=EveryN(1)) as ckpt:
        ckpt.step(1, state)  # allocates in the save itself
        ckpt.wait()
        stats = ckpt.history[0].stats
        assert stats.alloc_secs > 0
        ckpt.step(2, state)
        ckpt.wait()
        ckpt.step(3, state)
        measured = ckpt.stats()
        assert measured.stall_secs is not None
        assert measured.stall_secs <= stats.stall_secs - stats.alloc_secs + 0.05


@pytest.mark.parametrize("seed", range(20))
def test_a_ring_place_is_reused_only_after_every_writer_of_it_finished(seed: int) -> None:
    """Whatever the extent sizes, staging extent k waits for every earlier extent that last
    held any of the bytes it overwrites (writers finish out of order, so the newest one
    alone is not enough)."""
    import random

    from pitstop.engine.stage import Ring
    from pitstop.io.parallel import Extent

    rng = random.Random(seed)
    page = 4096
    sizes = [rng.choice([1, 3, 8, 12, 16, 20]) * page for _ in range(40)]
    ring_bytes = 32 * page
    extents, at = [], 0
    for n in sizes:
        extents.append(Extent(at, at + n))
        at += n
    buffer = torch.zeros(ring_bytes, dtype=torch.uint8)
    ring = Ring(tuple(extents), buffer, memoryview(buffer.numpy()))
    owner = [-1] * (ring_bytes // page)  # which extent last held each page
    for k, e in enumerate(extents):
        pages = range(ring.pos[k] // page, (ring.pos[k] + e.nbytes) // page)
        holders = {owner[p] for p in pages} - {-1}
        assert holders <= set(ring.after[k]), (k, holders, ring.after[k])
        for p in pages:
            owner[p] = k
