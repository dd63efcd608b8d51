"""Damaged and hostile metadata, special files, symlinks, newer formats and concurrent
writers: each ends in a pitstop error naming the thing at fault, never a wrong value, a
hang, a write outside the root or a lost commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

import pitstop
from conftest import assert_same_tensors, make_state, tensors_of
from pitstop.cli.main import main
from pitstop.errors import (
    CheckpointExistsError,
    CorruptCheckpointError,
    FormatVersionError,
    ManifestError,
)
from pitstop.format.manifest import Manifest
from pitstop.storage.local import LocalStorage
from pitstop.testing import GateStorage

S1, S2 = "step-0000000001", "step-0000000002"


def _two_steps(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, make_state(seed=1))
        ckpt.save(2, make_state(seed=2))


def _manifest(root: str, name: str = S2) -> dict[str, Any]:
    return json.load(open(os.path.join(root, name, "manifest.json")))


def _write_manifest(root: str, doc: dict[str, Any], *, reseal: bool, name: str = S2) -> None:
    path = os.path.join(root, name, "manifest.json")
    if reseal:  # as an adversary who knows the format would
        body = {k: v for k, v in doc.items() if k != "integrity"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        from pitstop.format.checksum import get_checksum

        doc["integrity"] = {"algorithm": "xxh3_64", "manifest": get_checksum("xxh3_64")(canonical)}
    with open(path, "w") as f:
        json.dump(doc, f)


def _restores_step_1(root: str) -> None:
    fresh = make_state(seed=99)
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.restore(fresh, rollback=False) == 1
        assert ckpt.last_restore is not None and ckpt.last_restore.skipped
    assert_same_tensors(tensors_of(make_state(seed=1)), tensors_of(fresh))


# ---------------------------------------------------------------- metadata integrity
def test_swapped_keys_of_same_shape_tensors_are_damage(root: str) -> None:
    _two_steps(root)
    doc = _manifest(root)
    keys = {t["key"]: t for t in doc["tensors"]}
    keys["model/bn.weight"]["key"], keys["model/bn.bias"]["key"] = (
        "model/bn.bias",
        "model/bn.weight",
    )
    _write_manifest(root, doc, reseal=False)
    assert main(["verify", root]) == 1
    _restores_step_1(root)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.__setitem__("world_size", 3),
        lambda d: d["tensors"][0].__setitem__("dtype", "float16"),
        lambda d: d["tensors"][-1].__setitem__("key", d["tensors"][-1]["key"] + "x"),
        lambda d: d.__setitem__("step", 1),
    ],
)
def test_any_edit_of_the_manifest_falls_back(root: str, edit: Any) -> None:
    _two_steps(root)
    doc = _manifest(root)
    edit(doc)
    _write_manifest(root, doc, reseal=False)
    _restores_step_1(root)


def test_huge_sizes_do_not_hang_or_allocate(root: str) -> None:
    _two_steps(root)
    doc = _manifest(root)
    doc["tensors"][0]["nbytes"] = 2**61
    doc["files"][0]["nbytes"] = 2**62
    _write_manifest(root, doc, reseal=True)
    t0 = time.perf_counter()
    assert main(["ls", root]) == 0
    assert main(["verify", root]) == 1
    _restores_step_1(root)
    assert time.perf_counter() - t0 < 30
    doc["tensors"][0]["shape"] = [0, 2**70]
    _write_manifest(root, doc, reseal=True)
    with pytest.raises(ManifestError, match="shape"):
        Manifest.loads(open(os.path.join(root, S2, "manifest.json"), "rb").read())


def test_claimed_data_size_is_checked_before_allocation(root: str, capsys: Any) -> None:
    _two_steps(root)
    doc = _manifest(root)
    doc["files"][0]["nbytes"] = 1 << 40  # a terabyte the file does not have
    _write_manifest(root, doc, reseal=True)
    assert main(["verify", root, "--step", "2"]) == 1
    assert "rank-00000.bin is said to hold 1099511627776 bytes" in capsys.readouterr().out
    _restores_step_1(root)


def test_deep_nesting_and_huge_files_are_refused_quickly(root: str) -> None:
    _two_steps(root)
    path = os.path.join(root, S2, "manifest.json")
    with open(path, "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)
    assert main(["ls", root]) == 0
    _restores_step_1(root)
    os.unlink(path)
    with open(path, "wb") as f:  # 3 GiB sparse: refused by size before it is read
        f.truncate(3 << 30)
    storage = LocalStorage(root, pitstop.IOOptions(max_metadata_bytes=1 << 20))
    with pytest.raises(CorruptCheckpointError, match="limit"):
        storage.read_manifest(S2)
    _restores_step_1(root)


# ---------------------------------------------------------------- special files and symlinks
def test_fifo_objects_file_does_not_block(root: str) -> None:
    _two_steps(root)
    objects = os.path.join(root, S2, "objects-00000.json")
    os.unlink(objects)
    os.mkfifo(objects)
    assert main(["verify", root, "--step", "2"]) == 1
    _restores_step_1(root)


def test_objects_file_linked_to_dev_zero_is_refused(root: str) -> None:
    _two_steps(root)
    objects = os.path.join(root, S2, "objects-00000.json")
    os.unlink(objects)
    os.symlink("/dev/zero", objects)
    assert main(["verify", root, "--step", "2"]) == 1
    _restores_step_1(root)


def test_symlinked_step_directory_is_foreign_and_never_touched(tmp_path: Any) -> None:
    other = str(tmp_path / "pretrained")
    with pitstop.CheckpointManager(other) as ckpt:
        ckpt.save(7, make_state(seed=7))
    root = str(tmp_path / "run")
    os.makedirs(root)
    os.symlink(os.path.join(other, "step-0000000007"), os.path.join(root, "step-0000000007"))
    with pitstop.CheckpointManager(root, keep_last=1) as ckpt:
        assert [e.status for e in ckpt.entries()] == ["foreign"]
        assert ckpt.restore(make_state(seed=99)) is None  # never followed
        for s in (8, 9):
            ckpt.save(s, make_state(seed=s))
        assert ckpt.steps() == [9]
        ckpt.gc(abandoned=True, damaged=True)
    assert os.path.exists(os.path.join(other, "step-0000000007", "manifest.json"))
    assert os.path.islink(os.path.join(root, "step-0000000007"))
    assert main(["verify", root]) == 1  # the foreign entry is reported, not followed


def test_symlinked_data_file_is_not_followed(root: str, tmp_path: Any) -> None:
    _two_steps(root)
    data = os.path.join(root, S2, "rank-00000.bin")
    outside = str(tmp_path / "outside.bin")
    os.rename(data, outside)
    os.symlink(outside, data)
    _restores_step_1(root)


# ---------------------------------------------------------------- newer formats
def test_newer_format_stops_restore_and_moves_nothing(root: str, capsys: Any) -> None:
    _two_steps(root)
    doc = _manifest(root)
    doc["format_version"] = 99
    _write_manifest(root, doc, reseal=True)
    before = sorted(os.listdir(root))
    with pitstop.CheckpointManager(root) as ckpt, pytest.raises(FormatVersionError) as info:
        ckpt.restore(make_state(seed=99))
    assert "format 99" in str(info.value) and "upgrade" in str(info.value)
    with pytest.raises(FormatVersionError):
        pitstop.load(root)
    assert sorted(os.listdir(root)) == before
    assert not os.path.exists(os.path.join(root, S2, "DAMAGED"))
    assert main(["ls", root]) == 0
    assert "newer" in capsys.readouterr().out


def test_damaged_version_field_is_damage_not_a_newer_format(root: str) -> None:
    _two_steps(root)
    doc = _manifest(root)
    doc["format_version"] = 4  # a flipped bit: the integrity checksum no longer matches
    _write_manifest(root, doc, reseal=False)
    _restores_step_1(root)


# ---------------------------------------------------------------- concurrent writers
def test_two_writers_of_one_step_one_wins_one_is_told(root: str) -> None:
    gate = GateStorage(LocalStorage(root), hold={"write_data"})
    a = pitstop.CheckpointManager(gate)
    b = pitstop.CheckpointManager(root)
    ha = a.async_save(5, make_state(seed=5))
    assert gate.arrived["write_data"].wait(20)  # a holds step 5, uncommitted
    with pytest.raises(CheckpointExistsError, match="being written"):
        b.save(5, make_state(seed=55))  # b does not remove a's save in progress
    gate.open("write_data")
    ha.wait()
    fresh = make_state(seed=99)
    assert pitstop.load(root, fresh) == 5
    assert_same_tensors(tensors_of(make_state(seed=5)), tensors_of(fresh))
    assert main(["verify", root]) == 0
    a.close()
    b.close()


def test_commit_never_replaces_a_manifest(root: str) -> None:
    storage = LocalStorage(root)
    storage.prepare(S1)
    storage.commit(S1, b'{"first": true}')
    with pytest.raises(CheckpointExistsError):
        storage.commit(S1, b'{"second": true}')
    assert open(os.path.join(root, S1, "manifest.json"), "rb").read() == b'{"first": true}'


def test_debris_of_a_dead_writer_is_replaced_and_collected(root: str) -> None:
    os.makedirs(os.path.join(root, S2))  # nobody holds it: its writer is gone
    open(os.path.join(root, S2, "rank-00000.bin"), "wb").close()
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(2, make_state(seed=2))
        assert ckpt.steps() == [2]
    os.makedirs(os.path.join(root, "step-0000000003"))
    assert pitstop.CheckpointManager(root).gc() == ["step-0000000003"]


WRITER = textwrap.dedent(
    """
    import sys, torch, pitstop
    root, who = sys.argv[1], int(sys.argv[2])
    ok = []
    with pitstop.CheckpointManager(root) as ckpt:
        for step in range(1, 31):
            try:
                ckpt.save(step, {"x": torch.full((4096,), float(who)), "who": who})
                ok.append(step)
            except pitstop.CheckpointExistsError:
                pass
    print(" ".join(map(str, ok)))
    """
)


@pytest.mark.fault
def test_two_processes_saving_the_same_steps_lose_nothing(root: str) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, root, str(who)], stdout=subprocess.PIPE, text=True
        )
        for who in (1, 2)
    ]
    told = {}
    for who, p in zip((1, 2), procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        told[who] = {int(s) for s in out.split()}
    assert not told[1] & told[2]  # never both told OK for one step
    assert told[1] | told[2] == set(range(1, 31))  # every step committed by someone
    for step in range(1, 31):
        loaded = pitstop.load(root, step=step)
        who = loaded["who"]
        assert step in told[who]
        assert torch.equal(loaded["x"], torch.full((4096,), float(who)))
    assert main(["verify", root]) == 0


def test_two_managers_with_different_steps_keep_working(root: str) -> None:
    errors: list[BaseException] = []

    def run(offset: int) -> None:
        try:
            with pitstop.CheckpointManager(root, keep_last=2) as ckpt:
                for s in range(1, 11):
                    ckpt.save(offset + s, {"x": torch.full((8,), float(offset + s))})
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(o,)) for o in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert pitstop.CheckpointManager(root).steps() == [9, 10, 1009, 1010]


def test_gc_never_removes_a_save_that_commits_after_its_scan(root: str) -> None:
    writer_gate = GateStorage(LocalStorage(root), hold={"commit"})
    gc_gate = GateStorage(LocalStorage(root), hold={"lock"})
    writer = pitstop.CheckpointManager(writer_gate)
    collector = pitstop.CheckpointManager(gc_gate)
    handle = writer.async_save(5, make_state(seed=5))
    assert writer_gate.arrived["commit"].wait(20)  # step 5: data written, not committed
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(removed=collector.gc()))
    t.start()
    assert gc_gate.arrived["lock"].wait(20)  # gc saw step 5 as partial and is about to lock it
    writer_gate.open("commit")
    handle.wait()  # committed, its lock released
    gc_gate.open("lock")
    t.join(30)
    assert out["removed"] == []
    assert writer.steps() == [5]
    writer.close()
    collector.close()


def test_a_step_directory_swapped_for_a_symlink_mid_save_is_not_followed(
    root: str, tmp_path: Any
) -> None:
    outside = str(tmp_path / "outside")
    os.makedirs(outside)
    gate = GateStorage(LocalStorage(root), hold={"write_data"})
    ckpt = pitstop.CheckpointManager(gate)
    handle = ckpt.async_save(1, make_state(seed=1))
    assert gate.arrived["write_data"].wait(20)
    os.rename(os.path.join(root, S1), os.path.join(root, ".moved"))
    os.symlink(outside, os.path.join(root, S1))
    gate.open("write_data")
    handle.wait()  # the save wrote into the directory it created, wherever that went
    ckpt.close()
    assert os.listdir(outside) == []
    assert sorted(os.listdir(os.path.join(root, ".moved"))) == [
        ".owner",
        "manifest.json",
        "objects-00000.json",
        "rank-00000.bin",
    ]


def test_odd_entries_under_the_root_do_not_stop_gc(root: str, tmp_path: Any) -> None:
    _two_steps(root)
    victim = str(tmp_path / "victim")
    os.makedirs(victim)
    os.symlink(victim, os.path.join(root, ".abandoned-step-0000000003-abc"))
    open(os.path.join(root, ".writing-step-0000000004-def"), "w").close()
    os.makedirs(os.path.join(root, "step-0000000005"))
    assert main(["gc", root, "--abandoned", "--damaged", "--min-age", "0"]) == 0
    assert not os.path.exists(os.path.join(root, "step-0000000005"))
    assert os.path.islink(os.path.join(root, ".abandoned-step-0000000003-abc"))
    assert os.path.isdir(victim)
    statuses = {e.name: e.status for e in pitstop.CheckpointManager(root).entries()}
    assert statuses[".abandoned-step-0000000003-abc"] == "foreign"


def test_step_names_are_canonical(root: str) -> None:
    _two_steps(root)
    os.rename(os.path.join(root, S2), os.path.join(root, "step-00000000002"))  # 11 digits
    with pitstop.CheckpointManager(root) as ckpt:
        assert ckpt.steps() == [1]


@pytest.mark.parametrize(
    "node", [{"float": []}, {"float": {}}, {"npscalar": ["float32", {"float": {}}]}]
)
def test_unhashable_values_in_float_nodes_are_damage(node: Any) -> None:
    from pitstop.format.objects import encode_objects, parse_objects

    with pytest.raises(ManifestError):
        parse_objects(encode_objects({"dict": [["x", node]]}, rank=0), name="o", tensor_keys=())


def test_import_of_a_fifo_does_not_block(tmp_path: Any) -> None:
    fifo = str(tmp_path / "ff")
    os.mkfifo(fifo)
    assert main(["import", fifo, "--to", str(tmp_path / "out")]) == 2
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04N.")
    os.mkfifo(str(dcp / "__0_0.distcp"))
    assert main(["import", str(dcp), "--to", str(tmp_path / "out2")]) == 1


def test_values_that_would_come_back_as_another_type_are_refused(root: str) -> None:
    import collections
    import enum

    class Color(enum.IntEnum):
        RED = 1

    np = pytest.importorskip("numpy")
    for bad, what in [
        ({"c": Color.RED}, "Color"),
        ({"d": collections.defaultdict(int)}, "defaultdict"),
        ({"k": {np.float64(1.5): 1}}, "float64"),
        ({"k": {Color.RED: 1}}, "Color"),
    ]:
        with (
            pitstop.CheckpointManager(root) as ckpt,
            pytest.raises(pitstop.UnsupportedValueError, match=what),
        ):
            ckpt.async_save(1, bad)
    assert not os.path.exists(os.path.join(root, S1))


def test_a_pinned_step_swapped_for_a_symlink_is_still_read_from_the_root(
    root: str, tmp_path: Any
) -> None:
    _two_steps(root)
    decoy = str(tmp_path / "decoy")
    import shutil

    shutil.copytree(os.path.join(root, S1), decoy)  # what a swap would make restore read
    gate = GateStorage(LocalStorage(root), hold={"open_data"})
    fresh = make_state(seed=99)
    out: dict[str, Any] = {}
    with pitstop.CheckpointManager(gate) as ckpt:
        t = threading.Thread(target=lambda: out.update(step=ckpt.restore(fresh, rollback=False)))
        t.start()
        assert gate.arrived["open_data"].wait(20)  # step 2 pinned, about to read its data
        os.rename(os.path.join(root, S2), os.path.join(root, ".moved"))
        os.symlink(decoy, os.path.join(root, S2))
        gate.open("open_data")
        t.join(30)
    assert out.get("step") == 2
    assert_same_tensors(tensors_of(make_state(seed=2)), tensors_of(fresh))
