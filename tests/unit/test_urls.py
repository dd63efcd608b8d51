"""A URL where a directory goes (a node-local level) and a near-URL (a pathlib.Path of one)
are refused before anything is made; a URL without the object-store extra names the extra;
a ``file:`` URL of a local path is that path; odd root types name the type."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

import pitstop


@pytest.mark.parametrize("url", ["s3://bucket/run1", "gs://bucket/run", "az://c/run"])
def test_an_object_store_url_is_never_made_a_local_directory(
    tmp_path: Any, monkeypatch: Any, url: str
) -> None:
    """A URL opens object storage (tests/objectstore) or fails with the reason; a local level
    given a URL is refused; nothing named 's3:' is ever created."""
    monkeypatch.chdir(tmp_path)
    scheme = url.split(":")[0]
    with pytest.raises(pitstop.UnsupportedSetupError, match=f"{scheme}:// is not a directory"):
        pitstop.CheckpointManager([pitstop.Local(f"{url}/{{node}}")])
    assert os.listdir(tmp_path) == []  # no directory named 's3:' anywhere


@pytest.mark.parametrize("url", ["s3://bucket/run1", "gs://bucket/run"])
def test_a_url_without_the_extra_names_the_extra(
    tmp_path: Any, monkeypatch: Any, capsys: Any, url: str
) -> None:
    from pitstop.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "obstore", None)  # not installed
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    with pytest.raises(pitstop.MissingExtraError, match=r"pip install 'pitstop\[s3\]'"):
        pitstop.CheckpointManager(url)
    with pytest.raises(pitstop.MissingExtraError, match=r"pitstop\[s3\]"):
        pitstop.CheckpointManager([pitstop.Local(tmp_path / "l" / "{node}"), pitstop.Shared(url)])
    with pytest.raises(pitstop.MissingExtraError, match=r"pitstop\[s3\]"):
        pitstop.save(url, {"w": torch.zeros(2)})
    assert main(["ls", url]) == 2
    assert "pitstop[s3]" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_file_url_is_the_directory_it_names(tmp_path: Any) -> None:
    model = torch.nn.Linear(2, 2)
    with pitstop.CheckpointManager(f"file://{tmp_path / 'ck'}") as ckpt:
        ckpt.save(1, {"model": model})
    assert (tmp_path / "ck" / "step-0000000001" / "manifest.json").exists()


@pytest.mark.parametrize(
    "root",
    [pathlib.Path("s3://bucket/run1"), "s3:/b/r", " s3://b/r", "./s3://x", "gs:"],
    ids=["pathlib", "one-slash", "blank", "dot-slash", "bare"],
)
def test_near_urls_and_paths_of_urls_are_refused(
    tmp_path: Any, monkeypatch: Any, root: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pitstop.UnsupportedSetupError, match="is not a directory"):
        pitstop.CheckpointManager(root)
    with pytest.raises(pitstop.UnsupportedSetupError):
        pitstop.save(root, {"w": torch.zeros(2)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("form", ["file://{p}", "file://localhost{p}", "file:{p}"])
def test_file_urls_of_a_local_path_work_everywhere(tmp_path: Any, form: str) -> None:
    url = form.format(p=tmp_path / "ck")
    pitstop.save(url, {"w": torch.ones(3)}, step=4)
    out = {"w": torch.zeros(3)}
    assert pitstop.load(url, out) == 4 and torch.equal(out["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["ck"]
    for bad in ("file://otherhost/x", "file://rel", "file://"):
        with pytest.raises(pitstop.UnsupportedSetupError, match="absolute path on this host"):
            pitstop.CheckpointManager(bad)


def test_odd_root_types_name_the_type(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match="not bytes"):
        pitstop.CheckpointManager(b"s3://b/r")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not int"):
        pitstop.CheckpointManager(3)  # type: ignore[arg-type]


def test_a_url_refused_by_the_cli_is_bad_usage_even_with_stderr_closed(tmp_path: Any) -> None:
    cli = os.path.join(os.path.dirname(sys.executable), "pitstop")
    for cmd in (["verify", "s3:/x"], ["ls", "gs:/b/r"], ["diff", "./s3://a", "s3:/b"]):
        r = subprocess.run([cli, *cmd], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "is not a directory" in r.stderr
        closed = subprocess.run(
            [cli, *cmd], stdout=subprocess.DEVNULL, stderr=_closed_pipe(), cwd=tmp_path
        )
        assert closed.returncode == 2, cmd
    assert os.listdir(tmp_path) == []


def test_output_that_cannot_be_written_is_said_and_the_command_still_finishes(
    tmp_path: Any,
) -> None:
    """stdout on a full disk: verify still checks (and marks) every step; exit 1, said."""
    root = tmp_path / "ck"
    for step in (1, 2):
        pitstop.save(root, {"w": torch.ones(64)}, step=step)
    data = root / "step-0000000001" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    cli = os.path.join(os.path.dirname(sys.executable), "pitstop")
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [cli, "verify", str(root)], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert r.returncode == 1
    assert "cannot write the output" in r.stderr and "internal error" not in r.stderr
    assert (root / "step-0000000001" / "DAMAGED").exists()  # checked and marked all the same
    with open("/dev/full", "w") as full:
        clean = subprocess.run(
            [cli, "ls", str(root)], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert clean.returncode == 1 and "cannot write the output" in clean.stderr


def _closed_pipe() -> int:
    read, write = os.pipe()
    os.close(read)
    return write


def test_gc_of_one_checkpoint_directory_is_bad_usage_not_gc_of_its_root(
    tmp_path: Any, capsys: Any
) -> None:
    from pitstop.cli.main import main

    root = tmp_path / "ck"
    pitstop.save(root, {"w": torch.ones(3)}, step=1)
    (root / "step-0000000002").mkdir()  # debris a gc of the root would remove
    assert main(["gc", str(root / "step-0000000001"), "--min-age", "0"]) == 2
    assert "give its root" in capsys.readouterr().err
    assert (root / "step-0000000002").exists()
    assert main(["gc", str(root), "--min-age", "0"]) == 0
    assert not (root / "step-0000000002").exists()
