"""Many runs of examples/lightning_mnist.py from one process that imports Lightning once.

``python lightning_runs.py SPEC.json``: SPEC is a list of chains, each a list of runs
``{"dir": ..., "argv": [...], "kill_at": "NAME:N" | null, "log": path}`` (and optionally
``"env"``: more environment variables of the run) done one after the other (a killed run,
then its resume). Chains run two at a time, each run in a child forked
from this process (Lightning's import costs seconds, a run of the example one), with
``PITSTOP_KILL_AT`` set as the run says. One JSON line per run on stdout: the run, its
``status`` (exit code; -9 for SIGKILL) and the ``pointers`` its directory holds afterwards
(``.ckpt`` name -> the step it names; the registry -> the ``last`` path it names).

Used by tests/integrations/test_lightning.py; not a test module itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from typing import Any

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "lightning_mnist.py")
PARALLEL = 2


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_mnist", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports torch and Lightning here, once
    return module


def _child(example: Any, run: dict[str, Any]) -> None:
    """In the forked child: the run's output to its log, its kill point, the example."""
    code = 1
    try:
        fd = os.open(run["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.pop("PITSTOP_KILL_AT", None)
        os.environ.pop("PITSTOP_CRASHTEST_KILL_STEP", None)
        if run.get("kill_at"):
            os.environ["PITSTOP_KILL_AT"] = run["kill_at"]
        os.environ.update(run.get("env") or {})
        code = example.main(run["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _pointers(directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.endswith(".ckpt") or name == ".pitstop-lightning.json":
            with open(os.path.join(directory, name)) as f:
                body = json.load(f)
            out[name] = body.get("step", body.get("last"))
    return out


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        chains: list[list[dict[str, Any]]] = json.load(f)
    example = _example()
    running: dict[int, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    todo = [list(chain) for chain in chains if chain]
    while todo or running:
        while todo and len(running) < PARALLEL:
            chain = todo.pop(0)
            run = chain.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(example, run)
            running[pid] = (chain, run)
        pid, status = os.wait()
        chain, run = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        report = {**run, "status": code, "pointers": _pointers(run["dir"])}
        print(json.dumps(report), flush=True)
        if chain:
            todo.insert(0, chain)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
