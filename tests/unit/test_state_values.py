"""Values a checkpoint holds exactly, values refused at the call, and the strict objects-file parse."""

from __future__ import annotations

import base64
import json
import os
import pickle
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import pitstop
from pitstop.errors import FormatVersionError, ManifestError, UnsupportedValueError
from pitstop.format.objects import OBJECTS_VERSION, encode_objects, parse_objects
from pitstop.state.restore import materialize
from pitstop.state.tree import MAX_NESTING, flatten

NAME = "objects-00000.json"
KEYS = frozenset({"model/fc.weight", "rng/numpy/1"})


def _doc(tree: Any, **wrapper: Any) -> bytes:
    if not wrapper:
        return encode_objects(tree, rank=0)  # copes with trees deeper than json.dumps does
    doc = {"format": "pitstop-objects", "format_version": OBJECTS_VERSION, "rank": 0, "tree": tree}
    doc.update(wrapper)
    return json.dumps(doc).encode()


def _parse(tree: Any, keys: frozenset[str] = KEYS, **wrapper: Any) -> Any:
    return parse_objects(_doc(tree, **wrapper), name=NAME, tensor_keys=keys)


def _nested(kind: str, depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = {"dict": [["k", node]]} if kind == "dict" else {kind: [node]}
    return node


def _no_steps(root: str) -> bool:
    return not os.path.isdir(root) or not any("step-" in n for n in os.listdir(root))


# ---------------------------------------------------------------- format/objects.py: valid trees

EVERY_KIND = {
    "dict": [
        ["s", "text"], [7, 2], [1.5, -0.0], [True, False], [None, None],
        ["od", {"dict": [["z", 1]], "ordered": True, "meta": {"dict": [["", {"dict": []}]]}}],
        ["list", {"list": [1, {"tuple": [2, 3]}]}],
        ["tensor", {"tensor": "model/fc.weight"}], ["arr", {"ndarray": "rng/numpy/1"}],
        ["opt", {"stateful": "torch.optim.adam.Adam", "state": {"dict": []}}],
        ["nan", {"float": "nan"}], ["inf", {"float": "inf"}], ["ninf", {"float": "-inf"}],
        ["b", {"bytes": base64.b64encode(b"\x00\xff").decode()}], ["empty", {"bytes": ""}],
        ["i8", {"npscalar": ["int8", -128]}], ["u64", {"npscalar": ["uint64", {"int": str(2**64 - 1)}]}],
        ["f16", {"npscalar": ["float16", {"float": "inf"}]}], ["b_", {"npscalar": ["bool", True]}],
        ["c", {"npscalar": ["complex128", [1.0, {"float": "nan"}]]}],
        ["p", {"pickle": base64.b64encode(pickle.dumps({1, 2})).decode(), "type": "builtins.set"}],
        ["big", {"int": "-" + "9" * 4000}], ["raw", 2**70],
    ],
}  # fmt: skip


def test_every_node_kind_parses_and_builds() -> None:
    tree = _parse(EVERY_KIND)
    assert tree == EVERY_KIND
    tensors = {"model/fc.weight": torch.ones(2), "rng/numpy/1": torch.arange(3)}
    value = materialize(tree, tensors.__getitem__, allow_pickle=True)
    assert value["big"] == -int("9" * 4000) and value["raw"] == 2**70
    assert type(value["u64"]) is np.uint64 and value["u64"] == 2**64 - 1
    assert type(value["c"]) is np.complex128 and np.isnan(value["c"].imag)
    assert value["od"]._metadata == {"": {}} and value["p"] == {1, 2}
    assert value["arr"].tolist() == [0, 1, 2] and value["list"] == [1, (2, 3)]


def test_encode_objects_round_trips_and_refuses_nan() -> None:
    data = encode_objects(EVERY_KIND, rank=0)
    assert b" " not in data.replace(b'"text"', b"")  # compact
    assert parse_objects(data, name=NAME, tensor_keys=KEYS) == EVERY_KIND
    with pytest.raises(ValueError):
        encode_objects({"x": float("nan")}, rank=0)


def test_version_1_files_still_parse() -> None:
    tree = {"dict": [["x", 1]]}
    assert _parse(tree, format_version=1) == tree


# ---------------------------------------------------------------- format/objects.py: bad trees

BAD_NODES = [
    ({"nope": 1}, "names no node kind"),
    ({"list": [], "tuple": []}, "several node kinds"),
    ({"list": "x"}, "items are not a list"),
    ({"list": [], "extra": 1}, "keys"),
    ([1, 2], "bare JSON list"),
    ({"dict": [["a", 1], ["a", 2]]}, "names the key 'a' twice"),
    ({"dict": [[1, 1], [True, 2]]}, "twice"),
    ({"dict": [[["k"], 1]]}, "key of JSON type list"),
    ({"dict": [["a"]]}, "not a [key, node] pair"),
    ({"dict": {"a": 1}}, "entries are not a list"),
    ({"dict": [], "ordered": "yes"}, "'ordered' is not a bool"),
    ({"tensor": "model/other"}, "refers to tensor 'model/other', which the manifest lacks"),
    ({"tensor": 3}, "key is not a str"),
    ({"ndarray": None}, "key is not a str"),
    ({"stateful": 1, "state": {"dict": []}}, "type name is not a str"),
    ({"stateful": "x"}, "expected ['state', 'stateful']"),
    ({"float": "NaN"}, "not nan/inf/-inf"),
    ({"float": 1.0}, "not nan/inf/-inf"),
    ({"bytes": "!!!!"}, "not valid base64"),
    ({"bytes": "abc"}, "not valid base64"),
    ({"bytes": "AB=="}, "not valid base64"),  # stray bits: not what the writer produces
    ({"bytes": 5}, "not valid base64"),
    ({"npscalar": ["float128", 1.0]}, "dtype 'float128', which is not allowed"),
    ({"npscalar": ["datetime64[s]", 1]}, "not allowed"),
    ({"npscalar": ["int8", 300]}, "does not fit dtype int8"),
    ({"npscalar": ["uint8", -1]}, "does not fit"),
    ({"npscalar": ["uint64", {"int": str(2**64)}]}, "does not fit"),
    ({"npscalar": ["bool", 1]}, "does not fit"),
    ({"npscalar": ["int64", 1.5]}, "does not fit"),
    ({"npscalar": ["float32", "1"]}, "does not fit"),
    ({"npscalar": ["complex64", [1.0]]}, "does not fit"),
    ({"npscalar": ["int64"]}, "not a [dtype, value] pair"),
    ({"pickle": "AAAA"}, "expected ['pickle', 'type']"),
    ({"pickle": "a b", "type": "x"}, "not valid base64"),
    ({"pickle": "AAAA", "type": 1}, "type name is not a str"),
    ({"int": "12a"}, "not a decimal"),
    ({"int": "1" * 4001}, "not a decimal of at most 4000 digits"),
    ({"int": 5}, "not a decimal"),
    ({"int": ""}, "not a decimal"),
]


@pytest.mark.parametrize("node, message", BAD_NODES, ids=[json.dumps(n)[:40] for n, _ in BAD_NODES])
def test_bad_node_names_file_and_key_path(node: Any, message: str) -> None:
    tree = {
        "dict": [
            ["model", {"tensor": "model/fc.weight"}],
            ["optimizer", {"stateful": "torch.optim.adam.Adam", "state": {"dict": [
                ["state", {"dict": [[0, {"dict": [["exp_avg", 1.0], ["step", node]]}]]}],
            ]}}],
        ]
    }  # fmt: skip
    with pytest.raises(ManifestError) as info:
        _parse(tree)
    text = str(info.value)
    assert text.startswith(f"{NAME}: node at 'optimizer/state/0/step'"), text
    assert message in text, text


def test_key_paths_escape_and_name_list_items_and_metadata() -> None:
    tree = {"dict": [["a/b", {"list": [0, {"dict": [], "meta": {"bad": 1}}]}]]}
    with pytest.raises(ManifestError, match=r"node at 'a%2Fb/1/_metadata'"):
        _parse(tree)
    with pytest.raises(ManifestError, match=r"node at '<state>'"):
        _parse({"nope": 1})


@pytest.mark.parametrize(
    "data, message",
    [
        (b'{"format": "other", "format_version": 1, "rank": 0, "tree": 1}', "not a pitstop objects file"),
        (b"[]", "not a pitstop objects file"),
        (b'{"format": "pitstop-objects", "format_version": "2", "rank": 0, "tree": 1}', "format_version"),
        (b'{"format": "pitstop-objects", "format_version": 0, "rank": 0, "tree": 1}', "format_version"),
        (b'{"format": "pitstop-objects", "format_version": 2, "rank": -1, "tree": 1}', "rank -1"),
        (b'{"format": "pitstop-objects", "format_version": 2, "rank": 0}', "lacks ['tree']"),
        (b'{"format": "pitstop-objects", "format_version": 2, "rank": 0, "tree": 1, "x": 0}', "unexpected keys ['x']"),
        (b'{"format": "pitstop-objects", "format_version": 2, "rank": 0, "tree": 1e999}', "non-finite number inf"),
        (b'{"format": "pitstop-objects", "format_version": 2, "rank": 0, "tree": NaN}', "not valid JSON"),
        (b'{"format": "pitstop-objects", "format_version": 2, "rank": 0, "tree": 1, "tree": 2}', "twice"),
        (b"\xff\xfe", "not UTF-8"),
        (b"{not json", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "levels deep"),
    ],
)  # fmt: skip
def test_bad_wrapper_is_a_manifest_error(data: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=NAME) as info:
        parse_objects(data, name=NAME, tensor_keys=KEYS)
    assert message in str(info.value)


def test_newer_version_raises_format_version_error() -> None:
    newer = OBJECTS_VERSION + 1
    with pytest.raises(FormatVersionError, match=f"objects format {newer}.*upgrade pitstop"):
        _parse({"dict": []}, format_version=newer)


def test_huge_raw_int_is_refused_by_the_bounded_parser() -> None:
    data = _doc(0).replace(b'"tree":0', b'"tree":' + b"7" * 5000)
    with pytest.raises(ManifestError, match="digits"):
        parse_objects(data, name=NAME, tensor_keys=KEYS)


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_nesting_limit(kind: str) -> None:
    data = _doc(_nested(kind, 512))  # the C json codec needs more than Python's 1000 frames here
    assert encode_objects(parse_objects(data, name=NAME, tensor_keys=KEYS), rank=0) == data
    with pytest.raises(ManifestError, match=r"more than 512 containers deep"):
        _parse(_nested(kind, 513))
    with pytest.raises(ManifestError, match=r"more than 8 containers deep"):
        parse_objects(_doc(_nested(kind, 9)), name=NAME, tensor_keys=KEYS, max_depth=8)


@pytest.mark.slow
def test_unreferenced_tensor_keys_are_fine_and_parse_is_linear() -> None:
    import tracemalloc

    assert _parse({"dict": []}, keys=frozenset({"a", "b"})) == {"dict": []}

    def peak(n: int) -> int:  # no clock: the work grows with the file, measured as memory
        tree = {"dict": [[str(i), {"list": [i, {"float": "nan"}]}] for i in range(n)]}
        data = _doc(tree)
        tracemalloc.start()
        try:
            parse_objects(data, name=NAME, tensor_keys=list(KEYS))
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(25_000), peak(100_000)
    assert large < 5 * small, (small, large)  # four times the nodes: about four times


# ---------------------------------------------------------------- save side: refused at the call


def _cycle_dict() -> dict[str, Any]:
    d: dict[str, Any] = {"ok": 1}
    d["self"] = d
    return d


def _cycle_list() -> list[Any]:
    x: list[Any] = [1]
    x.append({"again": x})
    return x


def _deep(depth: int) -> list[Any]:
    top: list[Any] = []
    cur = top
    for _ in range(depth - 1):
        cur.append([])
        cur = cur[0]
    return top


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


def _nested_tensor() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)


REFUSED = [
    ("cycle", lambda: {"extra": {"a": _cycle_dict()}}, r"'extra/a/self' contains itself"),
    ("list cycle", lambda: {"extra": _cycle_list()}, r"'extra/1/again' contains itself"),
    ("longdouble", lambda: {"extra": {"x": np.longdouble(1) / 3}}, r"'extra/x' is a NumPy longdouble scalar \(dtype float128\)"),
    ("complex256", lambda: {"extra": {"x": np.clongdouble(1)}}, r"'extra/x'.*complex256"),
    ("datetime64", lambda: {"extra": {"x": np.datetime64("2020-01-01")}}, r"'extra/x'.*datetime64"),
    ("np.str_", lambda: {"extra": {"x": np.str_("a")}}, r"'extra/x' is a NumPy str_ scalar"),
    ("np.bytes_", lambda: {"extra": {"x": np.bytes_(b"a")}}, r"'extra/x' is a NumPy bytes_ scalar"),
    ("masked array", lambda: {"extra": {"x": np.ma.masked_array([1, 2], mask=[0, 1])}}, r"'extra/x'.*MaskedArray"),
    ("nan key", lambda: {"extra": {"d": {float("nan"): 1}}}, r"'extra/d' is a dict with the non-finite key nan"),
    ("inf key", lambda: {"extra": {"d": {float("-inf"): 1}}}, r"'extra/d'.*non-finite key -inf"),
    ("tuple key", lambda: {"extra": {"d": {(1, 2): 1}}}, r"'extra/d'.*key '\(1, 2\)' of type tuple"),
    ("huge int", lambda: {"extra": {"n": 10**5000}}, r"'extra/n' is an integer of more than 4000 digits, which cannot be carried exactly; store it as a str"),
    ("huge int key", lambda: {"extra": {"d": {-(10**4001): 1}}}, r"'extra/d'.*integer key of more than 4000 digits"),
    ("quantized", lambda: {"w": _quantized()}, r"tensor 'w' is quantized"),
    ("sparse coo", lambda: {"s": {"t": torch.eye(3).to_sparse()}}, r"tensor 's/t' is sparse \(layout torch.sparse_coo\)"),
    ("sparse csr", lambda: {"s": torch.eye(3).to_sparse_csr()}, r"tensor 's' is sparse \(layout torch.sparse_csr\)"),
    ("meta", lambda: {"m": [torch.empty(3, device="meta")]}, r"tensor 'm/0' is on the meta device"),
    ("nested tensor", lambda: {"n": _nested_tensor()}, r"tensor 'n' is a nested tensor"),
    ("too deep", lambda: {"d": _deep(MAX_NESTING)}, r"value at 'd/0/0/0.*nests containers more than 500 levels deep"),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR is "beta"
@pytest.mark.parametrize("make, message", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_value_refused_at_async_save_with_its_key_path(root: str, make: Any, message: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        with pytest.raises(UnsupportedValueError, match=message):
            ckpt.async_save(1, make())
        assert _no_steps(root)  # refused on the caller's thread, before any file


def test_deepest_allowed_nesting_round_trips(root: str) -> None:
    state = {"d": _deep(MAX_NESTING - 1)}  # the state dict itself is the first level
    pitstop.save(root, state, step=1)
    assert pitstop.load(root) == state
    live: dict[str, Any] = {"d": None}
    pitstop.load(root, live)
    assert live == state


def test_big_ints_are_stored_as_decimal_strings_and_round_trip(root: str) -> None:
    values = [2**70, -(2**70), 2**53, -(2**53), 2**53 - 1, 10**3999, -(10**3999)]
    path = pitstop.save(root, {"extra": {"v": values, "k": {2**80: "key"}}}, step=1)
    text = open(os.path.join(path, NAME)).read()
    assert '{"int":"1180591620717411303424"}' in text and '{"int":"9007199254740992"}' in text
    assert "9007199254740991" in text and '"9007199254740991"' not in text  # 2**53-1 stays a number
    got = pitstop.load(root)["extra"]
    assert got["v"] == values and all(type(v) is int for v in got["v"])
    assert got["k"] == {2**80: "key"}


def test_numpy_generator_state_round_trips_exactly(root: str) -> None:
    gen = np.random.default_rng(1234)
    gen.random(7)
    state = {"extra": {"pcg": gen.bit_generator.state, "mt": np.random.MT19937(5).state}}
    pitstop.save(root, state, step=1)
    got = pitstop.load(root)["extra"]
    assert got["pcg"] == state["extra"]["pcg"]
    fresh = np.random.default_rng()
    fresh.bit_generator.state = got["pcg"]
    assert (fresh.random(5) == gen.random(5)).all()
    mt = np.random.MT19937()
    mt.state = got["mt"]
    assert mt.random_raw(3).tolist() == np.random.MT19937(5).random_raw(3).tolist()


def test_numpy_scalars_keep_type_and_value(root: str) -> None:
    scalars = {
        "b": np.bool_(True), "i8": np.int8(-5), "u64": np.uint64(2**64 - 1), "f16": np.float16(0.1),
        "f32": np.float32(np.inf), "f64": np.float64(1 / 3), "c64": np.complex64(1.5 - 2j),
        "c128": np.complex128(complex(np.nan, 1e300)),
    }  # fmt: skip
    pitstop.save(root, {"extra": scalars}, step=1)
    got = pitstop.load(root)["extra"]
    for k, v in scalars.items():
        assert type(got[k]) is type(v), k
        assert got[k].tobytes() == v.tobytes() or (k == "c128" and np.isnan(got[k].real)), k


def test_refused_numpy_scalar_is_pickled_with_opt_in(root: str) -> None:
    x = np.longdouble(1) / 3
    pitstop.save(root, {"extra": {"x": x, "d": {float("nan"): 1}}}, step=1, allow_pickle=True)
    got = pitstop.load(root, allow_pickle=True)["extra"]
    assert type(got["x"]) is np.longdouble and got["x"] == x


def test_flatten_is_iterative_and_keeps_tensor_order() -> None:
    a, b = torch.ones(1), torch.zeros(1)
    flat = flatten({"x": [a, {"y": b, "z": (a, 3)}], "w": b})
    assert list(flat.tensors) == ["x/0", "x/1/y"]
    assert flat.tree == {
        "dict": [
            ["x", {"list": [{"tensor": "x/0"}, {"dict": [
                ["y", {"tensor": "x/1/y"}], ["z", {"tuple": [{"tensor": "x/0"}, 3]}],
            ]}]}],
            ["w", {"tensor": "x/1/y"}],
        ]
    }  # fmt: skip
    shared = [1, 2]
    flat = flatten({"a": shared, "b": shared})  # the same list twice is not a cycle
    assert flat.tree == {"dict": [["a", {"list": [1, 2]}], ["b", {"list": [1, 2]}]]}


def test_an_optimizer_wrapper_is_hooked_through_the_optimizer_it_wraps(tmp_path: Any) -> None:
    # Accelerate's AcceleratedOptimizer subclasses Optimizer without running its __init__
    class Wrapper(torch.optim.Optimizer):
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        @property
        def param_groups(self) -> Any:  # type: ignore[override]
            return self.optimizer.param_groups

        @property
        def state(self) -> Any:  # type: ignore[override]
            return self.optimizer.state

        def state_dict(self) -> Any:
            return self.optimizer.state_dict()

        def load_state_dict(self, sd: Any) -> None:
            self.optimizer.load_state_dict(sd)

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return self.optimizer.step(closure)

    model = torch.nn.Linear(3, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    wrapped = Wrapper(inner)
    wrapped.step()
    pitstop.save(str(tmp_path / "c"), {"model": model, "optimizer": wrapped})
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pitstop.load(str(tmp_path / "c"), {"model": model, "optimizer": Wrapper(fresh)})
    assert torch.equal(
        fresh.state_dict()["state"][0]["momentum_buffer"],
        inner.state_dict()["state"][0]["momentum_buffer"],
    )

    class Broken(torch.optim.Optimizer):
        def __init__(self) -> None:
            pass

    with pytest.raises(pitstop.UnsupportedValueError, match="never initialized"):
        pitstop.save(str(tmp_path / "d"), {"optimizer": Broken()})
