"""Layer 4: torch.distributed, seen from pitstop: who is running, how ranks talk without the
training process group (:mod:`pitstop.ranks.group`), what each rank's part of a collective
step came to and how all ranks act on it alike (:mod:`pitstop.ranks.outcome`) and who writes
what (:mod:`pitstop.ranks.sharding`). In one process all of it is a no-op.
"""

from __future__ import annotations

from pitstop.ranks.group import Group, StoreGroup, make_group
from pitstop.ranks.outcome import Outcome, agree, gather

__all__ = ["Group", "Outcome", "StoreGroup", "agree", "gather", "make_group", "world"]


def world() -> tuple[int, int]:
    """(rank, world size) of an initialized default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
