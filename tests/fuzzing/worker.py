"""The worker process of a campaign (:func:`worker_main`: a persistent ``python -c`` in a
session of its own, its address space limited) and :class:`Worker`, the parent's handle on
it, with a pipe each way.

Protocol: the parent sends ``("init", expected)``; the worker answers ``("ready", pid)``
(or ``("fatal", traceback)`` and exits); then it answers each case dict (root, op,
forgery, seed) with the ``(category, message)`` of
:func:`~fuzzing.classify.run_case`, until it receives ``None``.

Call sequence: ``Worker(...)``, :meth:`Worker.call` per case, then :meth:`Worker.stop` or
:meth:`Worker.kill`, from the driver thread of its slot in a
:class:`~fuzzing.campaign.Fuzzer` (``Fuzzer.close`` stops them from the
caller's thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from fuzzing.classify import run_case
from fuzzing.root import Expected, build_state

__all__ = ["MEMORY_BYTES", "Abort", "Worker", "WorkerDied", "worker_main"]

MEMORY_BYTES = 4 << 30
_WORKER_CODE = "import sys; from fuzzing.worker import worker_main; worker_main(sys.argv[1:])"


def worker_main(argv: Sequence[str]) -> None:
    """A worker: ``argv`` is (fd to read cases from, fd to write results to, memory limit)."""
    import resource

    fd_in, fd_out, memory = (int(a) for a in argv)
    if memory > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    try:
        import logging

        import torch

        import pitstop.manager  # noqa: F401 - imported before the first case is timed

        torch.set_num_threads(1)
        logging.getLogger("pitstop").setLevel(logging.ERROR)
        _, expected = inbox.recv()
        build_state(seed=0, steps=1)
    except BaseException:
        outbox.send(("fatal", traceback.format_exc()))
        return
    outbox.send(("ready", os.getpid()))
    while True:
        msg = inbox.recv()
        if msg is None:
            return
        outbox.send(
            run_case(msg["root"], msg["op"], expected, forgery=msg["forgery"], seed=msg["seed"])
        )


class WorkerDied(Exception):
    pass


class Abort(RuntimeError):
    """A worker could not start, or the campaign was stopped: the campaign ends."""


class Worker:
    """A persistent worker process (its own session) with a pipe each way."""

    def __init__(
        self, log_path: str, expected: Expected, memory_bytes: int, startup_secs: float
    ) -> None:
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1"
        )
        env.pop("PITSTOP_KILL_AT", None)
        self.log_path = log_path
        try:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_CODE, str(r_in), str(w_out), str(memory_bytes)],
                    pass_fds=(r_in, w_out), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=env, cwd=os.path.dirname(log_path),
                    start_new_session=True,
                )  # fmt: skip
        except BaseException:
            for fd in (r_in, w_in, r_out, w_out):
                os.close(fd)
            raise
        os.close(r_in)
        os.close(w_out)
        self.outbox, self.inbox = (
            Connection(w_in, readable=False),
            Connection(r_out, writable=False),
        )
        self.cases = 0
        try:
            self.outbox.send(("init", expected))
            if not self.inbox.poll(startup_secs):
                raise Abort(f"fuzz worker did not start within {startup_secs:.0f} s")
            kind, detail = self.inbox.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise Abort(f"fuzz worker died at start ({e!r}): {self.log_tail()}") from None
        except BaseException:
            self.kill()
            raise
        if kind != "ready":
            self.kill()
            raise Abort(f"fuzz worker could not start:\n{detail}")

    def call(self, msg: dict[str, Any], timeout: float) -> tuple[str, str] | None:
        """The worker's answer, or None on timeout; raises WorkerDied."""
        self.cases += 1
        try:
            self.outbox.send(msg)
            if not self.inbox.poll(timeout):
                return None
            result: tuple[str, str] = self.inbox.recv()
        except (EOFError, OSError):
            rc = self.proc.wait()
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            raise WorkerDied(f"worker died ({how}): {self.log_tail()}") from None
        return result

    def log_tail(self, n: int = 400) -> str:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode(errors="replace").strip().replace("\n", " | ")
        return ""

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.outbox.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the worker's own session
            self.proc.wait()
        for conn in (self.outbox, self.inbox):
            conn.close()
