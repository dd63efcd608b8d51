"""``pitstop ls`` and ``pitstop verify`` of a multi-level setup (levels.json): both levels
listed, every rank's files and redundancy checked, recoverability as the restore decides."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import pitstop
from conftest import flip_byte
from pitstop.cli.main import main
from pitstop.levels.spec import Placement

NODES4 = ["n0", "n1", "n2", "n3"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture
def single(tmp_path: Path) -> Path:
    """One rank on node n0, redundancy single, steps 1 and 2 on both levels."""
    levels = [
        pitstop.Local(tmp_path / "local" / "{node}", redundancy="single"),
        pitstop.Shared(tmp_path / "shared", every=1),
    ]
    ckpt = pitstop.CheckpointManager(levels, topology=["n0"])
    for step in (1, 2):
        ckpt.save(step, {"w": torch.full((64,), float(step)), "extra": {"step": step}})
    ckpt.close()  # waits for the flushes
    return tmp_path


# ---------------------------------------------------------------------- the rule
def test_recoverable_rule_of_each_scheme() -> None:
    ok4 = [True] * 4
    single = Placement(NODES4, "single")
    assert single.redundancy.holds is None
    assert single.recoverable(set(), ok4) and not single.recoverable({1}, ok4)
    partner = Placement(NODES4, "partner")  # rank r's copy lives on rank r+1's node
    assert partner.redundancy.holds == "copy"
    assert partner.recoverable({1}, ok4)
    assert not partner.recoverable({1}, [True, True, False, True])  # its copy is bad
    assert not partner.recoverable({1, 2}, ok4)  # its copy's node is lost too
    assert partner.recoverable({1, 3}, ok4)
    xor = Placement(NODES4, "xor")
    assert xor.redundancy.holds == "parity"
    assert xor.recoverable({2}, ok4) and not xor.recoverable({1, 2}, ok4)
    assert not xor.recoverable({2}, [True, False, True, True])  # a survivor's parity
    assert xor.recoverable({2}, [True, True, False, True])  # the lost one's own: unused


# ---------------------------------------------------------------------- ls
def test_ls_shows_both_levels_and_the_nodes_of_each_step(
    single: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for root in (single / "shared", single / "local" / "n0"):
        code, out = _run(capsys, "ls", str(root))
        assert code == 0
        shared, local = out.split("local level:")
        assert "shared level:" in shared and shared.count("committed") == 2
        assert local.count("1/1: n0") == 2 and "single" in local and "yes" in local
    code, out = _run(capsys, "ls", str(single / "shared"), "--json")
    doc = json.loads(out)
    assert code == 0 and [r["step"] for r in doc["shared"]] == [1, 2]
    assert [(r["step"], r["nodes"], r["flushed"]) for r in doc["local"]] == [
        (1, ["n0"], True), (2, ["n0"], True),
    ]  # fmt: skip
    assert doc["levels"]["redundancy"] == "single" and doc["levels"]["node_dirs"][0]["exists"]


def test_ls_of_a_root_without_levels_is_unchanged(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pitstop.save(root, {"x": torch.ones(3)}, step=4)
    code, out = _run(capsys, "ls", root, "--json")
    assert code == 0 and [r["step"] for r in json.loads(out)] == [4]
    assert main(["verify", root, "--level", "local"]) == 2


def test_relative_paths_are_found_from_any_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    levels = [pitstop.Local("ck/local/{node}", redundancy="single"), pitstop.Shared("ck/shared", 1)]
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        ckpt.save(3, {"w": torch.ones(8)})
    monkeypatch.chdir("/")
    for root in (tmp_path / "ck" / "shared", tmp_path / "ck" / "local" / "n0"):
        code, out = _run(capsys, "ls", str(root), "--json")
        doc = json.loads(out)
        assert code == 0 and doc["levels"]["local"] == str(tmp_path / "ck" / "local" / "{node}")
        assert [(r["step"], r["nodes"], r["flushed"]) for r in doc["local"]] == [(3, ["n0"], True)]


# ---------------------------------------------------------------------- verify
def test_verify_passes_on_a_good_tree(single: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "verify", str(single / "shared"))
    assert code == 0
    shared, local = out.split("local level:")
    assert shared.count(": ok") == 2 and local.count(": ok (1 ranks on 1 nodes, single)") == 2
    code, out = _run(capsys, "verify", str(single / "local" / "n0"), "--step", "1")
    assert code == 0 and out.count(": ok") == 2
    code, out = _run(capsys, "verify", str(single / "shared"), "--level", "shared")
    assert code == 0 and "local level" not in out
    assert main(["verify", str(single / "shared"), "--step", "9"]) == 2


def test_a_flipped_byte_under_single_is_not_recoverable(
    single: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_byte(str(single / "local" / "n0" / "step-0000000002" / "rank-00000.bin"), 100)
    code, out = _run(capsys, "verify", str(single / "shared"), "--level", "local")
    assert code == 1
    assert "step-0000000002: NOT RECOVERABLE" in out and "rank 0 on n0: own files BAD" in out
    assert "step-0000000001: ok" in out
    assert main(["verify", str(single / "shared"), "--level", "shared"]) == 0  # its flush


def test_a_deleted_node_dir_is_reported(single: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(single / "local" / "n0")
    for cmd in ("ls", "verify"):
        code, out = _run(capsys, cmd, str(single / "shared"))
        assert code == 0  # the shared level still has both steps
        assert f"node n0: {single / 'local' / 'n0'} does not exist" in out


def test_a_bad_levels_file_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "levels.json").write_text(json.dumps({"local": 3, "nodes": ["../x"]}))
    assert main(["ls", str(tmp_path)]) == 1
    assert "not a levels file" in capsys.readouterr().err


# ---------------------------------------------------------------------- four nodes
def _train(rank: int, world: int, base: str, scheme: str) -> None:
    levels = [
        pitstop.Local(os.path.join(base, "local", "{node}"), redundancy=scheme),
        pitstop.Shared(os.path.join(base, "shared"), every=2),
    ]
    with pitstop.CheckpointManager(
        levels, topology=NODES4, options=pitstop.SaveOptions.from_env(dist_timeout_secs=20)
    ) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": torch.full((256,), float(rank + step)), "r": rank})


def _tree(tmp_path: Path, scheme: str) -> Path:
    """Steps 1 and 2 of four ranks on nodes n0..n3 (step 2 flushed)."""
    from pitstop.testing.distributed import run_ranks

    run_ranks(_train, 4, str(tmp_path), scheme, timeout_secs=60)
    return tmp_path


def _rank_file(base: Path, node: str, rank: int, step: int = 2) -> str:
    return str(base / "local" / node / f"step-{step:010d}" / f"rank-{rank:05d}.bin")


@pytest.mark.dist
def test_partner_four_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _tree(tmp_path, "partner")
    code, out = _run(capsys, "ls", str(base / "local" / "n2"))
    assert code == 0 and "4/4: n0 n1 n2 n3" in out and "partner" in out
    code, out = _run(capsys, "verify", str(base / "shared"))
    assert code == 0 and out.count("ok (4 ranks on 4 nodes, partner)") == 2
    flip_byte(_rank_file(base, "n1", 1), 100)
    shutil.rmtree(base / "local" / "n3")
    code, out = _run(capsys, "verify", str(base / "shared"), "--level", "local")
    assert code == 0, out  # rank 1's copy is whole on n2, rank 3's on n0
    assert "step-0000000002: recoverable" in out and "node n3:" in out
    assert "rank 1 on n1: own files BAD, partner copy of rank 0 ok" in out
    assert "rank 3 on n3: own files MISSING, partner copy of rank 2 BAD" in out
    code, out = _run(capsys, "ls", str(base / "shared"))
    assert "3/4: n0 n1 n2 (n3: missing)" in out
    shutil.rmtree(base / "local" / "n2")  # rank 1's copy goes with it
    code, out = _run(capsys, "verify", str(base / "shared"), "--level", "local", "--step", "2")
    assert code == 1 and "step-0000000002: NOT RECOVERABLE" in out


@pytest.mark.dist
def test_xor_four_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _tree(tmp_path, "xor")
    code, out = _run(capsys, "verify", str(base / "local" / "n0"))
    assert code == 0 and out.count("ok (4 ranks on 4 nodes, xor)") == 2
    flip_byte(_rank_file(base, "n1", 1), 100)
    code, out = _run(capsys, "verify", str(base / "local" / "n0"), "--level", "local")
    assert code == 0 and "rank 1 on n1: own files BAD, parity ok" in out
    flip_byte(_rank_file(base, "n3", 3), 100)  # a second member of the one XOR set
    code, out = _run(capsys, "verify", str(base / "local" / "n0"), "--level", "local")
    assert code == 1 and "step-0000000002: NOT RECOVERABLE" in out


# ---------------------------------------------------------------------- node directories
@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of four ranks on nodes n0..n3, partner (built once; tests copy it)."""
    return _tree(tmp_path_factory.mktemp("four"), "partner")


def _copy(four: Path, to: Path, *, relink: bool = True) -> Path:
    """A copy of ``four``; ``relink``: its levels.json files name the copy's own paths."""
    shutil.copytree(four, to, symlinks=True)
    for path in to.glob("**/levels.json") if relink else []:
        doc = json.loads(path.read_text())
        doc.update(local=str(to / "local" / "{node}"), shared=str(to / "shared"))
        path.write_text(json.dumps(doc))
    return to


def _markers(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.glob("**/DAMAGED"))


def _rewrite_manifest(path: Path, change: object) -> None:
    """Change the manifest at ``path`` (``change(doc)``) and seal it again: it still parses."""
    from pitstop.format.manifest import seal

    doc = json.loads(path.read_text())
    change(doc)  # type: ignore[operator]
    path.write_text(json.dumps(seal(doc), indent=1))


def _step_dir(base: Path, node: str, step: int = 2) -> Path:
    return base / "local" / node / f"step-{step:010d}"


def _mark_damaged(step_dir: Path, reason: str) -> None:
    """A DAMAGED marker as pitstop writes it: naming the checkpoint of ``step_dir``."""
    from pitstop.format.manifest import Manifest, manifest_digest
    from pitstop.format.markers import marker_text

    m = Manifest.loads((step_dir / "manifest.json").read_bytes())
    text = marker_text("damaged", m.step, reason=reason, manifest_digest=manifest_digest(m))
    (step_dir / "DAMAGED").write_text(text)


@pytest.mark.dist
def test_verify_of_a_node_dir_or_its_step_dir_is_level_aware_and_marks_nothing(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "t")
    for path in (base / "local" / "n1", _step_dir(base, "n1")):
        code, out = _run(capsys, "verify", str(path), "--level", "local")
        assert code == 0, out
        assert "step-0000000002: ok (4 ranks on 4 nodes, partner)" in out
    assert _markers(base) == []
    assert main(["verify", str(_step_dir(base, "n1")), "--step", "1"]) == 2  # holds step 2


@pytest.mark.dist
def test_diff_export_and_inspect_of_a_node_dir_never_mark_it(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "t")
    node = base / "local" / "n1"
    out_file = tmp_path / "out.pt"
    for argv in (
        ["export", str(node), str(out_file), "--to", "torch"],
        ["export", str(_step_dir(base, "n1")), str(out_file), "--to", "torch"],
        ["diff", str(node), str(base / "shared")],
        ["diff", str(base / "shared"), str(_step_dir(base, "n1"))],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "node n1" in err and "only" in err and str(base / "shared") in err, err
    assert not out_file.exists() and _markers(base) == []
    code, out = _run(capsys, "inspect", str(node))
    assert code == 0 and "node n1" in out and "rank(s) 1" in out
    assert _markers(base) == []
    # the shared level holds whole checkpoints: diff and export work there
    assert main(["diff", str(base / "shared"), str(base / "shared"), "--step-a", "2"]) == 0


def test_export_of_a_one_node_dir_works(
    single: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "w.pt"
    assert main(["export", str(single / "local" / "n0"), str(out_file), "--to", "torch"]) == 0
    assert torch.equal(torch.load(out_file)["w"], torch.full((64,), 2.0))


@pytest.mark.dist
def test_verify_agrees_on_the_manifest_most_nodes_hold(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "t")

    def other_checksum(doc: dict[str, object]) -> None:  # rank 2's tensor, not its bytes
        t = next(t for t in doc["tensors"] if t["rank"] == 2)  # type: ignore[attr-defined]
        t["checksum"] = ["0" * len(t["checksum"][0])]

    _rewrite_manifest(_step_dir(base, "n0") / "manifest.json", other_checksum)  # lowest rank
    _mark_damaged(_step_dir(base, "n2"), "an old verify")
    (_step_dir(base, "n3") / "manifest.json").write_text("{ not json")
    code, out = _run(capsys, "verify", str(base / "shared"), "--level", "local", "--step", "2")
    assert code == 0, out  # n1 and n2 hold the same manifest: the agreed one, rank 2 is whole
    assert "step-0000000002: recoverable" in out
    assert "degraded: will be repaired at the next restart" in out
    assert "rank 2" not in out
    assert "node n0: manifest DIFFERS" in out
    assert "node n2: manifest marked damaged (an old verify)" in out
    assert "node n3: manifest does not parse" in out
    assert "node n1" not in out
    assert _markers(base) == ["local/n2/step-0000000002/DAMAGED"]


@pytest.mark.dist
def test_verify_tries_the_next_manifest_as_the_restore_does(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "t")

    def other_checksum(doc: dict[str, object]) -> None:
        t = next(t for t in doc["tensors"] if t["rank"] == 2)  # type: ignore[attr-defined]
        t["checksum"] = ["0" * len(t["checksum"][0])]

    for node in ("n0", "n1"):  # the most held (tie, lowest rank): rank 2 cannot match it
        _rewrite_manifest(_step_dir(base, node) / "manifest.json", other_checksum)
    code, out = _run(capsys, "verify", str(base / "shared"), "--level", "local", "--step", "2")
    assert code == 0, out
    assert "step-0000000002: recoverable" in out and "n2 n3" in out
    assert "node n0: manifest DIFFERS" in out and "node n1: manifest DIFFERS" in out
    _rewrite_manifest(_step_dir(base, "n2") / "manifest.json", other_checksum)
    (_step_dir(base, "n3") / "manifest.json").unlink()
    code, out = _run(capsys, "verify", str(base / "shared"), "--level", "local", "--step", "2")
    assert code == 1 and "step-0000000002: NOT RECOVERABLE" in out, out


@pytest.mark.dist
def test_a_node_dir_that_is_a_file_is_reported_for_that_node(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "t")
    shutil.rmtree(base / "local" / "n3")
    (base / "local" / "n3").write_text("not a directory")
    code, out = _run(capsys, "verify", str(base / "local" / "n0"), "--level", "local")
    assert code == 0, out  # rank 3's copy is whole on n0
    assert f"node n3: {base / 'local' / 'n3'} is not a directory" in out
    assert out.count("recoverable") == 2 and "does not exist" not in out
    code, out = _run(capsys, "ls", str(base / "local" / "n0"))
    assert code == 0 and "3/4: n0 n1 n2 (n3: not a directory)" in out


@pytest.mark.dist
def test_a_copied_tree_resolves_inside_the_copy(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "copy", relink=False)  # levels.json names the original
    shutil.rmtree(base / "local" / "n3")
    flip_byte(str(base / "shared" / "step-0000000002" / "rank-00001.bin"), 100)
    code, out = _run(capsys, "verify", str(base / "local" / "n1"), "--level", "local")
    assert code == 0 and f"local level: {base / 'local' / '{node}'}" in out
    assert f"node n3: {base / 'local' / 'n3'} does not exist" in out
    assert str(four / "local") in out  # what levels.json recorded, said
    code, out = _run(capsys, "ls", str(base / "local" / "n1"), "--json")
    doc = json.loads(out)
    assert [r["nodes"] for r in doc["local"]] == [["n0", "n1", "n2"]] * 2
    code, out = _run(capsys, "verify", str(base / "shared"), "--level", "shared")
    assert code == 1 and f"shared level: {base / 'shared'}" in out  # the copy's damage
    # a node directory copied under another name: only that node's directory is the copy
    lone = tmp_path / "lone"
    shutil.copytree(base / "local" / "n1", lone)
    code, out = _run(capsys, "ls", str(lone))
    assert code == 0 and f"node n1: {lone}" in out and "4/4: n0 n1 n2 n3" in out
    assert _markers(four) == []


@pytest.mark.dist
def test_ls_shows_partial_and_damaged_nodes_of_every_step(
    four: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _copy(four, tmp_path / "t")
    for node in NODES4:  # step 1 marked on every node (a restart still considers it)
        _mark_damaged(_step_dir(base, node, 1), "x")
    for node in ("n0", "n1"):  # step 5: an interrupted save
        _step_dir(base, node, 5).mkdir()
    code, out = _run(capsys, "ls", str(base / "shared"), "--json")
    rows = {r["step"]: r for r in json.loads(out)["local"]}
    assert code == 0 and sorted(rows) == [1, 2, 5]
    assert rows[1]["nodes"] == [] and rows[1]["not_committed"] == dict.fromkeys(NODES4, "damaged")
    assert rows[5]["not_committed"] == {
        "n0": "partial", "n1": "partial", "n2": "missing", "n3": "missing",
    }  # fmt: skip
    code, out = _run(capsys, "ls", str(base / "shared"))
    assert "0/4 (n0: damaged, n1: damaged, n2: damaged, n3: damaged)" in out
    assert "0/4 (n0: partial, n1: partial, n2: missing, n3: missing)" in out


def test_ls_and_verify_help_say_what_they_show_for_levels(
    single: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for cmd, words in (
        ("ls", ["levels.json", "flushed to shared", "partial", "damaged"]),
        ("verify", ["levels.json", "degraded", "exit 0", "exit 1", "never marks"]),
    ):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split()).lower()
        assert all(w in text for w in words), (cmd, text)
    shutil.rmtree(single / "shared" / "step-0000000001")
    code, out = _run(capsys, "ls", str(single / "local" / "n0"))
    local = out.split("local level:")[1]
    assert code == 0 and "FLUSHED TO SHARED" in local
    assert [line.split()[6] for line in local.splitlines()[2:]] == ["no", "yes"]
