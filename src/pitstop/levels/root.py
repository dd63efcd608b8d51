"""RootLevel: a level every rank writes into as one directory (or
:class:`~pitstop.storage.Storage`): ``CheckpointManager("ckpts")`` is a list of this one
level; a list of levels may also start with one (``pitstop.Shared(...)`` first).

Call sequence (every rank; :class:`~pitstop.levels.stack.LevelStack` makes these calls)::

    level = RootLevel(storage, group, retention)   # training thread
    level.replicate(directory, manifest)   # persist thread, inside each commit: nothing
    level.committed(step, identity)        # persist thread, after a commit: retention (rank 0;
                                           #   the retired stop being checkpoints now, their
                                           #   files go in the background)
    level.prepare_survey()                 # collective, before the restart's survey: nothing
    level.lists(group); level.held(words)  # the restart's survey (rank 0 lists it)
    level.serve(walk, load, s, window, ...)   # collective: recover over the window
    level.close()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pitstop.engine.catalog import Catalog, Entry, RunIdentity
from pitstop.engine.recovery import RestoreResult
from pitstop.format.manifest import Manifest
from pitstop.levels.walk import Walk, left_by_rollback, serve_window
from pitstop.policy import RetentionPolicy
from pitstop.ranks.group import Group
from pitstop.storage.base import Storage
from pitstop.storage.retry import RetryingStorage

__all__ = ["CANDIDATES", "RootLevel"]

CANDIDATES = ("committed", "damaged", "newer")  # a plain level's steps a restore looks at
"""(damaged: skipped with its reason; newer: a newer format is raised, never passed over)"""


class RootLevel:
    """See the module docstring."""

    exact = False  # serves a window of steps, falling back by itself

    def __init__(
        self, inner: Storage, group: Group, retention: RetentionPolicy | None, name: str = "root"
    ) -> None:
        self.group, self.retention, self.name = group, retention, name
        self.storage: Storage = RetryingStorage(inner)  # type: ignore[assignment]
        self.catalog = Catalog(self.storage)

    @property
    def leaders(self) -> tuple[int, ...]:
        """Rank 0 creates and commits every step directory."""
        return (0,) * self.group.size

    def replicate(self, directory: str, manifest: bytes) -> None:
        """One copy: nothing to protect."""

    def committed(self, step: int, identity: RunIdentity | None) -> None:
        """Persist thread, after ``step`` committed: the retention policy, on rank 0."""
        if self.retention is not None and self.group.coordinator and identity is not None:
            retired = self.catalog.retire(self.retention, newest=step, identity=identity)
            self.catalog.purge_later(retired)

    def describe(self) -> dict[str, Any] | None:
        """None: no ``levels.json`` (``pitstop ls`` reads each plain level as a root)."""
        return None

    def levels_file(self) -> list[tuple[str, dict[str, Any]]]:
        return []

    # ------------------------------------------------------------------ restart
    def prepare_survey(self) -> None:
        """Collective, before the restart's survey: nothing to do for a plain level."""

    def lists(self, group: Group) -> bool:
        return group.coordinator

    def held(self, words: list[Any], marks: list[dict[str, Any]]) -> tuple[set[int], None]:
        """The steps rank 0 listed that a restore looks at (a rollback's leftovers: not)."""
        left = left_by_rollback(marks)
        return {b[0] for w in words for b in w if b[1] in CANDIDATES and not left(b)}, None

    def serve(
        self,
        walk: Walk,
        load: Callable[[Storage, Entry], Any],
        s: int,
        window: tuple[int | None, int] | None,
        view: Any,
        rollback: bool,
    ) -> RestoreResult | None:
        """Collective: the newest checkpoint of ``window`` that verifies, loaded."""
        return serve_window(
            walk, self.group, self.name, self.catalog, load, window=window, rollback=rollback
        )

    def fetch(self, manifest: Manifest, view: Any, storage: Storage) -> None:
        """A step a slower level served stays there (no copy into a plain first level)."""

    def close(self) -> None:
        self.catalog.close()
