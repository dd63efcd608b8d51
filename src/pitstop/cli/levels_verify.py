"""``pitstop verify`` of a multi-level setup: each local step judged as the restore judges
it, and the shared level verified as any root (see :mod:`pitstop.cli.levels` for how the
setup is read from ``levels.json``). Nothing is written into a node's directory.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from pitstop.cli.levels import (
    Levels,
    _node_word,
    _print_notes,
    _print_unusable,
    _scan_nodes,
    _Scans,
    _shared_has,
    _Step,
    _steps,
    _Unusable,
    read_levels,
)
from pitstop.cli.main import _UsageError, catalog_of, verify_root
from pitstop.errors import CheckpointError
from pitstop.format.manifest import Manifest
from pitstop.format.names import LEVELS_FILE, step_dir_name
from pitstop.levels.spec import Placement

__all__ = ["verify_levels"]


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
    from pitstop.levels.redundancy import Member, verify_own
    from pitstop.options import IOOptions
    from pitstop.storage.local import LocalStorage

    node = lv.nodes[rank]
    storage = LocalStorage(lv.node_dir(node), IOOptions())
    name = step_dir_name(manifest.step)
    m = Member(storage, name, manifest, placement, None, rank)  # type: ignore[arg-type]
    try:
        absent = storage.entry_kind(name) != "dir" or any(
            not os.path.lexists(os.path.join(storage.root, name, f.name)) for f, _ in m.files()
        )
    except CheckpointError:  # the node's directory is a file, or cannot be read
        absent = True
    own = "missing" if absent else "ok" if verify_own(m) else "bad"
    red = placement.redundancy
    held = ("ok" if red.held_ok(m) else "bad") if red.holds is not None else None
    return _RankCheck(rank, node, own, held if red.holds == "copy" else None,
                      held if red.holds == "parity" else None)  # fmt: skip


@contextlib.contextmanager
def _pinned(lv: Levels, st: _Step) -> Iterator[None]:
    """Hold the step on every node that holds its manifest (retention waits), as verify does."""
    with contextlib.ExitStack() as stack:
        for node in st.held:
            catalog = catalog_of(lv.node_dir(node))
            stack.callback(catalog.close)
            stack.enter_context(catalog.pin(step_dir_name(st.step)))
        yield


@dataclass
class _Judgement:
    """A step judged with one of its manifests (by its digest)."""

    digest: str
    checks: list[_RankCheck]
    ok: bool


def _judge(lv: Levels, placement: Placement, st: _Step, digest: str) -> _Judgement:
    m = st.candidates[digest]
    with _pinned(lv, st):
        checks = [_check_rank(lv, placement, m, r) for r in range(len(lv.nodes))]
    lost = {c.rank for c in checks if c.own != "ok"}
    ok = placement.recoverable(lost, [c.copy in ("ok", None) and c.parity in ("ok", None)
                                      for c in checks])  # fmt: skip
    return _Judgement(digest, checks, ok)


def _manifest_notes(lv: Levels, st: _Step, scans: _Scans, agreed: str, ok: bool) -> list[str]:
    """The nodes that lack the agreed manifest of the step, why, and what a restart does."""
    out = []
    for n in lv.order:
        scan, e = scans[n], st.here.get(n)
        if isinstance(scan, _Unusable):  # a missing one is created; anything else stops a job
            why = "" if scan.word == "missing" else (
                f"; a job cannot start on node {n} until it is a directory it can use"
            )  # fmt: skip
            out.append(f"node {n}: lacks the step: {scan.text}{why}")
            continue
        if e is None:
            out.append(f"node {n}: lacks the step")
        elif e.status == "partial":
            out.append(f"node {n}: no manifest (a save that did not finish there)")
        elif e.manifest is None:
            out.append(f"node {n}: manifest does not parse ({e.status}: {e.error})")
        elif st.held[n] != agreed:
            out.append(f"node {n}: manifest DIFFERS from the agreed one (held by "
                       f"{' '.join(st.holders(agreed, unmarked=False))})")  # fmt: skip
        elif e.status != "committed":
            out.append(f"node {n}: manifest marked {e.status} ({e.error})")
        else:
            continue
        out[-1] += ": a restart rewrites it" if ok else ": treated as lacking it"
    return out


def _verify_step(
    lv: Levels, placement: Placement, st: _Step, scans: _Scans, args: argparse.Namespace
) -> bool:
    """Print what one local step holds and whether a restart could rebuild it."""
    name = step_dir_name(st.step)
    usable = st.usable(len(lv.nodes))
    if not usable:
        if st.candidates:
            size = next(iter(st.candidates.values())).world_size
            print(f"{name}: NOT RECOVERABLE: written by {size} ranks; "
                  f"{LEVELS_FILE} places {len(lv.nodes)}")  # fmt: skip
        elif args.step is None and all(e.status == "partial" for e in st.here.values()):
            return True  # an interrupted save, as plain verify passes it by
        else:
            print(f"{name}: NOT RECOVERABLE: no node holds a manifest that parses")
            for n in lv.order:
                print(f"  - node {n}: {_node_word(st, n, scans, None)}")
        return False
    judged: list[_Judgement] = []
    for digest in usable:  # the restore tries the next manifest when one cannot be rebuilt
        judged.append(_judge(lv, placement, st, digest))
        if judged[-1].ok:
            break
    j = judged[-1] if judged[-1].ok else judged[0]
    notes = _manifest_notes(lv, st, scans, j.digest, j.ok)
    problems = [c for c in j.checks if c.problem()]
    if j.ok and not problems and not notes:
        print(f"{name}: ok ({len(j.checks)} ranks on {len(placement.order)} nodes, {lv.scheme})")
    elif j.ok:
        print(f"{name}: recoverable ({lv.scheme}), degraded: will be repaired at the next "
              "restart that restores it")  # fmt: skip
    else:
        also = (
            "; the shared level has it"
            if lv.shared and _shared_has(lv, st.step, committed=True)
            else ""
        )
        print(f"{name}: NOT RECOVERABLE on the local level ({lv.scheme}){also}")
    if j is not judged[0]:
        print(f"  - the manifest the most nodes hold cannot be rebuilt; a restart uses the "
              f"one {' '.join(st.holders(j.digest, unmarked=False))} hold")  # fmt: skip
    for c in problems:
        print(f"  - {c.describe(placement)}")
    for note in notes:
        print(f"  - {note}")
    for n, e in st.here.items():  # a marker that is no evidence: said, not acted on (restore)
        for line in e.ignored:
            print(f"  - node {n}: {line}; not acted on")
    return j.ok


def _verify_local(lv: Levels, args: argparse.Namespace, scans: _Scans) -> int:
    print(f"local level: {lv.local} (redundancy {lv.scheme}, {len(lv.order)} nodes)")
    _print_unusable(scans)
    steps = _steps(lv, scans)
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
        importlib.import_module("pitstop.levels.redundancy")  # imports torch
    except ImportError as e:
        raise _UsageError(
            f"verifying the local level needs torch ({e}); --level shared does not"
        ) from None
    placement = Placement(lv.nodes, lv.scheme, lv.set_size)
    return sum(not _verify_step(lv, placement, steps[s], scans, args) for s in chosen)


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


def verify_levels(args: argparse.Namespace, root: str | None = None) -> int:
    """``pitstop verify`` of ``root`` (default ``args.dir``), a root with levels.json: 1 if a
    shared checkpoint is bad or a local step could not be rebuilt, else 0 (a local step that
    a restart would repair is reported degraded). Node directories are only read."""
    root = root or args.dir
    lv = read_levels(root)
    level = args.level or "all"
    if level == "shared" and lv.shared is None:
        what = (
            f"a shared level that is no directory ({lv.shared_url})"
            if lv.shared_url
            else "no shared level"
        )
        raise _UsageError(f"{os.path.join(root, LEVELS_FILE)} names {what}")
    shared = lv.shared if level != "local" else None
    scans = _scan_nodes(lv) if level != "shared" else {}
    steps = _steps(lv, scans)
    in_shared = shared is not None and (args.step is None or _shared_has(lv, args.step))
    if args.step is not None and not in_shared and args.step not in steps:
        where = "any level" if level == "all" else f"the {level} level"
        raise _UsageError(f"{root}: no checkpoint of step {args.step} on {where}")
    _print_notes(lv)
    bad = 0
    if shared is not None:
        bad += _verify_shared(lv, args, in_shared)
        print()
    elif level == "all" and lv.shared_url is not None:
        print(f"shared level: {lv.shared_url}: not a local directory, not verified\n")
    if level != "shared":
        bad += _verify_local(lv, args, scans)
    return 1 if bad else 0
