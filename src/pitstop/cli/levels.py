"""``pitstop ls`` of a multi-level setup (``levels=``), how the setup is read (also for
``pitstop verify``, :mod:`pitstop.cli.levels_verify`), and the guard that keeps
whole-checkpoint commands (``diff``, ``export``) off a node's directory.

A root holding ``levels.json`` (the shared root or any node's directory) stands for the
whole setup: the file names the node-local template, the redundancy and every rank's node.
The directory given wins over the paths recorded, so that a copied tree resolves inside the
copy: given the shared root, that directory is the shared level; given node X's directory,
the other nodes' directories are derived from it (the template with X's path replaced by
the one given; if the copy renamed it, only X's directory is the one given). Relative
recorded paths start at the directory the job ran in, recovered from the one given. What
was used instead of the recorded paths is said.

A local step is judged as the restore judges it (:mod:`pitstop.levels.stack`): its
manifest is the one the most nodes hold (ties: the lowest rank's node) that fits the world
size, the next one if the step cannot be rebuilt from it; a node whose manifest is missing,
differs, does not parse or is marked lacks it (a restart rewrites it), and its ranks' files
are checked against the agreed one; :meth:`Placement.recoverable` says whether the step can
be rebuilt. Nothing is written into a node's directory: only the shared level's
checkpoints are marked damaged, as ``pitstop verify`` marks any root's. No torch at import;
verifying the local level imports :mod:`pitstop.levels.redundancy` (torch) when run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pitstop.cli.main import _human, _UsageError, catalog_of, ls_rows, print_ls
from pitstop.engine.catalog import Entry
from pitstop.errors import CheckpointError, CorruptCheckpointError
from pitstop.format.jsonsafe import load_json
from pitstop.format.manifest import Manifest, manifest_digest
from pitstop.format.names import LEVELS_FILE, parse_step_dir, step_dir_name
from pitstop.levels.spec import SCHEMES, SERVING, manifest_order

__all__ = [
    "Levels", "levels_root", "ls_levels", "node_note", "read_levels", "refuse_node_dir",
]  # fmt: skip

_SHOWN = 8  # node names shown on one line before "+N more"


@dataclass(frozen=True)
class _Unusable:
    """Why a node's directory cannot be listed: a word for ``ls``, a sentence."""

    word: str
    text: str


_Scans = dict[str, "list[Entry] | _Unusable"]  # node -> its step directories, or why not


@dataclass
class Levels:
    """levels.json, its paths resolved (see the module docstring)."""

    local: str  # the template, with {node}
    shared: str | None  # its directory (None: none, or a storage that is not a directory)
    shared_url: str | None  # as levels.json says
    scheme: str
    set_size: int
    nodes: list[str]  # every rank's node
    doc: dict[str, Any]
    level: str | None = None  # which level the directory given is: "local", "shared"
    node: str | None = None  # the node whose directory was given
    dirs: dict[str, str] = field(default_factory=dict)  # a node's directory off the template
    notes: list[str] = field(default_factory=list)  # paths used instead of the recorded ones

    @property
    def order(self) -> list[str]:
        """The nodes, each once, by their first rank."""
        return list(dict.fromkeys(self.nodes))

    def node_dir(self, node: str) -> str:
        return self.dirs.get(node) or self.local.replace("{node}", node)

    def ranks(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]


def _valid(doc: Any) -> bool:
    if not isinstance(doc, dict):
        return False
    nodes, size, level = doc.get("nodes"), doc.get("set_size"), doc.get("level")
    return (
        isinstance(doc.get("local"), str) and doc.get("redundancy") in SCHEMES
        and isinstance(doc.get("shared"), (str, type(None)))
        and type(size) is int and size >= 2 and isinstance(nodes, list) and bool(nodes)
        and all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in nodes)
        and level in (None, "local", "shared") and (level != "local" or doc.get("node") in nodes)
    )  # fmt: skip


def _local_path(path: object) -> bool:
    return isinstance(path, str) and bool(path) and "://" not in path


def _base(root: str, doc: dict[str, Any]) -> str:
    """Where the relative paths of ``doc`` start (the directory the job ran in): the one
    ROOT is reached from by one of them, else the working directory or the nearest
    directory above ROOT under which a node's directory exists."""
    root = os.path.abspath(root)
    local = [doc["local"].replace("{node}", n) for n in doc["nodes"]]
    shared = [doc["shared"]] if _local_path(doc["shared"]) else []
    for rel in local + shared:
        rel = os.path.normpath(rel)
        if not os.path.isabs(rel) and rel != "." and root.endswith(os.sep + rel):
            return root[: len(root) - len(rel)] or os.sep
    bases, up = [os.getcwd()], root
    while os.path.dirname(up) != up:
        up = os.path.dirname(up)
        bases.append(up)
    found = (b for b in bases if any(os.path.isdir(os.path.join(b, p)) for p in local))
    return next(found, os.getcwd())


def read_levels(root: str) -> Levels:
    """The setup ``root/levels.json`` describes; a file pitstop did not write is an error."""
    path = os.path.join(root, LEVELS_FILE)
    try:
        with open(path, "rb") as f:
            doc = load_json(f.read(1 << 20), what=LEVELS_FILE, path=path)
    except OSError as e:
        raise _UsageError(f"{path}: {e.strerror or e}") from None
    if not _valid(doc):
        raise CorruptCheckpointError(f"{path} is not a levels file pitstop wrote", path=path)
    base = _base(root, doc)
    shared = doc["shared"]
    lv = Levels(
        os.path.normpath(os.path.join(base, doc["local"])),
        os.path.join(base, shared) if _local_path(shared) else None, shared or None,
        doc["redundancy"], doc["set_size"], list(doc["nodes"]), doc,
    )  # fmt: skip
    _resolve(lv, os.path.abspath(root))
    return lv


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def _resolve(lv: Levels, given: str) -> None:
    """Which level ``given`` is, and its path over the recorded one (the module docstring)."""
    lv.level, lv.node = lv.doc.get("level"), lv.doc.get("node")
    if lv.level is None:  # written before levels.json said: find it among the recorded paths
        if lv.shared is not None and _same(lv.shared, given):
            lv.level = "shared"
        lv.node = next((n for n in lv.order if _same(lv.node_dir(n), given)), None)
        lv.level = lv.level or ("local" if lv.node else None)
    if lv.level == "shared" and (lv.shared is None or not _same(lv.shared, given)):
        lv.notes.append(f"shared level: {given}, the directory given ({LEVELS_FILE} records "
                        f"{lv.shared_url})")  # fmt: skip
        lv.shared = given
        lv.notes.append(f"local level: {lv.local}, as {LEVELS_FILE} records")
    if lv.level != "local" or lv.node is None or _same(lv.node_dir(lv.node), given):
        return
    if lv.shared_url is not None:
        lv.notes.append(f"shared level: {lv.shared or lv.shared_url}, as {LEVELS_FILE} records")
    template = _template(lv.local, lv.node, given)
    if template is not None:
        lv.notes.append(f"local level: {template}, from node {lv.node}'s directory given "
                        f"({LEVELS_FILE} records {lv.local})")  # fmt: skip
        lv.local = template
    else:
        lv.dirs[lv.node] = given
        lv.notes.append(f"node {lv.node}: {given}, the directory given; the other nodes' as "
                        f"{LEVELS_FILE} records ({lv.local})")  # fmt: skip


def _template(template: str, node: str, given: str) -> str | None:
    """``template`` moved to where ``given`` is node ``node``'s directory; None if ``given``
    does not end as ``node``'s directory does (from the first part holding ``{node}``)."""
    parts = template.split(os.sep)
    first = next((i for i, p in enumerate(parts) if "{node}" in p), None)
    if first is None:  # no {node}: one node, its directory is the one given
        return given
    tail, have = parts[first:], given.split(os.sep)
    if len(have) <= len(tail) or have[-len(tail) :] != [p.replace("{node}", node) for p in tail]:
        return None
    return os.sep.join(have[: -len(tail)] + tail)


def levels_root(path: str) -> tuple[str, int | None] | None:
    """The root holding levels.json that ``path`` is (or one step directory under it, whose
    step is returned too); None if ``path`` is no level of a multi-level setup."""
    norm = os.path.normpath(path)
    if os.path.isfile(os.path.join(norm, LEVELS_FILE)):
        return norm, None
    step, parent = parse_step_dir(os.path.basename(norm)), os.path.dirname(norm) or "."
    if step is not None and os.path.isfile(os.path.join(parent, LEVELS_FILE)):
        return parent, step
    return None


def _node_level(path: str) -> tuple[Levels, int | None] | None:
    """The setup of node directory ``path`` (or a step directory in one) and the step."""
    found = levels_root(path)
    if found is None:
        return None
    lv = read_levels(found[0])
    return (lv, found[1]) if lv.level == "local" and lv.node is not None else None


def refuse_node_dir(path: str, step: int | None, command: str) -> None:
    """``diff`` and ``export`` read whole checkpoints: a node's directory of a setup with
    more than one node holds only its node's ranks (reading it would find the other ranks'
    files missing), so it is refused, pointing at the shared level."""
    found = _node_level(path)
    if found is None or len(found[0].order) < 2:
        return  # not a node's directory, or the only node's: it holds every rank
    lv, step = found[0], found[1] if step is None else step
    where = (
        f"{command} the shared level instead ({lv.shared})" if lv.shared is not None
        else f"the shared level is {lv.shared_url}" if lv.shared_url is not None
        else "there is no shared level: CheckpointManager(...) rebuilds the state"
    )  # fmt: skip
    if step is not None and lv.shared is not None and not _shared_has(lv, step, committed=True):
        where += f"; step {step} was not flushed to it (`pitstop ls {lv.shared}`)"
    raise _UsageError(
        f"{path} is node {lv.node}'s directory of a multi-level checkpoint: it holds only "
        f"the files of that node's rank(s) {_ranks(lv.ranks(lv.node or ''))} (and the "
        f"redundancy it keeps for other nodes), not a whole checkpoint; {where}"
    )


def node_note(path: str) -> str | None:
    """``pitstop inspect``'s line for a node's directory (None: ``path`` is not one)."""
    try:
        found = _node_level(path)
    except (CheckpointError, _UsageError):
        return None
    if found is None or found[0].node is None or len(found[0].order) < 2:
        return None  # not a node's directory, or the only node's: it holds every rank
    lv, node = found[0], found[0].node
    return (
        f"level    local: node {node}'s directory holds the files of rank(s) "
        f"{_ranks(lv.ranks(node))} of {len(lv.nodes)} only (`pitstop verify` checks them all)"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


# ---------------------------------------------------------------------- the steps of the nodes
def _scan_nodes(lv: Levels) -> _Scans:
    """Every node's step directories, or why its directory cannot be listed."""
    out: _Scans = {}
    for node in lv.order:
        path = lv.node_dir(node)
        if not os.path.lexists(path):
            out[node] = _Unusable("missing", f"{path} does not exist")
            continue
        if not os.path.isdir(path):
            out[node] = _Unusable("not a directory", f"{path} is not a directory")
            continue
        catalog = catalog_of(path)
        try:
            out[node] = [e for e in catalog.scan() if e.is_step_dir and e.step is not None]
        except (CheckpointError, OSError) as e:
            out[node] = _Unusable("unreadable", f"{path} cannot be read: {e}")
        finally:
            catalog.close()
    return out


@dataclass
class _Step:
    """One local step on every node: each node's entry and the digest of the manifest it
    holds (marked or not), the manifests by digest in the restore's order of candidates
    (the most held first, ties: the lowest rank's node)."""

    step: int
    here: dict[str, Entry]
    held: dict[str, str]
    candidates: dict[str, Manifest]

    def holders(self, digest: str, *, unmarked: bool = True) -> list[str]:
        return [n for n, d in self.held.items() if d == digest
                and (not unmarked or self.here[n].status == "committed")]  # fmt: skip

    def usable(self, world_size: int) -> dict[str, Manifest]:
        return {d: m for d, m in self.candidates.items() if m.world_size == world_size}


def _steps(lv: Levels, scans: _Scans) -> dict[int, _Step]:
    """Every step any node has a directory of."""
    by: dict[int, dict[str, Entry]] = {}
    for node, entries in scans.items():
        for e in entries if isinstance(entries, list) else []:
            by.setdefault(e.step or 0, {})[node] = e
    out = {}
    for s, here in sorted(by.items()):
        manifests = {
            n: e.manifest for n, e in here.items() if e.status in SERVING and e.manifest is not None
        }
        held = {n: manifest_digest(manifests[n]) for n in lv.order if n in manifests}
        order = manifest_order(list(held.values()))  # as the restart tries them
        first = {d: next(n for n in held if held[n] == d) for d in order}
        out[s] = _Step(s, here, held, {d: manifests[first[d]] for d in order})
    return out


def _node_word(st: _Step, node: str, scans: _Scans, agreed: str | None) -> str:
    """What ``node`` holds of the step when it is not the agreed manifest, unmarked."""
    scan, e = scans[node], st.here.get(node)
    if isinstance(scan, _Unusable):
        return scan.word
    if e is None:
        return "missing"
    if node in st.held and st.held[node] != agreed:
        return "other manifest" if e.status == "committed" else f"{e.status}, other manifest"
    return e.status


def _agreed(lv: Levels, st: _Step) -> str | None:
    """The digest of the manifest the restore would try first."""
    return next(iter(st.usable(len(lv.nodes)) or st.candidates), None)


# ---------------------------------------------------------------------- ls
def _shared_rows(lv: Levels) -> list[dict[str, Any]] | None:
    if lv.shared is None:
        return None
    catalog = catalog_of(lv.shared)
    try:
        return ls_rows(catalog)
    finally:
        catalog.close()


def _local_rows(
    lv: Levels, scans: _Scans, steps: dict[int, _Step], flushed: set[int] | None
) -> list[dict[str, Any]]:
    rows = []
    for step, st in steps.items():
        digest = _agreed(lv, st)
        m = st.candidates[digest] if digest is not None else None
        on = st.holders(digest) if digest is not None else []
        others = {n: _node_word(st, n, scans, digest) for n in lv.order if n not in on}
        status = "committed" if on else next(w for w in others.values() if w != "missing")
        rows.append({
            "step": step, "name": step_dir_name(step), "status": status,
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix_secs))
            if m else "-",
            "bytes": m.nbytes if m else None, "world_size": m.world_size if m else None,
            "scheme": lv.scheme, "nodes": on, "not_committed": others,
            "flushed": None if flushed is None else step in flushed,
        })  # fmt: skip
    return rows


def _names(names: list[str]) -> str:
    more = len(names) - _SHOWN
    return " ".join(names[:_SHOWN]) + (f" (+{more} more)" if more > 0 else "")


def _print_local(lv: Levels, rows: list[dict[str, Any]]) -> None:
    print(f"local level: {lv.local} (redundancy {lv.scheme}, {len(lv.order)} nodes)")
    if not rows:
        print("  no checkpoints")
        return
    print(f"{'STEP':>12}  {'TIME':19}  {'SIZE':>10}  {'SCHEME':7}  FLUSHED TO SHARED  NODES")
    for r in rows:
        flushed = "-" if r["flushed"] is None else "yes" if r["flushed"] else "no"
        size = "-" if r["bytes"] is None else _human(r["bytes"])
        on = f": {_names(r['nodes'])}" if r["nodes"] else ""
        nodes = f"{len(r['nodes'])}/{len(lv.order)}{on}"
        gone = [f"{n}: {st}" for n, st in r["not_committed"].items()]
        if gone:
            nodes += " (" + ", ".join(gone[:_SHOWN]) + (", ...)" if len(gone) > _SHOWN else ")")
        print(
            f"{r['step']:>12}  {r['time']:19}  {size:>10}  {r['scheme']:7}  {flushed:17}  {nodes}"
        )


def _print_notes(lv: Levels) -> None:
    for note in lv.notes:
        print(f"paths: {note}")


def _print_unusable(scans: _Scans) -> None:
    for node, entries in scans.items():
        if isinstance(entries, _Unusable):
            print(f"node {node}: {entries.text}")


def _describe(lv: Levels, scans: _Scans) -> dict[str, Any]:
    doc = dict(lv.doc, local=lv.local, shared=lv.shared, paths_used=lv.notes)
    doc["node_dirs"] = [
        {"node": n, "path": lv.node_dir(n), "exists": not isinstance(scan, _Unusable),
         "problem": scan.text if isinstance(scan, _Unusable) else None, "ranks": lv.ranks(n)}
        for n, scan in scans.items()
    ]  # fmt: skip
    return doc


def ls_levels(args: argparse.Namespace) -> int:
    """``pitstop ls`` of a root with levels.json: the shared level, then the local level."""
    lv = read_levels(args.dir)
    shared = _shared_rows(lv)
    flushed = None if shared is None else {r["step"] for r in shared if r["status"] == "committed"}
    scans = _scan_nodes(lv)
    local = _local_rows(lv, scans, _steps(lv, scans), flushed)
    if args.json:
        print(
            json.dumps({"levels": _describe(lv, scans), "shared": shared, "local": local}, indent=1)
        )
        return 0
    every = lv.doc.get("every")
    when = f"every {every}" if isinstance(every, int) else "on its own schedule"
    print(f"disk levels of {os.path.abspath(args.dir)}: local every step, shared {when}"
          if lv.shared_url else f"disk levels of {os.path.abspath(args.dir)}: local only")  # fmt: skip
    _print_notes(lv)
    print()
    if lv.shared is not None and shared is not None:
        print(f"shared level: {lv.shared}")
        print_ls(lv.shared, shared)
        print()
    elif lv.shared_url is not None:
        print(f"shared level: {lv.shared_url}: not a local directory, not listed\n")
    _print_local(lv, local)
    _print_unusable(scans)
    _print_more_levels(lv)
    return 0


def _print_more_levels(lv: Levels) -> None:
    """The shared levels after the first (``levels`` in levels.json): named, each to be
    listed as a root of its own."""
    more = lv.doc.get("levels")
    if not isinstance(more, list) or len(more) < 2:
        return
    shown = {lv.shared_url, lv.shared}
    print("\nthe other shared levels (list each with `pitstop ls URL`; FLUSHED TO SHARED "
          "above is of the shared level listed):")  # fmt: skip
    for d in more:
        if isinstance(d, dict) and d.get("url") not in shown:
            every = d.get("every")
            when = f"every {every}" if isinstance(every, int) else "on its own schedule"
            print(f"  {d.get('name')}: {d.get('url')} ({when})")


def _shared_has(lv: Levels, step: int, *, committed: bool = False) -> bool:
    return any(
        r["step"] == step and r["name"] == step_dir_name(step)
        and (not committed or r["status"] == "committed")
        for r in _shared_rows(lv) or []
    )  # fmt: skip
