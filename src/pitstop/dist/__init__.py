"""torch.distributed, seen from pitstop: who is running (no-op in one process).

Call sequence: the manager calls :func:`check_single_process` at construction (training
thread). Distributed checkpointing (ranks splitting the bytes, one manifest per step)
replaces the refusal with the real thing.
"""

from __future__ import annotations

from pitstop.errors import UnsupportedSetupError

__all__ = ["check_single_process", "world"]


def world() -> tuple[int, int]:
    """(rank, world size) of an initialized default process group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_single_process() -> None:
    """Raise UnsupportedSetupError under a process group of several ranks: each rank would
    write the same step directories."""
    rank, size = world()
    if size > 1:
        raise UnsupportedSetupError(
            f"CheckpointManager under torch.distributed with world size {size}: this pitstop "
            "saves from a single process only (every rank would write the same step "
            "directories); run one process per job until distributed checkpointing lands",
            rank=rank, phase="plan",
        )  # fmt: skip
