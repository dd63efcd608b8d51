"""Ranks talking to each other for pitstop, never on the training process group.

Call sequence::

    group = make_group(timeout_secs)     # every rank, training thread, in the same order
                                         #   (collective: a gloo side group and a store prefix)
    group.all_gather(obj, phase)         # training thread: plan exchange, restore agreement
    vote = group.vote(values, phase)     # training thread: small integers, element-wise max
    vote.result()                        #   over the ranks, in flight until asked for
    group.broadcast_tensor(t, src)       # training thread: restored bytes from their reader
    group.post(key, data)                # persist thread: this rank's part of a save
    group.collect(key, phase)            # persist thread, coordinator: every rank's part
    group.read(key, phase)               # persist thread: the coordinator's word
    group.channel()                      # the same for one more thread (own connection)
    group.close()

Collectives of the training thread run on a gloo group of pitstop's own (so they work
beside NCCL and never interleave with the training's collectives); the background
threads use only the job's key-value store. Every wait is bounded by
``timeout_secs``: a rank that does not arrive is a DistributedCheckpointError naming
the phase (and the ranks, where the store can tell), never a hang.
Without torch.distributed (or with one rank) :class:`Group` does all this in-process.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pitstop.errors import DistributedCheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["Group", "StoreGroup", "Vote", "make_group"]

_KEPT_POSTS = 64  # one process reads a word right after posting it, or never (a commit's)
_BROADCAST_ELEMENTS = 64 << 20  # bytes of the uint8 buffers restore broadcasts, per call
_CLOSE_VOTE_SECS = 5.0  # close() waits this long at most for a vote still in flight


class Vote:
    """A vote in flight: ``result()`` is the element-wise maximum of every rank's values
    (the same list on every rank). One process: the values themselves."""

    def __init__(self, values: Sequence[int]) -> None:
        self._values = [int(v) for v in values]

    def result(self, timeout_secs: float | None = None) -> list[int]:
        """The result, once every rank voted (waiting at most ``timeout_secs``, by default
        the group's timeout: then DistributedCheckpointError)."""
        return list(self._values)


class Group:
    """One process: every collective is the identity."""

    rank = 0
    size = 1
    timeout_secs = 0.0

    def __init__(self) -> None:
        self._posts: dict[str, bytes] = {}

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any, phase: str) -> Any:
        return obj

    def vote(self, values: Sequence[int], phase: str) -> Vote:
        """Start an element-wise max of small non-negative integers over the ranks and
        return at once; every rank calls it with as many values, in the same order as its
        other collectives. Far cheaper than :meth:`all_gather` (one small all-reduce, no
        pickles), and the wait can come an iteration later, when the ranks have long
        arrived."""
        return Vote(values)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Rank ``src``'s bytes of a contiguous CPU ``tensor`` into every rank's (in place)."""
        if src != self.rank:
            raise ValueError(f"one process has no rank {src}")

    def post(self, key: str, data: bytes) -> None:
        self._posts[key] = data
        while len(self._posts) > _KEPT_POSTS:  # words nobody reads in one process go
            del self._posts[next(iter(self._posts))]

    def channel(self) -> Group:
        """This group for one more background thread (the flush): the store calls of two
        threads must not share a connection, where one thread's wait blocks the other's (one
        process: a mailbox of its own)."""
        return Group()

    def collect(self, key: str, phase: str) -> list[bytes]:
        return [self._posts.pop(f"{key}/0")]

    def read(self, key: str, phase: str) -> bytes:
        return self._posts.pop(key)

    def close(self) -> None:
        self._posts.clear()


class StoreGroup(Group):
    """Several ranks under torch.distributed (see the module docstring)."""

    def __init__(self, timeout_secs: float, store: Any = None) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        super().__init__()
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.timeout_secs = timeout_secs
        self._timeout = datetime.timedelta(seconds=timeout_secs)
        try:
            self._pg = dist.new_group(backend="gloo", timeout=self._timeout)
            token = [uuid.uuid4().hex if self.rank == 0 else None]
            dist.broadcast_object_list(token, src=0, group=self._pg)
        except RuntimeError as e:
            raise DistributedCheckpointError(
                f"could not set up pitstop's group of {self.size} ranks: {e}",
                rank=self.rank, phase="plan",
            ) from e  # fmt: skip
        base = store if store is not None else c10d._get_default_store()
        self._store = dist.PrefixStore(f"pitstop/{token[0]}/", base)
        self._votes: list[_StoreVote] = []  # in flight: close() lets them finish

    def all_gather(self, obj: Any, phase: str) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, obj, group=self._pg)
        except RuntimeError as e:  # gloo's timeout or a peer that went away
            raise self._missed(phase, e) from e
        return out

    def broadcast(self, obj: Any, phase: str) -> Any:
        return self.all_gather(obj if self.rank == 0 else None, phase)[0]

    def vote(self, values: Sequence[int], phase: str) -> Vote:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([int(v) for v in values], dtype=torch.int64)
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._pg, async_op=True)
        except RuntimeError as e:
            raise self._missed(phase, e) from e
        vote = _StoreVote(self, work, tensor, phase)
        self._votes = [v for v in self._votes if not v.done] + [vote]
        return vote

    def _missed(self, phase: str, e: BaseException) -> DistributedCheckpointError:
        return DistributedCheckpointError(
            f"not every rank arrived at {phase} within {self.timeout_secs:g} s "
            f"(a rank failed or is not calling it): {_short(e)}",
            rank=self.rank, phase=phase,
        )  # fmt: skip

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        flat = tensor.view(-1)
        try:  # in pieces: gloo would otherwise hold a second copy of a large one
            for lo in range(0, flat.numel(), _BROADCAST_ELEMENTS):
                piece = flat[lo : lo + _BROADCAST_ELEMENTS]
                dist.broadcast(piece, src=src, group=self._pg)
        except RuntimeError as e:
            raise DistributedCheckpointError(
                f"broadcast of restored bytes from rank {src} failed: {_short(e)}",
                ranks=[src], rank=self.rank, phase="restore",
            ) from e  # fmt: skip

    def post(self, key: str, data: bytes) -> None:
        self._store.set(key, data)  # type: ignore[arg-type]

    def channel(self) -> Group:
        twin = copy.copy(self)
        twin._store = self._store.clone()  # type: ignore[attr-defined]
        twin._pg = None  # the training thread's collectives stay with this group
        twin._votes = []
        return twin

    def collect(self, key: str, phase: str) -> list[bytes]:
        keys = [f"{key}/{r}" for r in range(self.size)]
        self._wait(keys, phase)
        out = [bytes(self._store.get(k)) for k in keys]
        for k in keys:
            self._delete(k)
        return out

    def read(self, key: str, phase: str) -> bytes:
        self._wait([key], phase)
        return bytes(self._store.get(key))

    def _wait(self, keys: list[str], phase: str) -> None:
        try:
            self._store.wait(keys, self._timeout)
        except Exception as e:  # DistStoreError (timeout) or the store went away
            missing = []
            for k in keys:
                try:
                    if not self._store.check([k]):
                        missing.append(k)
                except Exception:
                    missing.append(k)
            ranks = [int(k.rsplit("/", 1)[1]) for k in missing if k.rsplit("/", 1)[1].isdigit()]
            who = f"rank(s) {ranks}" if ranks else "the coordinator (rank 0)"
            raise DistributedCheckpointError(
                f"{who} did not report {phase} within {self.timeout_secs:g} s: {_short(e)}",
                ranks=ranks or [0], rank=self.rank, phase=phase,
            ) from e  # fmt: skip

    def _delete(self, key: str) -> None:
        with contextlib.suppress(Exception):  # some stores cannot delete; the keys are small
            self._store.delete_key(key)

    def close(self) -> None:
        import torch.distributed as dist

        votes, self._votes = self._votes, []
        for vote in votes:  # a vote nobody asked for (the last step's): done before the group
            with contextlib.suppress(Exception):  # goes; every rank started it: milliseconds
                vote.result(min(self.timeout_secs, _CLOSE_VOTE_SECS))
        pg, self._pg = self._pg, None
        if pg is not None and dist.is_initialized():
            with contextlib.suppress(Exception):  # the default group may already be gone
                dist.destroy_process_group(pg)


class _StoreVote(Vote):
    """A vote of several ranks: an all-reduce in flight on pitstop's group."""

    def __init__(self, group: StoreGroup, work: Any, tensor: torch.Tensor, phase: str) -> None:
        self._group, self._work, self._tensor, self._phase = group, work, tensor, phase
        self.done = False

    def result(self, timeout_secs: float | None = None) -> list[int]:
        if not self.done:
            wait = self._group.timeout_secs if timeout_secs is None else timeout_secs
            try:
                self._work.wait(datetime.timedelta(seconds=wait))
            except RuntimeError as e:  # gloo's timeout or a peer that went away
                raise self._group._missed(self._phase, e) from e
            self.done = True
        return [int(v) for v in self._tensor.tolist()]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def make_group(timeout_secs: float) -> Group:
    """The group of the running job: :class:`StoreGroup` under an initialized process group
    of several ranks, else a one-process :class:`Group`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StoreGroup(timeout_secs)
    return Group()
