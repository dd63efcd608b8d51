"""The levels a multi-level setup writes to, and where every rank's redundancy lives.

::

    ckpt = CheckpointManager([
        pitstop.Local("/local/ckpt/{node}", redundancy="partner"),   # every checkpoint
        pitstop.Shared("/shared/ckpt", every=10),                   # every 10th, in the background
    ])

``{node}`` in a path is replaced by the node's id: ranks of one node share that directory,
and on one machine distinct ids emulate distinct nodes. The id comes from ``topology=``
(rank -> node), else PITSTOP_NODE, else the hostname; a host that runs more ranks than
torchrun's LOCAL_WORLD_SIZE holds several emulated nodes, ``<host>-<rank // LOCAL_WORLD_SIZE>``
(so that ranks launched as separate nodes on one host stay apart, and one process or one
torchrun per host uses the plain hostname alike). :class:`Placement` turns the ids into failure groups (SCR's sets): nodes are cut
into sets of ``set_size``; within a set, rank r's partner copy lives on the next node of a
ring (the rank of the same local index there) and its XOR set is the ranks of its local
index on the set's nodes, so a copy or a parity block is never on its own node.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pitstop.errors import UnsupportedSetupError
from pitstop.levels.shm_header import JOB_TOKEN
from pitstop.options import env_node
from pitstop.policy.base import CheckpointPolicy
from pitstop.policy.fixed import EveryN
from pitstop.storage.local import local_path, object_url

__all__ = [
    "DEFAULT_EVERY", "REDUNDANCY", "SCHEMES", "SERVING", "Local", "Memory", "Partner",
    "Placement", "Redundancy", "Shared", "Xor", "check_levels",
    "level_names", "manifest_order", "memory_dir", "node_ids", "split_memory",
]  # fmt: skip

DEFAULT_EVERY = 10  # Shared(): every 10th local commit unless told otherwise


class Redundancy:
    """How the node-local level protects each rank's files across nodes: the strategy of a
    :class:`Local` level (``redundancy="single" | "partner" | "xor"``). This one, ``single``,
    keeps one copy and protects nothing. A strategy says what a node holds for the ranks of
    other nodes (:attr:`holds`), whether a loss can be rebuilt (:meth:`recoverable`, torch
    free: ``pitstop ls`` asks it), and does the byte work through
    :mod:`pitstop.levels.redundancy`: write its redundancy after a commit (:meth:`protect`),
    check what this rank's node holds (:meth:`held_ok`), rebuild lost ranks (:meth:`rebuild`).
    Every method runs on every rank of the job (the collective transfers inside)."""

    name = "single"
    holds: str | None = None
    """``copy`` or ``parity``: what a node keeps of another node's ranks (None: nothing)."""

    def recoverable(self, placement: Placement, lost: set[int], held_ok: list[bool]) -> bool:
        """Given per rank whether what its node holds for others is whole."""
        return not lost

    def protect(self, m: Any) -> int:
        """Write this rank's share of the step's redundancy; the bytes it received."""
        return 0

    def held_ok(self, m: Any) -> bool:
        """What this rank's node holds for another's rank is whole and right."""
        return True

    def rebuild(self, m: Any, lost: set[int]) -> dict[str, int]:
        """Rebuild the files of the ranks in ``lost`` (recoverable: checked); bytes by source."""
        if lost:
            raise AssertionError(f"redundancy={self.name!r} cannot rebuild ranks {sorted(lost)}")
        return {}


class Partner(Redundancy):
    """A full copy of each rank's files on the next node of its set (SCR's partner)."""

    name, holds = "partner", "copy"

    def recoverable(self, placement: Placement, lost: set[int], held_ok: list[bool]) -> bool:
        """Every lost rank's copy is whole on a node that kept its own files."""
        return all(
            held_ok[placement.partner_holder(r)] and placement.partner_holder(r) not in lost
            for r in lost
        )

    def protect(self, m: Any) -> int:
        return int(_io().protect_partner(m))

    def held_ok(self, m: Any) -> bool:
        return bool(_io().verify_copy(m))

    def rebuild(self, m: Any, lost: set[int]) -> dict[str, int]:
        return _io().rebuild_partner(m, lost) if lost else {}


class Xor(Redundancy):
    """Rotating XOR parity over the ranks of one local index on a set's nodes (SCR's XOR):
    storage N/(N-1) for sets of N nodes; one lost node per set."""

    name, holds = "xor", "parity"

    def recoverable(self, placement: Placement, lost: set[int], held_ok: list[bool]) -> bool:
        """Each lost rank's XOR set lost no other member, and every survivor's parity is whole."""
        for r in lost:
            members = placement.xor_set(r)
            if sum(x in lost for x in members) > 1:
                return False
            if not all(held_ok[k] for k in members if k != r):
                return False
        return True

    def protect(self, m: Any) -> int:
        return int(_io().protect_xor(m))

    def held_ok(self, m: Any) -> bool:
        return bool(_io().verify_parity(m))

    def rebuild(self, m: Any, lost: set[int]) -> dict[str, int]:
        return _io().rebuild_xor(m, lost) if lost else {}


REDUNDANCY: dict[str, Redundancy] = {c.name: c() for c in (Redundancy, Partner, Xor)}
SCHEMES = tuple(REDUNDANCY)


def _io() -> Any:
    """:mod:`pitstop.levels.redundancy`, the byte work of the strategies (it needs torch;
    the placement and ``pitstop ls`` do not)."""
    return importlib.import_module("pitstop.levels.redundancy")


@dataclass(frozen=True)
class Local:
    """The node-local level: every checkpoint, protected across nodes by ``redundancy``
    (``single``: own node only; ``partner``: plus a full copy on the next node; ``xor``:
    plus rotating parity, storage N/(N-1) for sets of N nodes). ``keep_last`` checkpoints
    are kept (default 2: a crash during a save never leaves none)."""

    path: str | os.PathLike[str]
    redundancy: str = "partner"
    set_size: int = 8
    keep_last: int = 2

    def __post_init__(self) -> None:
        if self.redundancy not in SCHEMES:
            raise ValueError(
                f"Local(redundancy=) must be one of {', '.join(SCHEMES)}, got {self.redundancy!r}"
            )
        if type(self.set_size) is not int or self.set_size < 2:
            raise ValueError(f"Local(set_size=) must be an int >= 2, got {self.set_size!r}")
        if type(self.keep_last) is not int or self.keep_last < 1:
            raise ValueError(f"Local(keep_last=) must be an int >= 1, got {self.keep_last!r}")

    def path_of(self, node: str) -> str:
        return os.fspath(self.path).replace("{node}", node)


@dataclass(frozen=True)
class Shared:
    """A level every rank reaches (a shared or parallel file system, or an object store):
    committed local checkpoints are copied there in the background, verified on the way, with
    their own commit, when its ``schedule`` says so. ``path`` is a directory, an object-store
    URL (``s3://bucket/run``: :class:`~pitstop.storage.ObjectStorage`) or a
    :class:`~pitstop.storage.Storage`.

    * ``every=n``: every n-th local commit (the default schedule, n = 10); or ``schedule=``
      any schedule policy (``EveryN(50) | Every(secs=1800)``), asked after each local commit
      with the commits and seconds since this level's last flush.
    * ``keep_last=n``: this level keeps its newest n checkpoints (default: the manager's
      ``keep_last``/``retention``).
    * ``name``: in logs, flush records and ``last_restore.level`` (default ``shared``; the
      second shared level of a list ``shared-2``, and so on).

    Several shared levels may follow the local one, fastest first: each flushed on its own
    schedule; a restart takes a step from the fastest level that holds it. A list may also
    start with a shared level (no node-local one): every save commits there, and it takes
    no ``every=``/``schedule=``."""

    path: Any
    every: int | None = None
    schedule: CheckpointPolicy | None = None
    keep_last: int | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.every is not None and self.schedule is not None:
            raise ValueError("Shared(): give every= or schedule=, not both")
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise ValueError(f"Shared(every=) must be an int >= 1, got {self.every!r}")
        if self.schedule is not None and not isinstance(self.schedule, CheckpointPolicy):
            raise TypeError(
                "Shared(schedule=) takes a schedule policy (pitstop.EveryN(10), "
                f"pitstop.Every(secs=600), ...), got {self.schedule!r}"
            )
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 1):
            raise ValueError(f"Shared(keep_last=) must be an int >= 1, got {self.keep_last!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"Shared(name=) must be a non-empty string, got {self.name!r}")
        if isinstance(self.path, (str, os.PathLike)) and "{node}" in os.fspath(self.path):
            raise ValueError(
                f"Shared({os.fspath(self.path)!r}): the shared level is one directory for the "
                "whole job; {node} belongs in a Local path"
            )

    def make_schedule(self) -> CheckpointPolicy:
        """A fresh schedule policy for one manager (a policy may keep state)."""
        if self.schedule is not None:
            return copy.deepcopy(self.schedule)
        return EveryN(self.every if self.every is not None else DEFAULT_EVERY)

    def described_every(self) -> int | None:
        """``every`` as levels.json records it (None for another schedule)."""
        if self.schedule is not None:
            return None
        return self.every if self.every is not None else DEFAULT_EVERY


@dataclass(frozen=True)
class Memory:
    """The memory level: snapshots in shared memory (``directory``, a RAM file system) that
    outlive the training process, not the node. It comes first in a list of levels, before
    the level every durable save commits to::

        CheckpointManager([pitstop.Memory(), pitstop.Local("/local/ckpt")], policy=EveryN(20))

    ``ckpt.step()`` takes a memory snapshot every ``every`` steps (the copy into a slot is
    the whole cost to training: the slot *is* the staging arena); the manager's ``policy``
    says which snapshots are also written to the next level (by the keeper). A restart
    restores from memory when the newest snapshot is there, at memory speed.

    * ``slots``: snapshots kept in memory (>= 2): the newest committed one stays intact
      while the next one is copied; a third lets a snapshot be written to disk meanwhile
      (with two, memory snapshots are skipped while the keeper writes one).
    * ``keeper``: hash and write in a keeper process beside training (False: in threads of
      the training process; ``"external"``: a keeper the launcher started on the node,
      ``pitstop keeper DIR``, seals the snapshots and writes a dead trainer's newest; the
      durable saves are written by this process).
    * ``linger_secs``: after the training process dies, the keeper keeps the snapshots that
      long for its restart (which adopts them) before it removes them.
    * ``job``: the token that names the segments (default: derived from the next level's
      path and the user id, the same for every restart of the job; letters, digits, ``_``).
    * ``limit_bytes``: a budget for the slots below what ``directory`` holds.
    * ``redundancy``: ``"single"`` (each node's memory holds its own ranks' snapshots) or
      ``"partner"`` (each snapshot is also copied, in the background, into the memory of
      another node, so a restart after one node is lost still restores from memory; one
      node: single). ``{node}`` in ``directory`` is replaced by the node's id.

    Under torch.distributed every rank keeps its part of each step (docs/memory-level.md).
    If shared memory cannot hold the slots, the manager warns and saves to the next level
    as without this level."""

    slots: int = 3
    every: int = 1
    keeper: bool | str = True
    linger_secs: float = 30.0
    job: str | None = None
    directory: str = "/dev/shm"
    limit_bytes: int | None = None
    redundancy: str = "single"

    def __post_init__(self) -> None:
        if self.redundancy not in ("single", "partner"):
            raise ValueError(
                f"Memory(redundancy=) must be 'single' or 'partner', got {self.redundancy!r}"
            )
        if type(self.slots) is not int or self.slots < 2:
            raise ValueError(f"Memory(slots=) must be an int >= 2, got {self.slots!r}")
        if type(self.every) is not int or self.every < 1:
            raise ValueError(f"Memory(every=) must be an int >= 1, got {self.every!r}")
        if not isinstance(self.keeper, bool) and self.keeper != "external":
            raise TypeError(f"Memory(keeper=) takes True, False or 'external', got {self.keeper!r}")
        if isinstance(self.linger_secs, bool) or not isinstance(self.linger_secs, (int, float)) \
                or not 0 <= self.linger_secs <= 3600:  # fmt: skip
            raise ValueError(
                f"Memory(linger_secs=) must be a number of seconds in [0, 3600], got "
                f"{self.linger_secs!r}"
            )
        if self.job is not None and not (
            isinstance(self.job, str) and JOB_TOKEN.fullmatch(self.job)
        ):
            raise ValueError(f"Memory(job=) takes 1-64 letters, digits or '_', got {self.job!r}")
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            raise ValueError(f"Memory(directory=) takes a directory, got {self.directory!r}")
        if self.limit_bytes is not None and (
            type(self.limit_bytes) is not int or self.limit_bytes < 1
        ):
            raise ValueError(
                f"Memory(limit_bytes=) must be a positive int, got {self.limit_bytes!r}"
            )


def memory_dir(spec: Memory, node: str) -> str:
    """The memory level's directory on ``node`` (``{node}`` replaced)."""
    return os.fspath(spec.directory).replace("{node}", node)


def split_memory(levels: Sequence[Any]) -> tuple[Memory | None, list[Any]]:
    """A list of levels as (its memory level or None, the levels after it): a
    :class:`Memory` comes first and at most once, and a slower level follows it."""
    levels = list(levels)
    memory = [i for i, lv in enumerate(levels) if isinstance(lv, Memory)]
    if not memory:
        return None, levels
    if memory != [0]:
        raise ValueError(
            "pitstop.Memory() comes first in a list of levels, and once (the fastest level); "
            f"got {levels!r}"
        )
    if len(levels) < 2:
        raise ValueError(
            "pitstop.Memory() needs a slower level after it, where durable saves go and "
            "the keeper writes: [pitstop.Memory(), pitstop.Local(path)] or "
            "[pitstop.Memory(), pitstop.Shared(path)]"
        )
    return levels[0], levels[1:]


def check_levels(levels: Sequence[Any]) -> tuple[Local | Shared, list[Shared]]:
    """The first level and the levels after it, in order, of a list of levels
    (``CheckpointManager([...])``): a :class:`Local` or a :class:`Shared` first (every save
    commits there; a first ``Shared`` takes no schedule), then any number of :class:`Shared`
    levels, fastest first; no directory twice, no name twice, no URL (each path goes
    through ``local_path``: refused before any directory is made)."""
    levels = list(levels)
    if not levels or not isinstance(levels[0], (Local, Shared)):
        raise ValueError(
            "a list of levels starts with pitstop.Local(...) or pitstop.Shared(...) (every save "
            f"goes there first), then pitstop.Shared(...) levels, fastest first; got {levels!r}"
        )
    first, shared = levels[0], levels[1:]
    if any(isinstance(lv, Local) for lv in shared):
        raise ValueError(
            f"a list of levels holds at most one pitstop.Local(...), first; got {levels!r}"
        )
    if not all(isinstance(lv, Shared) for lv in shared):
        raise ValueError(
            "a list of levels holds one pitstop.Local(...) or pitstop.Shared(...), then "
            f"pitstop.Shared(...) levels; got {levels!r}"
        )
    if isinstance(first, Shared) and (first.every is not None or first.schedule is not None):
        raise ValueError(
            f"{first!r} is the first level of the list: every save commits there (the manager's "
            "policy says when), so it takes no every= or schedule="
        )
    _check_apart(first, shared)
    names = level_names(levels if isinstance(first, Shared) else shared)
    bad = [n for n in names if not _NAME.fullmatch(n) or n.lower() == "local"]
    if bad or len({n.lower() for n in names}) != len(names):
        raise ValueError(
            "the levels of a list need distinct names of letters, digits, '.', '_' and '-', "
            f"other than 'local': {names}"
        )
    return first, shared


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def level_names(shared: Sequence[Shared]) -> list[str]:
    """The names of the shared levels of a list: ``name``, else ``shared``, ``shared-2``..."""
    return [lv.name or ("shared" if i == 0 else f"shared-{i + 1}") for i, lv in enumerate(shared)]


def _check_apart(first: Local | Shared, shared: list[Shared]) -> None:
    """No directory of one level lies in (or is) another level's: the local level's
    directories (up to ``{node}``) and each shared directory (one level's commit would meet
    another's step, and a copy on "two levels" would be one copy)."""
    dirs = []
    if isinstance(first, Local):
        base = os.fspath(first.path)
        base = base[: base.index("{node}")] if "{node}" in base else base
        dirs.append(("the local level", _real(base or ".")))
    else:
        shared = [first, *shared]
    dirs += [(f"Shared({os.fspath(lv.path)!r})", _real(lv.path)) for lv in shared
             if isinstance(lv.path, (str, os.PathLike)) and object_url(lv.path) is None]  # fmt: skip
    dirs += [(f"Shared({lv.path!r})", lv.path.rstrip("/")) for lv in shared
             if object_url(lv.path) is not None]  # fmt: skip
    for i, (a, pa) in enumerate(dirs):
        for b, pb in dirs[i + 1 :]:
            if pa == pb or _inside(pa, pb) or _inside(pb, pa):
                raise ValueError(
                    f"a list of levels needs a directory of its own for each level: {a} "
                    f"({pa}) and {b} ({pb}) are the same or one holds the other"
                )


def _inside(path: str, parent: str) -> bool:
    return path.startswith(parent.rstrip(os.sep) + os.sep) or path.startswith(
        parent.rstrip("/") + "/"
    )


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(local_path(path))


SERVING = (
    "committed",
    "damaged",
)  # a node's step that may serve a restart (damaged: verified anew)


def manifest_order(digests: Sequence[str]) -> list[str]:
    """The order in which a restart tries the manifests of one node-local step, given the
    digest of the manifest each node holds, in node order ("" where it holds none): the
    manifest the most nodes hold first, ties to the first node's. Restart
    (:mod:`pitstop.levels.restart`) and ``pitstop ls``/``verify`` ask this one
    function."""
    held = [d for d in digests if d]
    return sorted(dict.fromkeys(held), key=lambda d: -held.count(d))  # stable: first node


def node_ids(
    topology: Mapping[int, str] | Sequence[str] | None, rank: int, gather: object
) -> list[str]:
    """Every rank's node id (see the module docstring); ``gather(obj)`` all-gathers."""
    if topology is not None:
        ids = [str(topology[r]) for r in range(len(topology))]
        if not all(ids) or any("/" in n or n in (".", "..") for n in ids):
            raise ValueError(f"topology= node ids must be non-empty names without '/': {ids}")
        return ids
    node, per_node = env_node()
    host = socket.gethostname() or "localhost"
    words = [tuple(w) for w in gather((node, host))]  # type: ignore[operator]
    ids = []
    for r, (given, h) in enumerate(words):
        on_host = sum(1 for g, other in words if g is None and other == h)
        if given is None:  # a host that runs more ranks than a node has: emulated nodes
            given = f"{h}-{r // per_node}" if per_node and on_host > per_node else h
        if "/" in given or given in (".", ".."):
            raise ValueError(f"PITSTOP_NODE of rank {r} must be a name without '/', got {given!r}")
        ids.append(str(given))
    return ids


class Placement:
    """Nodes, sets, leaders, partners and XOR sets of a job (see the module docstring)."""

    def __init__(self, nodes: Sequence[str], scheme: str, set_size: int = 8) -> None:
        self.nodes = list(nodes)
        self.order = list(dict.fromkeys(self.nodes))  # nodes by their first rank
        self.ranks_of = {n: [r for r, m in enumerate(self.nodes) if m == n] for n in self.order}
        self.leaders = tuple(self.ranks_of[n][0] for n in self.nodes)
        self.scheme = scheme
        if scheme != "single" and len(self.order) < 2:
            self.scheme = "single"  # one node: nothing to protect against; said by the caller
        counts = {len(v) for v in self.ranks_of.values()}
        if self.scheme != "single" and len(counts) > 1:
            raise UnsupportedSetupError(
                f"redundancy={scheme!r} needs the same number of ranks on every node; "
                f"ranks per node: { {n: len(v) for n, v in self.ranks_of.items()} }",
                phase="replicate",
            )
        sets = [self.order[i : i + set_size] for i in range(0, len(self.order), set_size)]
        if len(sets) > 1 and len(sets[-1]) < 2:
            sets[-2].extend(sets.pop())  # a set of one node protects nothing
        self.set_of_node = {n: i for i, s in enumerate(sets) for n in s}
        self.sets = sets
        self.redundancy: Redundancy = REDUNDANCY[self.scheme]

    def local_index(self, rank: int) -> int:
        return self.ranks_of[self.nodes[rank]].index(rank)

    def _ring(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s local index on the nodes of its set, in ring order."""
        i = self.local_index(rank)
        return [self.ranks_of[n][i] for n in self.sets[self.set_of_node[self.nodes[rank]]]]

    def partner_holder(self, rank: int) -> int:
        """The rank whose node keeps ``rank``'s partner copy."""
        ring = self._ring(rank)
        return ring[(ring.index(rank) + 1) % len(ring)]

    def partner_source(self, rank: int) -> int:
        """The rank whose partner copy ``rank``'s node keeps."""
        ring = self._ring(rank)
        return ring[ring.index(rank) - 1]

    def xor_set(self, rank: int) -> list[int]:
        return self._ring(rank)

    def recoverable(self, lost: set[int], held_ok: list[bool]) -> bool:
        """Whether a step whose ranks in ``lost`` lost their files can be rebuilt, given per
        rank whether what its node holds for others is whole (see :class:`Redundancy`)."""
        return self.redundancy.recoverable(self, lost, held_ok)

    def describe(self) -> dict[str, object]:
        """For levels.json and manifests: enough for ``pitstop ls`` to say who holds what."""
        return {"nodes": self.nodes, "scheme": self.scheme, "sets": self.sets}
