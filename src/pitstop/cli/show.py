"""``pitstop inspect``: the manifest of one checkpoint (the newest step, or ``--step N``). No
torch.

It shows the step asked for or the newest step directory, never an older one in its place: a
newest or asked-for step whose manifest does not parse (or is of a newer format, or is not a
directory) is said and exits 1, as a step marked damaged does after its manifest is shown
(damage exits 1, never 2: see :mod:`pitstop.cli.main`).

Call sequence (the CLI's thread): ``run_inspect(args)``.
"""

from __future__ import annotations

import argparse
import json
import time

from pitstop.cli.main import EXIT_OK, EXIT_PROBLEM, _human, _open_root, _select, _UsageError
from pitstop.engine.catalog import Entry
from pitstop.errors import CorruptCheckpointError, FormatVersionError
from pitstop.format.manifest import Manifest

__all__ = ["run_inspect"]


def _inspected(args: argparse.Namespace) -> Entry:
    """The step directory to show: ``--step N`` (or the step directory given), else the newest
    one that is not an interrupted save. One without a manifest to show is an error."""
    catalog, only = _open_root(args.dir)
    try:
        entries = [e for e in _select(catalog, only, args.step) if e.status != "partial"]
    finally:
        catalog.close()
    if not entries:
        raise _UsageError(f"{args.dir}: no committed checkpoint")
    entry = entries[-1]
    if entry.manifest is None:
        older = "; --step N shows an older step" if args.step is None and only is None else ""
        path = f"{catalog.storage.url}/{entry.name}"
        if entry.status == "newer":
            raise FormatVersionError(f"{entry.name}: {entry.error}", step=entry.step, path=path)
        raise CorruptCheckpointError(
            f"{entry.name} is {entry.status}: {entry.error}{older}", step=entry.step, path=path
        )
    return entry


def _print_header(args: argparse.Namespace, entry: Entry, manifest: Manifest) -> None:
    from pitstop.cli.levels import node_note

    print(f"step {manifest.step}  ({entry.name}, format v{manifest.format_version})")
    print(
        f"written  {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created_unix_secs))}"
        f" by pitstop {manifest.library.get('pitstop', '?')}, torch {manifest.library.get('torch', '?')}"
    )
    print(f"world    {manifest.world_size} rank(s); checksum {manifest.checksum_algorithm}")
    note = node_note(args.dir)  # a node's directory of levels=: only its ranks' files
    if note is not None:
        print(note)
    if manifest.lineage is not None:
        print(
            f"lineage  run {manifest.lineage.run}, timeline {manifest.lineage.timeline}, "
            f"parent step {manifest.lineage.parent}"
        )
    if entry.status != "committed":
        print(f"status   {entry.status}: {entry.error}")
    for line in entry.ignored:
        print(f"marker   {line}")
    print(
        f"size     {_human(manifest.nbytes)} in {len(manifest.files)} files, {len(manifest.tensors)} tensors"
    )
    print()


def _print_tensors(manifest: Manifest) -> None:
    if manifest.world_size > 1:
        for f in manifest.files:
            if f.name.endswith(".bin"):
                stream = f.stream_nbytes or 0
                print(
                    f"rank {f.rank:<4} {f.name}: {_human(f.nbytes)} ({_human(stream)} replicated "
                    f"slice, {_human(f.nbytes - stream)} own and sharded)"
                )
        print()
    wide = manifest.world_size > 1
    extra = "  RANK  CHUNK" if wide else ""
    print(f"{'KEY':60}  {'DTYPE':10}  {'SHAPE':20}  {'BYTES':>10}{extra}")
    for t in manifest.tensors:
        line = (
            f"{t.key[:60]:60}  {t.dtype:10}  {str(list(t.shape))[:20]:20}  {_human(t.nbytes):>10}"
        )
        if wide:
            if t.owner is not None:
                chunk = f"rank {t.owner}'s own"
            elif t.global_shape is not None and not t.is_whole:
                chunk = f"at {list(t.box_start)} of {list(t.global_shape)}"
            else:
                chunk = "whole, shared"
            line += f"  {t.rank:>4}  {chunk}"
        print(line)


def run_inspect(args: argparse.Namespace) -> int:
    """``pitstop inspect``: 1 if the step shown is marked damaged, else 0."""
    entry = _inspected(args)
    manifest = entry.manifest
    assert manifest is not None
    if args.json:
        print(json.dumps(manifest.to_json(), indent=1))
    else:
        _print_header(args, entry, manifest)
        _print_tensors(manifest)
    return EXIT_PROBLEM if entry.status == "damaged" else EXIT_OK
