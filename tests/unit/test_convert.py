"""Export to and import from the real libraries: torch.save, safetensors, torch.distributed.checkpoint."""

from __future__ import annotations

import os
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
    expected = flat_tensors({"model": tree["model"]})
    assert_same_tensors(expected, loaded)  # tied weights are written under both names
    assert main(["export", root, out, "--to", "safetensors", "--only", "nope"]) == 1


def test_export_dcp_round_trip(saved: tuple[str, Any], tmp_path: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from pitstop.cli.convert import _dcp_compatible

    root, tree = saved
    out = os.path.join(str(tmp_path), "dcp")
    assert main(["export", root, out, "--to", "dcp"]) == 0
    template = _dcp_compatible(_zeros_like(tree))
    dcp.load(template, checkpoint_id=out, no_dist=True)
    assert_same_tensors(flat_tensors(_dcp_compatible(tree)), flat_tensors(template))


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
    out = capsys.readouterr().out
    assert (
        "w" in out and "0.5" in out and "only in B" in out and "3 tensors compared, 2 differ" in out
    )
