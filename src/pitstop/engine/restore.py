"""restore: read and verify one checkpoint into a buffer, then copy it into the live state.

Call sequence (training thread; io pool threads read and hash extents; under
torch.distributed one more thread sends and receives the replicated pieces)::

    load_entry(storage, entry, state, saver=...)          # checks sizes, allocates, then:
      layout = ReadLayout(manifest, rank, world)          #   where each needed byte lands
      agreement 1                                         #   every rank can read
      load_checkpoint(storage, directory, manifest, state, view, buffer, layout=layout, ...)
        read_checkpoint(...)                              #   read, verify, exchange pieces
        agreement 2                                       #   every rank verified its part
        restore_into(...)                                 #   only now the live state

Every file's real size is checked, the objects file of the rank whose state this rank
takes is read, checked and its tree validated against the manifest, then the data files
are read with large parallel reads into ``view`` and every segment's checksum checked;
only then (after the agreement: under torch.distributed every rank must have got this
far) is anything in the live state touched. Tensors are views of the buffer until they
are copied into the live objects.

A checkpoint of several ranks is read by any number of ranks. The replicated slices of
all data files form one stream (the bytes one process would have written, so a replicated
tensor cut between two files is one view again); it is cut into pieces of whole entries,
and each piece is read and verified by one rank (on the world size it was saved on, the
rank that wrote it: ``split`` spreads the reads, ``root`` is rank 0 reading and
broadcasting, the classic baseline; on another world size, equal shares) and broadcast
to the others on pitstop's gloo group while the reader goes on reading: the disk is read
once per job, not once per rank. A rank that received a piece trusts its reader's
verification, which agreement 2 reports. Then each rank reads the sharded and own pieces
it needs itself. Rank ``r`` of a job of ``M`` takes the per-rank values (RNG streams,
data position) of saved rank ``r mod N``; a DTensor takes its own box of the tensor its
chunks tile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pitstop.engine.verify import check_sizes, raise_problems, read_objects, read_verified
from pitstop.errors import CheckpointError, CorruptCheckpointError, StateMismatchError
from pitstop.format.codec import dtype_from_name, tensor_view
from pitstop.format.manifest import FileEntry, Manifest, TensorEntry
from pitstop.options import ALIGN_BYTES

if TYPE_CHECKING:
    from pitstop.engine.catalog import Entry
    from pitstop.engine.saver import Saver
    from pitstop.ranks.group import Group
from pitstop.state.restore import RestoreReport, materialize, restore_into
from pitstop.storage.base import Storage

__all__ = ["ReadLayout", "load_checkpoint", "load_entry"]

KeyMap = Callable[[str], "str | None"]
Sync = Callable[[BaseException | None], None]
Broadcast = Callable[[torch.Tensor, int], None]


PIECE_BYTES = 64 << 20  # the replicated stream is read and broadcast in pieces of this size


class Piece(NamedTuple):
    """Bytes ``start``-``end`` of data ``file``, at ``shift + start`` in the buffer, read by
    rank ``reader``."""

    file: str
    start: int
    end: int
    shift: int
    reader: int


class ReadLayout:
    """Which bytes of which files rank ``rank`` reads, and where they land in its buffer."""

    def __init__(self, manifest: Manifest, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.source_rank = rank % manifest.world_size
        wanted = [t for t in manifest.tensors if t.owner in (None, self.source_rank)]
        self.entries: dict[str, list[TensorEntry]] = {}
        for t in wanted:
            self.entries.setdefault(t.key, []).append(t)
        data = sorted((f for f in manifest.files if f.name.endswith(".bin")), key=lambda f: f.rank)
        # a file of one rank (format 1 and 2) is all stream; of several, its first stream_nbytes
        one = manifest.world_size == 1
        self._cuts = {
            f.name: f.nbytes if one and f.stream_nbytes is None else (f.stream_nbytes or 0)
            for f in data
        }
        self._shift: dict[tuple[str, bool], int] = {}
        base = 0
        for f in data:  # the replicated stream, slice after slice
            self._shift[(f.name, True)] = base
            base += self._cuts[f.name]
        needed = {t.file for t in wanted}
        self.own: list[tuple[str, int, int, int]] = []  # (file, start, end, shift)
        for f in data:  # then each file's own part, where this rank needs something in it
            cut = self._cuts[f.name]
            if f.nbytes > cut and f.name in needed:
                shift = base - cut
                self._shift[(f.name, False)] = shift
                self.own.append((f.name, cut, f.nbytes, shift))
                base += -(-(f.nbytes - cut) // ALIGN_BYTES) * ALIGN_BYTES
            self._shift.setdefault((f.name, False), 0)
        self.nbytes = base
        self.pieces = self._stream_pieces(manifest, data, world)

    def _stream_pieces(self, manifest: Manifest, data: list[FileEntry], world: int) -> list[Piece]:
        """The replicated stream cut into pieces of whole entries (up to ``PIECE_BYTES``
        unless one entry is larger), each read by one rank and broadcast to the others, in
        the order they are broadcast (the readers' pieces interleaved, so that every rank
        reads while the others' pieces are sent). Restored on the world size it was saved
        on, every rank reads the slice it wrote (``root``: rank 0 reads it all); otherwise
        the stream is cut into ``world`` parts of about equal bytes."""
        stream = sorted(
            (t for t in manifest.tensors if t.offset < self._cuts.get(t.file, 0)),
            key=lambda t: self._shift[(t.file, True)] + t.offset,
        )
        rank_of = {f.name: f.rank for f in data}
        total = max(1, sum(self._cuts.values()))
        by_reader: dict[int, list[Piece]] = {}
        for t in stream:
            at = self._shift[(t.file, True)] + t.offset
            same = world == manifest.world_size
            reader = rank_of[t.file] if same else min(world - 1, at * world // total)
            pieces = by_reader.setdefault(reader, [])
            last = pieces[-1] if pieces else None
            end = t.offset + t.nbytes
            if last and last.file == t.file and end - last.start <= PIECE_BYTES:
                pieces[-1] = last._replace(end=end)
            else:
                pieces.append(Piece(t.file, t.offset, end, self._shift[(t.file, True)], reader))
        order: list[Piece] = []
        queues = [by_reader[r] for r in sorted(by_reader)]
        for i in range(max((len(q) for q in queues), default=0)):
            order.extend(q[i] for q in queues if i < len(q))
        return order

    def position(self, t: TensorEntry) -> int:
        """Where entry ``t`` lands in the buffer."""
        in_stream = t.offset < self._cuts.get(t.file, 0)
        return self._shift[(t.file, in_stream)] + t.offset

    def tensor(self, key: str, buffer: torch.Tensor) -> torch.Tensor:
        """The saved tensor ``key`` (a view of the buffer where its chunks lie back to back)."""
        chunks = sorted(self.entries[key], key=lambda c: c.box_start)
        first = chunks[0]
        dtype = dtype_from_name(first.dtype)
        whole = first.whole_shape
        if len(chunks) == 1 and first.is_whole:
            return tensor_view(buffer, self.position(first), first.nbytes, dtype, whole)
        starts = [self.position(first)]  # where each chunk would start if back to back
        for c in chunks:
            starts.append(starts[-1] + c.nbytes)
        if all(self.position(c) == starts[i] for i, c in enumerate(chunks)) and all(
            c.shape[1:] == whole[1:] and not any(c.box_start[1:]) for c in chunks
        ):  # row ranges in order, back to back: one view
            return tensor_view(buffer, starts[0], starts[-1] - starts[0], dtype, whole)
        out = torch.empty(whole, dtype=dtype)
        for c in chunks:
            box = out
            for dim, (s0, n) in enumerate(zip(c.box_start, c.shape, strict=True)):
                box = box.narrow(dim, s0, n)
            box.copy_(tensor_view(buffer, self.position(c), c.nbytes, dtype, c.shape))
        return out

    def meta(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        first = self.entries[key][0]
        return dtype_from_name(first.dtype), first.whole_shape


def read_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    view: memoryview,
    layout: ReadLayout,
    *,
    pool: Executor,
    buffer: torch.Tensor | None = None,
    broadcast: Broadcast | None = None,
) -> Any:
    """Read and verify what ``layout`` gives this rank to read; returns the tree. The caller
    has checked every file's real size (:func:`load_entry`, before it allocates). Raises
    CorruptCheckpointError listing every problem found.

    With ``broadcast`` (several ranks; a collective): each stream piece read here is sent
    to every other rank from a thread of its own as soon as it is verified, while this rank
    reads on, and the other ranks' pieces arrive into ``buffer``. Whatever fails, every
    piece is sent (a failed rank sends what its buffer holds: the agreement that follows
    discards it) before this returns or raises, so no rank is left waiting in a broadcast."""
    problems: list[str] = []

    def read(name: str, start: int, end: int, shift: int) -> None:
        if not problems:  # after the first problem the outcome is known: stop reading
            read_verified(
                storage, directory, manifest, name, view[shift:], pool=pool,
                problems=problems, region=(start, end),
            )  # fmt: skip

    ready = [threading.Event() for _ in layout.pieces]
    sent: list[BaseException] = []

    def send() -> None:
        assert broadcast is not None and buffer is not None
        try:
            for i, p in enumerate(layout.pieces):
                if p.reader == layout.rank:
                    ready[i].wait()
                broadcast(buffer[p.shift + p.start : p.shift + p.end], p.reader)
        except BaseException as e:
            sent.append(e)

    sender = threading.Thread(target=send, name="pitstop-exchange", daemon=True)
    if broadcast is not None:
        sender.start()
    try:
        tree = read_objects(storage, directory, manifest, layout.source_rank, problems)
        if broadcast is None:  # nothing to hand on: each file's stream in one parallel read
            for name in dict.fromkeys(p.file for p in layout.pieces):
                mine = [p for p in layout.pieces if p.file == name]
                read(name, mine[0].start, mine[-1].end, mine[0].shift)
        else:
            for i, p in enumerate(layout.pieces):
                if p.reader == layout.rank:
                    read(p.file, p.start, p.end, p.shift)
                    ready[i].set()
        for region in layout.own:
            read(*region)
    finally:
        for event in ready:
            event.set()
        if broadcast is not None:
            sender.join()
    if sent:
        raise sent[0]
    raise_problems(problems, step=manifest.step, path=f"{storage.url}/{directory}")
    return tree


def load_checkpoint(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    state: Mapping[str, Any] | None,
    view: memoryview,
    buffer: torch.Tensor,
    *,
    pool: Executor,
    allow_pickle: bool = False,
    strict: bool = True,
    key_map: KeyMap | None = None,
    layout: ReadLayout,
    sync: Sync | None = None,
    broadcast: Broadcast | None = None,
) -> tuple[Any, RestoreReport | None]:
    """Restore into ``state`` in place (returns it and what was loaded or skipped), or build
    fresh objects when ``state`` is None (returns them and None). ``sync(error)`` is called
    after reading and verifying (with this rank's error, if any), before anything live is
    touched; it raises if another rank failed."""
    try:
        tree = read_checkpoint(
            storage, directory, manifest, view, layout, pool=pool, buffer=buffer,
            broadcast=broadcast,
        )  # fmt: skip
    except BaseException as e:
        if sync is not None:
            sync(e)
        raise
    if sync is not None:
        sync(None)

    def source(key: str) -> torch.Tensor:
        return layout.tensor(key, buffer)  # parse_objects checked every key the tree names

    path = f"{storage.url}/{directory}"
    try:
        if state is None:
            return materialize(tree, source, allow_pickle=allow_pickle), None
        report = restore_into(
            state, tree, source, layout.meta, allow_pickle=allow_pickle, strict=strict,
            key_map=key_map,
        )  # fmt: skip
    except CheckpointError as e:
        e.step, e.path = manifest.step, e.path or path
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RuntimeError) as e:
        # a verified tree that still cannot be built: damage the checks did not name
        raise CorruptCheckpointError(
            f"cannot load: {e!r}", step=manifest.step, path=path, phase="restore"
        ) from e
    return state, report


def load_entry(
    storage: Storage,
    entry: Entry,
    state: Mapping[str, Any] | None,
    *,
    saver: Saver,
    allow_pickle: bool,
    strict: bool = True,
    key_map: KeyMap | None = None,
) -> tuple[Any, RestoreReport | None]:
    """:func:`load_checkpoint` of a catalog entry into an arena the saver lends (kept for
    later saves); the data files' real sizes are checked before the arena is allocated.
    Under torch.distributed, every rank agrees before the live state is touched."""
    assert entry.manifest is not None
    if state is not None and not isinstance(state, Mapping):  # the caller's mistake, not damage
        raise StateMismatchError(
            f"the state to restore into must be a dict of named objects, such as "
            f'{{"model": model}}, not a {type(state).__name__}',
            phase="restore",
        )
    manifest, group = entry.manifest, saver.group
    agreement = _Agreement(group)
    try:
        problems: list[str] = []
        check_sizes(storage, entry.name, manifest, problems)
        raise_problems(problems, step=manifest.step, path=f"{storage.url}/{entry.name}")
        layout = ReadLayout(manifest, group.rank, group.size)
        with saver.borrow_buffer(layout.nbytes) as (view, buffer):
            agreement(None)  # every rank can read: the exchange of pieces may start
            return load_checkpoint(
                storage, entry.name, manifest, state, view, buffer, pool=saver.io_pool,
                allow_pickle=allow_pickle, strict=strict, key_map=key_map, layout=layout,
                sync=agreement, broadcast=group.broadcast_tensor if group.size > 1 else None,
            )  # fmt: skip
    except BaseException as e:
        if not agreement.ended:  # failed between agreements: the others learn it at the next
            agreement(e)
        raise


class _Agreement:
    """The points where the ranks of a restore agree to go on (each rank's error, if any,
    is gathered; all stop at the first point where any rank failed). One process: nothing."""

    POINTS = 2  # every rank can read; every rank verified what it read

    def __init__(self, group: Group) -> None:
        self.group = group
        self.reached = 0
        self.ended = False  # no agreement is to come: all were reached, or one failed

    def __call__(self, error: BaseException | None) -> None:
        self.reached += 1
        self.ended = True  # if the gather raises, the others expect no later point either
        if self.group.size > 1:
            words = self.group.all_gather(_word(error), "restore")
            _agree_loaded(words, error, self.group.rank)
        # after the last point, an error reaches the others through recover's outcome gather
        self.ended = error is not None or self.reached >= self.POINTS


def _word(error: BaseException | None) -> tuple[str, str]:
    if error is None:
        return ("ok", "")
    kind = "corrupt" if isinstance(error, CorruptCheckpointError) else "error"
    return (kind, f"{type(error).__name__}: {error}"[:1000])


def _agree_loaded(words: list[tuple[str, str]], mine: BaseException | None, rank: int) -> None:
    """Every rank read and verified its part, or all stop (damage found by any rank is damage
    for all: the next older checkpoint is tried together)."""
    from pitstop.errors import DistributedCheckpointError

    bad = [r for r, w in enumerate(words) if w[0] != "ok"]
    if not bad or mine is not None:
        return  # a rank that failed raises its own error after this
    corrupt = [r for r in bad if words[r][0] == "corrupt"]
    if corrupt:
        raise CorruptCheckpointError(
            f"rank {corrupt[0]}: {words[corrupt[0]][1]}", phase="verify", rank=rank
        )
    raise DistributedCheckpointError(
        f"restore failed on rank(s) {bad}: {words[bad[0]][1]}", ranks=bad, rank=rank,
        phase="restore",
    )  # fmt: skip
