"""``pitstop import`` and ``export`` on untrusted or broken input: no pickled code runs without
``--allow-pickle``, and every bad input ends in one line on stderr, never a traceback."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import pitstop
from conftest import assert_same_tensors, make_state
from pitstop.cli.convert import flat_tensors
from pitstop.cli.dcp_safe import (
    load_weights_only,
    read_dcp_metadata,
)
from pitstop.cli.main import main
from pitstop.errors import (
    CorruptCheckpointError,
    PickleRefusedError,
    UnsafePathError,
)


class ExecPayload:
    """Unpickling this runs ``builtins.exec``, which creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class SystemPayload:
    """Unpickling this runs ``os.system`` (``posix.system``), which creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class CustomObject:
    """A plain class of this test module: unpickling it imports and instantiates it."""

    def __init__(self) -> None:
        self.value = 1


PAYLOADS = {"exec": (ExecPayload, "builtins.exec"), "system": (SystemPayload, "system")}


@pytest.fixture
def marker(tmp_path: Any) -> Iterator[str]:
    path = os.path.join(str(tmp_path), "PWNED")
    yield path
    assert not os.path.exists(path), "a pickled payload ran"


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _full_state() -> dict[str, Any]:
    state = make_state(seed=5, steps=2)
    state["rng"] = pitstop.RNGState()
    state["misc"] = {"a": 1, "b": [1.5, "x"], "c": (1, 2), "n": None, "s": "text"}
    return state


@pytest.fixture
def full_ckpt(tmp_path: Any) -> tuple[str, dict[str, Any]]:
    root = os.path.join(str(tmp_path), "src")
    pitstop.save(root, _full_state(), step=7)
    return root, pitstop.load(root)


def _dcp_dir(tmp_path: Any, root: str, name: str = "dcp", only: str | None = "model") -> str:
    out = os.path.join(str(tmp_path), name)
    argv = ["export", root, out, "--to", "dcp"] + (["--only", only] if only else [])
    assert main(argv) == 0
    return out


def _assert_same_tree(a: Any, b: Any, key: str = "") -> None:
    """Equal trees: tensors bit for bit, NumPy arrays by value and dtype, the rest with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), key
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, key
        assert np.array_equal(a, b), key
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), key
        for k in a:
            _assert_same_tree(a[k], b[k], f"{key}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), key
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{key}/{i}")
    else:
        assert a == b, key


# --- problem 1 and 4: a DCP .metadata that is a pickle payload --------------------------------


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_dcp_metadata_payload_does_not_run(
    kind: str, tmp_path: Any, marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    payload, name = PAYLOADS[kind]
    src = os.path.join(str(tmp_path), "evil-dcp")
    os.makedirs(src)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(payload(marker), f)
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    line = _one_line_error(capsys)
    assert name in line and ".metadata" in line and "--allow-pickle" in line
    assert not os.path.exists(os.path.join(str(tmp_path), "ck"))


def test_dcp_payload_inside_real_metadata_does_not_run(
    full_ckpt: tuple[str, Any], tmp_path: Any, marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _dcp_dir(tmp_path, full_ckpt[0])
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own file: trusted
    metadata.planner_data["model.fc.weight"] = ExecPayload(marker)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    assert "builtins.exec" in _one_line_error(capsys)


def test_dcp_bytes_item_payload_does_not_run(
    tmp_path: Any, marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    src = os.path.join(str(tmp_path), "dcp-bytes")
    state = {"w": torch.ones(3), "evil": ExecPayload(marker)}
    dcp.save(state, checkpoint_id=src, no_dist=True)  # stores "evil" with torch.save
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    line = _one_line_error(capsys)
    assert "builtins.exec" in line and "--allow-pickle" in line and "evil" in line


def test_dcp_tensor_item_payload_does_not_run(
    tmp_path: Any, marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    src = os.path.join(str(tmp_path), "dcp-tensor")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=src, no_dist=True)
    blob = io.BytesIO()
    torch.save(ExecPayload(marker), blob)  # where torch expects a torch.save'd tensor
    with open(os.path.join(src, "evil.distcp"), "wb") as f:
        f.write(blob.getvalue())
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    for index in metadata.storage_data:
        metadata.storage_data[index] = _StorageInfo("evil.distcp", 0, len(blob.getvalue()))
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    line = _one_line_error(capsys)
    assert "builtins.exec" in line and "--allow-pickle" in line and "dcp-tensor" in line


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_torch_file_payload_does_not_run(
    zipped: bool, tmp_path: Any, marker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = os.path.join(str(tmp_path), "evil.pt")
    state = {"w": torch.ones(2), "evil": ExecPayload(marker)}
    torch.save(state, src, _use_new_zipfile_serialization=zipped)
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    line = _one_line_error(capsys)
    assert "builtins.exec" in line and "evil.pt" in line and "--allow-pickle" in line


def test_torch_file_custom_class_is_refused_by_name(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = os.path.join(str(tmp_path), "obj.pt")
    torch.save({"w": torch.ones(2), "obj": CustomObject()}, src)
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    assert "CustomObject" in _one_line_error(capsys)


def test_allow_pickle_imports_a_legit_dcp_directory(
    full_ckpt: tuple[str, Any], tmp_path: Any
) -> None:
    root, tree = full_ckpt
    src = _dcp_dir(tmp_path, root)
    dest = os.path.join(str(tmp_path), "back")
    assert main(["import", src, "--to", dest, "--allow-pickle"]) == 0
    assert_same_tensors(flat_tensors({"model": tree["model"]}), flat_tensors(pitstop.load(dest)))


def test_allow_pickle_still_loads_custom_objects_of_a_torch_file(tmp_path: Any) -> None:
    src = os.path.join(str(tmp_path), "obj.pt")
    torch.save({"w": torch.ones(2), "n": 3}, src)
    dest = os.path.join(str(tmp_path), "ck")
    assert main(["import", src, "--to", dest, "--allow-pickle"]) == 0
    assert pitstop.load(dest)["n"] == 3


# --- the restricted metadata unpickler itself -------------------------------------------------


def test_metadata_reader_reads_what_dcp_writes(full_ckpt: tuple[str, Any], tmp_path: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    src = _dcp_dir(tmp_path, full_ckpt[0], only=None)
    ours = read_dcp_metadata(src)
    theirs = FileSystemReader(src).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data


@pytest.mark.parametrize(
    "global_name",
    [
        b"cos\nsystem\n",
        b"cbuiltins\neval\n",
        b"ctorch\nload\n",
        b"ctorch._utils\n_rebuild_tensor_v2\n",
        b"cpitstop.cli.dcp_safe\nread_dcp_metadata\n",
        b"ctorch.distributed.checkpoint.metadata\ntorch\n",
    ],
)
def test_metadata_reader_refuses_any_other_global(tmp_path: Any, global_name: bytes) -> None:
    os.makedirs(os.path.join(str(tmp_path), "d"))
    with open(os.path.join(str(tmp_path), "d", ".metadata"), "wb") as f:
        f.write(global_name + b"(S'x'\ntR.")
    module, name = global_name[1:].decode().split("\n")[:2]
    with pytest.raises(PickleRefusedError, match=rf"{module}\.{name}.*--allow-pickle"):
        read_dcp_metadata(os.path.join(str(tmp_path), "d"))


def test_metadata_reader_refuses_a_data_file_outside_the_directory(
    full_ckpt: tuple[str, Any], tmp_path: Any
) -> None:
    src = _dcp_dir(tmp_path, full_ckpt[0])
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(UnsafePathError, match="passwd"):
        read_dcp_metadata(src)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "wrong type"])
def test_broken_dcp_metadata_is_a_one_line_error(
    how: str, full_ckpt: tuple[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _dcp_dir(tmp_path, full_ckpt[0])
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        data = f.read()
    broken = {
        "truncated": data[: len(data) // 2],
        "garbage": b"\x00\x01 this is not a pickle \xff",
        "empty": b"",
        "wrong type": pickle.dumps({"state_dict_metadata": {}}),
    }[how]
    with open(path, "wb") as f:
        f.write(broken)
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata"):
        read_dcp_metadata(src)
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    assert ".metadata" in _one_line_error(capsys)


def test_missing_dcp_data_file_is_a_one_line_error(
    full_ckpt: tuple[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _dcp_dir(tmp_path, full_ckpt[0])
    for name in os.listdir(src):
        if name.endswith(".distcp"):
            os.remove(os.path.join(src, name))
    assert main(["import", src, "--to", os.path.join(str(tmp_path), "ck")]) == 1
    assert src in _one_line_error(capsys)


# --- problem 2: pitstop's own full export comes back ------------------------------------------


def test_import_of_a_full_torch_export_round_trips(
    full_ckpt: tuple[str, Any], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root, tree = full_ckpt
    out = os.path.join(str(tmp_path), "full.pt")
    assert main(["export", root, out, "--to", "torch"]) == 0
    assert "rng/numpy/1" in capsys.readouterr().out  # says what it converted for weights_only
    dest = os.path.join(str(tmp_path), "back")
    assert main(["import", out, "--to", dest, "--step", "7"]) == 0
    back = pitstop.load(dest)
    _assert_same_tree(_as_exported(tree), back)
    assert isinstance(back["rng"]["numpy"][1], torch.Tensor)  # NumPy arrays became tensors
    fresh = _full_state()
    assert pitstop.CheckpointManager(dest).restore(fresh) == 7


def test_full_torch_export_loads_with_plain_weights_only(
    full_ckpt: tuple[str, Any], tmp_path: Any
) -> None:
    root, tree = full_ckpt
    out = os.path.join(str(tmp_path), "full.pt")
    assert main(["export", root, out, "--to", "torch"]) == 0
    _assert_same_tree(_as_exported(tree), torch.load(out, weights_only=True))


def _as_exported(tree: Any) -> Any:
    """The tree as ``export --to torch`` writes it: NumPy arrays as tensors, scalars plain."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, dict):
        return {k: _as_exported(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_as_exported(v) for v in tree)
    return tree


def test_import_of_a_full_dcp_export(full_ckpt: tuple[str, Any], tmp_path: Any) -> None:
    root, tree = full_ckpt
    src = _dcp_dir(tmp_path, root, only=None)
    dest = os.path.join(str(tmp_path), "back")
    assert main(["import", src, "--to", dest]) == 0
    back = pitstop.load(dest)
    for key in ("model", "rng", "misc", "extra"):
        assert_same_tensors(flat_tensors(tree[key]), flat_tensors(back[key]))
    assert np.array_equal(back["rng"]["numpy"][1], tree["rng"]["numpy"][1])
    assert back["misc"]["s"] == "text" and back["extra"] == tree["extra"]
    # DCP's layout keys optimizer state by parameter name, in the order of the param groups
    names = [n for g in back["optimizer"]["param_groups"] for n in g["params"]]
    assert names and all(isinstance(n, str) for n in names)
    for pid, per_param in tree["optimizer"]["state"].items():
        assert_same_tensors(
            flat_tensors(per_param), flat_tensors(back["optimizer"]["state"][names[pid]])
        )


def test_weights_only_loader_allows_numpy_but_not_code(tmp_path: Any) -> None:
    buf = io.BytesIO()
    torch.save({"a": np.arange(5, dtype=np.uint32), "f": np.float64(2.5)}, buf)
    buf.seek(0)
    loaded = load_weights_only(buf, where="buffer")
    assert loaded["a"].dtype == np.uint32 and np.array_equal(loaded["a"], np.arange(5))
    assert loaded["f"] == 2.5
    buf = io.BytesIO()
    torch.save({"evil": ExecPayload(os.path.join(str(tmp_path), "PWNED"))}, buf)
    buf.seek(0)
    with pytest.raises(PickleRefusedError, match=r"builtins\.exec.*buffer|buffer.*builtins\.exec"):
        load_weights_only(buf, where="buffer")
    assert not os.path.exists(os.path.join(str(tmp_path), "PWNED"))


# --- problem 3: every bad input is one line, exit 1 or 2 --------------------------------------


def _bad_inputs(tmp: str, root: str) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a piece of text the one-line error must contain)."""
    os.makedirs(os.path.join(tmp, "plain-dir"))
    with open(os.path.join(tmp, "junk.pt"), "wb") as f:
        f.write(b"hello, this is not a torch.save file")
    open(os.path.join(tmp, "empty.pt"), "wb").close()
    torch.save({1: torch.ones(1)}, os.path.join(tmp, "intkey.pt"))
    dest = os.path.join(tmp, "dest")
    nodir = os.path.join(tmp, "no", "such", "dir")
    return {
        "missing src": (["import", os.path.join(tmp, "nope.pt"), "--to", dest], "nope.pt"),
        "dir without .metadata": (["import", os.path.join(tmp, "plain-dir"), "--to", dest], "plain-dir"),
        "not a torch file": (["import", os.path.join(tmp, "junk.pt"), "--to", dest], "junk.pt"),
        "empty file": (["import", os.path.join(tmp, "empty.pt"), "--to", dest], "empty.pt"),
        "non-str keys": (["import", os.path.join(tmp, "intkey.pt"), "--to", dest], "1"),
        "only: no such key": (["export", root, os.path.join(tmp, "x.pt"), "--to", "torch", "--only", "nope"], "nope"),
        "torch out: no dir": (["export", root, os.path.join(nodir, "x.pt"), "--to", "torch"], nodir),
        "safetensors out: no dir": (["export", root, os.path.join(nodir, "x.st"), "--to", "safetensors"], nodir),
        "torch out is a dir": (["export", root, os.path.join(tmp, "plain-dir"), "--to", "torch"], "plain-dir"),
        "dcp out under a file": (["export", root, os.path.join(tmp, "junk.pt", "d"), "--to", "dcp"], "junk.pt"),
        "export: no checkpoint": (["export", os.path.join(tmp, "nock"), os.path.join(tmp, "y.pt"), "--to", "torch"], "nock"),
    }  # fmt: skip


CASES = [
    "missing src", "dir without .metadata", "not a torch file", "empty file", "non-str keys",
    "only: no such key", "torch out: no dir", "safetensors out: no dir", "torch out is a dir",
    "dcp out under a file", "export: no checkpoint",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_not_a_traceback(
    case: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root = os.path.join(str(tmp_path), "ck")
    pitstop.save(root, {"model": {"w": torch.ones(2)}}, step=1)
    argv, named = _bad_inputs(str(tmp_path), root)[case]
    assert main(argv) in (1, 2)
    assert named in _one_line_error(capsys)


def test_legacy_torch_save_format_still_imports(tmp_path: Any) -> None:
    src = os.path.join(str(tmp_path), "old.pt")
    torch.save({"w": torch.arange(4), "n": 2}, src, _use_new_zipfile_serialization=False)
    dest = os.path.join(str(tmp_path), "ck")
    assert main(["import", src, "--to", dest]) == 0
    back = pitstop.load(dest)
    assert torch.equal(back["w"], torch.arange(4)) and back["n"] == 2


def test_non_mapping_top_level_is_kept_under_state(tmp_path: Any) -> None:
    src = os.path.join(str(tmp_path), "t.pt")
    torch.save(torch.arange(3), src)
    dest = os.path.join(str(tmp_path), "ck")
    assert main(["import", src, "--to", dest]) == 0
    assert torch.equal(pitstop.load(dest)["state"], torch.arange(3))
