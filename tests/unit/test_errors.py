"""Bad input gets a clear error naming the thing at fault; nothing committed is touched."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import pitstop
from conftest import tensors_of
from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
    ManifestError,
    PickleRefusedError,
    StateMismatchError,
    UnsafePathError,
    UnsupportedValueError,
)
from pitstop.format.manifest import FORMAT_VERSION, Manifest, seal


def _sealed(doc: dict[str, object]) -> str:
    """A manifest edited on purpose, resealed so that its fields (not its checksum) are tested."""
    return json.dumps(seal(doc))


def _manifest_path(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:010d}", "manifest.json")


def test_error_tree() -> None:
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(CheckpointExistsError, FileExistsError)
    assert issubclass(StateMismatchError, ValueError)
    assert issubclass(UnsafePathError, CorruptCheckpointError)
    for name in pitstop.__all__:
        obj = getattr(pitstop, name)
        if isinstance(obj, type) and name.endswith("Error"):
            assert issubclass(obj, CheckpointError), name
    e = StateMismatchError("bad", step=3, path="/x", rank=0, phase="restore")
    assert str(e) == "bad [phase=restore, step=3, rank=0, path=/x]"


def test_the_one_drawing_of_the_tree_names_every_error_and_pitstop_exports_them() -> None:
    import re

    import pitstop.errors as errors

    drawing = errors.__doc__ or ""
    drawn = set(re.findall(r"(?:[├└]── |^    )(\w+Error)\b", drawing, flags=re.M))
    exported = {
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), CheckpointError)
    }
    assert exported - drawn == set()  # main: DistributedCheckpointError was not drawn
    assert exported - set(pitstop.__all__) == set()  # main: nor exported from pitstop


def test_shm_space_error_is_in_the_one_tree_and_the_old_imports_still_work() -> None:
    import errno

    from pitstop.errors import CheckpointIOError, ShmSpaceError
    from pitstop.levels import shm, shm_slot

    # main: defined in levels.shm_slot, neither in pitstop.errors nor exported from pitstop
    assert pitstop.ShmSpaceError is ShmSpaceError
    assert shm.ShmSpaceError is ShmSpaceError and shm_slot.ShmSpaceError is ShmSpaceError
    assert issubclass(ShmSpaceError, CheckpointIOError) and issubclass(ShmSpaceError, OSError)
    e = ShmSpaceError("full", errno=errno.ENOSPC, path="/dev/shm/x", phase="stage")
    assert e.errno == errno.ENOSPC and e.filename == "/dev/shm/x"
    assert str(e) == "full [phase=stage, path=/dev/shm/x]"


def test_dtype_and_shape_mismatch_name_the_key(root: str) -> None:
    pitstop.save(root, {"w": torch.zeros(2, 3), "model": nn.Linear(3, 2)}, step=1)
    with pytest.raises(StateMismatchError, match=r"w: state has torch.float32 \[3, 2\]"):
        pitstop.load(root, {"w": torch.zeros(3, 2), "model": nn.Linear(3, 2)})
    with pytest.raises(StateMismatchError, match=r"w: state has torch.float64"):
        pitstop.load(root, {"w": torch.zeros(2, 3, dtype=torch.float64), "model": nn.Linear(3, 2)})
    with pytest.raises(StateMismatchError, match=r"model/weight: state has torch.float32 \[2, 4\]"):
        pitstop.load(root, {"w": torch.zeros(2, 3), "model": nn.Linear(4, 2)})


def test_missing_and_unexpected_keys_are_named_and_nothing_changes(root: str) -> None:
    saved = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    pitstop.save(root, {"model": saved}, step=1)
    other = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    before = tensors_of({"m": other})
    with pytest.raises(StateMismatchError) as info:
        pitstop.load(root, {"model": other})
    assert "model/2.weight" in str(info.value) and "model/2.bias" in str(info.value)
    assert info.value.missing == ["model/2.weight", "model/2.bias"]  # type: ignore[attr-defined]
    after = tensors_of({"m": other})
    assert all(torch.equal(before[k], after[k]) for k in before)  # checked before touching anything
    with pytest.raises(StateMismatchError, match="not in the state: model"):
        pitstop.load(root, {"other": nn.Linear(2, 2)})


def test_unsupported_value_names_key_and_pickle_is_opt_in(root: str) -> None:
    class Thing:
        pass

    with pytest.raises(UnsupportedValueError, match=r"extra/obj.*Thing.*allow_pickle"):
        pitstop.save(root, {"extra": {"obj": Thing()}}, step=1)
    assert pitstop.CheckpointManager(root).steps() == []
    pitstop.save(root, {"extra": {"obj": {1, 2, 3}}}, step=1, allow_pickle=True)
    with pytest.raises(PickleRefusedError, match=r"extra/obj.*builtins.set.*allow_pickle"):
        pitstop.load(root)
    assert pitstop.load(root, allow_pickle=True)["extra"]["obj"] == {1, 2, 3}


def test_pickle_payload_is_never_run_without_opt_in(root: str, tmp_path: object) -> None:
    marker = os.path.join(str(tmp_path), "pwned")

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.mkdir, (marker,))

    pitstop.save(root, {"extra": {"e": Evil()}}, step=1, allow_pickle=True)
    with pytest.raises(PickleRefusedError):
        pitstop.load(root, {"extra": {"e": None}})
    assert not os.path.exists(marker)


def test_committed_step_is_never_rewritten(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, {"x": torch.ones(2)})
        before = open(_manifest_path(root, 1), "rb").read()
        with pytest.raises(CheckpointExistsError, match="step 1 is already committed"):
            ckpt.save(1, {"x": torch.zeros(2)})
        assert open(_manifest_path(root, 1), "rb").read() == before
        assert torch.equal(pitstop.load(root)["x"], torch.ones(2))


def test_newer_format_version_is_refused(root: str) -> None:
    pitstop.save(root, {"x": torch.ones(2)}, step=1)
    doc = json.load(open(_manifest_path(root, 1)))
    doc["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(FormatVersionError, match=f"format {FORMAT_VERSION + 1}.*upgrade pitstop"):
        Manifest.loads(_sealed(doc))


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/abs/rank-00000.bin", "rank-0.bin/..", "x.bin"]
)
def test_path_escaping_the_checkpoint_is_refused(root: str, name: str) -> None:
    pitstop.save(root, {"x": torch.ones(2)}, step=1)
    doc = json.load(open(_manifest_path(root, 1)))
    doc["files"][0]["name"] = name
    doc["tensors"][0]["file"] = name
    with pytest.raises(UnsafePathError, match="not a pitstop data file name"):
        Manifest.loads(_sealed(doc))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("step", -1, "out of range"),
        ("format", "other", "not a pitstop manifest"),
        ("tensors", "x", "wrong type"),
        ("checksum", {"algorithm": "md5", "segment_bytes": 4096}, "unknown checksum"),
    ],
)
def test_manifest_strict_parse(root: str, field: str, value: object, message: str) -> None:
    pitstop.save(root, {"x": torch.ones(2)}, step=1)
    doc = json.load(open(_manifest_path(root, 1)))
    doc[field] = value
    with pytest.raises(ManifestError, match=message):
        Manifest.loads(_sealed(doc))
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.loads(b"{not json")


def test_tensor_entry_validation(root: str) -> None:
    pitstop.save(root, {"x": torch.ones(2)}, step=1)
    doc = json.load(open(_manifest_path(root, 1)))
    bad = json.loads(json.dumps(doc))
    bad["tensors"][0]["shape"] = [3]
    with pytest.raises(ManifestError, match="nbytes does not match"):
        Manifest.loads(_sealed(bad))
    bad = json.loads(json.dumps(doc))
    bad["tensors"][0]["offset"] = 4096 * 100
    with pytest.raises(ManifestError, match="beyond the end"):
        Manifest.loads(_sealed(bad))
    bad = json.loads(json.dumps(doc))
    bad["tensors"][0]["offset"] = 8
    with pytest.raises(ManifestError, match="not 4 KiB-aligned"):
        Manifest.loads(_sealed(bad))


def test_not_a_checkpoint_and_not_found(tmp_path: object) -> None:
    with pytest.raises(CheckpointNotFoundError):
        pitstop.load(os.path.join(str(tmp_path), "nope"))
    empty = os.path.join(str(tmp_path), "empty")
    os.mkdir(empty)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        pitstop.load(empty, {"x": torch.zeros(1)})
    assert pitstop.CheckpointManager(empty).restore({"x": torch.zeros(1)}) is None


def test_a_directory_that_is_not_a_checkpoint(tmp_path: object) -> None:
    from pitstop.cli.main import main
    from pitstop.errors import NotACheckpointError

    other = os.path.join(str(tmp_path), "logs")
    os.makedirs(other)
    open(os.path.join(other, "train.log"), "w").close()
    with pytest.raises(NotACheckpointError, match=r"not a pitstop checkpoint directory.*train.log"):
        pitstop.load(other)
    assert main(["verify", other]) == 2
    assert main(["ls", other]) == 2


def test_state_must_be_a_dict(root: str) -> None:
    with pytest.raises(UnsupportedValueError, match="state must be a dict"):
        pitstop.save(root, [torch.ones(1)], step=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        pitstop.save(root, {"x": torch.ones(1)}, step=-1)


def test_sparse_and_meta_tensors_refused_with_key(root: str) -> None:
    with pytest.raises(UnsupportedValueError, match="'s'.*layout"):
        pitstop.save(root, {"s": torch.eye(3).to_sparse()}, step=1)
    with pytest.raises(UnsupportedValueError, match="'m'"):
        pitstop.save(root, {"m": torch.empty(3, device="meta")}, step=1)


def test_manifest_layout_checks(root: str) -> None:
    pitstop.save(root, {"x": torch.ones(2), "y": torch.zeros(1024)}, step=1)
    doc = json.load(open(_manifest_path(root, 1)))
    bad = json.loads(json.dumps(doc))
    bad["tensors"][1]["offset"] = 0  # y on top of x
    with pytest.raises(ManifestError, match="overlap"):
        Manifest.loads(_sealed(bad))
    bad = json.loads(json.dumps(doc))
    bad["files"].append({"name": "rank-00001.bin", "rank": 1, "nbytes": 8192, "checksum": None})
    bad["tensors"][0]["file"] = "rank-00001.bin"  # rank 0's tensor served from another file
    with pytest.raises(ManifestError, match="rank"):
        Manifest.loads(_sealed(bad))
    bad = json.loads(json.dumps(doc))
    bad["checksum"]["segment_bytes"] = 1000
    with pytest.raises(ManifestError, match="multiple of 4096"):
        Manifest.loads(_sealed(bad))


def test_huge_claimed_size_falls_back_without_allocating(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, {"x": torch.ones(2)})
        ckpt.save(2, {"x": torch.full((2,), 2.0)})
    doc = json.load(open(_manifest_path(root, 2)))
    doc["files"][0]["nbytes"] = 2**50
    for t in doc["tensors"]:
        t["offset"] = 0
    with open(_manifest_path(root, 2), "w") as f:
        json.dump(doc, f)
    live = {"x": torch.zeros(2)}
    assert pitstop.CheckpointManager(root).restore(live) == 1  # no 1 PB buffer was asked for
    assert live["x"].tolist() == [1.0, 1.0]


def test_optimizer_group_mismatch_is_found_before_anything_changes(root: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    two_groups = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1
    )
    pitstop.save(root, {"model": model, "optimizer": two_groups}, step=1)
    other = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = tensors_of({"m": other})
    one_group = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(
        StateMismatchError, match=r"optimizer: parameter groups of sizes \[4\].*\[2, 2\]"
    ):
        pitstop.load(root, {"model": other, "optimizer": one_group})
    after = tensors_of({"m": other})
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_stateful_that_fails_late_says_the_state_is_partly_restored(root: str) -> None:
    class Picky:
        def state_dict(self) -> dict[str, int]:
            return {"v": 1}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            raise ValueError("version 1 is too old")

    pitstop.save(root, {"a": torch.ones(2), "z": Picky()}, step=1)
    with pytest.raises(StateMismatchError, match="partly restored: do not train from it"):
        pitstop.load(root, {"a": torch.zeros(2), "z": Picky()})
