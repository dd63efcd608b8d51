"""``pitstop export``: each file loads through its tool's own standard recipe and equals the live
objects that were saved; optimizer parameter names recorded in the objects tree."""

from __future__ import annotations

import json
import os
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pitstop
from conftest import Net, make_state, train_step
from fuzzing.seal import reseal
from pitstop.cli.main import main
from pitstop.errors import ManifestError
from pitstop.format import objects as objects_format
from pitstop.format.objects import encode_objects, parse_objects
from pitstop.state.tree import flatten, walk


class Wrapped(nn.Module):
    """A module held under ``attr`` (``_orig_mod`` as torch.compile, ``module`` as DDP): its
    state dict keys carry the wrapper's prefix."""

    def __init__(self, inner: nn.Module, attr: str) -> None:
        super().__init__()
        setattr(self, attr, inner)


def _live(seed: int = 3, steps: int = 2) -> dict[str, Any]:
    state = make_state(seed=seed, steps=steps)
    state["rng"] = pitstop.RNGState()
    return state


def _export(root: str, out: str, to: str, *extra: str) -> str:
    assert main(["export", root, out, "--to", to, *extra]) == 0
    return out


def _same(a: Any, b: Any, key: str = "") -> None:
    """Equal trees: tensors bit for bit (and dtype), NumPy arrays against tensors by value,
    tuples stay tuples."""
    if isinstance(a, (torch.Tensor, np.ndarray)):
        b = b.numpy() if isinstance(b, torch.Tensor) and isinstance(a, np.ndarray) else b
        assert type(b) is type(a), key
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else np.array_equal(a, b), key
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (key, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{key}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{key}/{i}")
    else:
        assert type(a) is type(b) and a == b, key


# ---------------------------------------------------------------- the tree records params


def test_optimizer_node_records_parameter_keys_in_id_order() -> None:
    state = make_state(seed=1, steps=1)
    flat = flatten({"optimizer": state["optimizer"], "model": state["model"]})  # model after
    nodes = [n for _, kind, n in walk(flat.tree) if kind == "stateful" and "params" in n]
    assert len(nodes) == 1
    names = [name for name, _ in state["model"].named_parameters()]  # the tied one once
    assert nodes[0]["params"] == [f"model/{n}" for n in names]
    data = encode_objects(flat.tree, rank=0)
    assert (
        parse_objects(data, name="objects", tensor_keys=set(flat.tensors))
        == json.loads(data)["tree"]
    )


def test_a_parameter_stored_nowhere_else_is_null() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = flatten({"opt": opt, "bias": model.bias})
    node = next(n for _, kind, n in walk(flat.tree) if kind == "stateful")
    assert node["params"] == [None, "bias"]


def test_load_gives_the_plain_optimizer_state_dict(root: str) -> None:
    state = make_state(seed=2, steps=2)
    pitstop.save(root, state, step=1)
    loaded = pitstop.load(root)["optimizer"]
    assert set(loaded) == {"state", "param_groups"}
    assert (
        loaded["param_groups"][0]["params"]
        == state["optimizer"].state_dict()["param_groups"][0]["params"]
    )
    fresh = make_state(seed=9, steps=0)
    assert pitstop.load(root, fresh) == 1  # load_state_dict gets the state, not params
    _same(state["optimizer"].state_dict(), fresh["optimizer"].state_dict())


def _tree_with(params: Any) -> dict[str, Any]:
    return {"dict": [
        ["model", {"dict": [["w", {"tensor": "model/w"}]]}],
        ["opt", {"stateful": "torch.optim.sgd.SGD", "state": {"dict": []}, "params": params}],
    ]}  # fmt: skip


def _parse(tree: Any) -> Any:
    doc = {"format": "pitstop-objects", "format_version": 3, "rank": 0, "tree": tree}
    return parse_objects(
        json.dumps(doc).encode(), name="objects-00000.json", tensor_keys={"model/w"}
    )


@pytest.mark.parametrize(
    "params, message",
    [
        ("model/w", "'params' is not a list"),
        ({"0": "model/w"}, "'params' is not a list"),
        (["model/w", 3], "'params' entry 1 is not a key or null"),
        ([["model/w"]], "'params' entry 0 is not a key or null"),
        (["model/x"], "'params' entry 0 names tensor 'model/x', which the manifest lacks"),
        ([None, None, None], "'params' is not a list of at most 2"),
    ],
)
def test_parser_refuses_a_damaged_params_field(
    params: Any, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _parse(_tree_with(["model/w", None]))  # a good one parses
    monkeypatch.setattr(objects_format, "MAX_OPTIMIZER_PARAMS", 2)
    with pytest.raises(ManifestError) as info:
        _parse(_tree_with(params))
    assert "objects-00000.json: node at 'opt'" in str(info.value)
    assert message in str(info.value)


# ---------------------------------------------------------------- DCP


def _dcp_recipe(out: str, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
    """DCP's documented way to load a model and optimizer (plus a scheduler's state dict)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optimizer": optim_sd, "scheduler": sched.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(sd, checkpoint_id=out)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    sched.load_state_dict(sd["scheduler"])


def _assert_same_training_state(live: dict[str, Any], fresh: dict[str, Any]) -> None:
    _same(live["model"].state_dict(), fresh["model"].state_dict())
    a, b = live["optimizer"].state_dict(), fresh["optimizer"].state_dict()
    _same(a["state"], b["state"])
    _same(a["param_groups"], b["param_groups"])  # betas stay a tuple
    assert isinstance(b["param_groups"][0]["betas"], tuple)
    _same(live["scheduler"].state_dict(), fresh["scheduler"].state_dict())


def test_dcp_export_loads_with_get_state_dict_recipe(root: str, tmp_path: Any) -> None:
    live = make_state(seed=3, steps=3)
    pitstop.save(root, {"optimizer": live["optimizer"], **live}, step=5)  # optimizer first
    out = _export(root, str(tmp_path / "dcp"), "dcp")
    fresh = make_state(seed=9, steps=0)
    _dcp_recipe(out, fresh["model"], fresh["optimizer"], fresh["scheduler"])
    _assert_same_training_state(live, fresh)


def _wrapped_state(attr: str) -> dict[str, Any]:
    torch.manual_seed(4)
    inner = Net()
    model = Wrapped(inner, attr)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(2):
        train_step(model.get_submodule(attr), opt, i)
        sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched}


@pytest.mark.parametrize("attr", ["_orig_mod", "module"])
def test_wrapped_model_exports_plain_names(
    attr: str, root: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    live = _wrapped_state(attr)
    assert next(iter(live["model"].state_dict())).startswith(f"{attr}.")
    pitstop.save(root, live, step=1)
    fresh = make_state(seed=9, steps=0)  # a plain Net
    out = _export(root, str(tmp_path / "dcp"), "dcp")
    _dcp_recipe(out, fresh["model"], fresh["optimizer"], fresh["scheduler"])
    _same(live["model"].get_submodule(attr).state_dict(), fresh["model"].state_dict())
    _same(live["optimizer"].state_dict()["state"], fresh["optimizer"].state_dict()["state"])
    st = _export(root, str(tmp_path / "m.safetensors"), "safetensors", "--only", "model")
    plain = Net()
    plain.load_state_dict(load_file(st))  # strict: every key plain
    _same(live["model"].get_submodule(attr).state_dict(), plain.state_dict())
    pt = _export(root, str(tmp_path / "m.pt"), "torch")
    Net().load_state_dict(torch.load(pt, weights_only=True)["model"])
    assert "note" not in capsys.readouterr().out


def _as_old_writer(root: str, step: int) -> None:
    """Rewrite a checkpoint's objects file as pitstop wrote it before ``params`` (format 2)."""
    directory = os.path.join(root, f"step-{step:010d}")
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(directory, "objects-00000.json")) as f:
        doc = json.load(f)
    for _, kind, node in walk(doc["tree"]):
        if kind == "stateful":
            node.pop("params", None)
    doc["format_version"] = 2
    data = json.dumps(doc, separators=(",", ":")).encode()
    reseal(manifest, data, manifest["checksum"]["algorithm"])
    with open(os.path.join(directory, "objects-00000.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def test_checkpoint_without_params_exports_with_a_note(
    root: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    live = make_state(seed=3, steps=2)
    pitstop.save(root, live, step=2)
    _as_old_writer(root, 2)
    assert pitstop.load(root, make_state(seed=9, steps=0)) == 2  # still a valid checkpoint
    out = _export(root, str(tmp_path / "dcp"), "dcp")
    printed = capsys.readouterr().out
    assert "note: optimizer state at 'optimizer' keeps integer parameter ids" in printed
    expected = live["optimizer"].state_dict()["state"][0]["exp_avg"]
    template = {"optimizer": {"state": {"0": {"exp_avg": torch.zeros_like(expected)}}}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=out)
    assert torch.equal(template["optimizer"]["state"]["0"]["exp_avg"], expected)


def test_checkpoint_without_params_uses_param_names(
    root: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(5)
    model = Wrapped(Net(), "module")
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-2)  # param_names: module.fc.weight ...
    train_step(model.module, opt, 0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    pitstop.save(root, {"model": model, "optimizer": opt, "scheduler": sched}, step=1)
    _as_old_writer(root, 1)
    out = _export(root, str(tmp_path / "dcp"), "dcp")
    assert "note" not in capsys.readouterr().out
    fresh_model = Net()
    fresh_opt = torch.optim.Adam(fresh_model.named_parameters(), lr=1e-2)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2)
    _dcp_recipe(out, fresh_model, fresh_opt, fresh_sched)
    _same(model.module.state_dict(), fresh_model.state_dict())
    _same(opt.state_dict()["state"], fresh_opt.state_dict()["state"])


# ---------------------------------------------------------------- torch


def test_torch_export_loads_weights_only_and_equals_the_state(
    root: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    live = _live()
    expected = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in live.items()}
    pitstop.save(root, live, step=3)
    out = _export(root, str(tmp_path / "x.pt"), "torch")
    printed = capsys.readouterr().out
    assert "note: NumPy values converted" in printed and "rng/numpy/1" in printed
    loaded = torch.load(out, weights_only=True)  # no safe_globals needed
    _same(expected, loaded)
    random.random(), np.random.rand(), torch.rand(1)  # move the streams on
    pitstop.RNGState().load_state_dict(loaded["rng"])  # a tensor serves numpy too
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    live["rng"].load_state_dict(expected["rng"])
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    assert torch.equal(torch.rand(3), expected_draws[2])
    model = Net()
    model.load_state_dict(loaded["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(loaded["optimizer"])  # integer ids, as torch's recipe wants
    _same(expected["optimizer"], opt.state_dict())


def test_torch_export_of_numpy_scalars(root: str, tmp_path: Any) -> None:
    pitstop.save(root, {"m": {"f": np.float32(1.5), "i": np.int64(3), "a": np.arange(3)}}, step=1)
    loaded = torch.load(_export(root, str(tmp_path / "x.pt"), "torch"), weights_only=True)
    assert loaded["m"]["f"] == 1.5 and type(loaded["m"]["f"]) is float
    assert loaded["m"]["i"] == 3 and type(loaded["m"]["i"]) is int
    assert torch.equal(loaded["m"]["a"], torch.arange(3))


def test_torch_export_imports_back_and_restores(root: str, tmp_path: Any) -> None:
    live = _live()
    pitstop.save(root, live, step=3)
    out = _export(root, str(tmp_path / "x.pt"), "torch")
    dest = str(tmp_path / "back")
    assert main(["import", out, "--to", dest, "--step", "3"]) == 0
    fresh = _live(seed=8, steps=0)
    assert pitstop.load(dest, fresh) == 3
    _assert_same_training_state(live, fresh)


# ---------------------------------------------------------------- safetensors


def test_safetensors_only_model_loads_into_load_state_dict(root: str, tmp_path: Any) -> None:
    from safetensors.torch import load_file

    live = make_state(seed=3, steps=2)
    pitstop.save(root, live, step=1)
    out = _export(root, str(tmp_path / "m.safetensors"), "safetensors", "--only", "model")
    loaded = load_file(out)
    assert "embed.weight" in loaded and "out.weight" in loaded  # tied: both names
    model = Net()
    model.load_state_dict(loaded)
    _same(live["model"].state_dict(), model.state_dict())
    mask = os.umask(0o022)
    os.umask(mask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~mask  # like any new file, not 0600


def test_safetensors_metadata_holds_the_values(
    root: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    live = make_state(seed=3, steps=2)
    live["extra"]["blob"] = b"\x00"
    live["extra"]["bad"] = float("nan")
    pitstop.save(root, live, step=1)
    out = _export(root, str(tmp_path / "all.safetensors"), "safetensors")
    printed = capsys.readouterr().out
    assert "not carried: extra/blob (a bytes), extra/bad (a float: not finite)" in printed
    with safe_open(out, framework="pt") as f:
        values = json.loads(f.metadata()["pitstop.values"])
        keys = set(f.keys())
    assert "model/fc.weight" in keys and "optimizer/state/0/exp_avg" in keys
    group = live["optimizer"].state_dict()["param_groups"][0]
    assert values["optimizer/param_groups/0/lr"] == group["lr"]
    assert values["optimizer/param_groups/0/betas/1"] == group["betas"][1]
    assert values["extra/tag"] == "run" and values["scheduler/last_epoch"] == 2


def test_safetensors_file_imports(root: str, tmp_path: Any) -> None:
    live = make_state(seed=3, steps=2)
    pitstop.save(root, {"model": live["model"], "extra": live["extra"]}, step=1)
    out = _export(root, str(tmp_path / "all.safetensors"), "safetensors")
    dest = str(tmp_path / "back")
    assert main(["import", out, "--to", dest, "--step", "4"]) == 0
    back = pitstop.load(dest)
    _same(dict(sorted(live["model"].state_dict().items())), back["model"])  # safetensors sorts
    assert back["extra"] == {"epoch": 2, "tag": "run"}


def test_dcp_export_of_an_optimizer_that_has_not_stepped_says_how_to_load_it(
    tmp_path: Any, capsys: Any
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    pitstop.save(str(tmp_path / "c"), {"model": model, "optimizer": opt})
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "d"), "--to", "dcp"]) == 0
    assert "no state for 2 of 2 parameters" in capsys.readouterr().out
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    sd = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(
        sd, checkpoint_id=str(tmp_path / "d"), planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
