"""Frozen option dataclasses. The only module that reads environment variables.

Every knob has a measured default (see docs/design.md) and may be
overridden by an argument or by an environment variable:

=========================  =====================================  ==========
variable                   option                                 default
=========================  =====================================  ==========
PITSTOP_IO_THREADS         IOOptions.threads                      2
PITSTOP_CHUNK_BYTES        IOOptions.chunk_bytes                  64 MiB
PITSTOP_READ_CHUNK_BYTES   IOOptions.read_chunk_bytes             16 MiB
PITSTOP_READ_BUFFERS       IOOptions.read_buffers                 6
PITSTOP_DIRECT_IO          IOOptions.direct (auto|on|off)         auto
PITSTOP_MAX_METADATA_BYTES IOOptions.max_metadata_bytes           256 MiB
PITSTOP_IO_RETRIES         IOOptions.retries                      3
PITSTOP_MAX_IN_FLIGHT      SaveOptions.max_in_flight              1
PITSTOP_HOST_MEMORY_BYTES  SaveOptions.host_memory_bytes          unset (one arena)
PITSTOP_OVERLAP            SaveOptions.overlap (1|0)              1
PITSTOP_BACKGROUND_NICE    SaveOptions.background_nice            10
PITSTOP_LOG_LEVEL          log level of the ``pitstop`` logger    WARNING
PITSTOP_KILL_AT            kill point for fault tests (NAME[:N])  unset
RANK                       the rank shown in log records          0
=========================  =====================================  ==========
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ALIGN_BYTES",
    "MIN_HOST_MEMORY_BYTES",
    "SEGMENT_BYTES",
    "DirectMode",
    "IOOptions",
    "SaveOptions",
    "env_crashtest",
    "env_kill_at",
    "env_log_level",
    "env_node",
    "env_rank",
]

ALIGN_BYTES = 4096
"""Every tensor starts at a multiple of this in its data file; O_DIRECT needs it."""

DirectMode = Literal["auto", "on", "off"]

_MIB = 1 << 20

MIN_HOST_MEMORY_BYTES = 64 * _MIB
"""The smallest ``SaveOptions.host_memory_bytes``."""

SEGMENT_BYTES = 16 * _MIB
"""Checksum segments are at most this long (or ``chunk_bytes``, if smaller), so that a
reader verifies each one inside one read buffer."""


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _env_int(name: str, default: int) -> int:
    raw = _env(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class IOOptions:
    """How bytes move between host memory and one file system.

    ``threads`` writer threads share each file; ``chunk_bytes`` is the size of one write
    request (writers start on a chunk as soon as its tensors are copied, so smaller chunks
    overlap copying and writing better); checksum segments are ``min(chunk_bytes, 16 MiB)``.
    Reads stream through ``read_buffers`` aligned buffers of ``read_chunk_bytes`` each (one
    reader thread per buffer): that is all the host memory a restore or verify adds, and
    6 requests of 16 MiB in flight read 0.8-0.9x as fast here as 2 of 64 MiB into one large buffer
    (which a restarted process would first have to fault in at 0.3-0.8 GB/s); ``direct`` chooses
    O_DIRECT: ``auto`` uses it where the file system accepts it and falls back
    to buffered I/O + fsync elsewhere (tmpfs, some network file systems).
    ``max_metadata_bytes`` bounds a manifest or objects file that is read: a larger one
    is refused as damaged before it is read. ``retries`` attempts are made of a storage
    call that fails with a transient error (EIO, EAGAIN, ETIMEDOUT, ...), with
    exponential backoff from ``retry_backoff_secs``, before CheckpointIOError is raised.
    """

    threads: int = 2
    chunk_bytes: int = 64 * _MIB
    read_chunk_bytes: int = 16 * _MIB
    read_buffers: int = 6
    direct: DirectMode = "auto"
    fsync: bool = True
    max_metadata_bytes: int = 256 * _MIB
    retries: int = 3
    retry_backoff_secs: float = 0.05

    def __post_init__(self) -> None:
        if self.max_metadata_bytes < 1:
            raise ValueError(
                f"IOOptions.max_metadata_bytes must be >= 1, got {self.max_metadata_bytes}"
            )
        if self.retries < 1:
            raise ValueError(f"IOOptions.retries must be >= 1, got {self.retries}")
        if self.threads < 1:
            raise ValueError(f"IOOptions.threads must be >= 1, got {self.threads}")
        if self.read_buffers < 1:
            raise ValueError(f"IOOptions.read_buffers must be >= 1, got {self.read_buffers}")
        if self.chunk_bytes < ALIGN_BYTES or self.chunk_bytes % ALIGN_BYTES:
            raise ValueError(
                f"IOOptions.chunk_bytes must be a positive multiple of {ALIGN_BYTES}, "
                f"got {self.chunk_bytes}"
            )
        if self.read_chunk_bytes < ALIGN_BYTES or self.read_chunk_bytes % ALIGN_BYTES:
            raise ValueError(
                f"IOOptions.read_chunk_bytes must be a positive multiple of {ALIGN_BYTES}, "
                f"got {self.read_chunk_bytes}"
            )
        if self.direct not in ("auto", "on", "off"):
            raise ValueError(f"IOOptions.direct must be auto, on or off, got {self.direct!r}")

    @classmethod
    def from_env(cls, **overrides: object) -> IOOptions:
        values: dict[str, object] = {
            "threads": _env_int("PITSTOP_IO_THREADS", cls.threads),
            "chunk_bytes": _env_int("PITSTOP_CHUNK_BYTES", cls.chunk_bytes),
            "read_chunk_bytes": _env_int("PITSTOP_READ_CHUNK_BYTES", cls.read_chunk_bytes),
            "read_buffers": _env_int("PITSTOP_READ_BUFFERS", cls.read_buffers),
            "direct": _env("PITSTOP_DIRECT_IO") or cls.direct,
            "max_metadata_bytes": _env_int("PITSTOP_MAX_METADATA_BYTES", cls.max_metadata_bytes),
            "retries": _env_int("PITSTOP_IO_RETRIES", cls.retries),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SaveOptions:
    """How the engine stages and persists a checkpoint.

    ``max_in_flight`` host arenas of the state's size exist at most (default 1: host
    memory for saves is the state's size; a save that comes while the previous one still
    persists waits for it, which the policies' intervals avoid). ``host_memory_bytes``
    bounds the host memory of saves below that: a state larger than it is staged and
    written in pieces through a ring buffer of that size (the save then stalls the loop
    for about the time it takes to write the part that does not fit; the bound holds).
    ``overlap`` lets parameters and optimizer state finish
    copying while the next forward and backward run (an optimizer step
    pre-hook waits for them); with ``overlap=False`` every byte is copied
    before ``async_save`` returns. ``allow_pickle`` stores values JSON cannot
    hold as pickles; loading them needs the same opt-in. ``background_nice``
    lowers the priority of the persist and writer threads (Linux, per thread), so
    that on busy cores the write yields to training; 0 keeps normal priority.

    Under torch.distributed: ``replicated`` says who writes state every rank holds the
    same (module and optimizer tensors under DDP): ``"split"`` cuts its bytes into one
    slice per rank, each rank writing its own (write bandwidth adds up); ``"root"`` has
    rank 0 write all of it (the classic baseline). ``dist_timeout_secs`` bounds every
    wait for another rank: a rank that does not arrive makes the others fail with
    ``DistributedCheckpointError`` instead of hanging.
    """

    io: IOOptions = field(default_factory=IOOptions)
    max_in_flight: int = 1
    host_memory_bytes: int | None = None
    overlap: bool = True
    allow_pickle: bool = False
    background_nice: int = 10
    replicated: str = "split"
    dist_timeout_secs: float = 300.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"SaveOptions.max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.host_memory_bytes is not None and self.host_memory_bytes < MIN_HOST_MEMORY_BYTES:
            raise ValueError(
                f"SaveOptions.host_memory_bytes must be >= {MIN_HOST_MEMORY_BYTES} (64 MiB: two "
                f"pieces of at least one checksum segment each), got {self.host_memory_bytes}"
            )
        if self.replicated not in ("split", "root"):
            raise ValueError(
                f"SaveOptions.replicated must be 'split' or 'root', got {self.replicated!r}"
            )
        if not self.dist_timeout_secs > 0:
            raise ValueError(
                f"SaveOptions.dist_timeout_secs must be > 0, got {self.dist_timeout_secs}"
            )

    @classmethod
    def from_env(cls, **overrides: object) -> SaveOptions:
        io = overrides.pop("io", None)
        values: dict[str, object] = {
            "io": io if io is not None else IOOptions.from_env(),
            "max_in_flight": _env_int("PITSTOP_MAX_IN_FLIGHT", cls.max_in_flight),
            "host_memory_bytes": _env_int("PITSTOP_HOST_MEMORY_BYTES", 0) or None,
            "overlap": _env_int("PITSTOP_OVERLAP", 1) != 0,
            "background_nice": _env_int("PITSTOP_BACKGROUND_NICE", cls.background_nice),
            "replicated": os.environ.get("PITSTOP_REPLICATED", cls.replicated),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> SaveOptions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def resolve(cls, options: SaveOptions | None, io: IOOptions, **flags: object) -> SaveOptions:
        """``options`` (default: from the environment) with ``io`` and every flag not None."""
        base = options or cls.from_env(io=io)
        return base.replace(io=io, **{k: v for k, v in flags.items() if v is not None})


def env_log_level() -> str | None:
    """PITSTOP_LOG_LEVEL, e.g. ``INFO`` or ``DEBUG``; None when unset."""
    raw = _env("PITSTOP_LOG_LEVEL")
    return raw.upper() if raw else None


def env_rank() -> int:
    """RANK, as torchrun sets it; 0 when unset."""
    return _env_int("RANK", 0)


def env_kill_at() -> tuple[str, int] | None:
    """PITSTOP_KILL_AT=NAME[:N]: SIGKILL this process the N-th time NAME is reached."""
    raw = _env("PITSTOP_KILL_AT")
    if raw is None:
        return None
    name, _, count = raw.partition(":")
    try:
        hits = int(count) if count else 1
    except ValueError:
        raise ValueError(
            f"PITSTOP_KILL_AT={raw!r}: the count after ':' is not an integer"
        ) from None
    return name, hits


def env_crashtest() -> tuple[int | None, str | None]:
    """What ``pitstop crashtest`` asks of a training process it runs:
    PITSTOP_CRASHTEST_KILL_STEP (SIGKILL at the first step at or after it once a checkpoint
    has committed) and PITSTOP_CRASHTEST_LOG (a file to append one JSON line per save and
    restore to). Each is None when unset."""
    name = "PITSTOP_CRASHTEST_KILL_STEP"
    kill = None if _env(name) is None else _env_int(name, 0)
    if kill is not None and kill < 1:
        raise ValueError(f"environment variable {name}={kill} is not a step (an integer >= 1)")
    return kill, _env("PITSTOP_CRASHTEST_LOG")


def env_node() -> tuple[str | None, int | None]:
    """Which node this process runs on, for the multi-level local level: PITSTOP_NODE (an
    explicit node id) and torchrun's LOCAL_WORLD_SIZE (ranks per node, used with the
    hostname when PITSTOP_NODE is not set)."""
    node = _env("PITSTOP_NODE")
    local = _env("LOCAL_WORLD_SIZE")
    try:
        per_node = int(local) if local else None
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {local!r}") from None
    return (node or None), per_node
