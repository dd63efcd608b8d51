"""The ``pitstop`` command line.

Exit codes follow shell conventions (the README's table): 0 all good; 1 a problem was found
(a checksum failed, a checkpoint asked for or the newest one is damaged, hostile input, a
marker that is no evidence, ``diff``: the two differ, the demo's weights differ); 2 bad usage
or a path that is not a checkpoint (no such step: never a damaged one); 3 ``export
--fallback`` wrote an older step than the newest, which is damaged (named on stdout). Every
error is one line on stderr; ``--debug`` shows the traceback. A reader that stops early
(``pitstop inspect ckpts | head``) changes no exit status: the rest of stdout goes to nobody,
the command runs to its end and exits as it would have (damage is 1, a clean run 0, quietly).
``ls``, ``inspect``, ``verify`` and ``gc`` do not import torch, so they run on a login node.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO, cast

from pitstop.engine.catalog import Catalog, Entry
from pitstop.engine.verify import VerifyReport, verify_checkpoint
from pitstop.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingExtraError,
    NotACheckpointError,
    UnsupportedSetupError,
)
from pitstop.format.names import LEVELS_FILE, MANIFEST, parse_aside_dir, parse_step_dir
from pitstop.storage.local import LocalStorage, local_path, object_url
from pitstop.storage.retry import RetryingStorage

__all__ = ["EXIT_FALLBACK", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_PROBLEM = 1
"""Damage (of the step asked for, or of the newest when no fallback was asked for), hostile
input, a failed checksum, a marker that is no evidence; ``diff``: the states differ."""
EXIT_USAGE = 2
EXIT_FALLBACK = 3
"""``export --fallback``: written, from an older step than the newest (damaged), named."""

EXAMPLES = {
    "ls": "pitstop ls ckpts",
    "inspect": "pitstop inspect ckpts --step 1200 --json",
    "verify": "pitstop verify ckpts            # every committed step\n  pitstop verify ckpts --step 1200",
    "gc": "pitstop gc ckpts --dry-run\n  pitstop gc ckpts --abandoned --damaged   # also what rollbacks and damage set aside",
    "demo": "pitstop demo --steps 300 --every 10",
    "keeper": 'pitstop keeper /local/ckpt &   # then: pitstop.Memory(keeper="external")',
    "bench": "pitstop bench --dir /scratch --size 1GB --profile profile.json",
    "export": "pitstop export ckpts --step 1200 --to safetensors model.safetensors --only model",
    "import": "pitstop import model.pt --to ckpts --step 0",
    "diff": "pitstop diff ckpts-a ckpts-b --step-a 100 --step-b 100",
    "crashtest": "pitstop crashtest --kills 2 -- python train.py --ckpt-dir {dir} --epochs 2",
    "simulate": "pitstop simulate --iter-secs 0.5 --stall-secs 0.05 --persist-secs 0.7 --mtbf-hours 4 \\\n"
    "      --nodes 64 --hours 72 --policy all --plot out.png",
}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _open_root(path: str) -> tuple[Catalog, str | None]:
    """The catalog of a root and, when ``path`` is itself a checkpoint directory, its name."""
    if object_url(path) is not None:
        return _open_url(path)
    try:
        path = local_path(path)
    except UnsupportedSetupError as e:
        raise _UsageError(e.message) from None
    norm = os.path.normpath(path)
    if os.path.lexists(os.path.join(path, MANIFEST)) and parse_step_dir(os.path.basename(norm)):
        return catalog_of(os.path.dirname(norm) or "."), os.path.basename(norm)
    if not os.path.isdir(path):
        raise _UsageError(f"{path}: {'not a' if os.path.lexists(path) else 'no such'} directory")
    names = os.listdir(path)
    if names and not any(
        parse_step_dir(n) is not None or parse_aside_dir(n) is not None for n in names
    ):
        raise _UsageError(
            f"{path} is not a pitstop checkpoint directory (no manifest.json, no step-* directories)"
        )
    return catalog_of(path), None


def _open_url(url: str) -> tuple[Catalog, str | None]:
    """``_open_root`` of an object-store URL: a root, or one step "directory" under a root."""
    from pitstop.storage.object_store import step_url

    try:
        url, step = step_url(url)
        catalog = catalog_of(url)
        if step is not None:
            return catalog, step
        names = catalog.storage.entries()
    except (UnsupportedSetupError, MissingExtraError) as e:
        raise _UsageError(e.message) from None
    if not names:  # on an object store a prefix with no objects is one that does not exist
        raise _UsageError(f"{url}: no objects under this prefix (a typo in the URL?)")
    if not any(parse_step_dir(n) is not None or parse_aside_dir(n) is not None for n in names):
        raise _UsageError(
            f"{url} is not a pitstop checkpoint root (no manifest.json, no step-* prefixes)"
        )
    return catalog, None


def catalog_of(root: str) -> Catalog:
    """The catalog of the root ``root``, a directory or an object-store URL (I/O retried);
    the caller closes it."""
    if object_url(root) is not None:
        from pitstop.storage.object_store import ObjectStorage

        return Catalog(RetryingStorage(ObjectStorage(root)))  # type: ignore[arg-type]
    storage: Any = RetryingStorage(LocalStorage(root))
    return Catalog(storage)


class _UsageError(Exception):
    pass


class _Progress:
    """A one-line progress report on stderr (a terminal only, or when asked), for long reads."""

    def __init__(self, label: str, total: int, *, enabled: bool | None) -> None:
        self.label, self.total = label, max(total, 1)
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.done_bytes = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.done_bytes += n
            now = time.perf_counter()
            if now - self.last < 0.2 and self.done_bytes < self.total:
                return
            self.last = now
            rate = self.done_bytes / max(now - self.t0, 1e-9) / 1e9
            pct = 100 * self.done_bytes / self.total
            print(
                f"\r{self.label}: {pct:5.1f}% of {_human(self.total)}, {rate:.2f} GB/s",
                end="",
                file=sys.stderr,
            )

    def done(self) -> None:
        if self.enabled and self.done_bytes:
            print(file=sys.stderr)


def _select(catalog: Catalog, only: str | None, step: int | None) -> list[Entry]:
    entries = [e for e in catalog.scan() if e.is_step_dir]
    if only is not None:
        entries = [e for e in entries if e.name == only]
    if step is not None:
        entries = [e for e in entries if e.step == step]
        if not entries:
            have = [str(e.step) for e in catalog.scan() if e.is_step_dir]
            shown = ", ".join(have[-10:]) if have else "none"
            raise _UsageError(
                f"{catalog.storage.url}: no checkpoint of step {step} (steps: {shown})"
            )
    return entries


def cmd_ls(args: argparse.Namespace) -> int:
    if os.path.isfile(os.path.join(args.dir, LEVELS_FILE)):
        from pitstop.cli.levels import ls_levels

        code = ls_levels(args)
    else:
        catalog, only = _open_root(args.dir)
        rows = ls_rows(catalog, only)
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print_ls(catalog.storage.url, rows)
        code = 0
    if not args.json:
        _print_memory(args.dir, args.shm_dir)
    return code


def _job_dirs(root: str) -> list[str]:
    """``root`` and its nodes' directories (a multi-level root's): where a job whose memory
    level writes to them would (its default job token is the directory's)."""
    from pitstop.cli.levels import read_levels

    dirs = [os.path.abspath(root)]
    if os.path.isfile(os.path.join(root, LEVELS_FILE)):
        with contextlib.suppress(Exception):  # said by the listing
            lv = read_levels(root)
            dirs += [os.path.abspath(lv.node_dir(n)) for n in lv.order]
    return list(dict.fromkeys(dirs))


def _print_memory(root: str, shm_dir: str | None) -> None:
    """The memory level's snapshots of the job that writes to ``root`` (or to a node's
    directory under it) on this host, found by the default job token (a job run with its
    own ``Memory(job=)`` is not found; ``pitstop gc`` removes a dead job's)."""
    from pitstop.levels.shm_clean import job_slots
    from pitstop.levels.shm_header import SHM_DIR, job_token

    directory = shm_dir or SHM_DIR
    for d in _job_dirs(root):
        heads = job_slots(directory, job_token(d))
        if not heads:
            continue
        steps: dict[tuple[int, str], list[int]] = {}
        for h in heads:
            if h.step is not None and h.state in ("committed", "staged"):
                steps.setdefault((h.step, h.state), []).append(h.rank)
        several = any(h.rank for h in heads)
        shown = ", ".join(
            f"{s} ({state}{f', ranks {sorted(ranks)}' if several else ''})"
            for (s, state), ranks in sorted(steps.items(), reverse=True)
        )  # fmt: skip
        print(f"\nmemory level on this host ({directory}, job {job_token(d)}, writing to {d}): "
              f"{shown or 'no snapshot'}")  # fmt: skip


def ls_rows(catalog: Catalog, only: str | None = None) -> list[dict[str, Any]]:
    """``pitstop ls``'s rows (also its ``--json``) of a root, or only of ``only``."""
    entries = [e for e in catalog.scan() if only is None or e.name == only]
    rows: list[dict[str, Any]] = []
    for e in entries:
        if e.status == "other":
            continue
        m = e.manifest
        rows.append(
            {
                "step": e.step,
                "name": e.name,
                "status": e.status,
                "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix_secs))
                if m
                else "-",
                "bytes": m.nbytes if m else None,
                "tensors": len(m.tensors) if m else None,
                "world_size": m.world_size if m else None,
                "timeline": m.lineage.timeline if m and m.lineage else None,
                "parent": m.lineage.parent if m and m.lineage else None,
                "error": e.error,
                "ignored_markers": list(e.ignored),
            }
        )
    return rows


def print_ls(url: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        print(f"{url}: no checkpoints")
        return
    print(f"{'STEP':>12}  {'TIME':19}  {'SIZE':>10}  {'TENSORS':>7}  {'WORLD':>5}  STATUS")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        size = "-" if r["bytes"] is None else _human(r["bytes"])
        tensors = "-" if r["tensors"] is None else str(r["tensors"])
        world = "-" if r["world_size"] is None else str(r["world_size"])
        note = f"  ({r['name']})" if parse_step_dir(r["name"]) is None else ""
        why = f": {r['error'][:100]}" if r["error"] and r["status"] != "committed" else ""
        for line in r.get("ignored_markers") or []:  # a marker that is no evidence: said
            why += f"{'; ' if why else ': '}{line[:100]}"
        print(
            f"{step:>12}  {r['time']:19}  {size:>10}  {tensors:>7}  {world:>5}  {r['status']}{note}{why}"
        )


def cmd_inspect(args: argparse.Namespace) -> int:
    from pitstop.cli.show import run_inspect

    return run_inspect(args)


def cmd_verify(args: argparse.Namespace) -> int:
    from pitstop.cli.levels import levels_root
    from pitstop.cli.levels_verify import verify_levels

    found = levels_root(args.dir)  # a level of levels= (or a step directory in one)
    if found is not None:
        root, step = found
        if step is not None and args.step not in (None, step):
            raise _UsageError(f"{args.dir} holds step {step}, not {args.step}")
        args.step = step if step is not None else args.step
        return verify_levels(args, root)
    if args.level == "local":
        raise _UsageError(f"{args.dir} has no {LEVELS_FILE}: it is not a level of levels=")
    catalog, only = _open_root(args.dir)
    return verify_root(catalog, only, args)


def verify_root(catalog: Catalog, only: str | None, args: argparse.Namespace) -> int:
    """The checks of ``pitstop verify`` on one root: 1 if any checkpoint is bad, else 0."""
    storage = catalog.storage
    entries = _select(catalog, only, args.step)
    if not entries:
        print(f"{storage.url}: no checkpoints to verify")
        return 0
    bad = 0
    for e in entries:
        if e.status == "partial":
            if args.step is not None:
                print(f"{e.name}: partial (no manifest: an interrupted save)")
                bad += 1
            continue
        if e.status == "newer":
            print(f"{e.name}: NEWER FORMAT: {e.error}")
            bad += 1
            continue
        if e.status in ("foreign",) or e.manifest is None:
            print(
                f"{e.name}: {'CORRUPT' if e.status == 'damaged' else e.status.upper()}: {e.error}"
            )
            bad += 1
            continue
        data_bytes = sum(t.nbytes for t in e.manifest.tensors)  # what is read and checked
        progress = _Progress(f"verify {e.name}", data_bytes, enabled=args.progress)
        with catalog.pin(e.name) as alive:
            if not alive:
                print(f"{e.name}: removed while being verified")
                continue
            try:
                report = verify_checkpoint(
                    storage, e.name, e.manifest, threads=args.threads, on_bytes=progress.add
                )
            except CheckpointError as err:  # e.g. an objects file of a newer format
                print(f"{e.name}: NOT VERIFIED: {err}")
                bad += 1
                continue
        progress.done()
        bad += _say_verified(catalog, e, report)
    return 1 if bad else 0


def _say_verified(catalog: Catalog, e: Entry, report: VerifyReport) -> int:
    """Print what verifying ``e`` found (marking it damaged if it is, and was not marked) and
    the markers that are no evidence; how many problems that is."""
    bad, ignored = 0, list(e.ignored)
    rate = report.nbytes / report.secs / 1e9 if report.secs > 0 else 0.0
    if report.ok and e.status == "damaged":
        print(f"{e.name}: ok now, but marked damaged earlier: {e.error}")
        bad += 1
    elif report.ok:
        print(
            f"{e.name}: ok ({_human(report.nbytes)} checked in {report.secs:.2f} s, {rate:.2f} GB/s)"
        )
    else:
        bad += 1
        print(f"{e.name}: CORRUPT")
        for p in report.problems:
            print(f"  - {p}")
        if e.status == "committed":  # evidence of damage: restore and ls will know
            catalog.mark_damaged(e.name, "; ".join(report.problems))  # replaces any DAMAGED
            ignored = [x for x in ignored if not x.startswith("DAMAGED ")]
    for line in ignored:  # damaged or inconsistent marker: found, said, never acted on
        print(f"{e.name}: {line}; not acted on (remove the file once you have looked)")
        bad += 1
    return bad


def cmd_gc(args: argparse.Namespace) -> int:
    catalog, only = _open_root(args.dir)
    if only is not None:  # gc works on a whole root: never quietly on the step's parent
        catalog.close()
        raise _UsageError(
            f"{args.dir} is one checkpoint; gc collects a root's debris: give its root "
            f"({catalog.storage.url})"
        )
    done = catalog.collect(
        abandoned=args.abandoned,
        damaged=args.damaged,
        min_age_secs=args.min_age,
        dry_run=args.dry_run,
    )
    for e, what in done:
        if what.startswith("kept"):
            print(f"kept {e.name} ({e.status}){what.removeprefix('kept')}")
        else:
            print(f"{what} {e.name} ({e.status})")
    segments = _gc_shm(args)
    if not segments and not any(what in ("removed", "would remove") for _, what in done):
        print("nothing to remove")
    return 0


def _save_dead_jobs(args: argparse.Namespace, shm: str, newest: dict[str, int]) -> set[str]:
    """Before ``gc`` removes a dead job's shared memory: the newest memory step of the job
    that wrote to ``args.dir`` (or a node's directory under it) is written there unless it
    holds that step or a newer one (:func:`pitstop.levels.keeper_join.persist_newest`), so
    no committed step is lost. Those saved leave ``newest``; the jobs whose step could not
    be written are returned: their segments stay."""
    from concurrent.futures import ThreadPoolExecutor

    from pitstop.levels.keeper import newest_step
    from pitstop.levels.keeper_join import persist_newest
    from pitstop.levels.shm_header import job_token
    from pitstop.options import IOOptions
    from pitstop.storage.local import LocalStorage

    kept: set[str] = set()
    local = object_url(args.dir) is None and not args.discard_memory
    for d in _job_dirs(args.dir) if local else []:
        job = job_token(d)
        if newest.get(job, -1) < 0:
            continue
        if args.dry_run:
            print(f"would write job {job}'s newest memory step ({newest[job]}) to {d} first, "
                  "unless it holds it")  # fmt: skip
            del newest[job]
            continue
        storage = LocalStorage(d, IOOptions.from_env())
        with ThreadPoolExecutor(4) as pool, ThreadPoolExecutor(2) as hashers:
            try:  # (a damaged step is passed over for the next older one)
                step, what = persist_newest(shm, job, storage, pool=pool, hashers=hashers)
            except OSError as e:  # (CheckpointIOError too) the disk: keep them
                print(f"job {job}: its newest memory step could not be written to {d} ({e}); "
                      f"its shared memory is kept (run gc again)", file=sys.stderr)  # fmt: skip
                kept.add(job)
                continue
        if step is not None:
            done = what.startswith("written")
            print(f"{'wrote' if done else 'did not write'} job {job}'s memory step {step} to "
                  f"{d}: {what}")  # fmt: skip
        elif "damaged" in what:
            print(f"job {job}: no memory step written to {d}: {what}")
        held = newest_step(storage)
        if held is not None and held >= newest[job]:
            del newest[job]  # nothing newer than DIR goes with the segments
    return kept


def cmd_keeper(args: argparse.Namespace) -> int:
    """``pitstop keeper DIR``: see :mod:`pitstop.levels.keeper_watch`."""
    from pitstop.levels.keeper_watch import run_watch
    from pitstop.levels.shm_header import JOB_TOKEN, SHM_DIR, job_token

    directory = os.path.abspath(args.dir)
    job = args.job or job_token(directory)
    if not JOB_TOKEN.fullmatch(job):
        raise _UsageError(f"--job takes 1-64 letters, digits or '_', got {job!r}")
    shm = args.shm_dir or SHM_DIR
    if not os.path.isdir(shm):
        raise _UsageError(f"--shm-dir {shm}: no such directory")
    print(f"pitstop keeper: watching job {job} in {shm} (writing to {directory})", flush=True)
    code = run_watch(job, shm, directory, linger_secs=args.linger_secs, max_secs=args.max_secs)
    if code != EXIT_OK:
        print(f"pitstop keeper: another keeper watches job {job} already", file=sys.stderr)
    return code


def _gc_shm(args: argparse.Namespace) -> list[str]:
    """``gc``'s shared memory: the memory level's segments of dead jobs on this host (a job
    whose processes live is never touched: its lock decides). On by default for a local
    root, off for an object-store URL (``--shm``/``--no-shm``)."""
    shm = args.shm if args.shm is not None else object_url(args.dir) is None
    if not shm:
        return []
    from pitstop.levels.shm_clean import job_slots, remove_stale
    from pitstop.levels.shm_header import SHM_DIR, parse_segment_name

    directory = args.shm_dir or SHM_DIR
    newest: dict[str, int] = {}  # a dead job's newest snapshot: said before it goes
    for name in remove_stale(directory, dry_run=True):
        parsed = parse_segment_name(name)
        if parsed is not None and parsed[0] not in newest:
            steps = [
                h.step
                for h in job_slots(directory, parsed[0])
                if h.step is not None and h.state in ("staged", "committed")
            ]  # fmt: skip (a restart seals it)
            newest[parsed[0]] = max(steps, default=-1)
    kept = _save_dead_jobs(args, directory, newest)
    names = remove_stale(directory, keep=kept, dry_run=args.dry_run)
    what = "would remove" if args.dry_run else "removed"
    for name in names:
        print(f"{what} {os.path.join(directory, name)} (shared memory of a dead job)")
    from pitstop.levels.keeper import empty_logs

    ended = [p[0] for p in map(parse_segment_name, names) if p is not None]
    logs = empty_logs(ended)  # a killed keeper's, of the jobs whose segments went here
    for path in logs if not args.dry_run else []:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if logs:
        print(f"{what} {len(logs)} empty keeper log(s) of ended jobs in {os.path.dirname(logs[0])}")
    for job, step in newest.items():
        if step >= 0 and job not in kept:
            print(f"  job {job}: its newest memory snapshot, step {step}, "
                  f"{'would be' if args.dry_run else 'is'} gone with it (a restart of that job "
                  "would have resumed from it; the disk levels keep their own steps)")  # fmt: skip
    return names


def _work_dir_outside_roots(path: str | None) -> None:
    """A working directory (bench, demo) gets files of its own: never inside a checkpoint root."""
    from pitstop.cli.choice import refuse_inside_checkpoint

    if path is not None:
        refuse_inside_checkpoint(path, [], directory=True)


def cmd_demo(args: argparse.Namespace) -> int:
    from pitstop.cli.demo import run_demo

    _work_dir_outside_roots(args.dir)
    return run_demo(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from pitstop.cli.simulate import run_simulate

    try:
        return run_simulate(args)
    except ValueError as e:
        raise _UsageError(str(e)) from None


def _size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
    }
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    try:
        return int(float(num) * units[t[len(num) :]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 1GB, 2GiB)") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from pitstop.bench import print_report, run_bench, write_profile

    _work_dir_outside_roots(args.dir)
    result = run_bench(args.dir, args.size, args.reps, progress=args.progress)
    print_report(result)
    if args.profile:
        write_profile(result, args.profile)
        print(
            f"profile written to {args.profile} (pitstop simulate --profile {args.profile} --iter-secs ...)"
        )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pitstop.cli.convert import run_export
    from pitstop.cli.levels import refuse_node_dir

    refuse_node_dir(args.dir, args.step, "export")
    if args.fallback and args.step is not None:
        raise _UsageError("--fallback applies to the newest step; --step names one")
    return run_export(args)


def cmd_import(args: argparse.Namespace) -> int:
    from pitstop.cli.convert import run_import

    return run_import(args)


def cmd_diff(args: argparse.Namespace) -> int:
    from pitstop.cli.choice import choose, explain_damage
    from pitstop.cli.compare import run_diff
    from pitstop.cli.levels import refuse_node_dir

    refuse_node_dir(args.a, args.step_a, "diff")
    refuse_node_dir(args.b, args.step_b, "diff")
    # the steps compared are the ones named or the newest: never an older one in their place
    retry = {"a": "--step-a N compares an older step", "b": "--step-b N compares an older step"}
    a = choose(args.a, args.step_a, retry=retry["a"])
    b = choose(args.b, args.step_b, retry=retry["b"])
    args.step_a, args.step_b = a.entry.step, b.entry.step
    try:
        return run_diff(args)
    except CorruptCheckpointError as e:  # found damaged while loading (and marked): say which
        for choice, side in ((a, "a"), (b, "b")):
            said = explain_damage(choice, e, retry[side])
            if said is not e:
                raise said from None
        raise


def cmd_crashtest(args: argparse.Namespace) -> int:
    from pitstop.cli.crashtest import main_exit

    return main_exit(args)


_LS_LEVELS = """

A directory holding levels.json (the shared root of levels=, or any node's directory)
lists both levels: the shared level's checkpoints, then every step any node has a
directory of, with FLUSHED TO SHARED (yes: the shared level holds it committed; no: not;
-: no shared directory) and NODES: N/M: the nodes holding the manifest the nodes agree on
(the one a restart uses), then in parentheses what each other node holds: missing,
partial (no manifest), damaged, abandoned, other manifest, not a directory, unreadable.
The directory given wins over the paths levels.json records (a copied tree is listed
inside the copy); the paths used instead are said."""

_VERIFY_MORE = """

Exit 0: every checkpoint checked is whole. Exit 1: a checksum or size is wrong, a
checkpoint is damaged, or a marker (DAMAGED, ABANDONED, ROLLBACK) is no evidence (empty, not
a file, damaged, inconsistent with its step, copied from another checkpoint, or an abandonment
whose rollback is nowhere: shown, never acted on); under levels=, a shared
checkpoint is bad or a local step cannot be rebuilt from its redundancy. A local step that lost pieces its redundancy can rebuild
(a rank's files, a partner copy, parity, a node's manifest) still exits 0 and is
reported "recoverable, degraded: will be repaired at the next restart that restores it".
Exit 2: bad usage. A checkpoint root or a step directory is checked on its own and marked
DAMAGED when it fails. A directory holding levels.json (the shared root, any node's
directory, or a step directory in one) is checked as a whole setup: every rank's files on
its node, the partner copies or parity, the manifest the nodes agree on (as a restart
agrees); this never marks or writes into node directories."""


_EXPORT_MORE = """

Exports the step asked for (--step N, or a step directory given) or the newest step, never
another in its place. Exit 0: written. Exit 1: that step is damaged (nothing written; with
--fallback: no step verifies), or another problem. Exit 2: bad usage (no such step; OUT inside
a checkpoint root: only a save writes there; OUT a directory for a file format, a file for
dcp, or in a directory that does not exist). Exit 3: --fallback was given, the newest step is
damaged, and the newest one that verifies was written instead (stdout names it and why)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pitstop", description="Frequent, cheap, exact checkpoints for PyTorch training."
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_: str, more: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help_, description=help_ + more,
            epilog=f"example:\n  {EXAMPLES[name]}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip

    p = add("ls", "list the checkpoints under a directory with their status", _LS_LEVELS)
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--shm-dir", default=None,
                   help="where the memory level's snapshots are (default /dev/shm)")  # fmt: skip
    p.set_defaults(func=cmd_ls)

    p = add("inspect", "show the manifest of one checkpoint (default: the newest)")
    p.add_argument("dir")
    p.add_argument("--step", type=int)
    p.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    p.set_defaults(func=cmd_inspect)

    p = add(
        "verify", "check every size and every checksum; exit 1 if anything is wrong", _VERIFY_MORE
    )
    p.add_argument("dir", help="a checkpoint root or one step directory")
    p.add_argument("--step", type=int, help="only this step")
    p.add_argument("--threads", type=int, default=None, help="reader threads")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr (default: when stderr is a terminal)")  # fmt: skip
    p.add_argument("--level", choices=["local", "shared", "all"], default=None,
                   help="under levels=: which level (default all)")  # fmt: skip
    p.set_defaults(func=cmd_verify)

    p = add("keeper", "watch a job's memory snapshots on this node (started by a launcher)")
    p.add_argument("dir", help="the directory the memory level writes to (a node's, with {node})")
    p.add_argument("--job", default=None, help="the job token (default: derived from DIR)")
    p.add_argument("--shm-dir", default=None, help="where the snapshots are (default /dev/shm)")
    p.add_argument("--linger-secs", type=float, default=30.0,
                   help="how long a dead trainer's snapshots wait for its restart")  # fmt: skip
    p.add_argument("--max-secs", type=float, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_keeper)

    p = add("gc", "remove debris of interrupted saves")
    p.add_argument("dir")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument("--abandoned", action="store_true",
                   help="also remove checkpoints a rollback set aside (newer steps of an old timeline)")  # fmt: skip
    p.add_argument("--damaged", "--corrupt", dest="damaged", action="store_true",
                   help="also remove checkpoints that failed verification")  # fmt: skip
    p.add_argument("--min-age", type=float, default=300.0,
                   help="keep partial directories written to within this many seconds (default 300)")  # fmt: skip
    p.add_argument("--shm", action=argparse.BooleanOptionalAction, default=None,
                   help="also remove the memory level's shared memory of dead jobs on this "
                        "host, never a live job's (default: on for a local DIR, off for a URL)")  # fmt: skip
    p.add_argument("--shm-dir", default=None, help="where that shared memory is (default /dev/shm)")
    p.add_argument("--discard-memory", action="store_true",
                   help="remove a dead job's memory snapshots without writing its newest step "
                        "to DIR first (to start the job over)")  # fmt: skip
    p.set_defaults(func=cmd_gc)

    p = add(
        "bench", "measure this machine's storage and pitstop against torch.save on the same bytes"
    )
    p.add_argument("--dir", help="where to write (default: a temporary directory here)")
    p.add_argument("--size", type=_size, default=_size("1GB"), help="state size, e.g. 256MB, 1GB")
    p.add_argument("--reps", type=int, default=3, help="rounds (medians are reported)")
    p.add_argument("--profile", help="write a profile JSON for pitstop simulate --profile")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=cmd_bench)

    p = add(
        "export",
        "write a checkpoint as a torch.save file, a safetensors file or a DCP directory",
        _EXPORT_MORE,
    )
    p.add_argument("dir", help="a checkpoint root or one step directory")
    p.add_argument("out", help="the file (torch, safetensors) or directory (dcp) to write")
    p.add_argument("--to", choices=["torch", "safetensors", "dcp"], required=True)
    p.add_argument("--step", type=int, help="default: the newest")
    p.add_argument("--fallback", action="store_true",
                   help="if the newest step is damaged, export the newest one that verifies "
                   "(named on stdout; exit 3) instead of failing")  # fmt: skip
    p.add_argument("--only", help="export only this top-level key (e.g. model)")
    p.add_argument(
        "--allow-pickle", action="store_true", help="load pickled values (trusted checkpoints only)"
    )
    p.set_defaults(func=cmd_export)

    p = add(
        "import",
        "make a pitstop checkpoint from a torch.save file, a safetensors file or a DCP directory",
    )
    p.add_argument(
        "src",
        help="a torch.save file (loaded with weights_only), a safetensors file or a DCP directory",
    )
    p.add_argument("--to", required=True, help="checkpoint root to write into")
    p.add_argument("--step", type=int, default=0)
    p.add_argument(
        "--allow-pickle", action="store_true", help="allow arbitrary objects (trusted files only)"
    )
    p.set_defaults(func=cmd_import)

    p = add("diff", "compare every tensor and value of two checkpoints; exit 1 if any differ")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--step-a", type=int)
    p.add_argument("--step-b", type=int)
    p.add_argument("--allow-pickle", action="store_true")
    p.add_argument("--ignore", action="append", metavar="GLOB",
                   help="key paths not compared, e.g. 'progress/*' (repeatable)")  # fmt: skip
    p.add_argument("--show", type=int, default=20, help="differences shown (default 20)")
    p.set_defaults(func=cmd_diff)

    p = add(
        "crashtest",
        "run a training command to the end, then killed and resumed; exit 1 unless both end identical",
    )
    from pitstop.cli.crashtest import add_arguments as add_crashtest_arguments

    add_crashtest_arguments(p)
    p.set_defaults(func=cmd_crashtest)

    p = add("simulate", "compare checkpoint policies under simulated failures (no torch needed)")
    from pitstop.cli.simulate import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_simulate)

    p = add("demo", "train, SIGKILL, resume and prove the weights match an uninterrupted run")
    p.add_argument("--dir", help="working directory (default: a new temporary one)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-at", type=int, default=None, help="kill at this step (default: random)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.set_defaults(func=cmd_demo)
    return parser


class _Stdout:
    """``sys.stdout`` while a command runs. A reader that stops early (``| head``) stops no
    command: the first write or flush that finds the pipe closed points stdout at /dev/null,
    and the command goes on to its exit status (damage is 1 whoever reads its output).
    Another write error (a full disk: ``> /dev/full``) does the same and is kept in
    ``error``: ``main`` says it once the command ended, and exits 1 unless the command's own
    status is already a failure."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False  # output goes nowhere from now on
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except OSError as e:
                self._failed(e)
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except OSError as e:
                self._failed(e)

    def _failed(self, e: OSError) -> None:
        if not isinstance(e, BrokenPipeError) and self.error is None:
            self.error = e
        if not _to_devnull(self._stream):  # no descriptor: drop what is written from now on
            self._gone = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    stdout = sys.stdout
    if stdout is None:  # pragma: no cover - no stdout at all (pythonw)
        return _main(argv)
    guard = _Stdout(stdout)
    sys.stdout = cast(TextIO, guard)
    try:
        code = _main(argv)
    finally:
        guard.flush()  # here, not at exit, where a closed pipe would change the status
        sys.stdout = stdout
    if guard.error is not None:
        try:
            print(f"pitstop: cannot write the output: {guard.error.strerror or guard.error}",
                  file=sys.stderr)  # fmt: skip
        except OSError:
            _to_devnull(sys.stderr)
        return code or 1
    return code


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        from pitstop._version import __version__

        print(f"pitstop {__version__}")
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except _UsageError as e:
        return _fail(args, f"{e}", 2)
    except (CheckpointNotFoundError, NotACheckpointError) as e:  # a path that is not one
        return _fail(args, f"{e}", 2)
    except UnsupportedSetupError as e:  # a URL where a directory goes, and such
        return _fail(args, f"{e}", 2)
    except CheckpointError as e:
        return _fail(args, f"{e}", 1)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug or an input no check named: one line, not a traceback
        return _fail(args, f"internal error: {type(e).__name__}: {e} (--debug shows where)", 1)


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    if args.debug:
        import traceback

        traceback.print_exc()
    try:
        print(f"pitstop {args.command}: {' '.join(message.split())}", file=sys.stderr)
        sys.stderr.flush()
    except OSError:  # stderr closed or full: the exit status still says it
        _to_devnull(sys.stderr)
    return code


def _to_devnull(stream: Any) -> bool:
    """Point ``stream``'s descriptor at /dev/null (what it still holds goes nowhere, and
    nothing fails at exit); False when it has no descriptor."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return True


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
