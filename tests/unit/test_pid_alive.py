"""``pitstop.io.locks.pid_alive``: a process that ended but was not waited for yet (a zombie)
is not alive. A keeper judging whether every trainer of its job is dead asked ``kill(pid,
0)``, which a zombie answers: with a launcher that reaps late, a killed trainer counted as
alive and the job's newest step was never written (hostile review, issue 27)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pitstop.io.locks import pid_alive


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0]


def test_a_zombie_is_not_alive_a_running_process_is() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert pid_alive(child.pid)
        assert child.stdin is not None
        child.stdin.close()  # it ends; not waited for: a zombie
        deadline = time.monotonic() + 30
        while _state(child.pid) != b"Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(child.pid) == b"Z"
        assert not pid_alive(child.pid)
    finally:
        child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())
