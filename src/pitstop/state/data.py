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
default taken from torch.distributed when it is initialized). A state resumes on
the same number of replicas exactly where each rank was. It also resumes on a
different number: there it continues at the *global* position of the epoch (the
ranks must have saved in lockstep, as a synchronous data-parallel loop does), the
rest of the epoch's order is dealt out over the new ranks, so no sample of the
epoch is repeated or skipped apart from the tail padding or dropping spelled out
in :class:`ResumableSampler`, and the later epochs are those of a fresh sampler
with the new number of replicas.
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


def _shard_len(length: int, num_replicas: int, drop_last: bool) -> int:
    """Indices per rank when ``length`` indices are dealt out over ``num_replicas`` ranks."""
    if drop_last and length % num_replicas:
        return math.ceil((length - num_replicas) / num_replicas)  # == length // num_replicas
    return math.ceil(length / num_replicas)


def _deal(order: list[int], num_replicas: int, rank: int, drop_last: bool) -> list[int]:
    """``rank``'s share of ``order``, as DistributedSampler deals it: padded by repeating
    the beginning of ``order`` to a multiple of ``num_replicas`` (or, with ``drop_last``,
    cut to one), then every ``num_replicas``-th entry from ``rank``."""
    total = _shard_len(len(order), num_replicas, drop_last) * num_replicas
    if not drop_last and total > len(order) and order:
        pad = total - len(order)
        order = order + (order * math.ceil(pad / len(order)))[:pad]
    order = order[:total]
    return order[rank:total:num_replicas]


class ResumableSampler(Sampler[int]):
    """Indices of ``data_source`` (or ``range(n)``), one epoch per ``iter()``, resumable.

    Call sequence: the DataLoader calls ``iter()`` once per epoch; the
    checkpoint calls ``state_dict()`` on the training thread; a restore calls
    ``load_state_dict()`` before the next ``iter()``. When an epoch is exhausted
    the sampler moves to the next one by itself (``set_epoch`` also works).

    Order: the epoch's global order is ``torch.randperm(n)`` seeded with
    ``seed + epoch`` (``range(n)`` without ``shuffle``). Like ``DistributedSampler``
    it is padded to a multiple of ``num_replicas`` by repeating its beginning (with
    ``drop_last``: its tail is cut to a multiple instead), and rank ``r`` takes
    every ``num_replicas``-th entry starting at ``r``.

    State: ``epoch``; ``consumed``, the indices this rank has handed out in the
    epoch; ``start``, the global position at which the epoch's current dealing
    began (0, except in an epoch resumed on a different number of replicas);
    ``global_consumed`` = ``start + consumed * num_replicas``, how much of the
    epoch's global order the ranks handed out together if they are in lockstep;
    and ``seed``, ``n``, ``shuffle``, ``num_replicas``, ``rank``, ``drop_last``.
    ``load_state_dict`` refuses a different ``seed``, ``n`` or ``shuffle`` (the
    order would differ). A state without ``start``/``global_consumed`` (from an
    older pitstop) is one with ``start == 0``.

    Same number of replicas: each rank loads its own state and continues its own
    shard exactly where it was.

    Different number of replicas (a state saved on N ranks, loaded on M): the N
    ranks must have saved in lockstep, every rank having handed out the same
    number of indices of the epoch. Then every rank's state holds the same global
    position, and each of the M ranks may load any of them (say rank ``r mod N``'s).
    Lockstep cannot be checked from one rank's state: a state from ranks that were
    not in lockstep resumes at the position of the rank whose state was loaded.

    * If the N ranks had handed out their whole (non-empty) shards of the epoch,
      the resumed sampler starts the next epoch: that epoch was complete, with
      the N-rank padding (repeats) or dropped tail it had.
    * Otherwise they had handed out exactly ``order[:g]``, ``g = global_consumed``,
      and the M ranks deal out the rest, ``order[g:]``, like DistributedSampler:
      rank ``r`` takes ``order[g + r]``, ``order[g + r + M]``, ... If ``n - g`` is not
      a multiple of M, the rest is padded by repeating its own beginning (up to
      ``M - 1`` indices handed out twice in the epoch) or, with this sampler's
      ``drop_last``, its last ``(n - g) % M`` indices are left out of the epoch.
      Apart from that, across the restart every index of the epoch is handed
      out exactly once. ``len()`` is the length of this rank's resumed shard.
    * The following epochs are exactly those of a fresh M-replica sampler.
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
        self.num_samples = _shard_len(n, self.num_replicas, drop_last)  # per rank, a whole epoch
        self.epoch = 0
        self.consumed = 0
        self.start = 0  # global position where this epoch's dealing began (a resumed epoch)

    def __len__(self) -> int:
        return self.shard_len()

    def shard_len(self) -> int:
        """The number of indices of this rank's shard of the current epoch."""
        return self._len_from(self.start)

    def _len_from(self, start: int) -> int:
        """This rank's shard length when this world deals the epoch's order from ``start``."""
        if start == 0:
            return self.num_samples
        return _shard_len(self.n - start, self.num_replicas, self.drop_last)

    def _order(self, epoch: int) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            return torch.randperm(self.n, generator=g).tolist()
        return list(range(self.n))

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices of ``epoch``, in order: a pure function of (seed, epoch).

        That is the epoch from its beginning; in an epoch resumed on a different
        number of replicas, ``iter()`` deals out the rest of the order instead.
        """
        return _deal(self._order(epoch), self.num_replicas, self.rank, self.drop_last)

    def shard_indices(self) -> list[int]:
        """This rank's shard of the current epoch (a resumed one, or ``epoch_indices``)."""
        if self.start == 0:
            return self.epoch_indices(self.epoch)
        order = self._order(self.epoch)[self.start :]
        return _deal(order, self.num_replicas, self.rank, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (a no-op for the epoch already under way)."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self.start = epoch, 0, 0

    def _next_epoch(self) -> None:
        self.epoch, self.consumed, self.start = self.epoch + 1, 0, 0

    def __iter__(self) -> Iterator[int]:
        indices = self.shard_indices()
        while self.consumed < len(indices):
            index = indices[self.consumed]
            self.consumed += 1
            yield index
        self._next_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "n": self.n,
            "shuffle": self.shuffle, "num_replicas": self.num_replicas, "rank": self.rank,
            "drop_last": self.drop_last, "start": self.start,
            "global_consumed": self.start + self.consumed * self.num_replicas,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "n", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler {key} is {getattr(self, key)!r} but the checkpoint has {state[key]!r}: "
                    "the data order would differ from the interrupted run"
                )
        replicas = int(state["num_replicas"])
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        start = int(state.get("start", 0))  # absent in states of older versions
        if replicas < 1:
            raise ValueError(f"sampler checkpoint has num_replicas {replicas}")
        if not 0 <= start < max(self.n, 1):
            raise ValueError(f"sampler start {start} is outside the epoch (n={self.n})")
        if "global_consumed" in state and state["global_consumed"] != start + consumed * replicas:
            raise ValueError(
                f"sampler checkpoint is inconsistent: global_consumed {state['global_consumed']} "
                f"but start {start} + consumed {consumed} * num_replicas {replicas}"
            )
        if replicas == self.num_replicas:  # each rank continues its own shard
            saved_len = self._len_from(start)
        else:
            saved_drop_last = bool(state.get("drop_last", self.drop_last))
            saved_len = _shard_len(self.n - start, replicas, saved_drop_last)
        if not 0 <= consumed <= saved_len:
            raise ValueError(f"sampler position {consumed} is outside the epoch ({saved_len})")
        if replicas == self.num_replicas:
            self.epoch, self.consumed, self.start = epoch, consumed, start
        elif 0 < consumed == saved_len:  # every rank had handed out its whole shard
            self.epoch = epoch
            self._next_epoch()
        else:  # deal the rest of the epoch's order over this world from the global position
            self.epoch, self.consumed, self.start = epoch, 0, start + consumed * replicas


class _Batch(list):
    """A batch of indices that carries the seed its worker uses for augmentation."""

    seed: int = 0

    def __reduce__(self) -> Any:
        return (_make_batch, (list(self), self.seed))


def _make_batch(items: list[int], seed: int) -> _Batch:
    batch = _Batch(items)
    batch.seed = seed
    return batch


def batch_seed(seed: int, epoch: int, batch: int, rank: int, start: int = 0) -> int:
    """The augmentation seed of one batch: a pure function of its position.

    ``start`` is the sampler's: batch ``batch`` of a shard dealt from global position
    ``start`` (an epoch resumed on a different number of replicas) is another batch.
    """
    key = f"{seed}/{epoch}/{batch}/{rank}" + (f"/{start}" if start else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _BatchSampler(Sampler[list[int]]):
    """Batches of a ResumableSampler's epoch, starting at its saved position, each tagged with its seed."""

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = self.sampler.shard_len()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def delivered(self) -> int:
        """Batches of the epoch already handed out (a partial last batch counts as delivered)."""
        return -(-self.sampler.consumed // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        indices = s.shard_indices()
        for b in range(self.delivered(), len(self)):
            items = indices[b * self.batch_size : (b + 1) * self.batch_size]
            yield _make_batch(items, batch_seed(s.seed, s.epoch, b, s.rank, s.start))


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
    ``loader.epoch`` is the epoch the next ``for`` will run and ``loader.position`` the index
    of the next batch in it, so a loop that numbers its batches keeps counting across a
    resume: ``for i, batch in enumerate(loader, start=loader.position)``.

    It stands in for the DataLoader: ``len(loader)`` is the number of batches of an epoch
    (all of them, also after a resume mid-epoch), ``loader.dataset`` the dataset given,
    ``loader.sampler`` the :class:`ResumableSampler` (``len(loader.sampler)``: samples per
    epoch on this rank), ``loader.batch_size`` and ``loader.drop_last`` what it batches
    with, and the other DataLoader attributes (``num_workers``, ``pin_memory``,
    ``collate_fn``, ``generator``, ...) are those of the DataLoader inside.

    State: ``sampler`` (the :class:`ResumableSampler` state of the index order;
    the loader's sampler pads, never drops), ``batch_size`` (per rank),
    ``drop_last`` (of batches) and ``batches``, the batches this rank delivered
    in the epoch (informational).

    On a different number of replicas (N saved, M resuming) the loader resumes
    like the sampler, at the global position ``batches * batch_size * N`` of the
    epoch (plus the sampler's ``start`` in an epoch that was itself resumed): the N ranks must have delivered the same number of batches (lockstep),
    and the batch size per rank must be the same (a ValueError names both
    otherwise). The rest of the epoch's order is dealt out over the M ranks
    (padded by repeating its beginning to a multiple of M) and each rank batches
    its share; with ``drop_last`` each rank's last partial batch of that share is
    dropped. If the N ranks had delivered all their batches of the epoch (with
    ``drop_last``: all their full batches), the resumed loader starts the next
    epoch. The epochs after that are those of a fresh M-replica loader.
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
        self._seeded = _SeededDataset(dataset)
        self.loader = DataLoader(self._seeded, batch_sampler=self._batches, **loader_kwargs)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def position(self) -> int:
        """The index in the epoch of the next batch this loader delivers (0 at an epoch's start)."""
        return self._batches.delivered()

    @property
    def dataset(self) -> Any:
        return self._seeded.dataset

    @property
    def drop_last(self) -> bool:
        return self._batches.drop_last

    def __len__(self) -> int:
        return len(self._batches)

    def __getattr__(self, name: str) -> Any:
        # only reached for names this class lacks: the DataLoader's own attributes
        if name.startswith("__") or name in ("loader", "sampler", "_batches", "_seeded"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        epoch, shard_len = s.epoch, s.shard_len()
        for batch in self.loader:
            s.consumed = min(s.consumed + self.batch_size, shard_len)  # handed to the loop now
            yield batch
            if s.epoch != epoch:  # pragma: no cover - set_epoch called mid-epoch
                return
        s.epoch, s.consumed, s.start = epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        s = self.sampler
        return {
            "sampler": s.state_dict(), "batch_size": self.batch_size,
            "drop_last": self._batches.drop_last,
            "batches": self.position,  # delivered by this rank, this epoch
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["batch_size"] != self.batch_size:
            raise ValueError(
                f"loader batch_size is {self.batch_size} but the checkpoint has "
                f"{state['batch_size']}: the batch size per rank must be the same to resume"
            )
        sampler_state = dict(state["sampler"])
        replicas = sampler_state["num_replicas"]
        saved_drop_last = state.get("drop_last", self._batches.drop_last)
        if replicas != self.sampler.num_replicas and saved_drop_last:
            # The saving loader dropped its ranks' last partial batches: if it had delivered
            # all its full batches, its epoch was over, whatever indices were left.
            start = int(sampler_state.get("start", 0))
            padded = not sampler_state.get("drop_last", False)  # the loader's sampler pads
            saved_len = _shard_len(self.sampler.n - start, int(replicas), not padded)
            consumed = int(sampler_state["consumed"])
            if (
                0 < consumed < saved_len
                and consumed >= saved_len // self.batch_size * self.batch_size
            ):
                sampler_state["consumed"] = saved_len
                sampler_state.pop("global_consumed", None)
        self.sampler.load_state_dict(sampler_state)
