"""Outcome categories (:data:`GOOD`, :data:`BAD`) and :func:`run_case`, which runs one
operation on a damaged root and classifies what happened.
"""

from __future__ import annotations

import contextlib
import io
import os
import traceback
from collections.abc import Mapping

from fuzzing.root import Expected, build_state, digest_state

__all__ = ["BAD", "GOOD", "run_case", "where"]

GOOD = frozenset(
    {"ok_newest", "ok_fallback", "pitstop_error", "forged_value"}
    | {f"cli_exit_{rc}" for rc in (0, 1, 2)}
)
BAD = frozenset(
    {
        "wrong_value",
        "half_restore",
        "non_pitstop_exception",
        "hang",
        "crash",
        "memory",
        "outside_modified",
        "harness_error",
    }
)


def run_case(
    root: str, op: str, expected: Expected, *, forgery: bool = False, seed: int = 0
) -> tuple[str, str]:
    """Run ``op`` on the checkpoint root ``root`` in this process and classify the outcome:
    (category, message). Called in a worker; never raises (but for KeyboardInterrupt)."""
    try:
        if op == "restore":
            return _case_restore(root, expected, forgery, seed)
        if op == "load":
            return _case_load(root, expected, forgery)
        if op in ("verify", "ls", "inspect"):
            return _case_cli(root, op)
        raise ValueError(f"unknown op {op!r}")
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        return _classify_exception(e)


def where(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} in {f.name}"


def _classify_exception(e: BaseException) -> tuple[str, str]:
    from pitstop.errors import CheckpointError

    text = f"{type(e).__name__}: {str(e)[:300]}{where(e)}"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "allocate" in str(e)):
        return "memory", text
    if isinstance(e, CheckpointError):
        return "pitstop_error", text
    return "non_pitstop_exception", text


def _case_restore(root: str, expected: Expected, forgery: bool, seed: int) -> tuple[str, str]:
    import pitstop
    from pitstop.errors import (
        CheckpointError,
        CheckpointIOError,
        FormatVersionError,
        MissingExtraError,
        PartialRestoreError,
        StateMismatchError,
    )

    state = build_state(seed=1000 + seed, steps=0, fresh=True)
    before = digest_state(state)
    try:
        with pitstop.CheckpointManager(root) as mgr:
            step = mgr.restore(state)
    except CheckpointError as e:
        category, text = _classify_exception(e)
        if category != "pitstop_error":
            return category, text
        after = digest_state(state)
        changed = sorted(k for k in before if after.get(k) != before[k])
        # raised by design without trying step 1: storage failures, a newer format, a checksum
        # package this machine lacks, and (for a consistent forgery) a state that does not fit
        allowed = isinstance(e, (FormatVersionError, CheckpointIOError, MissingExtraError)) or (
            forgery and isinstance(e, StateMismatchError) and not isinstance(e, PartialRestoreError)
        )
        if changed:
            return "half_restore", f"state partly overwritten ({', '.join(changed)}): {text}"
        if not allowed:
            return "half_restore", f"no fallback to the intact step 1: {text}"
        return "pitstop_error", text
    got = digest_state(state)
    if step in (1, 2) and got == expected.restore[step]:
        return ("ok_newest" if step == 2 else "ok_fallback"), ""
    if step == 2 and forgery:
        return "forged_value", _differs(got, expected.restore[2])
    if step is None:
        return "wrong_value", "restore returned None although step 1 is intact"
    return (
        "wrong_value",
        f"restore returned step {step}; {_differs(got, expected.restore.get(step, {}))}",
    )


def _differs(got: dict[str, str], want: dict[str, str]) -> str:
    keys = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    return f"differs from the saved values in: {', '.join(keys) or 'nothing'}"


def _case_load(root: str, expected: Expected, forgery: bool) -> tuple[str, str]:
    import pitstop

    tree = pitstop.load(root)
    if not isinstance(tree, Mapping):
        return "wrong_value", f"pitstop.load returned a {type(tree).__name__}"
    got = digest_state(tree)
    for step, category in ((2, "ok_newest"), (1, "ok_fallback")):
        if got == expected.load[step]:
            return category, ""
    if forgery:
        return "forged_value", _differs(got, expected.load[2])
    return "wrong_value", f"neither step's values; {_differs(got, expected.load[2])}"


def _case_cli(root: str, op: str) -> tuple[str, str]:
    from pitstop.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: object = main([op, root])
        except SystemExit as e:
            rc = e.code
    if "Traceback" in err.getvalue():
        lines = err.getvalue().strip().splitlines()
        return "non_pitstop_exception", f"traceback on stderr: {' | '.join(lines[-2:])[:400]}"
    if rc not in (0, 1, 2):
        return "non_pitstop_exception", f"exit code {rc!r}"
    last = (err.getvalue().strip().splitlines() or out.getvalue().strip().splitlines() or [""])[-1]
    return f"cli_exit_{rc}", last[:300]
