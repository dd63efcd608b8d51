"""Data position: every sample once per epoch across restarts, and reproducible augmentation.

Two tools, for two situations:

* :class:`ResumableSampler` - a ``Sampler`` whose order is a pure function of
  ``(seed, epoch)`` and which records how many indices of the epoch it has
  handed out. With ``DataLoader(num_workers=0)`` nothing is fetched ahead, so
  that count is exactly what the loop consumed: put the sampler in the state and
  a restore continues with the remaining indices of the epoch. Augmentation in
  the main process draws from the global generators, which ``RNGState`` restores.

* :class:`ResumableLoader` - with worker processes the loader fetches batches
  ahead of the loop, so a sampler cannot know what the loop consumed. The
  loader wrapper counts the batches it *delivered to the loop*, and restores
  exactly there. It also makes augmentation in workers reproducible: before a
  worker builds batch ``b`` of epoch ``e``, it seeds ``random``, NumPy and torch
  from ``(seed, epoch, b)``, so a batch's random crops and flips do not depend on
  which worker built it, how many workers there are, or whether the run was
  restarted (the dataset sees this through ``__getitems__``, which DataLoader
  calls with the whole batch).

Both shard like ``DistributedSampler`` with ``num_replicas`` and ``rank`` (by
default taken from torch.distributed when it is initialized).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ResumableLoader", "ResumableSampler"]


def _world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        dist = torch.distributed
        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")
    return num_replicas, rank


class ResumableSampler(Sampler[int]):
    """Indices of ``data_source`` (or ``range(n)``), one epoch per ``iter()``, resumable.

    Call sequence: the DataLoader calls ``iter()`` once per epoch; the
    checkpoint calls ``state_dict()`` on the training thread; a restore calls
    ``load_state_dict()`` before the next ``iter()``. When an epoch is exhausted
    the sampler moves to the next one by itself (``set_epoch`` also works).
    """

    def __init__(
        self,
        data_source_or_len: Sized | int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ) -> None:
        n = data_source_or_len if isinstance(data_source_or_len, int) else len(data_source_or_len)
        if n < 0:
            raise ValueError(f"data source length must be >= 0, got {n}")
        self.n, self.shuffle, self.seed, self.drop_last = n, shuffle, seed, drop_last
        self.num_replicas, self.rank = _world(num_replicas, rank)
        if drop_last and n % self.num_replicas:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.epoch = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in order: a pure function of (seed, epoch)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.num_replicas
        if not self.drop_last and total > len(order) and order:
            pad = total - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        order = order[:total]
        return order[self.rank : total : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a no-op for the epoch already under way)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_indices(self.epoch)
        while self.consumed < len(indices):
            index = indices[self.consumed]
            self.consumed += 1
            yield index
        self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "n": self.n,
            "shuffle": self.shuffle, "num_replicas": self.num_replicas, "rank": self.rank,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "n", "shuffle", "num_replicas"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler {key} is {getattr(self, key)!r} but the checkpoint has {state[key]!r}: "
                    "the data order would differ from the interrupted run"
                )
        if not 0 <= state["consumed"] <= self.num_samples:
            raise ValueError(
                f"sampler position {state['consumed']} is outside the epoch ({self.num_samples})"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


class _Batch(list):
    """A batch of indices that carries the seed its worker uses for augmentation."""

    seed: int = 0

    def __reduce__(self) -> Any:
        return (_make_batch, (list(self), self.seed))


def _make_batch(items: list[int], seed: int) -> _Batch:
    batch = _Batch(items)
    batch.seed = seed
    return batch


def batch_seed(seed: int, epoch: int, batch: int, rank: int) -> int:
    """The augmentation seed of one batch: a pure function of its position."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{batch}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _BatchSampler(Sampler[list[int]]):
    """Batches of a ResumableSampler's epoch, starting at its saved position, each tagged with its seed."""

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = self.sampler.num_samples
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        indices = s.epoch_indices(s.epoch)
        first = -(-s.consumed // self.batch_size)  # a partial last batch counts as delivered
        for b in range(first, len(self)):
            items = indices[b * self.batch_size : (b + 1) * self.batch_size]
            yield _make_batch(items, batch_seed(s.seed, s.epoch, b, s.rank))


class _SeededDataset(Dataset[Any]):
    """Builds each batch under generators seeded from the batch's position.

    In a worker process the worker's own generators are simply reseeded; in the
    main process (``num_workers=0``) the training process's generators are saved
    and put back afterwards, so loading data does not shift them.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        seed = getattr(batch, "seed", None)
        if seed is None:
            return [self.dataset[i] for i in batch]
        if torch.utils.data.get_worker_info() is not None:
            _seed_all(seed)
            return [self.dataset[i] for i in batch]
        py, np_state = random.getstate(), _numpy_state()
        with torch.random.fork_rng(devices=[]):
            _seed_all(seed, main_process=True)
            items = [self.dataset[i] for i in batch]
        random.setstate(py)
        _set_numpy_state(np_state)
        return items


def _seed_all(seed: int, *, main_process: bool = False) -> None:
    random.seed(seed)
    if main_process:  # only the CPU generator: CUDA streams (dropout on GPU) stay untouched
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % (1 << 32))


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy


def _numpy_state() -> Any:
    np = _numpy()
    return np.random.get_state() if np is not None else None


def _set_numpy_state(state: Any) -> None:
    np = _numpy()
    if np is not None and state is not None:
        np.random.set_state(state)


_LOADER_KWARGS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
    "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order",
)  # fmt: skip


class ResumableLoader:
    """A DataLoader that restarts at the batch the training loop was at, with workers too.

    ``ResumableLoader(dataset, batch_size=64, shuffle=True, seed=0, num_workers=2)``
    takes a dataset and DataLoader keyword arguments; ``ResumableLoader(loader)``
    takes an existing DataLoader and keeps its settings (its sampler and
    batch sampler are replaced; shuffling follows whether it had a RandomSampler).

    Put it in the state. Call sequence (training thread): ``for batch in loader``
    once per epoch; ``state_dict()`` counts the batches handed to the loop so
    far (not those that workers fetched ahead); ``load_state_dict()`` before the
    next ``for`` makes that loop start at the next undelivered batch.
    ``loader.epoch`` is the epoch the next ``for`` will run.
    """

    def __init__(
        self,
        dataset_or_loader: Any,
        batch_size: int | None = None,
        *,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if isinstance(dataset_or_loader, DataLoader):
            loader = dataset_or_loader
            dataset = loader.dataset
            batch_size = batch_size if batch_size is not None else loader.batch_size
            if shuffle is None:
                shuffle = isinstance(loader.sampler, torch.utils.data.RandomSampler)
            drop_last = loader.drop_last if drop_last is None else drop_last
            inherited = {k: getattr(loader, k) for k in _LOADER_KWARGS if hasattr(loader, k)}
            if inherited.get("num_workers", 0) == 0:
                inherited.pop("prefetch_factor", None)
            inherited.update(loader_kwargs)
            loader_kwargs = inherited
        else:
            dataset = dataset_or_loader
        if batch_size is None or batch_size < 1:
            raise ValueError(
                "ResumableLoader needs a batch_size >= 1 (batches must have a fixed size to resume)"
            )
        self.batch_size = batch_size
        self.sampler = ResumableSampler(
            len(dataset),  # type: ignore[arg-type]
            shuffle=True if shuffle is None else shuffle, seed=seed,
            num_replicas=num_replicas, rank=rank, drop_last=False,
        )  # fmt: skip
        self._batches = _BatchSampler(self.sampler, batch_size, bool(drop_last))
        # DataLoader draws a base seed for its workers at every iter(); from the global
        # generator that would shift the training RNG on a resume mid-epoch. Batches are
        # seeded by position instead, so a private generator is all it needs.
        loader_kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        if loader_kwargs["generator"] is None:
            loader_kwargs["generator"] = torch.Generator().manual_seed(seed)
        if loader_kwargs.get("in_order") is False:  # delivered batch k must be batch k
            raise ValueError(
                "ResumableLoader needs in_order=True: out-of-order delivery cannot be resumed"
            )
        self.loader = DataLoader(
            _SeededDataset(dataset), batch_sampler=self._batches, **loader_kwargs
        )

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self._batches)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        epoch = s.epoch
        for batch in self.loader:
            s.consumed = min(s.consumed + self.batch_size, s.num_samples)  # handed to the loop now
            yield batch
            if s.epoch != epoch:  # pragma: no cover - set_epoch called mid-epoch
                return
        s.epoch, s.consumed = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["batch_size"] != self.batch_size:
            raise ValueError(
                f"loader batch_size is {self.batch_size} but the checkpoint has {state['batch_size']}"
            )
        self.sampler.load_state_dict(state["sampler"])
