"""The one recovery walk over a list of levels: the newest step any level can deliver, the
fastest level first for a step several hold. ``CheckpointManager("ckpts")`` walks a list of
one (:class:`~pitstop.levels.root.RootLevel`); a list of levels starts with the node-local
level (:class:`~pitstop.levels.node.NodeLevel`) or a plain one, then flush targets.

Call sequence (training thread, every rank, collective)::

    result = Restart(group, levels).recover(load, step, rollback=..., fetch=...)

``survey``: the ranks that list a level (node leaders for the node-local level, rank 0 for
the others: ``level.lists``) send a brief of its steps; one all-gather; the rollback marks
found on any level apply to all (a rollback killed half-way, having marked one level only,
still holds everywhere: the steps it left are no candidates). A level that cannot be listed
is said; if no level delivers, the restart raises rather than start from step 0.

Steps are tried newest first over every level, in the order of the list for a step several
hold. A node-local level serves a step exactly, made whole on every node first
(:mod:`pitstop.levels.repair`). Any other level serves a *window*: from the step at hand
down to (not including) the next step another level holds, falling back by itself on
damage, so it never serves an older step than a faster level could. A step a slower level
served is fetched into the first level (``level.fetch``: the node-local level copies and
protects it; a plain level needs nothing). A rollback sets aside the newer steps of every
level (a plain level that served does it from the scan it chose from).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from pitstop.engine.catalog import Catalog, Entry
from pitstop.engine.recovery import RestoreResult, agree_on_step
from pitstop.errors import CheckpointError, CheckpointIOError
from pitstop.levels.walk import WITH_MANIFEST, Walk, brief
from pitstop.log import get_logger
from pitstop.ranks.group import Group
from pitstop.ranks.outcome import attempt
from pitstop.storage.base import Storage

__all__ = ["Restart"]

_log = get_logger("pitstop.levels")
_RESCANS = 5


class Restart:
    """See the module docstring. ``levels``: the list, fastest first; each answers the calls
    :mod:`pitstop.levels.walk` names."""

    def __init__(self, group: Group, levels: Sequence[Any], *, commits_to: int = 0) -> None:
        self.group, self.levels = group, list(levels)
        self.commits_to = commits_to  # the level every save commits to (after a memory level)

    def recover(
        self,
        load: Callable[[Storage, Entry], Any],
        step: int | None = None,
        *,
        rollback: bool = False,
        fetch: bool = True,
    ) -> RestoreResult:
        """Collective: load the newest step (or ``step``) that any level can deliver (see the
        module docstring). ``rollback``: the newer steps of every level are set aside;
        ``fetch``: a step a slower level served is copied into the first level."""
        t0 = time.perf_counter()
        seen: list[int] | None = None
        for _ in range(_RESCANS):  # steps that vanished while they were listed or read (the
            held, views, unlisted = self._survey(step)  # retention of a job still running)
            candidates = sorted(set().union(*held), reverse=True)
            if step is not None:
                candidates = [s for s in candidates if s == step]
            walk = Walk(prefixed=len(self.levels) > 1)
            result, served = self._walk(walk, load, step, candidates, held, views, rollback)
            if result is not None or walk.skipped or walk.missing or candidates == seen == []:
                break  # loaded, failed for a reason, or nothing there (listed twice alike)
            seen = candidates
        else:
            if candidates:
                raise CheckpointError(
                    f"the checkpoints of {self.levels[self.commits_to].storage.url} vanished while they were "
                    f"read, {_RESCANS} times (is another job's retention removing them?): "
                    "restore again", path=self.levels[self.commits_to].storage.url,
                    phase="restore",
                )  # fmt: skip
        if result is None or result.step is None or served is None:
            if unlisted:
                raise CheckpointIOError(
                    f"no level could deliver a checkpoint, and "
                    f"{'; '.join(u[1] for u in unlisted)}: it may hold the newest one, so this "
                    "restart does not start from scratch (restore again once the level is back; "
                    "remove the level from the list to give it up)",
                    path=self.levels[self.commits_to].storage.url, phase="restore",
                    errno=unlisted[0][2],
                )  # fmt: skip
            return walk.nothing(step, self.levels[self.commits_to].storage.url)
        if served > 0:
            self._said_slower(result.step, served, candidates, held)
        for j in range(served) if fetch and result.manifest is not None else ():
            self.levels[j].fetch(result.manifest, views[j], self.levels[served].storage)
        if rollback:
            done = served if not self.levels[served].exact else None  # it set its own aside
            result.set_aside += self._roll_back(result.step, skip=done, walk=walk)
        after = self.commits_to + 1  # a level that lacks the step gets the next commit
        for level, h in zip(self.levels[after:], held[after:]):
            level.restarted(result.step in h)
        result.skipped = walk.skipped + result.skipped
        result.secs = time.perf_counter() - t0
        return result

    def _walk(
        self,
        walk: Walk,
        load: Callable[[Storage, Entry], Any],
        step: int | None,
        candidates: list[int],
        held: list[set[int]],
        views: list[Any],
        rollback: bool,
    ) -> tuple[RestoreResult | None, int | None]:
        """Collective: the candidates newest first, each on the levels that hold it in the
        order of the list; (the result, the index of the level that served it)."""
        covered = [math.inf] * len(self.levels)  # a level's steps above it were tried
        for i, s in enumerate(candidates):
            for j, level in enumerate(self.levels):
                if s not in held[j] or s > covered[j]:
                    continue
                window = None
                if not level.exact:  # down to the next step another level holds
                    others = set().union(*(h for k, h in enumerate(held) if k != j))
                    if any(s in h for h in held[j + 1 :]) or step is not None:
                        floor: int | None = s - 1
                    else:
                        floor = next((c for c in candidates[i + 1 :] if c in others), None)
                    covered[j] = floor if floor is not None else -math.inf
                    window = (floor, s)
                result = level.serve(walk, load, s, window, views[j], rollback)
                if result is not None:
                    return result, j
        return None, None

    def _said_slower(
        self, s: int, served: int, candidates: list[int], held: list[set[int]]
    ) -> None:
        """A step from a slower level: said at the default log level (work may be lost);
        not for a faster level that held nothing and is empty after a clean end (memory)."""
        faster = [
            j
            for j in range(served)
            if held[j] or not getattr(self.levels[j], "quiet_when_empty", False)
        ]
        if not self.group.coordinator or not faster:
            return
        newest = candidates[0] if candidates else s
        _log.warning(
            "restored step %d from the %s level: the %s level could not deliver it or a newer "
            "step%s", s, self.levels[served].name, self.levels[faster[0]].name,
            f" (the newest step listed on any level is {newest})" if newest > s else "",
            phase="restore",
        )  # fmt: skip

    def _survey(
        self, step: int | None
    ) -> tuple[list[set[int]], list[Any], list[tuple[int, str, int | None]]]:
        """Collective: each level's steps (and its view: per node for the node-local level)
        from the briefs of the ranks that list it, with the rollback marks of every level
        applied; and the levels that could not be listed (index, why, errno). Every rank must
        ask for the same ``step``; a first level that every save commits to (not node-local)
        that cannot be listed is raised, never passed over for an older step."""
        mine: list[list[tuple[Any, ...]]] = []
        unlisted: list[tuple[int, str, int | None]] = []
        errors: dict[int, CheckpointError] = {}
        for level in self.levels:
            level.prepare_survey()
        for j, level in enumerate(self.levels):
            entries: list[tuple[Any, ...]] = []
            if level.lists(self.group):
                try:
                    entries = brief(level.catalog.scan())
                except CheckpointError as e:
                    errors[j] = e
                    why = f"the {level.name} level ({level.storage.url}) cannot be listed: {e}"
                    unlisted.append((j, why, getattr(e, "errno", None)))
            mine.append(entries)
        words = self.group.all_gather((step, mine, unlisted), "restore")
        agree_on_step([w[0] for w in words], self.group.rank)
        said = sorted({tuple(u) for w in words for u in w[2]})
        c = self.commits_to
        first = next((u for u in said if u[0] == c), None)
        if first is not None and not self.levels[c].exact:
            raise errors.get(c) or CheckpointIOError(
                str(first[1]), errno=first[2], path=self.levels[c].storage.url, phase="restore"
            )
        for u in said if self.group.coordinator else []:
            _log.warning("%s", u[1], phase="restore")
        marks = [b[5] for w in words for part in w[1] for b in part if b[5] is not None]
        out = [level.held([w[1][j] for w in words], marks) for j, level in enumerate(self.levels)]
        return [h for h, _ in out], [v for _, v in out], said

    def _roll_back(self, s: int, *, skip: int | None, walk: Walk) -> list[str]:
        """Set aside the steps newer than ``s`` on every level but ``skip``: the next saves'
        step names are free, and no later restart resumes the abandoned timeline. The ranks
        that list a level do it there; a failure is said, never a lone rank's error. The
        names, as ``<level>:<name>`` (``<node>:<name>`` on the node-local level)."""
        out: list[str] = []
        for j, level in enumerate(self.levels):
            if j == skip or not level.lists(self.group):
                continue
            where = getattr(level, "node", level.name) if walk.prefixed else ""
            moved = attempt(partial(_roll_back, level.catalog, s), self.group.rank, "restore")
            if moved.failed:
                _log.warning("the steps after %d stay on %s: %s", s, where, moved.text,
                             phase="restore")  # fmt: skip
            else:
                out += [f"{where}:{name}" if where else name for name in moved.value]
        names = sorted({n for part in self.group.all_gather(out, "restore") for n in part})
        if names and self.group.coordinator:
            _log.warning("a new timeline starts at step %d; set aside: %s", s,
                         ", ".join(names), phase="restore")  # fmt: skip
        return names


def _roll_back(catalog: Catalog, s: int) -> list[str]:
    """Set aside the steps of ``catalog`` newer than ``s``: a rollback marker first where
    ``s`` is committed (``Catalog.start_timeline``), else each one."""
    entries = catalog.scan()
    here = next((e for e in entries if e.step == s and e.status == "committed"), None)
    if here is not None and here.is_step_dir:
        return catalog.start_timeline(here, entries, set())
    out = []
    for e in entries:
        if e.is_step_dir and e.step is not None and e.step > s and e.status in WITH_MANIFEST:
            name = catalog.set_aside(e, "damaged" if e.status == "damaged" else "abandoned")
            if name is not None:
                out.append(name)
    return out
