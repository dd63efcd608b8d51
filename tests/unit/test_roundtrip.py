"""Every value kind round-trips exactly; tied tensors stay tied; restore is in place."""

from __future__ import annotations

import collections
import math
import random

import numpy as np
import pytest
import torch

import pitstop
from conftest import assert_same_tensors, make_state, tensors_of, train_step


def test_model_optimizer_scheduler_round_trip(root: str) -> None:
    state = make_state(seed=1, steps=3)
    saved = tensors_of(state)
    sched_sd = state["scheduler"].state_dict()
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(3, state)
        fresh = make_state(seed=2, steps=1)
        assert ckpt.restore(fresh) == 3
    assert_same_tensors(saved, tensors_of(fresh))
    assert fresh["scheduler"].state_dict() == sched_sd
    assert fresh["extra"] == {"epoch": 3, "tag": "run"}
    # the restored optimizer continues exactly like the original
    train_step(state["model"], state["optimizer"], 99)
    train_step(fresh["model"], fresh["optimizer"], 99)
    assert_same_tensors(tensors_of(state), tensors_of(fresh))


def test_restore_into_fresh_optimizer_without_state(root: str) -> None:
    state = make_state(seed=1, steps=2)
    pitstop.save(root, state, step=5)
    torch.manual_seed(7)
    fresh = make_state(seed=3, steps=0)
    assert fresh["optimizer"].state_dict()["state"] == {}
    assert pitstop.load(root, fresh) == 5
    assert_same_tensors(tensors_of(state), tensors_of(fresh))


DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_dtypes_round_trip_bitwise(root: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    if dtype.is_complex:
        t = torch.randn(5, 7, dtype=dtype, generator=g)
    elif dtype.is_floating_point:
        t = (torch.randn(5, 7, generator=g) * 100).to(dtype)
        t.view(-1)[0] = float("nan")
        t.view(-1)[1] = float("-inf")
    elif dtype == torch.bool:
        t = torch.rand(5, 7, generator=g) > 0.5
    else:
        t = torch.randint(0, 100, (5, 7), generator=g).to(dtype)
    pitstop.save(root, {"t": t}, step=1)
    target = {"t": torch.zeros_like(t)}
    pitstop.load(root, target)
    # bitwise: compare raw bytes so NaN payloads and -0.0 count too
    assert target["t"].view(torch.uint8).equal(t.view(torch.uint8))


def test_odd_shapes_round_trip(root: str) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "noncontig": base.t(),
        "strided": base[:, ::2],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "big_offset": base[2:],
    }
    expected = {k: v.clone() for k, v in state.items()}
    pitstop.save(root, state, step=1)
    loaded = pitstop.load(root)
    for k, v in expected.items():
        assert loaded[k].shape == v.shape and torch.equal(loaded[k], v), k
    live = {k: torch.zeros_like(v) for k, v in expected.items()}
    live["noncontig"] = torch.zeros(4, 6).t()  # restore into a non-contiguous target
    pitstop.load(root, live)
    for k, v in expected.items():
        assert torch.equal(live[k], v), k


def test_plain_values_and_containers_round_trip(root: str) -> None:
    extra = {
        "int": 7, "neg": -(2**62), "float": 0.1, "nan": float("nan"), "inf": float("-inf"),
        "str": "ünïcode/with/slashes", "bool": True, "none": None, "bytes": b"\x00\xffraw",
        "list": [1, [2, 3], {"a": (4, 5)}], "tuple": (1, "two", 3.0), 5: "int key",
        "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
        "tensors": [torch.ones(2), {"w": torch.zeros(3)}],
    }  # fmt: skip
    pitstop.save(root, {"extra": extra}, step=1)
    got = pitstop.load(root)["extra"]
    assert math.isnan(got.pop("nan"))
    assert got["inf"] == float("-inf") and got["tuple"] == (1, "two", 3.0)
    assert isinstance(got["list"][2]["a"], tuple) and got[5] == "int key"
    assert isinstance(got["ordered"], collections.OrderedDict) and list(got["ordered"]) == [
        "z",
        "a",
    ]
    assert got["bytes"] == b"\x00\xffraw" and got["neg"] == -(2**62)
    assert torch.equal(got["tensors"][0], torch.ones(2)) and torch.equal(
        got["tensors"][1]["w"], torch.zeros(3)
    )
    # restore in place into a live dict
    live = {"extra": {k: None for k in extra}}
    pitstop.load(root, live)
    assert live["extra"]["str"] == "ünïcode/with/slashes" and live["extra"][5] == "int key"


def test_numpy_arrays_and_scalars(root: str) -> None:
    state = {
        "extra": {
            "arr": np.arange(6, dtype=np.int16).reshape(2, 3),
            "sc": np.float32(1.5),
            "i": np.int64(3),
        }
    }
    pitstop.save(root, state, step=1)
    got = pitstop.load(root)["extra"]
    assert got["arr"].dtype == np.int16 and (got["arr"] == state["extra"]["arr"]).all()
    assert got["sc"] == np.float32(1.5) and type(got["sc"]) is np.float32
    assert type(got["i"]) is np.int64


def test_tied_weights_stored_once_and_restored_shared(root: str) -> None:
    state = make_state(seed=4, steps=2)
    model = state["model"]
    pitstop.save(root, {"model": model}, step=1)
    manifest_keys = [t.key for t in pitstop.CheckpointManager(root).entries()[0].manifest.tensors]
    assert sum(k.endswith("embed.weight") or k.endswith("out.weight") for k in manifest_keys) == 1
    loaded = pitstop.load(root)["model"]
    assert loaded["embed.weight"] is loaded["out.weight"]
    fresh = make_state(seed=9, steps=0)["model"]
    pitstop.load(root, {"model": fresh})
    assert fresh.out.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_rng_state_restores_every_stream(root: str) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    pitstop.save(root, {"rng": pitstop.RNGState()}, step=1)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(10)
    np.random.seed(20)
    torch.manual_seed(30)
    pitstop.load(root, {"rng": pitstop.RNGState()})
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_rng_is_restored_after_everything_else(root: str) -> None:
    class Consumer:
        """A Stateful whose load draws a random number, like a sampler that reshuffles."""

        def state_dict(self) -> dict[str, int]:
            return {"x": 1}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            torch.rand(1)

    torch.manual_seed(5)
    pitstop.save(root, {"rng": pitstop.RNGState(), "z": Consumer()}, step=1)
    expected = torch.rand(4)
    pitstop.load(root, {"rng": pitstop.RNGState(), "z": Consumer()})
    assert torch.equal(torch.rand(4), expected)


def test_user_stateful_and_grad_scaler(root: str) -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.n = sd["n"]

    c = Counter()
    c.n = 41
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    pitstop.save(root, {"counter": c, "scaler": scaler}, step=1)
    c2, scaler2 = Counter(), torch.amp.GradScaler("cpu", init_scale=2.0)
    pitstop.load(root, {"counter": c2, "scaler": scaler2})
    assert c2.n == 41
    assert scaler2.state_dict()["scale"] == scaler.state_dict()["scale"]


def test_load_by_step_and_from_step_directory(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": torch.tensor([float(step)])})
        assert ckpt.steps() == [1, 2, 3]
    assert pitstop.load(root, step=2)["x"].item() == 2.0
    assert pitstop.load(f"{root}/step-0000000001")["x"].item() == 1.0
    live = {"x": torch.zeros(1)}
    assert pitstop.load(root, live) == 3 and live["x"].item() == 3.0


def test_keys_that_look_alike_do_not_collide(root: str) -> None:
    state = {
        "extra": {
            1: torch.zeros(2),
            "1": torch.ones(2),
            None: torch.full((2,), 5.0),
            "None": torch.full((2,), 6.0),
        }
    }
    pitstop.save(root, state, step=1)
    got = pitstop.load(root)["extra"]
    assert got[1].tolist() == [0.0, 0.0] and got["1"].tolist() == [1.0, 1.0]
    assert got[None].tolist() == [5.0, 5.0] and got["None"].tolist() == [6.0, 6.0]
    live = {
        "extra": {
            1: torch.empty(2),
            "1": torch.empty(2),
            None: torch.empty(2),
            "None": torch.empty(2),
        }
    }
    pitstop.load(root, live)
    assert live["extra"][1].tolist() == [0.0, 0.0] and live["extra"]["1"].tolist() == [1.0, 1.0]


def test_a_resume_at_an_epochs_end_steps_the_scheduler_without_torchs_warning(root: str) -> None:
    import warnings

    def fresh() -> dict[str, object]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return {
            "model": model,
            "optimizer": opt,
            "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
        }

    state = fresh()
    state["model"](torch.ones(2, 4)).sum().backward()
    state["optimizer"].step()  # the epoch's last batch; the checkpoint; then a kill
    pitstop.save(root, state, step=1)
    resumed = fresh()
    pitstop.load(root, resumed)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed["scheduler"].step()  # the epoch's end, as the uninterrupted run does it
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)], seen
