"""Partial, renamed and wrapper-prefixed restores; everything checked before anything is touched."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import pitstop
from conftest import Net, tensors_of, train_step
from pitstop.errors import PartialRestoreError, StateMismatchError
from pitstop.format.objects import encode_objects, parse_objects
from pitstop.state.keys import add_prefix, strip_prefix, strip_wrappers, wrapper_renames
from pitstop.state.restore import RestoreReport, TensorMeta, TensorSource, materialize, restore_into
from pitstop.state.tree import flatten


class DDP(nn.Module):
    """Names its child ``module`` like DistributedDataParallel and DataParallel do."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class Compiled(nn.Module):
    """Names its child ``_orig_mod`` like torch.compile's OptimizedModule does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._orig_mod = module


def _saved(state: dict[str, Any]) -> tuple[Any, TensorSource, TensorMeta]:
    """A tree as the restore path sees it (written and parsed), with its tensors."""
    flat = flatten(state)
    tensors = {k: t.detach().clone() for k, t in flat.tensors.items()}
    data = encode_objects(flat.tree, rank=0)
    tree = parse_objects(data, name="objects-00000.json", tensor_keys=tensors.keys())

    def meta(key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return tensors[key].dtype, tuple(tensors[key].shape)

    return tree, tensors.__getitem__, meta


def _restore(live: dict[str, Any], saved: dict[str, Any], **kw: Any) -> RestoreReport:
    return restore_into(live, *_saved(saved), **kw)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _full_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, opt, seed)
    return {"model": model, "optimizer": opt, "rng": pitstop.RNGState(), "data": {"epoch": 3}}


# ---------------------------------------------------------------- strict=False


def test_restore_only_the_model_from_a_full_checkpoint(root: str) -> None:
    full = _full_state(1)
    expected = _weights(full["model"])
    pitstop.save(root, full, step=4)
    torch.manual_seed(9)
    model = Net()
    assert pitstop.load(root, {"model": model}, strict=False) == 4
    assert _same(_weights(model), expected)
    with pytest.raises(StateMismatchError, match="not in the state: optimizer, rng, data"):
        pitstop.load(root, {"model": Net()})
    report = _restore({"model": Net()}, _full_state(2), strict=False)
    assert report.loaded == ["model"] and report.skipped == ["optimizer", "rng", "data"]
    assert report.missing == [] and report.renamed == {}


def test_state_keys_the_checkpoint_lacks_are_left_untouched(root: str) -> None:
    pitstop.save(root, {"model": nn.Linear(2, 2), "extra": {"a": 1, "b": [1]}}, step=1)
    head = nn.Linear(2, 2)
    head_before = _weights(head)
    live = {"model": nn.Linear(2, 2), "head": head, "extra": {"a": 0, "c": "mine"}}
    pitstop.load(root, live, strict=False)
    assert live["extra"] == {"a": 1, "c": "mine"}
    assert _same(_weights(head), head_before)
    with pytest.raises(StateMismatchError) as info:
        pitstop.load(root, live)
    assert info.value.missing == ["head", "extra/c"]  # type: ignore[attr-defined]
    assert info.value.unexpected == ["extra/b"]  # type: ignore[attr-defined]
    saved = {"model": nn.Linear(2, 2), "extra": {"a": 1, "b": [1]}}
    report = _restore(
        {"model": nn.Linear(2, 2), "head": head, "extra": {"c": 0}}, saved, strict=False
    )
    assert report.loaded == ["model", "extra"]
    assert report.missing == ["head", "extra/c"] and report.skipped == ["extra/a", "extra/b"]


def test_module_with_fewer_or_more_keys_loads_the_common_ones() -> None:
    saved = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3))
    live = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.Linear(3, 1))
    untouched = _weights(live[3])
    report = _restore({"m": live}, {"m": saved}, strict=False)
    assert torch.equal(live[0].weight, saved[0].weight)
    assert _same(_weights(live[3]), untouched)
    assert report.missing == ["m/2.weight", "m/2.bias", "m/3.weight", "m/3.bias"]
    assert report.skipped == ["m/1.weight", "m/1.bias"]


def test_shape_mismatch_of_a_common_key_is_still_an_error() -> None:
    live = nn.Sequential(nn.Linear(2, 4))
    before = _weights(live)
    with pytest.raises(StateMismatchError, match=r"m/0.weight: state has torch.float32 \[4, 2\]"):
        _restore(
            {"m": live, "x": torch.zeros(2)}, {"m": nn.Sequential(nn.Linear(2, 3))}, strict=False
        )
    assert _same(_weights(live), before)


# ---------------------------------------------------------------- wrapper prefixes


@pytest.mark.parametrize(
    "wrap_saved, wrap_live",
    [
        (DDP, lambda m: m),
        (lambda m: m, DDP),
        (Compiled, lambda m: m),
        (lambda m: m, Compiled),
        (lambda m: DDP(Compiled(m)), lambda m: m),
        (lambda m: Compiled(DDP(m)), Compiled),
        (DDP, Compiled),
    ],
    ids=["ddp->bare", "bare->ddp", "compiled->bare", "bare->compiled", "ddp+compile->bare",
         "compile+ddp->compiled", "ddp->compiled"],
)  # fmt: skip
def test_wrapper_prefixes_are_mapped_automatically(
    root: str,
    wrap_saved: Callable[[nn.Module], nn.Module],
    wrap_live: Callable[[nn.Module], nn.Module],
) -> None:
    torch.manual_seed(0)
    inner = Net()
    pitstop.save(root, {"model": wrap_saved(inner)}, step=1)
    torch.manual_seed(1)
    fresh = Net()
    pitstop.load(root, {"model": wrap_live(fresh)})
    assert _same(_weights(fresh), _weights(inner))
    assert fresh.out.weight is fresh.embed.weight  # still tied
    report = _restore({"model": wrap_live(Net())}, {"model": wrap_saved(inner)})
    saved_keys = list(wrap_saved(inner).state_dict())
    assert sorted(report.renamed) == sorted(f"model/{k}" for k in saved_keys)


def test_ddp_checkpoint_with_optimizer_restores_exactly(root: str) -> None:
    torch.manual_seed(0)
    inner = Net()
    opt = torch.optim.Adam(inner.parameters(), lr=1e-2)
    train_step(inner, opt, 1)
    pitstop.save(root, {"model": DDP(inner), "optimizer": opt}, step=1)
    torch.manual_seed(5)
    bare = Net()
    bare_opt = torch.optim.Adam(bare.parameters(), lr=1e-2)
    pitstop.load(root, {"model": bare, "optimizer": bare_opt})
    train_step(inner, opt, 2)
    train_step(bare, bare_opt, 2)
    assert _same(_weights(bare), _weights(inner))


def test_ambiguous_prefixes_are_not_mapped() -> None:
    assert wrapper_renames(["module.w", "w"], ["w"]) == {}  # two saved keys strip to "w"
    assert wrapper_renames(["module.w"], ["w", "_orig_mod.w"]) == {}
    assert wrapper_renames(["w"], ["w"]) == {}
    assert wrapper_renames(["module.module.w", "module.b"], ["module.w", "b"]) == {
        "module.module.w": "module.w",
        "module.b": "b",
    }
    assert strip_wrappers("_orig_mod.module._orig_mod.fc.weight") == "fc.weight"


# ---------------------------------------------------------------- key maps


def test_key_map_strip_prefix_and_add_prefix() -> None:
    torch.manual_seed(0)
    src = DDP(nn.Linear(2, 2))
    bare = nn.Linear(2, 2)
    report = _restore({"model": bare}, {"model": src}, key_map=strip_prefix("module."))
    assert torch.equal(bare.weight, src.module.weight)
    assert report.renamed == {
        "model/module.weight": "model/weight",
        "model/module.bias": "model/bias",
    }
    wrapped = DDP(nn.Linear(2, 2))
    report = _restore(
        {"model": wrapped}, {"model": src.module}, key_map=add_prefix("module.", under="model")
    )
    assert torch.equal(wrapped.module.bias, src.module.bias)
    assert report.renamed["model/bias"] == "model/module.bias"
    assert strip_prefix("module.")("model/module.fc.weight") == "model/fc.weight"
    assert strip_prefix("module.")("module.x") == "module.x"  # top-level keys stay
    assert add_prefix("m.")("opt/state") == "opt/m.state"


def test_key_map_renames_top_level_and_drops_entries() -> None:
    saved = {"net": nn.Linear(2, 2), "extra": {"keep": 1, "drop": 2, "old": 3}}

    def key_map(path: str) -> str | None:
        return {"net": "model", "extra/drop": None, "extra/old": "extra/new"}.get(path, path)

    model = nn.Linear(2, 2)
    live = {"model": model, "extra": {"keep": 0, "new": 0}}
    report = _restore(live, saved, key_map=key_map)
    assert torch.equal(model.weight, saved["net"].weight)
    assert live["extra"] == {"keep": 1, "new": 3}
    assert report.renamed == {"net": "model", "extra/old": "extra/new"}
    assert report.skipped == ["extra/drop"] and report.loaded == ["model", "extra"]
    fresh = materialize(_saved(saved)[0], _saved(saved)[1], allow_pickle=False, key_map=key_map)
    assert set(fresh) == {"model", "extra"} and fresh["extra"] == {"keep": 1, "new": 3}


@pytest.mark.parametrize(
    "key_map, message",
    [
        (lambda p: "other/weight" if p == "model/weight" else p, "outside its dict 'model'"),
        (lambda p: "model/bias" if p == "model/weight" else p, "which 'model/bias' already takes"),
        (lambda p: 3, "expected a key path or None"),
    ],
)
def test_key_map_that_leaves_its_dict_is_refused_before_anything(
    key_map: Any, message: str
) -> None:
    live = nn.Linear(2, 2)
    before = _weights(live)
    with pytest.raises(ValueError, match=message):
        _restore({"model": live}, {"model": nn.Linear(2, 2)}, key_map=key_map)
    assert _same(_weights(live), before)


def test_key_map_through_load(root: str) -> None:
    src = DDP(nn.Linear(2, 2))
    pitstop.save(root, {"model": src, "other": 1}, step=1)
    bare = nn.Linear(2, 2)
    pitstop.load(root, {"model": bare}, strict=False, key_map=strip_prefix("module."))
    assert torch.equal(bare.weight, src.module.weight)


# ---------------------------------------------------------------- checked first, partial after


def test_optimizer_state_shape_mismatch_is_found_before_the_model_is_touched(root: str) -> None:
    full = _full_state(1)
    pitstop.save(root, {"model": full["model"], "optimizer": full["optimizer"]}, step=1)
    torch.manual_seed(3)
    model = Net()
    before = _weights(model)
    params = [torch.zeros(p.shape[::-1] if p.dim() == 2 else p.shape, requires_grad=True)
              for p in model.parameters()]  # fmt: skip
    opt = torch.optim.Adam(params, lr=1e-2)
    sum((p * p).sum() for p in params).backward()  # type: ignore[union-attr]
    opt.step()  # the live optimizer has state, of other shapes
    with pytest.raises(
        StateMismatchError,
        match=r"optimizer/state/0/exp_avg: state has torch.float32 \[8, 10\], checkpoint has torch.float32 \[10, 8\]",
    ):
        pitstop.load(root, {"model": model, "optimizer": opt})
    assert _same(_weights(model), before)
    assert not isinstance(
        _exc(lambda: pitstop.load(root, {"model": model, "optimizer": opt})), PartialRestoreError
    )


def _exc(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as e:
        return e
    return None


class Picky:
    def state_dict(self) -> dict[str, int]:
        return {"v": 1}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        raise ValueError("version 1 is too old")


def test_failure_after_an_overwrite_is_a_partial_restore(root: str) -> None:
    pitstop.save(root, {"a": torch.ones(2), "z": Picky()}, step=1)
    live = {"a": torch.zeros(2), "z": Picky()}
    with pytest.raises(PartialRestoreError, match=r"at 'z'.*version 1 is too old.*partly restored"):
        pitstop.load(root, live)
    assert live["a"].tolist() == [1.0, 1.0]


def test_failure_before_any_overwrite_is_a_plain_mismatch() -> None:
    with pytest.raises(StateMismatchError) as info:
        _restore({"z": Picky(), "a": torch.zeros(2)}, {"z": Picky(), "a": torch.ones(2)})
    assert not isinstance(info.value, PartialRestoreError)
    assert "before anything else was overwritten" in str(info.value)


def test_rng_still_restored_last_and_report_of_a_full_restore(root: str) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = _full_state(4)
    pitstop.save(root, state, step=1)
    expected = (random.random(), torch.rand(2))
    fresh = _full_state(5)
    report = restore_into(fresh, *_saved(state))
    assert report.loaded == ["model", "optimizer", "rng", "data"]
    assert report.skipped == report.missing == [] and report.renamed == {}
    pitstop.load(root, fresh)
    assert random.random() == expected[0] and torch.equal(torch.rand(2), expected[1])
    assert _same(tensors_of({"m": fresh["model"]}), tensors_of({"m": state["model"]}))
