"""Manifests and objects files cost memory and time linear in their size: a plain list of a
million numbers saves, loads, restores and verifies in a small multiple of its file's size,
and a file of more values than the stated cap is refused, naming the file and the limit,
before it is parsed.

Memory is measured in process with tracemalloc (the fast tier), and as the growth of peak
RSS in a fresh process, after its imports (marked ``fault``: they run scripts): VmHWM of
/proc/self/status, the peak of the process's own memory (``ru_maxrss`` of a child started by
``subprocess`` can start at its parent's peak: a vfork child folds the parent's memory into its
own at exec). No assertion is on time."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import tracemalloc
from typing import Any

import pytest

import pitstop
from pitstop.errors import ManifestError, UnsupportedValueError
from pitstop.format.checksum import get_checksum
from pitstop.format.jsonsafe import MAX_VALUES, json_shape, load_json, nesting_depth
from pitstop.format.manifest import seal
from pitstop.format.objects import encode_objects, parse_objects
from pitstop.state.restore import materialize, restore_into

MIB = 1 << 20
RATIO = 20  # peak memory growth allowed, in multiples of the objects file's size
ALLOWANCE = 32 * MIB  # ... plus this much (buffers, lazily imported modules, allocator slack)
N = 1_000_000
OBJECTS = "objects-00000.json"

# A child process: imports first (their memory is not the operation's), then the peak RSS
# growth of one operation, printed as JSON. argv: operation, root, kind of list.
_PEAK = textwrap.dedent(
    """
    def peak():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    """
)
_CHILD = _PEAK + textwrap.dedent(
    """
    import json, random, sys
    op, root, kind = sys.argv[1:4]
    if op != "verify":
        import torch  # noqa: F401
        import pitstop, pitstop.manager, pitstop.engine.restore  # noqa: F401
    from pitstop.cli.main import main

    def values():
        rnd = random.Random(0)
        if kind == "floats":  # a loss history: one float per iteration
            return [round(rnd.uniform(0.5, 3.0), 5) for _ in range(N)]
        return [0] * N

    N = int(sys.argv[4])
    expected = values() if op != "verify" else None
    state = {"history": []}
    base = peak()
    if op == "save":
        pitstop.save(root, {"history": expected})
    elif op == "load":
        out = pitstop.load(root)
    elif op == "restore":
        pitstop.load(root, state)
    else:
        code = main(["verify", root])
    growth = peak() - base
    if op == "load":
        assert out["history"] == expected
    if op == "restore":
        assert state["history"] == expected
    if op == "verify":
        assert code == 0, code
    print(json.dumps({"growth": growth}))
    """
)


def _child(op: str, root: str, kind: str, n: int = N) -> int:
    """Peak RSS growth (bytes) of ``op`` in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, op, root, kind, str(n)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return int(json.loads(done.stdout.strip().splitlines()[-1])["growth"])


def _objects_nbytes(root: str, step: int = 0) -> int:
    return os.path.getsize(os.path.join(root, f"step-{step:010d}", OBJECTS))


def _history(kind: str) -> list[Any]:
    rnd = random.Random(0)
    if kind == "floats":  # a loss history: one float per iteration
        return [round(rnd.uniform(0.5, 3.0), 5) for _ in range(N)]
    return [0] * N


def _no_tensor(stored: str) -> Any:
    raise AssertionError(f"no tensor was saved, {stored!r} was asked for")


@pytest.mark.parametrize("kind", ["floats", "zeros"])
def test_parsing_and_building_a_million_numbers_allocates_linear_in_the_file(kind: str) -> None:
    history = _history(kind)
    data = encode_objects({"dict": [["history", {"list": history}]]}, rank=0)
    tracemalloc.start()
    try:
        tree = parse_objects(data, name=OBJECTS, tensor_keys=())
        built = materialize(tree, _no_tensor, allow_pickle=False)
        state: dict[str, Any] = {"history": []}
        restore_into(state, tree, _no_tensor, _no_tensor)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert built == state == {"history": history}
    assert peak <= RATIO * len(data), f"{peak / MIB:.0f} MiB for {len(data) / MIB:.1f} MiB"


@pytest.fixture(scope="module")
def float_history(tmp_path_factory: Any) -> tuple[str, int]:
    """A state of one 1,000,000-float loss history, saved in a fresh process; the peak RSS
    growth of that save."""
    root = str(tmp_path_factory.mktemp("history") / "ckpts")
    return root, _child("save", root, "floats")


def _assert_linear(growth: int, nbytes: int, what: str) -> None:
    bound = RATIO * nbytes + ALLOWANCE
    assert growth <= bound, (
        f"{what}: peak RSS grew by {growth / MIB:.0f} MiB for an objects file of "
        f"{nbytes / MIB:.1f} MiB (bound {bound / MIB:.0f} MiB)"
    )


@pytest.mark.fault
def test_saving_a_million_float_history_takes_memory_linear_in_its_file(
    float_history: tuple[str, int],
) -> None:
    root, growth = float_history
    nbytes = _objects_nbytes(root)
    assert nbytes > 4 * MIB  # a list of plain values, not a tensor
    _assert_linear(growth, nbytes, "save")


@pytest.mark.fault
@pytest.mark.parametrize("op", ["load", "restore"])
def test_loading_a_million_float_history_takes_memory_linear_in_its_file(
    float_history: tuple[str, int], op: str
) -> None:
    root, _ = float_history
    _assert_linear(_child(op, root, "floats"), _objects_nbytes(root), op)


@pytest.mark.fault
@pytest.mark.parametrize("op", ["load", "verify"])
def test_a_list_of_a_million_zeros_loads_and_verifies_in_linear_memory(
    tmp_path: Any, op: str
) -> None:
    root = str(tmp_path / "ckpts")
    pitstop.save(root, {"history": [0] * N})
    nbytes = _objects_nbytes(root)
    assert nbytes < 3 * MIB  # two bytes a value
    _assert_linear(_child(op, root, "zeros"), nbytes, op)


# ---------------------------------------------------------------- the cap on values


def _crafted_objects(n: int) -> bytes:
    """An objects file whose state is one list of ``n`` zeros (not written by ``encode_objects``,
    which refuses more than MAX_VALUES)."""
    return (
        b'{"format":"pitstop-objects","format_version":3,"rank":0,"tree":{"dict":[["history",'
        b'{"list":[' + b"0," * (n - 1) + b"0]}]]}}"
    )


def _replace_objects(root: str, step: int, data: bytes) -> None:
    """Put ``data`` in as the objects file of ``step``, with its size and checksum in the
    manifest and the manifest resealed: valid to every check but the file's own content."""
    directory = os.path.join(root, f"step-{step:010d}")
    with open(os.path.join(directory, OBJECTS), "wb") as f:
        f.write(data)
    with open(os.path.join(directory, "manifest.json")) as f:
        doc = json.load(f)
    algorithm = doc["checksum"]["algorithm"]
    for entry in doc["files"]:
        if entry["name"] == OBJECTS:
            entry["nbytes"], entry["checksum"] = len(data), get_checksum(algorithm)(data)
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(seal(doc, doc["integrity"]["algorithm"]), f)


_VERIFY_BOUNDED = _PEAK + textwrap.dedent(
    """
    import json, resource, sys
    from pitstop.cli.main import main
    limit = 2 << 30  # address space: a parse of the whole list would need far more
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    base = peak()
    code = main(["verify", sys.argv[1], "--step", "2"])
    growth = peak() - base
    print(json.dumps({"code": code, "growth": growth}))
    """
)


@pytest.mark.fault
def test_an_objects_file_of_more_values_than_the_cap_is_refused_before_it_is_parsed(
    root: str,
) -> None:
    pitstop.save(root, {"history": [0]}, step=1)
    pitstop.save(root, {"history": [0]}, step=2)
    data = _crafted_objects(MAX_VALUES + 1)  # 64 MiB; 60 M zeros would be 114 MiB
    _replace_objects(root, 2, data)
    done = subprocess.run(
        [sys.executable, "-c", _VERIFY_BOUNDED, root],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    report = "\n".join(lines[:-1])
    assert result["code"] == 1, report
    assert OBJECTS in report and f"{MAX_VALUES}" in report, report
    assert result["growth"] < 3 * len(data), result  # refused before the parse allocated
    assert pitstop.load(root)["history"] == [0]  # restore falls back to step 1


def test_the_cap_on_values_is_the_same_for_writer_and_reader() -> None:
    tree = {"dict": [["history", {"list": [0.5] * 1000}], ["tag", 'a,[b\\"{']]}
    data = encode_objects(tree, rank=0)
    values = json_shape(data).values
    assert 1000 < values < 1100
    assert encode_objects(tree, rank=0, max_values=values) == data
    assert parse_objects(data, name=OBJECTS, tensor_keys=(), max_values=values) == tree
    with pytest.raises(UnsupportedValueError, match=f"more than {values - 1} values"):
        encode_objects(tree, rank=0, max_values=values - 1)
    with pytest.raises(ManifestError, match=f"{OBJECTS} holds more than {values - 1} values"):
        parse_objects(data, name=OBJECTS, tensor_keys=(), max_values=values - 1)


def test_a_manifest_of_more_values_than_the_cap_is_refused() -> None:
    data = json.dumps({"files": [0] * 100}).encode()
    assert load_json(data, what="manifest.json", max_values=200) == {"files": [0] * 100}
    with pytest.raises(ManifestError, match=r"manifest.json holds more than 50 values"):
        load_json(data, what="manifest.json", max_values=50)


# ---------------------------------------------------------------- the scan before the parse


def _reference(doc: Any) -> tuple[int, int]:
    """(depth, values) of a parsed document as ``json_shape`` counts them in its text: one for
    the top value, one for each container and one for each item after a container's first."""
    depth, values, stack = 0, 1, [(doc, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (list, dict)):
            depth = max(depth, level + 1)
            items = list(node.values()) if isinstance(node, dict) else node
            values += max(len(items), 1)
            stack.extend((item, level + 1) for item in items)
    return depth, values


_TRICKY = ['"', "\\", '\\"', "[", "]", "{", "}", ",", ":", "\\\\", '"]', "\u00e9", "\n", ""]


def _random_doc(rnd: random.Random, level: int = 0) -> Any:
    roll = rnd.random()
    if level > 6 or roll < 0.35:
        return rnd.choice([0, -1.5, None, True, "".join(rnd.choices(_TRICKY, k=rnd.randint(0, 5)))])
    items = [_random_doc(rnd, level + 1) for _ in range(rnd.randint(0, 4))]
    if roll < 0.7:
        return items
    return {
        "".join(rnd.choices(_TRICKY, k=rnd.randint(0, 4))) + str(i): v for i, v in enumerate(items)
    }


@pytest.mark.parametrize("seed", range(5))
def test_the_scan_counts_depth_and_values_outside_strings(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(200):
        doc = _random_doc(rnd)
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False, indent=1)):
            shape = json_shape(text.encode())
            assert (shape.depth, shape.values) == _reference(doc), text
            assert nesting_depth(text) == shape.depth
    assert json_shape(b'"' + b'\\"' * 200_000).depth == 0  # unterminated: linear, no brackets
    assert json_shape(b'["a\\\\", "\\\\\\"[", {"b": "]"}]').depth == 2


# ---------------------------------------------------------------- files of many small nodes


def _small_nodes(node: bytes, n: int) -> bytes:
    """An objects file whose state is one list of ``n`` copies of ``node`` (JSON text)."""
    return (
        b'{"format":"pitstop-objects","format_version":3,"rank":0,"tree":{"dict":[["history",'
        b'{"list":[' + b",".join([node] * n) + b"]}]]}}"
    )


def _traced_peak(call: Any) -> int:
    """Peak bytes that tracemalloc sees allocated during ``call()`` (an error is fine)."""
    tracemalloc.start()
    try:
        call()
    except ManifestError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(
    "node",
    [b"{}", b'{"a":[]}', b'{"list":[]}', b'{"dict":[[0,0]]}'],
    ids=["empty", "keyed-list", "list-node", "dict-node"],
)
def test_validating_many_small_nodes_adds_no_memory_per_node(node: bytes) -> None:
    """The checks hold memory in the depth of the tree, not per node: a file of 200,000 small
    nodes (the first two invalid: they fail at their first node, after the parse) takes no
    more than its parse, which makes a Python object per container."""
    data = _small_nodes(node, 200_000)
    depth = 3 * 512 + 8

    def parse() -> None:
        load_json(data, what=OBJECTS, max_depth=depth, max_int_digits=4300)

    def validate() -> None:
        parse_objects(data, name=OBJECTS, tensor_keys=())

    parsed, validated = _traced_peak(parse), _traced_peak(validate)
    assert validated <= parsed * 1.05 + MIB, (
        f"validating took {validated / MIB:.0f} MiB, the parse alone {parsed / MIB:.0f} MiB"
    )
    assert validated <= 32 * len(data), f"{validated / len(data):.0f}x the file"


def test_a_small_nodes_error_names_the_first_bad_node() -> None:
    data = _small_nodes(b'{"list":[]}', 1000).replace(b'{"list":[]}]', b'{"a":[]}]')
    with pytest.raises(ManifestError, match=r"node at 'history/999' names no node kind"):
        parse_objects(data, name=OBJECTS, tensor_keys=())
    data = _small_nodes(b"{}", 1000)
    with pytest.raises(ManifestError, match=r"node at 'history/0' names no node kind"):
        parse_objects(data, name=OBJECTS, tensor_keys=())


def test_building_a_dict_of_many_nodes_keeps_nothing_per_node_but_the_values() -> None:
    """A dict node's children that are nodes are built one at a time, with no list of them
    kept meanwhile: the build peaks at about what it returns."""
    entries = b",".join(b'["%d",{"list":[]}]' % i for i in range(200_000))
    data = _small_nodes(b"0", 1).replace(b'{"list":[0]}', b'{"dict":[' + entries + b"]}")
    tree = parse_objects(data, name=OBJECTS, tensor_keys=())
    tracemalloc.start()
    try:
        built = materialize(tree, _no_tensor, allow_pickle=False)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(built["history"]) == 200_000 and built["history"]["7"] == []
    assert peak <= kept * 1.1 + MIB, f"peak {peak / MIB:.0f} MiB for {kept / MIB:.0f} MiB built"


def _no_memory(*args: Any, **kwargs: Any) -> Any:
    raise MemoryError


@pytest.mark.parametrize("where", ["parse", "validate"])
def test_running_out_of_memory_parsing_or_validating_is_a_manifest_error(
    monkeypatch: Any, where: str
) -> None:
    import pitstop.format.jsonsafe as jsonsafe
    import pitstop.format.objects as objects

    data = _small_nodes(b'{"list":[]}', 10)
    if where == "parse":
        monkeypatch.setattr(jsonsafe.json, "loads", _no_memory)
    else:
        monkeypatch.setattr(objects._Validator, "run", _no_memory)
    with pytest.raises(ManifestError) as info:
        parse_objects(data, name=OBJECTS, tensor_keys=(), path="/ckpts/step-1")
    assert str(info.value).startswith(f"{OBJECTS} ({len(data)} bytes) cannot be parsed")
    assert "memory" in str(info.value) and info.value.path == "/ckpts/step-1"
    assert info.value.__context__ is None  # the parse's frames (and the tree) are let go
    if where == "parse":
        with pytest.raises(ManifestError, match=r"manifest.json \(2 bytes\) cannot be parsed"):
            load_json(b"{}", what="manifest.json")


_VERIFY_SHORT_OF_MEMORY = _PEAK + textwrap.dedent(
    """
    import resource, sys
    from pitstop.cli.main import main
    with open("/proc/self/status") as f:
        size = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    limit = size + (384 << 20)  # the parse of this file needs about 550 MiB
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print("code", main(["verify", sys.argv[1], "--step", "2"]))
    """
)


@pytest.mark.fault
def test_verify_short_of_memory_reports_the_file_not_an_internal_error(root: str) -> None:
    pitstop.save(root, {"history": [0]}, step=1)
    pitstop.save(root, {"history": [0]}, step=2)
    data = _small_nodes(b'{"list":[]}', 2_000_000)  # 23 MiB of valid small nodes
    _replace_objects(root, 2, data)
    done = subprocess.run(
        [sys.executable, "-c", _VERIFY_SHORT_OF_MEMORY, root],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-3000:]
    assert "internal error" not in report and "MemoryError" in report, report[-3000:]
    assert f"{OBJECTS} ({len(data)} bytes) cannot be parsed and checked in the memory" in report
    assert done.stdout.strip().splitlines()[-1] == "code 1", report[-3000:]
