"""``pitstop ls`` and ``pitstop verify`` of a multi-level setup (``levels=``).

A root holding ``levels.json`` (the shared root or any node's directory) stands for the
whole setup: the file names the node-local template, the redundancy and every rank's node,
so the node directories are found from it (a relative path in it is taken relative to the
directory the job ran in, recovered from ROOT when ROOT is one of the levels). The local
level is listed by step: on which nodes it is committed, its protection, whether the
shared level has it too. ``verify`` checks, for every rank, its own files on its node and
the partner copy or parity block its node keeps, and says whether a restart could rebuild
the step (:meth:`Placement.recoverable`, the rule the restore applies). No torch at import;
verifying the local level imports :mod:`pitstop.multilevel.redundancy` (torch) when run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pitstop.cli.main import _human, _UsageError, catalog_of, ls_rows, print_ls, verify_root
from pitstop.engine.catalog import Entry
from pitstop.errors import CorruptCheckpointError
from pitstop.format.jsonsafe import load_json
from pitstop.format.manifest import Manifest
from pitstop.format.names import LEVELS_FILE, step_dir_name
from pitstop.multilevel.levels import SCHEMES, Placement

__all__ = ["Levels", "ls_levels", "read_levels", "verify_levels"]

_SHOWN = 8  # node names shown on one line before "+N more"


@dataclass
class Levels:
    """levels.json, its paths made absolute."""

    local: str  # the template, with {node}
    shared: str | None  # its directory (None: none, or a storage that is not a directory)
    shared_url: str | None  # as levels.json says
    scheme: str
    set_size: int
    nodes: list[str]  # every rank's node
    doc: dict[str, Any]

    @property
    def order(self) -> list[str]:
        """The nodes, each once, by their first rank."""
        return list(dict.fromkeys(self.nodes))

    def node_dir(self, node: str) -> str:
        return self.local.replace("{node}", node)


def _valid(doc: Any) -> bool:
    if not isinstance(doc, dict):
        return False
    nodes, size = doc.get("nodes"), doc.get("set_size")
    return (
        isinstance(doc.get("local"), str) and doc.get("redundancy") in SCHEMES
        and isinstance(doc.get("shared"), (str, type(None)))
        and type(size) is int and size >= 2 and isinstance(nodes, list) and bool(nodes)
        and all(isinstance(n, str) and n and "/" not in n and n not in (".", "..") for n in nodes)
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
    return Levels(
        os.path.join(base, doc["local"]),
        os.path.join(base, shared) if _local_path(shared) else None, shared or None,
        doc["redundancy"], doc["set_size"], list(doc["nodes"]), doc,
    )  # fmt: skip


def _scan_nodes(lv: Levels) -> dict[str, list[Entry] | None]:
    """Every node's step directories (None: the node's directory does not exist)."""
    out: dict[str, list[Entry] | None] = {}
    for node in lv.order:
        path = lv.node_dir(node)
        if not os.path.isdir(path):
            out[node] = None
            continue
        catalog = catalog_of(path)
        try:
            out[node] = [e for e in catalog.scan() if e.is_step_dir and e.step is not None]
        finally:
            catalog.close()
    return out


def _by_step(scans: dict[str, list[Entry] | None]) -> dict[int, dict[str, Entry]]:
    """Step -> node -> its entry there, for the steps committed on at least one node."""
    out: dict[int, dict[str, Entry]] = {}
    for node, entries in scans.items():
        for e in entries or []:
            out.setdefault(e.step or 0, {})[node] = e
    return {s: h for s, h in out.items() if any(e.status == "committed" for e in h.values())}


def _manifest(here: dict[str, Entry]) -> Manifest:
    """The step's manifest (the global one: every node that committed it has the same)."""
    m = next(e.manifest for e in here.values() if e.status == "committed")
    assert m is not None
    return m


def _shared_rows(lv: Levels) -> list[dict[str, Any]] | None:
    if lv.shared is None:
        return None
    catalog = catalog_of(lv.shared)
    try:
        return ls_rows(catalog)
    finally:
        catalog.close()


def _local_rows(
    lv: Levels, scans: dict[str, list[Entry] | None], flushed: set[int] | None
) -> list[dict[str, Any]]:
    rows = []
    for step, here in sorted(_by_step(scans).items()):
        on = [n for n in lv.order if n in here and here[n].status == "committed"]
        m = _manifest(here)
        others = {n: here[n].status if n in here else "missing" for n in lv.order if n not in on}
        rows.append({
            "step": step, "name": step_dir_name(step),
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix_secs)),
            "bytes": m.nbytes, "world_size": m.world_size, "scheme": lv.scheme,
            "nodes": on, "not_committed": others,
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
    print(f"{'STEP':>12}  {'TIME':19}  {'SIZE':>10}  {'SCHEME':7}  {'FLUSHED':7}  NODES")
    for r in rows:
        flushed = "-" if r["flushed"] is None else "yes" if r["flushed"] else "no"
        nodes = f"{len(r['nodes'])}/{len(lv.order)}: {_names(r['nodes'])}"
        gone = [f"{n}: {st}" for n, st in r["not_committed"].items()]
        if gone:
            nodes += " (" + ", ".join(gone[:_SHOWN]) + (", ...)" if len(gone) > _SHOWN else ")")
        print(
            f"{r['step']:>12}  {r['time']:19}  {_human(r['bytes']):>10}  {r['scheme']:7}  "
            f"{flushed:7}  {nodes}"
        )


def _print_missing_nodes(lv: Levels, scans: dict[str, list[Entry] | None]) -> None:
    for node, entries in scans.items():
        if entries is None:
            print(f"node {node}: {lv.node_dir(node)} does not exist")


def _describe(lv: Levels, scans: dict[str, list[Entry] | None]) -> dict[str, Any]:
    doc = dict(lv.doc, local=lv.local, shared=lv.shared)
    doc["node_dirs"] = [
        {"node": n, "path": lv.node_dir(n), "exists": scans[n] is not None,
         "ranks": [r for r, m in enumerate(lv.nodes) if m == n]}
        for n in lv.order
    ]  # fmt: skip
    return doc


def ls_levels(args: argparse.Namespace) -> int:
    """``pitstop ls`` of a root with levels.json: the shared level, then the local level."""
    lv = read_levels(args.dir)
    shared = _shared_rows(lv)
    flushed = None if shared is None else {r["step"] for r in shared if r["status"] == "committed"}
    scans = _scan_nodes(lv)
    local = _local_rows(lv, scans, flushed)
    if args.json:
        print(
            json.dumps({"levels": _describe(lv, scans), "shared": shared, "local": local}, indent=1)
        )
        return 0
    every = lv.doc.get("every")
    print(f"levels of {os.path.abspath(args.dir)}: local every step, shared every {every}\n"
          if lv.shared_url else f"levels of {os.path.abspath(args.dir)}: local only\n")  # fmt: skip
    if lv.shared is not None and shared is not None:
        print(f"shared level: {lv.shared}")
        print_ls(lv.shared, shared)
        print()
    elif lv.shared_url is not None:
        print(f"shared level: {lv.shared_url}: not a local directory, not listed\n")
    _print_local(lv, local)
    _print_missing_nodes(lv, scans)
    return 0


# ---------------------------------------------------------------------- verify
@dataclass
class _RankCheck:
    """One rank's pieces of one local step: ``ok``, ``bad`` or ``missing`` (None: the
    scheme has no such piece)."""

    rank: int
    node: str
    own: str
    copy: str | None
    parity: str | None

    def problem(self) -> bool:
        return "bad" in (self.own, self.copy, self.parity) or self.own == "missing"

    def describe(self, placement: Placement) -> str:
        def word(s: str | None) -> str:
            return "ok" if s == "ok" else str(s).upper()

        text = f"rank {self.rank} on {self.node}: own files {word(self.own)}"
        if self.copy is not None:
            text += (
                f", partner copy of rank {placement.partner_source(self.rank)} {word(self.copy)}"
            )
        if self.parity is not None:
            text += f", parity {word(self.parity)}"
        return text


def _check_rank(lv: Levels, placement: Placement, manifest: Manifest, rank: int) -> _RankCheck:
    from pitstop.multilevel.redundancy import Member, verify_copy, verify_own, verify_parity
    from pitstop.options import IOOptions
    from pitstop.storage.local import LocalStorage

    node = lv.nodes[rank]
    storage = LocalStorage(lv.node_dir(node), IOOptions())
    name = step_dir_name(manifest.step)
    m = Member(storage, name, manifest, placement, None, rank)  # type: ignore[arg-type]
    absent = storage.entry_kind(name) != "dir" or any(
        not os.path.lexists(os.path.join(storage.root, name, f.name)) for f, _ in m.files()
    )
    own = "missing" if absent else "ok" if verify_own(m) else "bad"
    copy = ("ok" if verify_copy(m) else "bad") if placement.scheme == "partner" else None
    parity = ("ok" if verify_parity(m) else "bad") if placement.scheme == "xor" else None
    return _RankCheck(rank, node, own, copy, parity)


@contextlib.contextmanager
def _pinned(lv: Levels, here: dict[str, Entry], name: str) -> Iterator[None]:
    """Hold the step on every node that committed it (retention waits), as verify does."""
    with contextlib.ExitStack() as stack:
        for node, e in here.items():
            if e.status == "committed":
                catalog = catalog_of(lv.node_dir(node))
                stack.callback(catalog.close)
                stack.enter_context(catalog.pin(name))
        yield


def _verify_step(lv: Levels, placement: Placement, step: int, here: dict[str, Entry]) -> bool:
    """Print what one local step holds and whether a restart could rebuild it."""
    name = step_dir_name(step)
    manifest = _manifest(here)
    if manifest.world_size != len(lv.nodes):
        print(f"{name}: NOT RECOVERABLE: written by {manifest.world_size} ranks; "
              f"{LEVELS_FILE} places {len(lv.nodes)}")  # fmt: skip
        return False
    with _pinned(lv, here, name):
        checks = [_check_rank(lv, placement, manifest, r) for r in range(len(lv.nodes))]
    lost = {c.rank for c in checks if c.own != "ok"}
    ok = placement.recoverable(
        lost, [c.copy in ("ok", None) for c in checks], [c.parity in ("ok", None) for c in checks]
    )
    problems = [c for c in checks if c.problem()]
    if not problems:
        print(f"{name}: ok ({len(checks)} ranks on {len(placement.order)} nodes, {lv.scheme})")
    elif ok:
        print(f"{name}: recoverable ({lv.scheme}: a restart rebuilds what is lost or bad)")
    else:
        print(f"{name}: NOT RECOVERABLE on the local level ({lv.scheme})")
    for c in problems:
        print(f"  - {c.describe(placement)}")
    return ok


def _verify_local(
    lv: Levels, args: argparse.Namespace, scans: dict[str, list[Entry] | None]
) -> int:
    print(f"local level: {lv.local} (redundancy {lv.scheme}, {len(lv.order)} nodes)")
    _print_missing_nodes(lv, scans)
    steps = _by_step(scans)
    chosen = sorted(steps, reverse=True)
    if args.step is not None:
        chosen = [s for s in chosen if s == args.step]
        if not chosen:
            print(f"  no checkpoint of step {args.step} on this level")
            return 0
    if not chosen:
        print("  no checkpoints to verify")
        return 0
    try:
        importlib.import_module("pitstop.multilevel.redundancy")  # imports torch
    except ImportError as e:
        raise _UsageError(
            f"verifying the local level needs torch ({e}); --level shared does not"
        ) from None
    placement = Placement(lv.nodes, lv.scheme, lv.set_size)
    return sum(not _verify_step(lv, placement, s, steps[s]) for s in chosen)


def _shared_has(lv: Levels, step: int) -> bool:
    return any(
        r["step"] == step and r["name"] == step_dir_name(step) for r in _shared_rows(lv) or []
    )


def _verify_shared(lv: Levels, args: argparse.Namespace, has_step: bool) -> int:
    assert lv.shared is not None
    print(f"shared level: {lv.shared}")
    if not has_step:
        print(f"  no checkpoint of step {args.step} on this level")
        return 0
    catalog = catalog_of(lv.shared)
    try:
        return verify_root(catalog, None, args)
    finally:
        catalog.close()


def verify_levels(args: argparse.Namespace) -> int:
    """``pitstop verify`` of a root with levels.json: 1 if a shared checkpoint is bad or a
    local step could not be rebuilt, else 0 (a damaged but recoverable step is reported)."""
    lv = read_levels(args.dir)
    level = args.level or "all"
    if level == "shared" and lv.shared is None:
        what = (
            f"a shared level that is no directory ({lv.shared_url})"
            if lv.shared_url
            else "no shared level"
        )
        raise _UsageError(f"{os.path.join(args.dir, LEVELS_FILE)} names {what}")
    shared = lv.shared if level != "local" else None
    scans = _scan_nodes(lv) if level != "shared" else {}
    steps = _by_step(scans)
    in_shared = shared is not None and (args.step is None or _shared_has(lv, args.step))
    if args.step is not None and not in_shared and args.step not in steps:
        where = "any level" if level == "all" else f"the {level} level"
        raise _UsageError(f"{args.dir}: no checkpoint of step {args.step} on {where}")
    bad = 0
    if shared is not None:
        bad += _verify_shared(lv, args, in_shared)
        print()
    elif level == "all" and lv.shared_url is not None:
        print(f"shared level: {lv.shared_url}: not a local directory, not verified\n")
    if level != "shared":
        bad += _verify_local(lv, args, scans)
    return 1 if bad else 0
