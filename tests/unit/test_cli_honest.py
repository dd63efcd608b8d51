"""The command line is honest about damage and about where it writes: a fallback to an older
step is named as one (in the output and the exit status), damage exits 1 (never 2, bad usage),
an export never writes inside a checkpoint root, and hints point to the right tool."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import pitstop
from conftest import flip_byte
from pitstop.cli.main import main
from pitstop.errors import UnsupportedValueError

S1, S2 = "step-0000000001", "step-0000000002"
EXIT_FALLBACK = 3  # the README's exit code: exported, but an older step than the newest


def _two_steps(root: str) -> str:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, {"w": torch.full((4,), 1.0)})
        ckpt.save(2, {"w": torch.full((4,), 2.0)})
    return root


def _damage(root: str, name: str = S2) -> None:
    flip_byte(os.path.join(root, name, "rank-00000.bin"), 1)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


# ---------------------------------------------------------------- export of a damaged newest step
def test_export_refuses_a_damaged_newest_step(
    root: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    _damage(_two_steps(root))
    out = os.path.join(str(tmp_path), "out.pt")
    code, stdout, err = _run(capsys, "export", root, out, "--to", "torch")
    assert code == 1, (stdout, err)
    assert not os.path.exists(out)
    assert "step 2" in err and "damaged" in err and "--fallback" in err
    assert "exported" not in stdout


def test_export_fallback_names_the_step_it_exported(
    root: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    _damage(_two_steps(root))
    out = os.path.join(str(tmp_path), "out.pt")
    code, stdout, _ = _run(capsys, "export", root, out, "--to", "torch", "--fallback")
    assert code == EXIT_FALLBACK != 0
    assert "step 1" in stdout and "fallback" in stdout and "step 2" in stdout
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((4,), 1.0))


def test_damage_of_a_named_step_exits_1_not_2(
    root: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    _damage(_two_steps(root))
    assert main(["verify", root, "--step", "2"]) == 1  # marks it DAMAGED
    capsys.readouterr()
    out = os.path.join(str(tmp_path), "out.pt")
    code, _, err = _run(capsys, "export", root, out, "--to", "torch", "--step", "2")
    assert code == 1 and "damaged" in err and not os.path.exists(out)
    code, stdout, _ = _run(capsys, "inspect", root, "--step", "2")
    assert code == 1 and "damaged" in stdout
    code, _, err = _run(capsys, "inspect", root)  # the newest is the damaged one
    assert code == 1
    code, _, err = _run(capsys, "export", root, out, "--to", "torch", "--step", "7")
    assert code == 2 and "no checkpoint of step 7" in err  # usage: that step is not there


def test_diff_does_not_compare_an_older_step_in_place_of_a_damaged_newest(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    _damage(_two_steps(a))
    pitstop.save(b, {"w": torch.full((4,), 1.0)}, step=1)  # equal to a's step 1
    code, stdout, err = _run(capsys, "diff", a, b)
    assert code == 1, (stdout, err)
    assert "step 2" in err and "damaged" in err


# ---------------------------------------------------------------- export never writes in a root
@pytest.mark.parametrize(
    "where", [f"{S1}/rank-00000.bin", f"{S1}/new.pt", "out.pt", f"{S2}/objects-00000.json"]
)
def test_export_into_a_checkpoint_root_is_refused(
    root: str, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_steps(root)
    before = {n: sorted(os.listdir(os.path.join(root, n))) for n in (S1, S2)}
    out = os.path.join(root, where)
    code, stdout, err = _run(capsys, "export", root, out, "--to", "torch", "--step", "1")
    assert code == 2, (stdout, err)
    assert out in err and "inside" in err
    assert {n: sorted(os.listdir(os.path.join(root, n))) for n in (S1, S2)} == before
    assert sorted(os.listdir(root)) == [S1, S2]
    assert main(["verify", root]) == 0


def test_export_dcp_into_a_step_directory_is_refused(
    root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_steps(root)
    out = os.path.join(root, S1)
    code, _, err = _run(capsys, "export", root, out, "--to", "dcp", "--step", "1")
    assert code == 2 and out in err
    assert main(["verify", root]) == 0


# ---------------------------------------------------------------- hints and paths
def test_ls_of_a_file_says_not_a_directory(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    _two_steps(root)
    path = os.path.join(root, S1, "rank-00000.bin")
    for command in ("ls", "verify", "inspect", "gc"):
        code, _, err = _run(capsys, command, path)
        assert code == 2 and f"{path}: not a directory" in err, (command, err)


def test_a_plain_dataloader_in_the_state_points_to_resumable_loader(root: str) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(8))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    with pytest.raises(UnsupportedValueError) as info:
        pitstop.save(root, {"w": torch.ones(2), "data": loader}, step=1)
    text = str(info.value)
    assert "pitstop.ResumableLoader" in text and "allow_pickle" not in text


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_work_directories_inside_a_checkpoint_root_are_refused(
    root: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_steps(root)
    extra = ["--size", "1MB", "--reps", "1", "--no-progress"] if command == "bench" else []
    code, _, err = _run(capsys, command, "--dir", root, *extra)
    assert code == 2 and f"{root} is the checkpoint root" in err
    assert sorted(os.listdir(root)) == [S1, S2]


def test_export_fallback_when_no_step_verifies_does_not_suggest_fallback(
    root: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_steps(root)
    _damage(root, S1)
    _damage(root, S2)
    out = os.path.join(str(tmp_path), "out.pt")
    code, stdout, err = _run(capsys, "export", root, out, "--to", "torch", "--fallback")
    assert code == 1 and not os.path.exists(out), (stdout, err)
    assert "--fallback exports" not in err and "no step verifies" in err, err
    assert "step 1" in err and "step 2" in err  # each one said, with why


@pytest.mark.parametrize("to", ["torch", "safetensors", "dcp"])
def test_export_onto_the_wrong_kind_of_path_is_bad_usage(
    root: str, tmp_path: object, to: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_steps(root)
    if to == "dcp":
        out = os.path.join(str(tmp_path), "a-file")
        with open(out, "w") as f:
            f.write("x")
    else:
        out = str(tmp_path)  # a directory, where a file is written
    code, _, err = _run(capsys, "export", root, out, "--to", to)
    assert code == 2 and out in err, err
    if to != "dcp":  # a DCP directory is made with its parents
        missing = os.path.join(out + "-none", "x")
        code, _, err = _run(capsys, "export", root, missing, "--to", to)
        assert code == 2 and "does not exist" in err, err


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_dataloader_iterator_in_the_state_points_to_the_loader(
    root: str, allow_pickle: bool
) -> None:
    data = torch.utils.data.TensorDataset(torch.arange(8))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    with pytest.raises(UnsupportedValueError) as info:
        pitstop.save(
            root, {"w": torch.ones(2), "it": iter(loader)}, step=1, allow_pickle=allow_pickle
        )
    text = str(info.value)
    assert "'it'" in text and "iterator" in text and "pitstop.ResumableLoader" in text
    assert "allow_pickle" not in text


# ---------------------------------------------------------------- diff counts what it compared
def _diff_counts(out: str) -> tuple[int, int, int]:
    """``pitstop diff``'s last line: tensors compared, tensors that differ, other values."""
    found = re.search(
        r"^(\d+) tensors .*compared: (\d+) tensors and (\d+) other values differ$", out, re.M
    )
    assert found is not None, out
    compared, differ, others = (int(g) for g in found.groups())
    assert differ <= compared, out  # never more differ than were compared
    return compared, differ, others


def test_diff_counts_tensors_in_one_checkpoint_only(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    pitstop.save(a, {"w": torch.ones(3), "x": torch.ones(2)}, step=1)
    state_b = {"w": torch.zeros(3), "x": torch.ones(2), "y": torch.ones(2), "z": torch.ones(1)}
    pitstop.save(b, state_b, step=1)
    code, out, err = _run(capsys, "diff", a, b)
    assert code == 1, (out, err)
    assert _diff_counts(out) == (4, 3, 0)  # w, x, y, z compared; w differs, y and z only in B
    code, out, _ = _run(capsys, "diff", b, a)
    assert code == 1 and _diff_counts(out) == (4, 3, 0)  # the same, either way round


def test_diff_counts_every_kind_of_difference_consistently(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    same = torch.arange(4)
    pitstop.save(a, {
        "same": same, "dtype": torch.ones(2), "shape": torch.ones(2), "ignored": torch.ones(1),
        "tree": {"p": torch.ones(1), "q": torch.ones(1)}, "np": np.arange(3), "lr": 0.1,
        "only_a": {"t": torch.ones(1), "n": 3},
    }, step=1)  # fmt: skip
    pitstop.save(b, {
        "same": same, "dtype": torch.ones(2, dtype=torch.float64), "shape": torch.ones(3),
        "ignored": torch.zeros(1), "tree": [torch.ones(1), torch.ones(1), torch.ones(1)],
        "np": np.arange(3) + 1, "lr": 0.2, "only_b": 7,
    }, step=1)  # fmt: skip
    code, out, err = _run(capsys, "diff", a, b, "--ignore", "ignored")
    assert code == 1, (out, err)
    # compared: same, dtype, shape, np, tree/p, tree/q, tree/0, tree/1, tree/2, only_a/t (10);
    # differ: all but same (9); other values: lr, only_b (only_a holds a tensor: counted there)
    assert _diff_counts(out) == (10, 9, 2), out
    code, out, _ = _run(capsys, "diff", a, a, "--ignore", "ignored")
    assert code == 0 and _diff_counts(out) == (7, 0, 0)  # A's tensors but the ignored one


# ---------------------------------------------------------------- a reader that stops early
def _into_closed_pipe(*argv: str) -> tuple[int, str]:
    """Run the ``pitstop`` console script with stdout a pipe nobody reads (its read end is
    closed before the command starts: every write fails, as ``| head`` makes later ones fail);
    its exit status and stderr."""
    exe = shutil.which("pitstop", path=os.path.dirname(sys.executable))
    assert exe is not None, "the pitstop console script is not installed"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [exe, *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300
        )
    finally:
        os.close(write_end)
    return done.returncode, done.stderr


def _many_tensors(root: str, n: int) -> str:
    """Two steps of ``n`` tensors each: ``inspect`` prints far more than a pipe's buffer."""
    with pitstop.CheckpointManager(root) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {f"layer{i}": torch.full((2,), float(step)) for i in range(n)})
    return root


@pytest.mark.parametrize("tensors", [1, 400])  # output within stdout's buffer, or far beyond
def test_inspect_of_a_damaged_step_exits_1_when_the_reader_stops_early(
    root: str, tensors: int, capsys: pytest.CaptureFixture[str]
) -> None:
    _damage(_many_tensors(root, tensors))
    assert main(["verify", root]) == 1  # marks step 2 damaged
    capsys.readouterr()
    code, err = _into_closed_pipe("inspect", root)
    assert code == 1, err  # damage, said by the status though nobody reads stdout
    assert "Traceback" not in err and "Exception ignored" not in err, err
    code, err = _into_closed_pipe("inspect", root, "--step", "1")  # a good step: quiet, 0
    assert (code, err) == (0, ""), err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["ls", "{root}"], 0),
        (["verify", "{root}"], 1),  # step 3 is damaged: printed last, to nobody
        (["verify", "{root}", "--step", "1"], 0),
        (["gc", "{root}", "--dry-run"], 0),
        (["export", "{root}", "{out}", "--to", "torch", "--fallback"], EXIT_FALLBACK),
        (["diff", "{root}", "{root}", "--step-a", "1", "--step-b", "2"], 1),
    ],
    ids=["ls", "verify-damaged", "verify-clean", "gc", "export-fallback", "diff"],
)
def test_every_command_keeps_its_exit_status_when_the_reader_stops_early(
    root: str, tmp_path: object, argv: list[str], expected: int
) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((4,), float(step))})
    _damage(root, "step-0000000003")
    out = os.path.join(str(tmp_path), "out.pt")
    code, err = _into_closed_pipe(*(a.format(root=root, out=out) for a in argv))
    assert code == expected, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
