"""pitstop.integrations.lightning on a root someone tampered with: a registry whose ``last`` or
``dirs`` name files that are not pitstop's, or do not parse; a FIFO where a pointer was.
Nothing outside pitstop's own pointer files is written or deleted, and nothing blocks."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch

import pitstop
from pitstop.cli.main import main as pitstop_main
from pitstop.integrations.lightning import PitstopCheckpointIO

REGISTRY = ".pitstop-lightning.json"


def _ckpt(step: int, root: str) -> dict[str, Any]:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), float(step))}}


def _named(path: str) -> int:
    with open(path) as f:
        return int(json.load(f)["step"])


def _committed_root(tmp_path: Any) -> tuple[str, str]:
    """A root whose only committed step is 40, and the bytes of its manifest."""
    root = str(tmp_path / "run")
    pitstop.save(root, {"w": torch.ones(3)}, step=40)
    with open(os.path.join(root, "step-0000000040", "manifest.json")) as f:
        return root, f.read()


def _registry(root: str, body: Any) -> None:
    with open(os.path.join(root, REGISTRY), "w") as f:
        f.write(body if isinstance(body, str) else json.dumps(body))


@pytest.mark.parametrize(
    "last",
    [
        "step-0000000040/manifest.json",  # a committed step's manifest: never a pointer
        "step-0000000040/last.ckpt",  # inside a step directory, even with the name of one
        "{victim}",  # a file outside the root
        "last.ckpt",  # a file that is there and is no pitstop pointer (Lightning's own)
        "elsewhere/last.ckpt",  # a directory the registry does not list
    ],
)
def test_a_registry_last_that_does_not_validate_overwrites_nothing(
    tmp_path: Any, caplog: Any, last: str
) -> None:
    root, manifest = _committed_root(tmp_path)
    victim = str(tmp_path / "victim.txt")
    planted = {victim, os.path.join(root, "last.ckpt"), os.path.join(root, last)}
    planted.discard(os.path.join(root, "step-0000000040", "manifest.json"))
    for path in planted:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("precious")
    dirs = [".", "step-0000000040"]
    _registry(root, {"pitstop": "lightning-registry", "version": 1, "dirs": dirs,
                     "last": last.format(victim=victim)})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        io = PitstopCheckpointIO(root)
    io.close()
    with open(os.path.join(root, "step-0000000040", "manifest.json")) as f:
        assert f.read() == manifest
    for path in planted:
        with open(path) as f:
            assert f.read() == "precious", path
    assert REGISTRY in caplog.text and "ignored" in caplog.text
    assert pitstop_main(["verify", root]) == 0


@pytest.mark.parametrize(
    "body",
    [
        {"dirs": 5},
        {"dirs": [1]},
        {"dirs": "."},
        {"last": 5},
        {"dirs": ["."], "last": ["last.ckpt"]},
        "[1, 2",
        "",
    ],
)
def test_a_malformed_registry_is_ignored_with_a_warning(
    tmp_path: Any, caplog: Any, body: Any
) -> None:
    root, _ = _committed_root(tmp_path)
    if isinstance(body, dict):
        body = {"pitstop": "lightning-registry", "version": 1, **body}
    _registry(root, body)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        io = PitstopCheckpointIO(root)
    assert REGISTRY in caplog.text and "ignored" in caplog.text
    io.save_checkpoint(_ckpt(50, root), os.path.join(root, "last.ckpt"))
    io.close()
    assert _named(os.path.join(root, "last.ckpt")) == 50  # the registry is written anew
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        caplog.clear()
        PitstopCheckpointIO(root).close()
    assert "ignored" not in caplog.text


def test_the_valid_parts_of_a_registry_are_kept(tmp_path: Any) -> None:
    root = str(tmp_path / "run")
    io = PitstopCheckpointIO(root)
    io.save_checkpoint(_ckpt(10, root), os.path.join(root, "mc", "a.ckpt"))
    io.close()
    _registry(root, {"pitstop": "lightning-registry", "version": 1, "dirs": ["mc", 7],
                     "last": 5})  # fmt: skip
    io = PitstopCheckpointIO(root)
    io.save_checkpoint(_ckpt(20, root), os.path.join(root, "b.ckpt"))
    io.remove_checkpoint(os.path.join(root, "b.ckpt"))
    io.save_checkpoint(_ckpt(30, root), os.path.join(root, "c.ckpt"))
    io.close()
    assert io.manager.steps() == [10, 30]  # mc/a.ckpt still names 10: its directory was read


def test_registered_directories_lose_only_pitstop_temporary_files(tmp_path: Any) -> None:
    root, _ = _committed_root(tmp_path)
    other, step_dir = str(tmp_path / "other"), os.path.join(root, "step-0000000040")
    os.makedirs(other)
    kept = [os.path.join(other, "data.pitstop-tmp"), os.path.join(other, "x.ckpt.3.pitstop-tmp"),
            os.path.join(step_dir, "last.ckpt.1.pitstop-tmp")]  # fmt: skip
    for path in kept:
        with open(path, "w") as f:
            f.write("precious")
    os.symlink(kept[0], os.path.join(other, "link.ckpt.4.pitstop-tmp"))
    leftover = os.path.join(root, "last.ckpt.7.pitstop-tmp")  # a killed pointer write's
    body = {"pitstop": "lightning-pointer", "version": 1, "step": 40, "root": "."}
    with open(leftover, "w") as f:
        json.dump(body, f)
    open(os.path.join(root, "epoch=1.ckpt.9.pitstop-tmp"), "w").close()  # killed before a byte
    dirs = [".", "../other", "step-0000000040"]
    _registry(root, {"pitstop": "lightning-registry", "version": 1, "dirs": dirs, "last": None})
    PitstopCheckpointIO(root).close()
    assert all(os.path.isfile(p) for p in kept) and os.path.islink(
        os.path.join(other, "link.ckpt.4.pitstop-tmp")
    )
    assert not os.path.exists(leftover)
    assert not os.path.exists(os.path.join(root, "epoch=1.ckpt.9.pitstop-tmp"))


def _within(seconds: float, fn: Any, fifo: str) -> Any:
    """``fn()`` in a thread; if it is still running after ``seconds`` (blocked opening
    ``fifo``), a writer opens the FIFO to release it and the test fails."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"blocked on the FIFO {fifo}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_fifo_at_a_pointer_path_blocks_nothing(tmp_path: Any, caplog: Any) -> None:
    root = str(tmp_path / "run")
    last, top = os.path.join(root, "last.ckpt"), os.path.join(root, "epoch=0-step=5.ckpt")
    io = PitstopCheckpointIO(root)
    io.save_checkpoint(_ckpt(5, root), top)
    io.save_checkpoint(_ckpt(5, root), last)
    io.close()
    os.remove(last)
    os.mkfifo(last)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        io = _within(20, lambda: PitstopCheckpointIO(root), last)
    assert last in caplog.text and "not a regular file" in caplog.text
    with pytest.raises(pitstop.NotACheckpointError, match="not a regular file"):
        _within(20, lambda: io.load_checkpoint(last), last)
    _within(20, lambda: io.remove_checkpoint(last), last)
    assert _within(20, lambda: io.load_checkpoint(top), last)["global_step"] == 5
    io.close()
