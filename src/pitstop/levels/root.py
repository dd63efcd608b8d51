"""RootLevel: the levels of ``CheckpointManager("ckpts")``: a list of one level, the directory
(or :class:`~pitstop.storage.Storage`) every rank writes into.

It answers the calls the manager makes of any list of levels (:class:`LevelStack` for a
node-local level and shared levels after it)::

    levels = RootLevel(storage, group, retention)      # training thread, every rank
    levels.bind(identity)                              # the run's identity (retention)
    saver = Saver(levels.storage, ..., nodes=levels.node_commit())   # None: one commit
    levels.committed(step)          # persist thread, after each commit: retention (rank 0)
    result = levels.recover(load, step, rollback=..., fetch=...)     # training thread,
                                    #   collective: this level's recover
    levels.flush(); levels.flush_records()    # nothing to flush: None, []
    levels.close()

With one level there is nothing to interleave: its restart is
:func:`~pitstop.engine.recovery.recover` (newest first, fall back on damage, rollback).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pitstop.engine.catalog import Catalog, Entry, RunIdentity
from pitstop.engine.collective import NodeCommit
from pitstop.engine.recovery import RestoreResult, recover
from pitstop.levels.flush import Flusher, FlushRecord
from pitstop.policy import RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.storage.base import Storage
from pitstop.storage.retry import RetryingStorage

__all__ = ["RootLevel"]


class RootLevel:
    """See the module docstring."""

    flusher: Flusher | None = None

    def __init__(self, inner: Storage, group: Group, retention: RetentionPolicy | None) -> None:
        self.group, self.retention = group, retention
        self.storage: Storage = RetryingStorage(inner)  # type: ignore[assignment]
        self.catalog = Catalog(self.storage)
        self.identity: RunIdentity | None = None

    @property
    def flushers(self) -> list[Flusher]:
        return []

    def bind(self, identity: RunIdentity) -> None:
        """The run whose checkpoints retention retires (rank 0 applies it)."""
        self.identity = identity

    def node_commit(self) -> NodeCommit | None:
        return None

    def committed(self, step: int) -> None:
        """Persist thread, after ``step`` committed: the retention policy, on rank 0 (the
        retired stop being checkpoints now; their files go in the background)."""
        if self.retention is not None and self.group.coordinator and self.identity is not None:
            retired = self.catalog.retire(self.retention, newest=step, identity=self.identity)
            self.catalog.purge_later(retired)

    def flush(self) -> FlushRecord | None:
        return None

    def flush_records(self) -> list[FlushRecord]:
        return []

    def recover(
        self,
        load: Callable[[Storage, Entry], Any],
        step: int | None = None,
        *,
        rollback: bool = False,
        fetch: bool = True,
    ) -> RestoreResult:
        """Collective: the newest checkpoint that verifies (or ``step``), loaded."""
        return recover(
            self.catalog, lambda e: load(self.storage, e), step=step, rollback=rollback,
            group=self.group,
        )  # fmt: skip

    def close(self) -> None:
        self.catalog.close()
