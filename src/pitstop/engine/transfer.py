"""transfer: the one streaming copy of every copy between levels and between ranks.

A flush (local files to the shared level), a fetch (back), a partner copy, XOR parity and a
rebuild all move a rank's *payload* (:class:`~pitstop.engine.payload.Layout`) piece by
piece through a few bounded, reused buffers, hashing what passes. A copy is a list of
:class:`Round`\\ s, the same on every rank that takes part; in each round a rank

1. reads what it sends to each peer into a send buffer (``Round.sends``);
2. exchanges pieces with its peers over the peer link (``PeerLink.exchange``);
3. produces at most one piece of its *target* (``Round.piece``): a local read
   (``Round.local``), one received piece (received straight into the target's ring), or
   the XOR of several; ``check`` sees it (the manifest's checksums, or a running digest)
   and the target's writer threads write it (``Storage.write_data``, O_DIRECT where the
   storage writes so) while the next round runs.

Host memory: the target's ring (``ring_slots(io)`` pieces), one buffer per send and per
received piece beyond the first; :func:`piece_bytes` sizes the pieces so that they fit in
:func:`copy_budget` whatever the size of the files.

Call sequence (one thread of each rank: the flush thread, the persist thread while a save
replicates, the training thread at restart; every rank of an exchange the same rounds)::

    piece = piece_bytes(io, buffers)          # buffers: send and extra receive buffers
    pieces = layout.pieces(piece)             # the target's pieces (every rank cuts alike)
    received = transfer(rounds, pieces, target=Target(storage, directory, layout),
                        link=link, check=checker.feed, phase="replicate")
    copy_files(source, target, directory, manifest, rank, phase)   # the copy without peers

A failure on one rank (a read, a checksum, a write) never leaves its peers waiting: it
takes part in the remaining rounds without doing their work, and a last exchange of one
byte tells every peer it received from whether what it sent was whole; then every rank
that failed or received from a rank that failed raises. A failure of the link itself (a
peer gone) is raised at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from pitstop.engine.payload import Checker, FileSink, Fill, Layout, Reader, align
from pitstop.errors import CorruptCheckpointError, DistributedCheckpointError
from pitstop.format.manifest import FileEntry, Manifest
from pitstop.io.arena import Arena
from pitstop.io.parallel import Extent
from pitstop.options import ALIGN_BYTES, MIN_HOST_MEMORY_BYTES, IOOptions
from pitstop.ranks.peers import PeerLink
from pitstop.storage.base import Storage

__all__ = [
    "Round",
    "Target",
    "copy_budget",
    "copy_files",
    "member_files",
    "payloads",
    "piece_bytes",
    "ring_slots",
    "transfer",
]


def copy_budget(io: IOOptions) -> int:
    """The host memory of one copy between levels or ranks: the restore's read buffers
    (``io.read_buffers`` x ``io.read_chunk_bytes``, 96 MiB by default), at most
    ``MIN_HOST_MEMORY_BYTES`` (64 MiB), so that every ``SaveOptions.host_memory_bytes`` a
    save may be given bounds the copies too."""
    return max(ALIGN_BYTES, min(io.read_buffers * io.read_chunk_bytes, MIN_HOST_MEMORY_BYTES))


def ring_slots(io: IOOptions) -> int:
    """Pieces in a target's ring: one being filled, one per writer thread being written."""
    return io.threads + 1


def piece_bytes(io: IOOptions, buffers: int) -> int:
    """The length of a piece when ``buffers`` pieces live beside the target's ring (a
    multiple of 4 KiB, at most ``io.chunk_bytes``). Every rank of an exchange must pass the
    same ``buffers`` (and have the same IOOptions): the pieces it cuts are its peers'."""
    n = min(io.chunk_bytes, copy_budget(io) // (ring_slots(io) + buffers))
    return max(ALIGN_BYTES, n - n % ALIGN_BYTES)


def payloads(manifest: Manifest) -> dict[int, list[tuple[FileEntry, int]]]:
    """Every rank's files of ``manifest`` in name order, each with its offset in the rank's
    payload (4 KiB-aligned)."""
    out: dict[int, list[tuple[FileEntry, int]]] = {}
    for f in sorted(manifest.files, key=lambda f: f.name):
        files = out.setdefault(f.rank, [])
        at = files[-1][1] + align(files[-1][0].nbytes) if files else 0
        files.append((f, at))
    return out


def member_files(manifest: Manifest, rank: int) -> list[tuple[FileEntry, int]]:
    """``rank``'s files of ``manifest`` with their offsets in its payload."""
    return payloads(manifest).get(rank, [])


@dataclass(frozen=True)
class Round:
    """One round of a transfer (see the module docstring). ``sends``: (peer, nbytes, fill);
    ``recvs``: the peers whose pieces (of the length of ``piece``) this rank receives and
    XORs; ``piece``: the index of the target's piece this round produces, from ``local``
    (a read) or from ``recvs``; None: this rank produces nothing this round."""

    sends: tuple[tuple[int, int, Fill], ...] = ()
    recvs: tuple[int, ...] = ()
    piece: int | None = None
    local: Fill | None = None


@dataclass(frozen=True)
class Target:
    """Where the produced pieces go: the files of ``layout`` in ``directory`` of
    ``storage`` (None in ``transfer``: they are checked and dropped)."""

    storage: Storage
    directory: str
    layout: Layout


def _u8(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8)


class _Run:
    """The state of one transfer on one rank."""

    def __init__(
        self,
        rounds: Sequence[Round],
        pieces: Sequence[Extent],
        target: Target | None,
        link: PeerLink | None,
        check: Callable[[int, memoryview], None] | None,
        phase: str,
    ) -> None:
        self.rounds, self.pieces, self.link = rounds, pieces, link
        self.sink: FileSink | None = None  # the target's, once it runs
        self.check, self.phase = check, phase
        sizes = [e.nbytes for e in pieces] + [n for r in rounds for _, n, _ in r.sends]
        self.unit = max([ALIGN_BYTES, *sizes])
        self.sends = max((len(r.sends) for r in rounds), default=0)
        extra = max((len(r.recvs) for r in rounds if r.piece is not None), default=1) - 1
        own = 1 if not target and any(r.piece is not None for r in rounds) else 0
        count = self.sends + max(0, extra) + own
        self._arena = Arena(count * self.unit) if count else None
        self._spare: Arena | None = None  # the first received piece once the target failed
        self.error: BaseException | None = None  # this rank's first failure
        self.send_error: BaseException | None = None  # a failure to read what it sends
        self.broken: BaseException | None = None  # the link failed: nothing more can go on
        self.received = 0

    def buffer(self, i: int, n: int) -> memoryview:
        assert self._arena is not None
        return self._arena.view[i * self.unit : i * self.unit + n]

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            if self.sink is not None:
                self.sink.fail(error)

    def exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]
    ) -> None:
        if not sends and not recvs:
            return
        if self.link is None:
            raise ValueError("a transfer with peers needs a link")
        try:
            self.link.exchange(sends, recvs, self.phase)
        except BaseException as e:
            self.broken = e
            raise

    def fill_sends(self, r: Round) -> list[tuple[int, torch.Tensor]]:
        out = []
        for i, (peer, n, fill) in enumerate(r.sends):
            buf = self.buffer(i, n)
            if self.send_error is None:  # a failed target does not spoil what is sent
                try:
                    fill(buf)
                except Exception as e:
                    self.send_error = e
                    self.fail(e)
            out.append((peer, _u8(buf)))
        return out

    def run_round(self, r: Round) -> None:
        sends = self.fill_sends(r)
        if r.piece is None:
            self.exchange(sends, [])
            return
        e = self.pieces[r.piece]
        done = False

        def produce(out: memoryview) -> None:
            nonlocal done
            if r.local is not None:
                r.local(out)
            else:
                recvs = self._recvs(r, out)
                self.exchange(sends, recvs)
                done = True
                self.received += e.nbytes * len(recvs)
                acc = recvs[0][1]
                for _, t in recvs[1:]:
                    acc.bitwise_xor_(t)
            if self.check is not None:
                self.check(e.start, out)

        if self.error is None:
            try:
                if self.sink is not None:
                    self.sink.put(r.piece, produce)
                else:
                    produce(self.buffer(self.sends + max(0, len(r.recvs) - 1), e.nbytes))
            except Exception as err:
                if self.broken is not None:
                    raise self.broken from None
                self.fail(err)
        if not done:  # this rank failed: it still takes its part in the exchange
            if r.recvs and self._spare is None:
                self._spare = Arena(self.unit)
            first = self._spare.view[: e.nbytes] if self._spare is not None else memoryview(b"")
            self.exchange(sends, self._recvs(r, first) if r.recvs else [])

    def _recvs(self, r: Round, first: memoryview) -> list[tuple[int, torch.Tensor]]:
        n = len(first)
        out = [(r.recvs[0], _u8(first))]
        out += [(j, _u8(self.buffer(self.sends + i, n))) for i, j in enumerate(r.recvs[1:])]
        return out

    def status(self) -> None:
        """The last exchange: whether what this rank sent was whole, to every peer it sent
        to; a peer whose sends were not fails what this rank made of them."""
        sent_to = sorted({p for r in self.rounds for p, _, _ in r.sends})
        got_from = sorted({p for r in self.rounds if r.piece is not None for p in r.recvs})
        ok = 1 if self.send_error is None else 0
        flags = [(p, torch.zeros(1, dtype=torch.uint8)) for p in got_from]
        self.exchange([(p, torch.full((1,), ok, dtype=torch.uint8)) for p in sent_to], flags)
        bad = [p for p, t in flags if int(t.item()) != 1]
        if bad:  # the cause of any checksum that then failed here
            why = f"{self.phase}: rank(s) {bad} could not read what they sent here"
            error = DistributedCheckpointError(why, ranks=bad, phase=self.phase)
            if isinstance(self.error, CorruptCheckpointError):
                self.error = error
            self.fail(error)

    def close(self) -> None:
        """Wait for the target's writes (told to stop after a failure), free the buffers,
        raise the first failure."""
        error = self.error
        if self.sink is not None:
            sink_error = self.sink.close()
            error = error or sink_error
        for arena in (self._arena, self._spare):
            if arena is not None:
                arena.close()
        if error is not None:
            raise error


def transfer(
    rounds: Sequence[Round],
    pieces: Sequence[Extent],
    *,
    target: Target | None = None,
    link: PeerLink | None = None,
    check: Callable[[int, memoryview], None] | None = None,
    phase: str,
) -> int:
    """Run ``rounds`` (see the module docstring): the produced pieces (``pieces`` of the
    target's layout) are checked by ``check(start, bytes)`` in order and written into
    ``target``; raises this rank's first failure (or a peer's that spoiled what it received)
    once every round, the status exchange and every write have ended. The bytes received."""
    run = _Run(rounds, pieces, target, link, check, phase)
    try:
        if target is not None:
            slots = ring_slots(target.storage.io)
            run.sink = FileSink(target.storage, target.directory, target.layout, pieces,
                                slots=slots)  # fmt: skip
        for r in rounds:
            run.run_round(r)
        run.status()
    except BaseException as e:
        run.fail(e)
    run.close()
    return run.received


def copy_files(
    source: Storage, target: Storage, directory: str, manifest: Manifest, rank: int, phase: str
) -> int:
    """Copy ``rank``'s files of ``directory`` from ``source`` to ``target`` under the same
    names, every checksum of ``manifest`` checked on the way (CorruptCheckpointError at the
    first that differs; what was written stays for the caller to abort or replace). A file
    already on ``target`` is replaced, never written through. The bytes of the files."""
    files = member_files(manifest, rank)
    layout = Layout.of((f.name, f.nbytes) for f, _ in files)
    pieces = layout.pieces(piece_bytes(source.io, 0))
    reader = Reader(source, directory, layout)
    checker = Checker(manifest, files)
    try:
        rounds = [Round(piece=k, local=partial(reader.read, e.start)) for k, e in enumerate(pieces)]
        transfer(rounds, pieces, target=Target(target, directory, layout), check=checker.feed,
                 phase=phase)  # fmt: skip
        checker.finish()
    finally:
        reader.close()
    return sum(f.nbytes for f, _ in files)
