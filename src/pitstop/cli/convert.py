"""``pitstop export`` and ``pitstop import``: checkpoints to and from the
formats of the tools people already use. These commands load tensors, so they import torch.

Export writes what each tool's standard recipe loads (``export_formats``), with plain module
names and, for DCP, optimizer state keyed by parameter name (``export_names``); both need the
checkpoint's objects tree as well as its values.

Import reads files it cannot trust: a torch.save file is loaded weights-only (plus NumPy's array
reconstruction), a DCP directory through ``dcp_safe``, which never hands a pickle to plain
``pickle.load``, and a safetensors file (no pickle at all) with its ``pitstop.values`` metadata;
``--allow-pickle`` lifts the first two for trusted files. Every bad input ends in a
``CheckpointError`` naming the path, which the CLI prints as one line.

Call sequence (the CLI's thread)::

    run_export(args): choice.choose (the step asked for or the newest; damage refused unless
                      --fallback) -> choice.refuse_inside_checkpoint -> _check_out
                      -> _load_with_tree -> _select -> export_names (rename)
                      -> export_formats.EXPORTERS[to] (inside _writing) -> print the step
                      exported (a fallback named: exit 3) and notes
    run_import(args): _read_source (dcp_safe.load_dcp | _load_safetensors
                      | dcp_safe.load_torch_file) -> CheckpointManager.save -> print
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from pitstop.engine.verify import read_objects
from pitstop.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingExtraError,
    NotACheckpointError,
    UnsupportedSetupError,
    UnsupportedValueError,
)
from pitstop.io.files import check_regular
from pitstop.manager import CheckpointManager
from pitstop.options import SaveOptions
from pitstop.state.keys import unescape_key
from pitstop.state.tree import join_key

__all__ = ["flat_tensors", "run_export", "run_import"]


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded state under its key path (``model/fc.weight``), shared ones once each."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flat_tensors(v, join_key(prefix, k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, join_key(prefix, i)))
    return out


def _select(tree: Any, only: str | None) -> Any:
    if only is None:
        return tree
    if not isinstance(tree, Mapping) or only not in tree:
        keys = ", ".join(map(str, tree)) if isinstance(tree, Mapping) else "?"
        raise UnsupportedValueError(
            f"the checkpoint has no top-level key {only!r} (it has: {keys})"
        )
    return {only: tree[only]}


def _check_out(out: str, to: str) -> None:
    """Refuse, as bad usage, an output path that cannot take what ``to`` writes, before
    anything big is loaded."""
    from pitstop.cli.main import _UsageError
    from pitstop.storage.local import refuse_url

    try:
        refuse_url(out)
    except UnsupportedSetupError:
        raise _UsageError(
            f"{out}: export writes a local {'directory' if to == 'dcp' else 'file'}; give a "
            "local path and copy it to the bucket with your own tools"
        ) from None
    if to == "dcp":
        if os.path.exists(out) and not os.path.isdir(out):
            raise _UsageError(f"{out}: dcp writes a directory, and this exists as a file")
        return
    if os.path.isdir(out):
        raise _UsageError(f"{out}: {to} writes a file, and this is a directory")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise _UsageError(f"{out}: cannot write: directory {parent} does not exist")


@contextlib.contextmanager
def _writing(out: str) -> Iterator[None]:
    """Whatever the writer raises for a path it cannot write becomes a CheckpointIOError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        code = e.errno if isinstance(e, OSError) else None
        text = str(e).strip().splitlines()
        raise CheckpointIOError(
            f"cannot write ({type(e).__name__}: {text[0][:200] if text else ''})",
            errno=code,
            path=out,
        ) from None


def _load_with_tree(root: str, step: int | None, allow_pickle: bool) -> tuple[Any, Any, Any]:
    """The saved state as fresh objects (``CheckpointManager.load``: verified; ``step`` None:
    the newest that verifies, falling back like restore), the objects tree it was built from,
    read again under a pin (``read_objects``: size, checksum and grammar checked against the
    same manifest), and the load's RestoreResult (which step, what it skipped)."""
    options = SaveOptions.from_env(allow_pickle=allow_pickle, max_in_flight=1)
    with CheckpointManager(root, options=options) as mgr:
        value = mgr.load(step)
        loaded = mgr.last_restore
        assert loaded is not None and loaded.name is not None and loaded.manifest is not None
        problems: list[str] = []
        with mgr.hooks.catalog.pin(loaded.name) as alive:
            tree = (
                read_objects(mgr.hooks.storage, loaded.name, loaded.manifest, 0, problems)
                if alive
                else None
            )
        if tree is None:
            raise CorruptCheckpointError(
                f"{loaded.name} changed while it was being exported"
                + (f": {'; '.join(problems)}" if problems else " (removed)"),
                step=loaded.step, path=f"{mgr.url}/{loaded.name}",
            )  # fmt: skip
    return value, tree, loaded


_RETRY = "--fallback exports the newest step that verifies instead (exit 3), --step N an older one"


def run_export(args: argparse.Namespace) -> int:
    """``pitstop export``: 0 written from the step asked for or the newest; 3 (``--fallback``)
    written from an older step, the newest being damaged (said on stdout); damage without
    ``--fallback`` writes nothing (CorruptCheckpointError: exit 1)."""
    from pitstop.cli.choice import (
        choose,
        explain_damage,
        fallback_note,
        none_verifies,
        refuse_inside_checkpoint,
    )
    from pitstop.cli.export_formats import EXPORTERS
    from pitstop.cli.export_names import find_names, name_optimizers, strip_wrappers_in
    from pitstop.cli.main import EXIT_FALLBACK, EXIT_OK

    choice = choose(args.dir, args.step, fallback=args.fallback, retry=_RETRY)
    refuse_inside_checkpoint(args.out, [choice.root], directory=args.to == "dcp")
    _check_out(args.out, args.to)
    try:
        value, tree, loaded = _load_with_tree(choice.root, choice.step, args.allow_pickle)
    except CorruptCheckpointError as e:
        if args.fallback and not choice.asked:  # it fell back as far as it could
            raise none_verifies(choice, e) from None
        raise explain_damage(choice, e, _RETRY) from None
    value = _select(value, args.only)
    found = find_names(tree)
    strip_wrappers_in(value, found)
    notes = name_optimizers(value, found) if args.to == "dcp" else []
    with _writing(args.out):
        notes += EXPORTERS[args.to](value, args.out, args.only)
    fallback = fallback_note(choice, loaded.step, loaded.skipped)
    which = "" if choice.asked or fallback else ", the newest"
    print(f"exported {args.dir} (step {loaded.step}{which}) to {args.to}: {args.out}")
    for note in ([fallback] if fallback else []) + notes:
        print(note)
    return EXIT_FALLBACK if fallback else EXIT_OK


_SAFETENSORS_HEADER_MAX = 100_000_000  # the safetensors library's own limit


def _is_safetensors(path: str) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return n <= min(_SAFETENSORS_HEADER_MAX, os.path.getsize(path) - 8)


def _load_safetensors(path: str) -> dict[str, Any]:
    """A safetensors file as a state: key paths split at ``/`` into nested dicts, tensors and the
    JSON values of ``pitstop.values`` (what ``export --to safetensors`` writes) at their paths."""
    try:
        from safetensors import safe_open

        from pitstop.cli.export_formats import VALUES_KEY
    except ImportError:
        raise MissingExtraError(
            "import of a safetensors file needs safetensors: pip install safetensors", path=path
        ) from None
    try:
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            values = json.loads((f.metadata() or {}).get(VALUES_KEY, "{}"))
    except Exception as e:  # SafetensorError, bad JSON: the header or data is damaged
        text = str(e).strip().splitlines()
        raise CorruptCheckpointError(
            f"cannot load as a safetensors file ({type(e).__name__}: {text[0][:200] if text else ''})",
            path=path,
        ) from None
    if not isinstance(values, dict):
        raise CorruptCheckpointError(
            f"safetensors metadata {VALUES_KEY} is not a JSON object", path=path
        )
    state: dict[str, Any] = {}
    for key, value in [*tensors.items(), *values.items()]:
        *parents, last = [unescape_key(part) for part in key.split("/")]
        here = state
        for part in parents:
            here = here.setdefault(part, {})
            if not isinstance(here, dict):
                raise CorruptCheckpointError(
                    f"key {key!r} lies under a value, not a dict", path=path
                )
        if last in here:
            raise CorruptCheckpointError(f"key {key!r} is given twice", path=path)
        here[last] = value
    return state


def _read_source(src: str, allow_pickle: bool) -> Any:
    from pitstop.cli.dcp_safe import METADATA, load_dcp, load_torch_file  # DCP takes ~1 s to import

    if not os.path.exists(src):
        raise CheckpointNotFoundError("no such file or directory", path=src)
    if os.path.isdir(src):
        if not os.path.lexists(os.path.join(src, METADATA)):
            raise NotACheckpointError(
                f"a directory without DCP {METADATA}: not a DCP checkpoint", path=src
            )
        for name in os.listdir(src):  # read only regular files: no FIFO, device or symlink
            if name == METADATA or name.endswith(".distcp"):
                check_regular(os.lstat(os.path.join(src, name)), os.path.join(src, name))
        return load_dcp(src, allow_pickle=allow_pickle)
    if not stat.S_ISREG(os.stat(src).st_mode):
        raise NotACheckpointError("not a regular file (a FIFO, device or socket)", path=src)
    try:
        safetensors = _is_safetensors(src)
    except OSError as e:
        raise CheckpointIOError(f"cannot read: {e.strerror}", errno=e.errno, path=src) from None
    if safetensors:
        return _load_safetensors(src)
    return load_torch_file(src, allow_pickle=allow_pickle)


def run_import(args: argparse.Namespace) -> int:
    src = args.src
    tree = _read_source(src, args.allow_pickle)
    if not isinstance(tree, Mapping):
        tree = {"state": tree}
    options = SaveOptions.from_env(allow_pickle=args.allow_pickle, max_in_flight=1, overlap=False)
    with CheckpointManager(args.to, options=options) as mgr:
        mgr.save(args.step, tree)
    print(f"imported {src} into {args.to} as step {args.step} ({len(flat_tensors(tree))} tensors)")
    return 0
