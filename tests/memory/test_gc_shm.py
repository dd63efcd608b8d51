"""``pitstop gc`` also removes the memory level's shared memory of dead jobs on this host, and
never a living job's (its lock decides). Every test works in a private directory under
/dev/shm (``--shm-dir``): real jobs' segments are never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from pitstop.cli.main import main
from pitstop.levels.shm import SlotSet, lock_name, new_job_token, segment_names, write_header

from .conftest import dead_job

pytestmark = pytest.mark.fault


def _dead_job(shm_dir: str) -> list[str]:
    return dead_job(shm_dir)[1]


def _other_boot_job(shm_dir: str) -> list[str]:
    """Slots without a lock file whose headers were written in another boot."""
    job = "t" + new_job_token()
    slots = SlotSet.create(job, data_bytes=8192, directory=shm_dir)
    os.unlink(os.path.join(shm_dir, lock_name(job, 0)))
    for slot in slots.slots:
        head = slot.header()
        assert head is not None
        write_header(slot.fd, replace(head, boot="another-boot", seq=head.seq + 1))
    slots.close()  # closed, not unlinked: the segments stay
    names = segment_names(shm_dir, job)
    assert len(names) == 2
    return names


def _root(tmp_path: object) -> str:
    root = os.path.join(str(tmp_path), "ckpts")
    os.makedirs(root)
    return root


def test_gc_removes_dead_jobs_segments_and_keeps_a_live_ones(
    tmp_path: object, shm_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _root(tmp_path)
    stale = sorted(_dead_job(shm_dir) + _other_boot_job(shm_dir))
    live = "t" + new_job_token()
    alive = SlotSet.create(live, data_bytes=8192, directory=shm_dir)
    try:
        kept = segment_names(shm_dir, live)
        # --dry-run says what it would remove and removes nothing
        assert main(["gc", root, "--dry-run", "--shm-dir", shm_dir]) == 0
        out = capsys.readouterr().out
        for name in stale:
            assert f"would remove {os.path.join(shm_dir, name)} " in out, out
        assert live not in out and "nothing to remove" not in out
        assert sorted(os.listdir(shm_dir)) == sorted(stale + kept)

        # main: gc left every segment where it was
        assert main(["gc", root, "--shm-dir", shm_dir]) == 0
        out = capsys.readouterr().out
        assert sorted(line.split()[1] for line in out.splitlines()) == sorted(
            os.path.join(shm_dir, n) for n in stale
        )
        assert all(line.startswith("removed ") for line in out.splitlines())
        assert sorted(os.listdir(shm_dir)) == sorted(kept)  # the living job's, all of them

        assert main(["gc", root, "--shm-dir", shm_dir]) == 0
        assert capsys.readouterr().out == "nothing to remove\n"
    finally:
        alive.close(unlink=True)


def test_no_shm_leaves_shared_memory_alone(
    tmp_path: object, shm_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _root(tmp_path)
    stale = _dead_job(shm_dir)
    assert main(["gc", root, "--no-shm", "--shm-dir", shm_dir]) == 0
    assert capsys.readouterr().out == "nothing to remove\n"
    assert sorted(os.listdir(shm_dir)) == sorted(stale)
    assert main(["gc", root, "--shm-dir", shm_dir]) == 0  # on by default for a local root
    assert os.listdir(shm_dir) == []


def test_gc_of_shared_memory_runs_without_torch(tmp_path: object, shm_dir: str) -> None:
    root = _root(tmp_path)
    stale = _dead_job(shm_dir)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        from pitstop.cli.main import main
        assert main(["gc", {root!r}, "--shm-dir", {shm_dir!r}]) == 0
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == len(stale) and os.listdir(shm_dir) == []


def test_gc_removes_the_empty_keeper_logs_of_the_jobs_it_removes(
    tmp_path: object, shm_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A killed keeper leaves its log behind; gc removes the empty ones of the dead jobs whose
    segments it removes, never a log with something in it nor a living job's."""
    from pitstop.levels.keeper import keeper_log
    from pitstop.levels.shm_header import parse_segment_name

    dead = {p[0] for p in map(parse_segment_name, _dead_job(shm_dir)) if p is not None}
    (ended,) = dead
    running = "t" + new_job_token()
    live = SlotSet.create(running, data_bytes=4096, directory=shm_dir)
    paths = [keeper_log(ended), keeper_log(ended, 1), keeper_log(running)]
    try:
        for p in paths:
            open(p, "w").close()
        with open(paths[1], "w") as f:
            f.write("keeper: a warning worth keeping\n")
        root = _root(tmp_path)
        assert main(["gc", root, "--shm-dir", shm_dir, "--dry-run"]) == 0
        assert os.path.exists(paths[0])
        assert main(["gc", root, "--shm-dir", shm_dir]) == 0
        assert "removed 1 empty keeper log(s)" in capsys.readouterr().out
        assert [os.path.exists(p) for p in paths] == [False, True, True]
    finally:
        live.close(unlink=True)
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
