"""restore: stream one checkpoint, verified, straight into the live state.

Call sequence (training thread; reader threads read and hash; under torch.distributed
one more thread sends and receives the replicated pieces)::

    load_entry(storage, entry, state, saver=...)
      check_sizes(...)                                  # every file's real size
      layout = ReadLayout(manifest, rank, world)        # who reads which bytes
      tree = read_objects(...)                          # checked and validated
      plan = plan_restore(state, tree, ...)             # pairs live state and tree, compares
                                                        #   shapes and dtypes: nothing touched
      landing = Landing(layout, plan.targets)           # where each saved byte lands
      agreement 1                                       # every rank can read, its state fits
      read_all(...)                                     # read, verify, land (and exchange)
      agreement 2                                       # every rank verified what it read
      plan.apply(landing.tensor)                        # load_state_dict & co.

No buffer of the checkpoint's size exists: reader threads read pieces of each data file
into a few reused aligned buffers (``io.read_buffers`` x ``io.read_chunk_bytes``), check
every checksum segment, and copy the verified bytes to where they belong: into the live
tensor that will hold them (parameters, buffers, optimizer state: the check pass names
them), or into a fresh tensor where the state has none (an optimizer that has not
stepped yet, ``pitstop.load`` without a state), which the state then keeps. A restarted
process therefore needs no more host memory than its state plus the read buffers.

What is guaranteed (docs/restore.md): a checkpoint that fails verification is never
reported as restored. Its bytes may already have landed in the live state (a segment
lands once verified, but a checkpoint is verified only when its last segment is); then
recovery falls back to the next older checkpoint, which overwrites everything it loads,
and if none can be restored the error says the live state was partly overwritten
(PartialRestoreError; ``error.live_overwritten`` on any error after a byte landed). A
state that does not fit the checkpoint is refused before anything is read.

Several ranks: the replicated slices of all data files form one stream (the bytes one
process would have written); it is cut into pieces of whole checksum segments (at most
``PIECE_BYTES``), each read and verified by one rank (on the world size it was saved on,
the rank that wrote it: ``split`` spreads the reads, ``root`` is rank 0 reading and
broadcasting; otherwise equal shares) and broadcast on pitstop's gloo group, with one
status byte, while the reader goes on reading: the disk is read once per job. Each rank
then reads the sharded and own entries it needs itself. Rank ``r`` of a job of ``M``
takes the per-rank values (RNG streams, data position) of saved rank ``r mod N``; a
DTensor takes its own box of the tensor its chunks tile.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pitstop.engine.stage import copy_bytes
from pitstop.engine.verify import (
    Deliver,
    Place,
    ReadBuffers,
    Seg,
    check_empty,
    check_sizes,
    raise_problems,
    read_buffers,
    read_objects,
    segments_of,
    stream_verified,
)
from pitstop.errors import (
    CheckpointError,
    CorruptCheckpointError,
    PartialRestoreError,
    StateMismatchError,
)
from pitstop.format.codec import dtype_from_name
from pitstop.format.manifest import FileEntry, Manifest, TensorEntry
from pitstop.format.names import objects_file_name
from pitstop.io.arena import Arena
from pitstop.options import ALIGN_BYTES
from pitstop.ranks.outcome import Outcome, agree, gather

if TYPE_CHECKING:
    from pitstop.engine.catalog import Entry
    from pitstop.engine.saver import Saver
    from pitstop.ranks.group import Group
from pitstop.state.restore import RestoreReport, materialize, plan_restore
from pitstop.storage.base import Storage

__all__ = ["Landing", "ReadLayout", "load_entry"]

KeyMap = Callable[[str], "str | None"]
Broadcast = Callable[[torch.Tensor, int], None]


PIECE_BYTES = 32 << 20  # the replicated stream is broadcast in pieces of at most this
_OWN_PIECES = 2  # pieces a rank may have read ahead of their broadcast
_PLACE_MIN_BYTES = 64 << 10  # a fresh tensor this large is read into directly (Landing.place)
_WARM_BUFFERS = 2  # read buffers first-touched while the restore is prepared (ReadBuffers.warm)


class Piece(NamedTuple):
    """Bytes ``start``-``end`` of data ``file`` (whole checksum segments ``segs``), read by
    rank ``reader`` and broadcast to the others."""

    file: str
    start: int
    end: int
    reader: int
    segs: tuple[Seg, ...]


class ReadLayout:
    """Which saved entries rank ``rank`` needs, and which of them it reads itself."""

    def __init__(self, manifest: Manifest, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.source_rank = rank % manifest.world_size
        self.segment_bytes = manifest.segment_bytes
        wanted = [t for t in manifest.tensors if t.owner in (None, self.source_rank)]
        self.entries: dict[str, list[TensorEntry]] = {}
        for t in wanted:
            self.entries.setdefault(t.key, []).append(t)
        self.wanted = wanted
        data = sorted((f for f in manifest.files if f.name.endswith(".bin")), key=lambda f: f.rank)
        # a file of one rank (format 1 and 2) is all stream; of several, its first stream_nbytes
        one = manifest.world_size == 1
        cuts = {
            f.name: f.nbytes if one and f.stream_nbytes is None else (f.stream_nbytes or 0)
            for f in data
        }
        shared = world > 1
        self.pieces = self._stream_pieces(manifest, data, cuts, world) if shared else []
        # what this rank reads itself: everything (one process), else what is past the stream
        self.own: dict[str, list[TensorEntry]] = {}
        for t in wanted:
            if t.nbytes and not (shared and t.offset < cuts.get(t.file, 0)):
                self.own.setdefault(t.file, []).append(t)

    def _stream_pieces(
        self, manifest: Manifest, data: list[FileEntry], cuts: dict[str, int], world: int
    ) -> list[Piece]:
        """The replicated stream cut into pieces of whole segments (at most ``PIECE_BYTES``
        unless one segment is longer), in the order they are broadcast: the readers' pieces
        interleaved, so that every rank reads while the others' pieces are sent. On the
        world size it was saved on, every rank reads the slice it wrote; otherwise the
        stream is cut into ``world`` parts of about equal bytes."""
        base, shift = 0, {}
        for f in data:  # the replicated stream, slice after slice
            shift[f.name] = base
            base += cuts[f.name]
        total = max(1, base)
        rank_of = {f.name: f.rank for f in data}
        stream = [t for t in manifest.tensors if t.nbytes and t.offset < cuts.get(t.file, 0)]
        segs = sorted(
            segments_of(stream, manifest.segment_bytes),
            key=lambda s: (shift[s[2].file], s[0]),
        )
        same = world == manifest.world_size
        by_reader: dict[int, list[Piece]] = {}
        for seg in segs:
            start, n, t, _ = seg
            at = shift[t.file] + t.offset  # an entry's segments all go to one reader
            reader = rank_of[t.file] if same else min(world - 1, at * world // total)
            pieces = by_reader.setdefault(reader, [])
            last = pieces[-1] if pieces else None
            if last and last.file == t.file and start + n - last.start <= PIECE_BYTES:
                pieces[-1] = last._replace(end=start + n, segs=(*last.segs, seg))
            else:
                pieces.append(Piece(t.file, start, start + n, reader, (seg,)))
        order: list[Piece] = []
        queues = [by_reader[r] for r in sorted(by_reader)]
        for i in range(max((len(q) for q in queues), default=0)):
            order.extend(q[i] for q in queues if i < len(q))
        return order

    def reads(self) -> set[str]:
        """The files this rank reads (their sizes are its to check; a node-local level
        holds no other rank's files)."""
        out = {objects_file_name(self.source_rank), *self.own}
        out.update(p.file for p in self.pieces if p.reader == self.rank)
        return out

    def meta(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        first = self.entries[key][0]
        return dtype_from_name(first.dtype), first.whole_shape


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous ``t`` (no autograd: the bytes are overwritten)."""
    return t.detach().reshape(-1).view(torch.uint8)


class Landing:
    """Where the bytes of each saved entry this rank needs land: the live tensor of its key
    (``targets``: the check pass found one of the same dtype and shape), else a fresh tensor
    that the restored state then keeps. Chunks of a tensor that are whole rows land in place;
    other boxes through a tensor of their own, copied in by :meth:`finish`.

    ``deliver`` is called from reader threads (disjoint bytes); ``touched`` says whether any
    byte of the live state was overwritten."""

    def __init__(
        self,
        layout: ReadLayout,
        targets: Mapping[str, torch.Tensor],
        used: set[str] | None = None,
    ) -> None:
        self.touched = False
        self._dest: dict[str, torch.Tensor] = {}
        self._live: set[str] = set()
        self._sink: dict[tuple[str, int], tuple[torch.Tensor, int, bool]] = {}
        self._boxes: list[tuple[str, TensorEntry, torch.Tensor]] = []
        self._places: dict[tuple[str, int], memoryview] = {}
        for key, chunks in layout.entries.items():
            if used is not None and key not in used:
                continue  # a partial restore does not read what it drops
            dtype, whole = layout.meta(key)
            live = targets.get(key)
            if live is None and len(chunks) == 1 and chunks[0].is_whole:
                dest = self._fresh(chunks[0], whole, dtype)
            else:
                dest = live if live is not None else torch.empty(whole, dtype=dtype)
            self._dest[key] = dest
            if live is not None:
                self._live.add(key)
            flat = _bytes(dest)
            row = dtype.itemsize * int(torch.Size(whole[1:]).numel()) if whole else 0
            for c in chunks:
                if c.nbytes == 0:
                    continue  # no bytes to land (and its offset may be another's)
                if c.is_whole:
                    self._sink[(c.file, c.offset)] = (flat, 0, live is not None)
                elif c.shape[1:] == whole[1:] and not any(c.box_start[1:]):
                    self._sink[(c.file, c.offset)] = (flat, c.box_start[0] * row, live is not None)
                else:
                    box = torch.empty(c.shape, dtype=dtype)
                    self._boxes.append((key, c, box))
                    self._sink[(c.file, c.offset)] = (_bytes(box), 0, False)

    def _fresh(self, c: TensorEntry, whole: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor for whole entry ``c`` (no live tensor holds its key). A large one
        starts at an aligned address with room up to the next aligned size: the reader
        threads read its bytes straight into it (:meth:`place`), where a read buffer and a
        copy would touch as many bytes of fresh memory again (0.7-0.85 GB/s here)."""
        if c.nbytes < _PLACE_MIN_BYTES:
            return torch.empty(whole, dtype=dtype)
        span = -(-c.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        raw = torch.empty(span + ALIGN_BYTES, dtype=torch.uint8)
        skip = -raw.data_ptr() % ALIGN_BYTES
        room = raw[skip : skip + span]
        view = (ctypes.c_char * span).from_address(room.data_ptr())  # lives as long as room
        self._places[(c.file, c.offset)] = memoryview(view).cast("B")
        return room[: c.nbytes].view(dtype).reshape(whole)

    def place(self, entry: TensorEntry) -> memoryview | None:
        """Where ``entry``'s bytes may be read to directly (a fresh tensor of its own), or
        None: they come through :meth:`deliver` (verify.Place; reader threads)."""
        return self._places.get((entry.file, entry.offset))

    def wants(self, entry: TensorEntry) -> bool:
        return (entry.file, entry.offset) in self._sink

    def deliver(self, entry: TensorEntry, lo: int, data: memoryview | torch.Tensor) -> None:
        flat, base, live = self._sink[(entry.file, entry.offset)]
        src = data if isinstance(data, torch.Tensor) else torch.frombuffer(data, dtype=torch.uint8)
        if base + lo + src.numel() > flat.numel():  # a sealed manifest that still lies
            raise CorruptCheckpointError(
                f"{entry.file}: tensor {entry.key!r} has more bytes than its shape holds",
                path=entry.file, phase="restore",
            )  # fmt: skip
        if live:
            self.touched = True
        copy_bytes(flat[base + lo : base + lo + src.numel()], src)

    def finish(self) -> None:
        """Copy the chunks that are not whole rows into their tensors."""
        for key, c, box in self._boxes:
            target = self._dest[key]
            for dim, (s0, n) in enumerate(zip(c.box_start, c.shape, strict=True)):
                target = target.narrow(dim, s0, n)
            if key in self._live:
                self.touched = True
            with torch.no_grad():
                target.copy_(box)
        self._boxes.clear()

    def tensor(self, key: str) -> torch.Tensor:
        """The restored tensor of ``key`` (after :meth:`finish`)."""
        return self._dest[key]

    def owned(self, key: str) -> bool:
        """Whether ``key``'s tensor is fresh (the state may keep it without a copy)."""
        return key not in self._live


def _stream_file(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    name: str,
    segs: list[Seg],
    buffers: ReadBuffers,
    problems: list[str],
    deliver: Deliver,
    place: Place | None = None,
) -> None:
    with contextlib.closing(storage.open_data(directory, name)) as reader:
        stream_verified(
            reader, manifest, name, segs, buffers=buffers, problems=problems, deliver=deliver,
            place=place,
        )  # fmt: skip


def _read_own(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    layout: ReadLayout,
    landing: Landing,
    buffers: ReadBuffers,
    problems: list[str],
) -> None:
    for name, all_entries in layout.own.items():
        entries = [t for t in all_entries if landing.wants(t)]
        if problems:
            return
        if entries:
            segs = segments_of(entries, manifest.segment_bytes)
            _stream_file(
                storage, directory, manifest, name, segs, buffers, problems, landing.deliver,
                landing.place,
            )  # fmt: skip


def _exchange(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    layout: ReadLayout,
    landing: Landing,
    buffers: ReadBuffers,
    problems: list[str],
    broadcast: Broadcast,
) -> None:
    """Read this rank's pieces of the replicated stream and broadcast every piece in order
    (a sender thread), landing the others' pieces as they arrive; then read the own part.
    Whatever fails, every piece is sent (with a failed status byte) before this returns, so
    no rank is left waiting in a broadcast and nobody lands bytes that were not verified."""
    largest = max((p.end - p.start for p in layout.pieces), default=0) + 1
    mine = [i for i, p in enumerate(layout.pieces) if p.reader == layout.rank]
    arenas = [Arena(largest) for _ in range(1 + (_OWN_PIECES if mine else 0))]
    try:
        bufs = [torch.frombuffer(a.view, dtype=torch.uint8) for a in arenas]
        receive, free = bufs[0], queue.SimpleQueue[torch.Tensor]()
        for b in bufs[1:]:
            free.put(b)
        ready: dict[int, queue.SimpleQueue[torch.Tensor]] = {i: queue.SimpleQueue() for i in mine}
        sent: list[BaseException] = []

        def send() -> None:
            try:
                for i, p in enumerate(layout.pieces):
                    n = p.end - p.start
                    buf = ready[i].get() if p.reader == layout.rank else receive
                    broadcast(buf[: n + 1], p.reader)
                    if p.reader == layout.rank:
                        free.put(buf)
                    elif buf[n].item() == 1:  # verified by its reader: land it
                        for s, length, t, _ in p.segs:
                            if landing.wants(t):
                                at = s - p.start
                                landing.deliver(t, s - t.offset, buf[at : at + length])
            except BaseException as e:
                sent.append(e)

        sender = threading.Thread(target=send, name="pitstop-exchange", daemon=True)
        sender.start()

        def take() -> torch.Tensor | None:
            """A free piece buffer (None: the sender is gone and frees none any more)."""
            while True:
                try:
                    return free.get(timeout=0.1)
                except queue.Empty:
                    if not sender.is_alive():
                        return None

        handed = 0
        try:
            for i in mine:
                p, buf = layout.pieces[i], take()
                if buf is None:
                    break
                ok = False
                try:
                    if not problems:

                        def land(
                            t: TensorEntry, lo: int, data: memoryview,
                            p: Piece = p, out: torch.Tensor = buf,
                        ) -> None:  # fmt: skip
                            at = t.offset + lo - p.start
                            out[at : at + len(data)].copy_(
                                torch.frombuffer(data, dtype=torch.uint8)
                            )
                            if landing.wants(t):
                                landing.deliver(t, lo, data)

                        _stream_file(
                            storage, directory, manifest, p.file, list(p.segs), buffers,
                            problems, land,
                        )  # fmt: skip
                        ok = not problems
                finally:
                    buf[p.end - p.start] = 1 if ok else 0
                    ready[i].put(buf)
                    handed += 1
            _read_own(storage, directory, manifest, layout, landing, buffers, problems)
        finally:
            for i in mine[handed:]:  # after a failure the rest go out marked failed
                buf = take()
                if buf is None:
                    break
                buf[layout.pieces[i].end - layout.pieces[i].start] = 0
                ready[i].put(buf)
            sender.join()
        if sent:
            raise sent[0]
    finally:
        for a in arenas:
            a.close()


def read_all(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    layout: ReadLayout,
    landing: Landing,
    buffers: ReadBuffers,
    *,
    broadcast: Broadcast | None = None,
) -> None:
    """Read, verify and land everything ``layout`` gives this rank. Raises
    CorruptCheckpointError listing every problem found."""
    problems: list[str] = []
    check_empty(manifest, layout.wanted, problems)
    if broadcast is None:
        _read_own(storage, directory, manifest, layout, landing, buffers, problems)
    else:
        _exchange(storage, directory, manifest, layout, landing, buffers, problems, broadcast)
    raise_problems(problems, step=manifest.step, path=f"{storage.url}/{directory}")
    landing.finish()


def load_entry(
    storage: Storage,
    entry: Entry,
    state: Mapping[str, Any] | None,
    *,
    saver: Saver,
    allow_pickle: bool,
    strict: bool = True,
    key_map: KeyMap | None = None,
    view_rank: int | None = None,
) -> tuple[Any, RestoreReport | None]:
    """Restore a catalog entry into ``state`` in place (returns it and what was loaded or
    skipped), or build fresh objects when ``state`` is None (returns them and None). Under
    torch.distributed, every rank agrees before reading and before the state is loaded.
    ``view_rank`` (one process only): the per-rank values of that saved rank, not rank 0's."""
    assert entry.manifest is not None
    if state is not None and not isinstance(state, Mapping):  # the caller's mistake, not damage
        raise StateMismatchError(
            f"the state to restore into must be a dict of named objects, such as "
            f'{{"model": model}}, not a {type(state).__name__}',
            phase="restore",
        )
    manifest, group = entry.manifest, saver.group
    path = f"{storage.url}/{entry.name}"
    if view_rank is not None and not 0 <= view_rank < manifest.world_size:
        raise ValueError(
            f"rank {view_rank}: step {manifest.step} was saved by {manifest.world_size} rank(s)"
        )
    agreement = _Agreement(group)
    landing: Landing | None = None
    largest = max((f.nbytes for f in manifest.files if f.name.endswith(".bin")), default=0)
    buffers = read_buffers(storage, largest)  # a small checkpoint takes little
    try:
        if state is not None:  # most bytes land in live tensors, through these buffers
            buffers.warm(_WARM_BUFFERS)
        problems: list[str] = []
        layout = ReadLayout(manifest, group.rank if view_rank is None else view_rank, group.size)
        check_sizes(storage, entry.name, manifest, problems, names=layout.reads())
        raise_problems(problems, step=manifest.step, path=path)
        tree = read_objects(storage, entry.name, manifest, layout.source_rank, problems)
        raise_problems(problems, step=manifest.step, path=path)
        try:
            plan = None
            if state is not None:  # nothing is touched if the state does not fit
                plan = plan_restore(
                    state, tree, layout.meta, allow_pickle=allow_pickle, strict=strict,
                    key_map=key_map,
                )  # fmt: skip
            if plan is not None:
                landing = Landing(layout, plan.targets, plan.used)
            else:
                landing = Landing(layout, {})
        except (OSError, MemoryError, RuntimeError) as e:
            raise CheckpointError(
                f"cannot allocate the tensors to restore into: {e}", phase="restore"
            ) from e
        agreement(None)  # every rank can read, and its state fits: the exchange may start
        try:
            read_all(
                storage, entry.name, manifest, layout, landing, buffers,
                broadcast=group.broadcast_tensor if group.size > 1 else None,
            )  # fmt: skip
        except BaseException as e:
            agreement(e)
            raise
        finally:
            buffers.close()
        agreement(None)  # every rank verified its part: the state is loaded
        return _apply(plan, state, tree, landing, allow_pickle, manifest.step, path)
    except BaseException as e:
        buffers.close()  # (again: closing twice is fine)
        if not agreement.ended:  # failed between agreements: the others learn it at the next
            agreement(e)
        if landing is not None and landing.touched and isinstance(e, CheckpointError):
            _overwritten(e)
        raise


def _overwritten(e: CheckpointError) -> None:
    """Damage goes to recovery, which tries older checkpoints and says it if none fits;
    any other error reaches the caller: its message says it."""
    if not e.live_overwritten and not isinstance(e, PartialRestoreError | CorruptCheckpointError):
        e.message += "; the live state was partly overwritten: do not train from it"
        e.args = (e.message,)
    e.live_overwritten = True


def _apply(
    plan: Any,
    state: Mapping[str, Any] | None,
    tree: Any,
    landing: Landing,
    allow_pickle: bool,
    step: int,
    path: str,
) -> tuple[Any, RestoreReport | None]:
    """Load the landed tensors into the state (or build fresh objects around them)."""
    try:
        if state is None:
            value = materialize(tree, landing.tensor, allow_pickle=allow_pickle, clone=False)
            return value, None
        return state, plan.apply(landing.tensor, owned=landing.owned, touched=landing.touched)
    except CheckpointError as e:
        e.step, e.path = step, e.path or path
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RuntimeError) as e:
        # a verified tree that still cannot be built: damage the checks did not name
        raise CorruptCheckpointError(
            f"cannot load: {e!r}", step=step, path=path, phase="restore"
        ) from e


class _Agreement:
    """The points where the ranks of a restore agree to go on: each rank's outcome is
    gathered (one process: a gather of one); all stop at the first point where any rank
    failed: the others with an error naming every failed rank (a CorruptCheckpointError when
    any found damage: the next older checkpoint is tried together); a rank that failed
    returns, and the caller raises its own error (the others' failures added to it).
    Training thread, every rank."""

    POINTS = 2  # every rank can read; every rank verified what it read

    def __init__(self, group: Group) -> None:
        self.group = group
        self.reached = 0
        self.ended = False  # no agreement is to come: all were reached, or one failed

    def __call__(self, error: BaseException | None) -> None:
        self.reached += 1
        self.ended = True  # if the gather raises, the others expect no later point either
        rank = self.group.rank
        mine = Outcome.ok(rank, "restore") if error is None else Outcome.of(error, rank, "restore")
        outcomes = gather(self.group, mine, "restore")
        try:
            agree(outcomes, rank, "restore", phase="restore", damage=True)
        except BaseException as raised:
            if raised is not error:
                raise
            # this rank's own error, the others' failures added to it: the caller raises it
        # after the last point, an error reaches the others through recover's outcome gather
        self.ended = error is not None or self.reached >= self.POINTS
