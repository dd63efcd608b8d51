"""Resuming on a different number of replicas: the epoch continues at its global position.

N ranks save in lockstep, M ranks load (rank r the state of rank r mod N, or of any
rank) and finish the epoch: what the N ranks took before plus what the M ranks take
after is the epoch's order once, apart from the documented tail padding (repeats)
or dropping; the epoch after that is a fresh M-replica epoch. The reference is
torch's own ``DistributedSampler``, not pitstop's code.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from pitstop.state.data import ResumableLoader, ResumableSampler

PAIRS = [(2, 4), (4, 2), (2, 1), (1, 2), (3, 2)]
SEED = 11


def _order(n: int, epoch: int, seed: int = SEED) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _dist(
    items: list[int],
    replicas: int,
    rank: int,
    drop_last: bool,
    *,
    shuffle: bool = False,
    epoch: int = 0,
) -> list[int]:
    """``rank``'s share of ``items`` as torch's DistributedSampler deals it."""
    ds = DistributedSampler(
        range(len(items)), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=SEED,
        drop_last=drop_last,
    )  # fmt: skip
    ds.set_epoch(epoch)
    return [items[i] for i in ds]


def _fresh_epoch(n: int, replicas: int, rank: int, drop_last: bool, epoch: int) -> list[int]:
    return _dist(list(range(n)), replicas, rank, drop_last, shuffle=True, epoch=epoch)


def _check_union(
    order: list[int], before: list[int], after: list[int], pad: int, drop: int
) -> None:
    """before + after is ``order`` once, plus ``pad`` repeats, minus ``drop`` tail entries."""
    union = Counter(before) + Counter(after)
    repeated, missing = union - Counter(order), Counter(order) - union
    assert sum(repeated.values()) == pad, (repeated, pad)
    assert sum(missing.values()) == drop, (missing, drop)
    if drop:  # only the tail of the order is left out
        assert missing == Counter(order[len(order) - drop :])


def _positions(shard: int) -> list[int | None]:
    """Indices each rank takes before the save: start, early, middle, near the end, at the
    end (the epoch's generator not exhausted), and None: the epoch was run to exhaustion."""
    return [*sorted({0, min(1, shard), shard // 2, max(shard - 1, 0), shard}), None]


# ---------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("n", [23, 24])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("old", "new"), PAIRS)
@pytest.mark.parametrize("source", ["mod", "rank0"])
def test_sampler_reshards_at_the_global_position(
    old: int, new: int, drop_last: bool, n: int, source: str
) -> None:
    epoch = 1
    order = _order(n, epoch)
    shard = len(ResumableSampler(n, seed=SEED, num_replicas=old, rank=0, drop_last=drop_last))
    for k in _positions(shard):
        before: list[int] = []
        states = []
        for r in range(old):
            s = ResumableSampler(n, seed=SEED, num_replicas=old, rank=r, drop_last=drop_last)
            s.set_epoch(epoch)
            before += list(s) if k is None else list(itertools.islice(iter(s), k))
            states.append(s.state_dict())
        assert len({st["global_consumed"] for st in states}) == 1  # lockstep: one position
        after: list[int] = []
        for q in range(new):
            s2 = ResumableSampler(n, seed=SEED, num_replicas=new, rank=q, drop_last=drop_last)
            s2.load_state_dict(states[q % old if source == "mod" else 0])
            if s2.epoch == epoch:
                after += list(s2)
            assert s2.epoch == epoch + 1 and s2.consumed == 0 and s2.start == 0
            # the next epoch is exactly what a fresh M-replica sampler produces
            nxt = list(s2)
            assert nxt == _fresh_epoch(n, new, q, drop_last, epoch + 1), (k, q)
            assert nxt == ResumableSampler(
                n, seed=SEED, num_replicas=new, rank=q, drop_last=drop_last
            ).epoch_indices(epoch + 1)
        if k is None or k == shard:  # the N-rank epoch was complete: nothing is left of it
            assert after == []
            full = [i for r in range(old) for i in _fresh_epoch(n, old, r, drop_last, epoch)]
            assert Counter(before) == Counter(full)
            continue
        g = k * old
        assert Counter(before) == Counter(order[:g]), k  # the N ranks took a prefix of the order
        rest = n - g
        pad = 0 if drop_last else -rest % new
        _check_union(order, before, after, pad, rest % new if drop_last else 0)
        expected = [i for q in range(new) for i in _dist(order[g:], new, q, drop_last)]
        assert Counter(after) == Counter(expected), k
        if not pad:
            assert not set(before) & set(after)


def test_sampler_works_under_a_dataloader_after_a_reshard() -> None:
    n, bs = 23, 3
    loaders = [ResumableSampler(n, seed=SEED, num_replicas=2, rank=r) for r in range(2)]
    before = [
        i
        for s in loaders
        for b in itertools.islice(
            torch.utils.data.DataLoader(range(n), batch_size=bs, sampler=s), 2
        )
        for i in b.tolist()
    ]
    after = []
    for q in range(3):
        s2 = ResumableSampler(n, seed=SEED, num_replicas=3, rank=q)
        s2.load_state_dict(loaders[q % 2].state_dict())
        dl = torch.utils.data.DataLoader(range(n), batch_size=bs, sampler=s2)
        assert len(s2) == len(_dist(_order(n, 0)[12:], 3, q, False)) == 4
        after += [i for b in dl for i in b.tolist()]
    _check_union(_order(n, 0), before, after, pad=1, drop=0)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_reshards_twice_and_a_resumed_epoch_resumes_exactly(drop_last: bool) -> None:
    """2 -> 3 (mid-epoch) -> 3 again: identical to the uninterrupted 3-rank resumed epoch;
    2 -> 3 -> 2: still the epoch's order once."""
    n = 41
    order = _order(n, 0)
    first = [
        ResumableSampler(n, seed=SEED, num_replicas=2, rank=r, drop_last=drop_last)
        for r in range(2)
    ]
    before = [i for s in first for i in itertools.islice(iter(s), 5)]
    mid = []
    for q in range(3):
        s = ResumableSampler(n, seed=SEED, num_replicas=3, rank=q, drop_last=drop_last)
        s.load_state_dict(first[q % 2].state_dict())
        mid.append(s)
    assert [s.start for s in mid] == [10, 10, 10]
    assert all(len(s) == (10 if drop_last else 11) for s in mid)  # 31 left for 3 ranks
    uninterrupted = []
    for s in mid:
        twin = ResumableSampler(n, seed=SEED, num_replicas=3, rank=s.rank, drop_last=drop_last)
        twin.load_state_dict(s.state_dict())
        uninterrupted.append(list(twin))
    middle = [i for s in mid for i in itertools.islice(iter(s), 4)]
    assert middle == [i for u in uninterrupted for i in u[:4]]
    states = [s.state_dict() for s in mid]
    assert {st["global_consumed"] for st in states} == {10 + 4 * 3}
    for q in range(3):  # same world: this rank's own state, bit-identical
        again = ResumableSampler(n, seed=SEED, num_replicas=3, rank=q, drop_last=drop_last)
        again.load_state_dict(states[q])
        assert uninterrupted[q][:4] + list(again) == uninterrupted[q]
        assert list(again) == _fresh_epoch(n, 3, q, drop_last, 1)
    after = []
    for q in range(2):  # and on to 2 ranks again
        s = ResumableSampler(n, seed=SEED, num_replicas=2, rank=q, drop_last=drop_last)
        s.load_state_dict(states[q])
        assert s.start == 22
        after += list(s)
        assert list(s) == _fresh_epoch(n, 2, q, drop_last, 1)
    assert Counter(before + middle) == Counter(order[:22])
    _check_union(
        order, before + middle, after, pad=0 if drop_last else 1, drop=1 if drop_last else 0
    )


def test_sampler_state_of_an_older_version_still_loads() -> None:
    s = ResumableSampler(23, seed=SEED, num_replicas=2, rank=1)
    taken = list(itertools.islice(iter(s), 4))
    old_state = {
        k: v
        for k, v in s.state_dict().items()
        if k not in ("start", "global_consumed", "drop_last")
    }
    same = ResumableSampler(23, seed=SEED, num_replicas=2, rank=1)
    same.load_state_dict(old_state)
    assert taken + list(same) == same.epoch_indices(0)
    other = ResumableSampler(23, seed=SEED, num_replicas=4, rank=0)
    other.load_state_dict(old_state)  # start 0: the global position is consumed * num_replicas
    assert other.start == 8 and list(other) == _dist(_order(23, 0)[8:], 4, 0, False)


def test_sampler_reshard_refuses_what_cannot_be_resumed() -> None:
    state = ResumableSampler(20, seed=1, num_replicas=2, rank=0).state_dict()
    for kwargs, key in (({"seed": 2}, "seed"), ({"shuffle": False}, "shuffle")):
        with pytest.raises(ValueError, match=f"{key}.*data order would differ"):
            ResumableSampler(20, num_replicas=3, rank=0, **{"seed": 1, **kwargs}).load_state_dict(
                state
            )
    with pytest.raises(ValueError, match="n is 21.*20.*data order would differ"):
        ResumableSampler(21, seed=1, num_replicas=3, rank=0).load_state_dict(state)
    bad = dict(state, consumed=3)  # global_consumed still says 0
    with pytest.raises(ValueError, match="inconsistent.*global_consumed 0"):
        ResumableSampler(20, seed=1, num_replicas=3, rank=0).load_state_dict(bad)
    with pytest.raises(ValueError, match="position 11 is outside the epoch"):
        ResumableSampler(20, seed=1, num_replicas=3, rank=0).load_state_dict(
            dict(state, consumed=11, global_consumed=22)
        )
    with pytest.raises(ValueError, match="start 20 is outside the epoch"):
        ResumableSampler(20, seed=1, num_replicas=3, rank=0).load_state_dict(
            dict(state, start=20, global_consumed=20)
        )


# ----------------------------------------------------------------------------- loader


def _ids(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b[0]]


def _loader(
    n: int, bs: int, replicas: int, rank: int, drop_last: bool, **kw: Any
) -> ResumableLoader:
    ds = TensorDataset(torch.arange(n))
    return ResumableLoader(
        ds, bs, shuffle=True, seed=SEED, num_replicas=replicas, rank=rank, drop_last=drop_last,
        num_workers=0, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_loader_reshards_at_the_global_position(old: int, new: int, drop_last: bool) -> None:
    n, bs, epoch = 29, 3, 2
    order = _order(n, epoch)
    batches = len(_loader(n, bs, old, 0, drop_last))
    for b in _positions(batches):
        before: list[int] = []
        states = []
        for r in range(old):
            loader = _loader(n, bs, old, r, drop_last)
            loader.set_epoch(epoch)
            before += _ids(list(loader) if b is None else list(itertools.islice(loader, b)))
            states.append(loader.state_dict())
        after: list[int] = []
        for q in range(new):
            resumed = _loader(n, bs, new, q, drop_last)
            resumed.load_state_dict(states[q % old])
            if resumed.epoch == epoch:
                after += _ids(list(resumed))
            assert resumed.epoch == epoch + 1
            fresh = _loader(n, bs, new, q, drop_last)
            fresh.set_epoch(epoch + 1)
            nxt = _ids(list(resumed))
            assert nxt == _ids(list(fresh)), (b, q)
            expected = _fresh_epoch(n, new, q, False, epoch + 1)
            if drop_last:
                expected = expected[: len(expected) // bs * bs]
            assert nxt == expected
        if b is None or b == batches:  # the N-rank epoch was complete
            assert after == []
            continue
        g = b * bs * old
        assert g < n and Counter(before) == Counter(order[:g])
        expected_after = []
        for q in range(new):
            share = _dist(order[g:], new, q, False)
            expected_after += share[: len(share) // bs * bs] if drop_last else share
        assert Counter(after) == Counter(expected_after), b
        pad = -(n - g) % new
        if drop_last:
            union = Counter(before) + Counter(after)
            assert not union - Counter(order) - Counter(order[g : g + pad])  # repeats: padding only
            assert sum((Counter(order) - union).values()) < new * bs  # dropped: partial batches
        else:
            _check_union(order, before, after, pad, 0)


def test_loader_reshard_twice_is_exact_on_the_same_world_and_reproducible() -> None:
    """2 -> 3 ranks, then a save mid-way of the resumed epoch and a restore on 3 ranks:
    the batches, augmentation included, are those of the uninterrupted resumed epoch."""

    class Augmented(Dataset[tuple[int, float]]):
        def __len__(self) -> int:
            return 31

        def __getitem__(self, i: int) -> tuple[int, float]:
            return i, float(torch.rand(())) + random.random()

    def make(replicas: int, rank: int) -> ResumableLoader:
        return ResumableLoader(
            Augmented(), 2, seed=SEED, num_replicas=replicas, rank=rank, num_workers=0
        )

    first = [make(2, r) for r in range(2)]
    for loader in first:
        list(itertools.islice(loader, 3))
    states = [loader.state_dict() for loader in first]
    assert states[0]["batches"] == 3 and states[0]["sampler"]["global_consumed"] == 12
    for q in range(3):
        reference = make(3, q)
        reference.load_state_dict(states[q % 2])
        assert reference.sampler.start == 12 and len(reference) == 4  # 19 left: 7 per rank
        ref = list(reference)
        for stop in range(len(ref) + 1):
            a = make(3, q)
            a.load_state_dict(states[q % 2])
            got = list(itertools.islice(a, stop))
            b = make(3, q)
            b.load_state_dict(a.state_dict())
            got += list(b)
            assert [(x[0].tolist(), x[1].tolist()) for x in got] == [
                (x[0].tolist(), x[1].tolist()) for x in ref
            ], (q, stop)
            assert b.epoch == 1


def test_loader_reshard_needs_the_same_batch_size() -> None:
    state = _loader(20, 4, 2, 0, False).state_dict()
    with pytest.raises(ValueError, match=r"batch_size is 5 but the checkpoint has 4"):
        _loader(20, 5, 3, 0, False).load_state_dict(state)
    with pytest.raises(ValueError, match="seed.*data order would differ"):
        ResumableLoader(
            TensorDataset(torch.arange(20)), 4, seed=0, num_replicas=3, rank=0
        ).load_state_dict(state)
