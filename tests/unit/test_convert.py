"""Export to and import from the real libraries: torch.save, safetensors, torch.distributed.checkpoint."""

from __future__ import annotations

import os
import pickle
import random
import warnings
from typing import Any

import pytest
import torch

import pitstop
from conftest import assert_same_tensors, make_state, tensors_of
from pitstop.cli.convert import flat_tensors
from pitstop.cli.main import main


@pytest.fixture
def saved(root: str) -> tuple[str, dict[str, Any]]:
    state = make_state(seed=3, steps=2)
    pitstop.save(root, state, step=5)
    return root, pitstop.load(root)


def _zeros_like(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_zeros_like(v) for v in tree)
    return tree


def test_export_torch_round_trip(saved: tuple[str, Any], tmp_path: Any) -> None:
    root, tree = saved
    out = os.path.join(str(tmp_path), "x.pt")
    assert main(["export", root, out, "--to", "torch"]) == 0
    loaded = torch.load(out, weights_only=True)
    assert_same_tensors(flat_tensors(tree), flat_tensors(loaded))
    assert loaded["extra"] == tree["extra"] and loaded["scheduler"] == tree["scheduler"]


def test_export_safetensors_round_trip(saved: tuple[str, Any], tmp_path: Any) -> None:
    from safetensors.torch import load_file

    root, tree = saved
    out = os.path.join(str(tmp_path), "m.safetensors")
    assert main(["export", root, out, "--to", "safetensors", "--only", "model"]) == 0
    loaded = load_file(out)
    expected = flat_tensors(tree["model"])  # keys below --only: fc.weight
    assert_same_tensors(expected, loaded)  # tied weights are written under both names
    assert main(["export", root, out, "--to", "safetensors", "--only", "nope"]) == 1


def test_import_torch_save_then_restore(tmp_path: Any) -> None:
    state = make_state(seed=4, steps=2)
    src = os.path.join(str(tmp_path), "ckpt.pt")
    torch.save(
        {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}, src
    )
    dest = os.path.join(str(tmp_path), "ck")
    assert main(["import", src, "--to", dest, "--step", "3"]) == 0
    fresh = make_state(seed=9, steps=0)
    assert pitstop.CheckpointManager(dest).restore(fresh) == 3
    assert_same_tensors(tensors_of(state), tensors_of(fresh))


def test_import_dcp_directory(saved: tuple[str, Any], tmp_path: Any) -> None:
    root, tree = saved
    out = os.path.join(str(tmp_path), "dcp")
    assert main(["export", root, out, "--to", "dcp", "--only", "model"]) == 0
    dest = os.path.join(str(tmp_path), "back")
    assert main(["import", out, "--to", dest]) == 0
    back = pitstop.load(dest)
    assert_same_tensors(flat_tensors({"model": tree["model"]}), flat_tensors(back))


class Thing:
    pass


def test_import_refuses_pickled_objects_by_default(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = os.path.join(str(tmp_path), "evil.pt")
    torch.save({"x": torch.ones(1), "t": Thing()}, src)
    dest = os.path.join(str(tmp_path), "ck")
    assert main(["import", src, "--to", dest]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "test_convert.Thing" in err and "evil.pt" in err and "--allow-pickle" in err
    assert main(["import", src, "--to", dest, "--allow-pickle"]) == 0


def test_diff(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    pitstop.save(a, {"w": torch.ones(3), "v": torch.zeros(2)}, step=1)
    pitstop.save(
        b, {"w": torch.tensor([1.0, 1.5, 1.0]), "v": torch.zeros(2), "u": torch.ones(1)}, step=1
    )
    assert main(["diff", a, a]) == 0
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out  # the wording of the report is cli/compare's
    assert "0.5" in out and "only in B" in out


# --- import: every file it cannot read is one line naming it and why -----------------------


class SystemPayload:
    """Unpickling this runs ``os.system``, which creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _bad_file(tmp: str, case: str, root: str) -> str:
    """The path of a bad input of kind ``case``."""
    path = os.path.join(tmp, f"bad-{case}")
    good = os.path.join(tmp, "good.pt")
    torch.save({"w": torch.arange(2000.0), "n": 3}, good)
    with open(good, "rb") as f:
        data = f.read()
    noise = random.Random(7).randbytes(4096)
    contents = {
        "zip cut in half": data[: len(data) // 2],
        "zip cut short": data[:200],
        "zip without its last byte": data[:-1],
        "random bytes": noise,
        "random bytes that start like a pickle": b"\x80" + noise,
        "empty file": b"",
        "pickle calling os.system": pickle.dumps({"x": SystemPayload(path + ".PWNED")}, protocol=2),
    }
    if case in contents:
        with open(path, "wb") as f:
            f.write(contents[case])
    elif case == "fifo":
        os.mkfifo(path)
    elif case == "directory without metadata":
        os.makedirs(path)
    elif case == "dcp with damaged metadata":
        assert main(["export", root, path, "--to", "dcp", "--only", "model"]) == 0
        with open(os.path.join(path, ".metadata"), "r+b") as f:
            f.truncate(40)
    elif case.startswith("safetensors"):
        assert main(["export", root, path, "--to", "safetensors", "--only", "model"]) == 0
        with open(path, "r+b") as f:
            if case == "safetensors cut short":
                f.truncate(os.path.getsize(path) - 100)
            else:
                f.seek(20)
                f.write(b"\x00garbage\x00")
    return path


BAD_FILES = [
    "zip cut in half", "zip cut short", "zip without its last byte", "random bytes",
    "random bytes that start like a pickle", "empty file", "pickle calling os.system", "fifo",
    "directory without metadata", "dcp with damaged metadata", "safetensors cut short",
    "safetensors with a damaged header",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_FILES)
def test_import_of_a_bad_file_is_one_line(
    case: str, saved: tuple[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _bad_file(str(tmp_path), case, saved[0])
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as warned:  # a warning is a second line on stderr
        warnings.simplefilter("always")
        assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) in (1, 2)
    assert not warned, [str(w.message)[:100] for w in warned]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err and "Warning" not in err, err
    assert src in lines[0] or os.path.basename(src) in lines[0], err
    assert not os.path.exists(src + ".PWNED")
    assert not os.path.exists(os.path.join(str(tmp_path), "ck", "step-0000000000"))


@pytest.mark.parametrize(
    "case, says",
    [
        ("zip cut in half", "truncated or damaged"),
        ("random bytes that start like a pickle", "does not unpickle weights-only"),
        ("pickle calling os.system", "refusing to unpickle posix.system"),
        ("safetensors cut short", "safetensors"),
    ],
)
def test_import_says_why(
    case: str, says: str, saved: tuple[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _bad_file(str(tmp_path), case, saved[0])
    capsys.readouterr()
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) in (1, 2)
    assert says in capsys.readouterr().err
