"""Named kill points for crash tests.

The engine calls :func:`killpoint` at each named point of the save path. When
``PITSTOP_KILL_AT=NAME[:N]`` is set (read by :mod:`pitstop.options`), the
process kills itself with SIGKILL the N-th time it reaches NAME: no cleanup,
no atexit, exactly like a node failure. Fault tests start a child with this
variable and check that restore in a fresh process picks the last committed
step with identical bytes.
"""

from __future__ import annotations

import os
import signal
import threading

from pitstop.options import env_kill_at

__all__ = ["KILL_POINTS", "killpoint"]

KILL_POINTS: tuple[str, ...] = (
    "stage.mid",  # half the tensors copied into the arena
    "persist.mid",  # half the data chunks written
    "persist.after_data",  # data files written and fsynced, no manifest yet
    "commit.before_rename",  # manifest written to its temporary name and fsynced
    "commit.after_rename",  # manifest renamed: the checkpoint is committed
    "retention.mid",  # an old checkpoint un-committed, its files not yet removed
    "gc.mid",  # gc holds a directory it is about to remove
    "replicate.mid",  # multi-level: every rank's files durable, redundancy being written
    "flush.mid",  # multi-level: a rank's files of a flush on the shared level, not committed
    "lightning.pointer",  # Lightning: a pointer file renamed into place (the step committed)
    "lightning.registry",  # Lightning: the root's registry of pointer paths rewritten
    "keeper.seal",  # memory level: the keeper about to seal a staged slot (the state a kill
    # after hashing, before the header flip leaves: hashing writes nothing the header names)
    "keeper.persist",  # memory level: a slot's data and objects written to the next level,
    # not committed (the keeper, or the training process when it persists itself)
)

_lock = threading.Lock()
_hits: dict[str, int] = {}
_target: tuple[str, int] | None = None
_loaded = False


def _load_target() -> tuple[str, int] | None:
    global _target, _loaded
    if not _loaded:
        target = env_kill_at()
        if target is not None and target[0] not in KILL_POINTS:
            raise ValueError(
                f"PITSTOP_KILL_AT names unknown kill point {target[0]!r}; "
                f"known: {', '.join(KILL_POINTS)}"
            )
        _target, _loaded = target, True
    return _target


def killpoint(name: str) -> None:
    """Reach kill point ``name``: SIGKILL this process if PITSTOP_KILL_AT asks for it."""
    target = _load_target()
    if target is None or target[0] != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] >= target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
