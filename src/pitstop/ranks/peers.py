"""Point-to-point transfers between ranks on a gloo group reserved for checkpoint traffic.

Call sequence::

    link = make_link(group)                  # every rank, training thread, collective
    link.exchange(sends, recvs, "replicate") # one thread at a time per rank: the persist
                                             #   thread while saving, the training thread
                                             #   during restore (no save is in flight then)
    link.close()

Partner copies and parity blocks travel here, never on the training's process group nor on
pitstop's group for the training thread's collectives, so a background transfer can never
interleave with either. Every transfer is bounded by the group's timeout: a peer that died
is a DistributedCheckpointError naming it, never a hang.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch

from pitstop.errors import DistributedCheckpointError
from pitstop.ranks.group import Group

__all__ = ["PeerLink", "make_link"]


class PeerLink:
    """Sends and receives uint8 tensors between the ranks of ``group``."""

    def __init__(self, group: Group, pg: Any) -> None:
        self.rank, self.size = group.rank, group.size
        self.timeout_secs = group.timeout_secs
        self._pg = pg

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        phase: str,
    ) -> None:
        """Send each ``(dst, tensor)`` and fill each ``(src, tensor)``, all at once (one
        message per peer and direction: the caller concatenates)."""
        if not sends and not recvs:
            return
        if self._pg is None:
            raise DistributedCheckpointError(
                "one process has no peers to exchange with", rank=self.rank, phase=phase
            )
        import torch.distributed as dist

        works = []
        peer = -1
        try:
            for peer, t in recvs:
                works.append((peer, dist.irecv(t, src=peer, group=self._pg)))
            for peer, t in sends:
                works.append((peer, dist.isend(t, dst=peer, group=self._pg)))
            timeout = datetime.timedelta(seconds=self.timeout_secs)
            for peer, w in works:  # noqa: B007 (the except names the peer that failed)
                if w is not None:
                    w.wait(timeout)
        except RuntimeError as e:
            raise DistributedCheckpointError(
                f"{phase}: transfer with rank {peer} failed or timed out after "
                f"{self.timeout_secs:g} s: {str(e).splitlines()[0][:300]}",
                ranks=[peer], rank=self.rank, phase=phase,
            ) from e  # fmt: skip

    def close(self) -> None:
        self._pg = None


def make_link(group: Group) -> PeerLink:
    """A link on a new gloo group of every rank (collective); in one process, a link that
    has no peers."""
    if group.size == 1:
        return PeerLink(group, None)
    import torch.distributed as dist

    try:
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=group.timeout_secs))
    except RuntimeError as e:
        raise DistributedCheckpointError(
            f"could not set up pitstop's group for checkpoint traffic: {e}",
            rank=group.rank, phase="replicate",
        ) from e  # fmt: skip
    return PeerLink(group, pg)
