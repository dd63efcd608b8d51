"""Every sample once per epoch across a restore, at every position, with and without workers."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import pitstop
from pitstop.state.data import ResumableLoader, ResumableSampler


class Augmented(Dataset[tuple[int, float]]):
    """Index plus a random 'augmentation' drawn from torch and random: exposes RNG use."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, float(torch.rand(())) + random.random()


def _flat(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[int], list[float]]:
    idx = [int(i) for b in batches for i in b[0]]
    aug = [float(a) for b in batches for a in b[1]]
    return idx, aug


@pytest.mark.parametrize("replicas", [1, 2])
def test_sampler_exactly_once_at_every_position(replicas: int) -> None:
    n, bs = 23, 4
    for rank in range(replicas):
        full = ResumableSampler(n, seed=3, num_replicas=replicas, rank=rank).epoch_indices(0)
        for stop in range(len(full) // bs + 2):
            s = ResumableSampler(n, seed=3, num_replicas=replicas, rank=rank)
            loader = DataLoader(range(n), batch_size=bs, sampler=s)
            # the loop takes `stop` batches (islice pulls no more than that), then the job dies
            seen = [i for b in itertools.islice(loader, stop) for i in b.tolist()]
            state = s.state_dict()
            s2 = ResumableSampler(n, seed=3, num_replicas=replicas, rank=rank)
            s2.load_state_dict(state)
            rest = [i for b in DataLoader(range(n), batch_size=bs, sampler=s2) for i in b.tolist()]
            if state["epoch"] == 0:
                assert seen + rest == full, (rank, stop)
                assert s2.epoch == 1 and s2.consumed == 0  # and it moves on to the next epoch
            else:  # the last batch drained the sampler: it had moved on to epoch 1 already
                assert seen == full and rest == s2.epoch_indices(1), (rank, stop)
    if replicas == 2:
        both = ResumableSampler(24, seed=1, num_replicas=2, rank=0).epoch_indices(
            0
        ) + ResumableSampler(24, seed=1, num_replicas=2, rank=1).epoch_indices(0)
        assert sorted(both) == list(range(24))


def test_sampler_epochs_differ_and_are_pure() -> None:
    s = ResumableSampler(50, seed=7)
    e0, e1 = list(s), list(s)
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1
    assert ResumableSampler(50, seed=7).epoch_indices(1) == e1


def test_sampler_refuses_a_different_order() -> None:
    s = ResumableSampler(10, seed=1)
    with pytest.raises(ValueError, match="seed.*data order would differ"):
        ResumableSampler(10, seed=2).load_state_dict(s.state_dict())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("replicas", [1, 2])
def test_loader_resumes_at_every_batch_with_identical_augmentation(
    workers: int, replicas: int
) -> None:
    n, bs = 20, 3
    ds = Augmented(n)
    kwargs = {"num_workers": workers, "seed": 5, "num_replicas": replicas}
    for rank in range(replicas):
        ref_loader = ResumableLoader(ds, bs, rank=rank, **kwargs)
        reference = _flat(list(ref_loader))
        for stop in range(len(ref_loader) + 1):
            loader = ResumableLoader(ds, bs, rank=rank, **kwargs)
            got = list(itertools.islice(loader, stop))
            state = loader.state_dict()
            resumed = ResumableLoader(ds, bs, rank=rank, **kwargs)
            resumed.load_state_dict(state)
            got += list(resumed)
            assert _flat(got) == reference, (workers, rank, stop)
            assert resumed.epoch == 1


def test_loader_does_not_shift_the_training_rng_without_workers() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    list(ResumableLoader(Augmented(8), 2, num_workers=0))
    assert torch.equal(torch.rand(3), expected)


def test_loader_wraps_an_existing_dataloader() -> None:
    dl = DataLoader(Augmented(10), batch_size=4, shuffle=True, num_workers=0)
    loader = ResumableLoader(dl, seed=1)
    assert loader.batch_size == 4 and len(loader) == 3
    idx, _ = _flat(list(loader))
    assert sorted(idx) == list(range(10))
    with pytest.raises(ValueError, match="batch_size"):
        ResumableLoader(Augmented(3), None)


def test_loader_round_trip_through_a_checkpoint(root: str) -> None:
    loader = ResumableLoader(Augmented(12), 4, num_workers=2, seed=9)
    it = iter(loader)
    first = next(it)
    pitstop.save(root, {"data": loader}, step=1)
    rest_expected = _flat(list(it))
    fresh = ResumableLoader(Augmented(12), 4, num_workers=2, seed=9)
    pitstop.load(root, {"data": fresh})
    assert _flat(list(fresh)) == rest_expected
    assert int(first[0][0]) not in rest_expected[0]


def test_loader_stands_in_for_a_dataloader_in_a_scripts_log_lines(root: str) -> None:
    # pytorch/examples' MNIST log line reads len(loader.dataset) and len(loader), and numbers
    # batches with enumerate: after a resume mid-epoch the count goes on, not from 0
    data = Augmented(40)
    loader = ResumableLoader(data, batch_size=8, shuffle=True, seed=1, num_workers=0)
    assert loader.dataset is data and len(loader.dataset) == 40
    assert len(loader) == 5 and len(loader.sampler) == 40 and loader.batch_size == 8
    assert loader.num_workers == 0 and loader.drop_last is False and loader.position == 0
    seen = []
    for i, _ in enumerate(loader, start=loader.position):
        seen.append(i)
        if i == 2:
            break
    assert loader.position == 3
    pitstop.save(root, {"data": loader})
    again = ResumableLoader(Augmented(40), batch_size=8, shuffle=True, seed=1, num_workers=0)
    pitstop.load(root, {"data": again})
    assert again.position == 3 and len(again) == 5  # the whole epoch's length, as DataLoader
    rest = [i for i, _ in enumerate(again, start=again.position)]
    assert seen + rest == [0, 1, 2, 3, 4]
    assert again.position == 0 and again.epoch == 1
    with pytest.raises(AttributeError):
        _ = again.no_such_attribute
