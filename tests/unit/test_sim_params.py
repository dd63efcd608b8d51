"""Bad parameters of the simulator and of ``benchmarks/goodput.py`` are refused at once, named
(hostile review, issue 26): before, ``pitstop simulate --mtbf-hours -1`` (nan, 1e-300,
``--weibull-shape nan``, ``--hours 1e12``, ...) ran for ever, others ended in an "internal
error" that named no option, and some (``--nodes 0``, a trace of ``abc``) were accepted with
nonsense output. Every case here must end quickly: the module's timeout stands for "hangs"."""

from __future__ import annotations

import importlib.util
import math
import os
import random
import subprocess
import sys
from types import ModuleType

import pytest

from pitstop.cli.main import main
from pitstop.policy import EveryN
from pitstop.sim import (
    FailureClass,
    FailureModel,
    JobModel,
    LossModel,
    TooManyFailures,
    compare,
    load_profile,
    load_trace,
    simulate,
)

pytestmark = pytest.mark.timeout(60)

BASE = {
    "--iter-secs": "0.5",
    "--stall-secs": "0.05",
    "--persist-secs": "0.7",
    "--mtbf-hours": "4",
    "--hours": "0.2",
    "--seeds": "1",
    "--jobs": "1",
    "--policy": "every:10",
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _simulate(capsys: pytest.CaptureFixture[str], **changes: str) -> tuple[int, str]:
    """Exit status and stderr of ``pitstop simulate`` with BASE's options, ``changes`` applied
    (keys: the option without its dashes, '_' for '-')."""
    opts = dict(BASE)
    for k, v in changes.items():
        opts["--" + k.replace("_", "-")] = v
    argv = ["simulate"] + [f"{k}={v}" for k, v in opts.items()]  # '=': '-1' is a value
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusal
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def _refused(code: int, err: str, option: str, value: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    assert option in err, err
    assert value in err or f"{float(value):g}" in err, err


def test_good_parameters_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _simulate(capsys)
    assert code == 0, err


BAD = [
    *[("--mtbf-hours", v) for v in ("0", "-1", "nan", "inf", "1e308", "1e-300", "abc")],
    *[("--iter-secs", v) for v in ("0", "-1", "nan", "inf", "1e12")],
    *[
        (opt, v)
        for opt in ("--stall-secs", "--persist-secs", "--slowdown-secs", "--restart-secs")
        for v in ("-1", "nan", "inf")
    ],
    *[("--hours", v) for v in ("0", "-1", "nan", "inf", "1e12")],
    *[("--weibull-shape", v) for v in ("0", "-1", "nan", "inf")],
    *[
        (opt, v)
        for opt in ("--max-in-flight", "--nodes", "--epoch-iters", "--seeds", "--jobs")
        for v in ("0", "-1")
    ],
    *[("--loss-tau-hours", v) for v in ("0", "-1", "nan")],
    *[("--stop-min", v) for v in ("-1", "nan", "inf", "1e12")],
]


@pytest.mark.parametrize(("option", "value"), BAD, ids=[f"{o}={v}" for o, v in BAD])
def test_cli_refuses_a_bad_value_naming_the_option(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _simulate(capsys, **{option[2:]: value})
    _refused(code, err, option, value)


def test_cli_refuses_failures_faster_than_it_can_simulate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _simulate(capsys, mtbf_hours="1e-6", nodes="1000")
    _refused(code, err, "--mtbf-hours", "1e-6")
    assert "--nodes" in err and "limit" in err


def test_cli_refuses_a_weibull_shape_that_clusters_too_many_failures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The mean number of failures is within the limit; the bursts of shape 0.05 are not."""
    code, err = _simulate(capsys, hours="100", mtbf_hours="0.01", weibull_shape="0.05")
    _refused(code, err, "--weibull-shape", "0.05")


@pytest.mark.parametrize("spec", ["every:nan", "every:0", "checkfreq:x", "checkfreq:nan"])
def test_cli_refuses_a_bad_policy_argument_naming_the_option(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _simulate(capsys, policy=spec)
    assert code == 2 and "--policy" in err and spec in err and "Traceback" not in err, err


TRACES = {
    "abc": "abc\n",  # a header and nothing else
    "negative": "10\n-5\n",
    "nan": "10\nnan\n",
    "inf": "inf\n",
    "word": "10\n20\nabc\n",
    "empty": "",
}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_cli_refuses_a_bad_trace_naming_the_file(
    name: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(str(tmp_path), f"{name}.csv")
    with open(path, "w") as f:
        f.write(TRACES[name])
    code, err = _simulate(capsys, trace=path)
    assert code == 2 and f"--trace {path}" in err and "Traceback" not in err, err
    if name in ("negative", "nan", "word"):
        assert "line 2" in err or "line 3" in err, err


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_cli_refuses_an_unreadable_trace_or_profile(
    what: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(str(tmp_path), "nothing.csv") if what == "missing" else str(tmp_path)
    for option in ("trace", "profile"):
        code, err = _simulate(capsys, **{option: path})
        assert code == 2 and f"--{option} {path}: cannot read it" in err, err
        assert "internal error" not in err, err


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ('{"iter_secs": NaN}', "iter_secs"),
        ('{"stall_secs": -1}', "stall_secs"),
        ('{"persist_secs": Infinity}', "persist_secs"),
        ('{"stall_secs": "x"}', "stall_secs"),
        ('{"iter_secs": 0}', "iter_secs"),
        ("not json", "not a JSON profile"),
    ],
)
def test_cli_refuses_a_bad_profile_value_naming_the_file_and_the_key(
    doc: str, key: str, tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(str(tmp_path), "profile.json")
    with open(path, "w") as f:
        f.write(doc)
    code, err = _simulate(capsys, profile=path)
    assert code == 2 and f"--profile {path}" in err and key in err, err


# ---------------------------------------------------------------- the library itself

JOB = {"iter_secs": 0.5, "stall_secs": 0.05, "persist_secs": 0.7, "iterations": 100}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[
            (f, v)
            for f in ("iter_secs", "stall_secs", "persist_secs", "slowdown_secs", "restart_secs")
            for v in (-1.0, math.nan, math.inf)
        ],
        ("iter_secs", 0.0),
        ("cost_noise_secs", math.nan),
        ("measured_cost_secs", math.inf),
        ("iterations", 0),
        ("iterations", 10**8),
        ("iterations", 1.5),
        ("max_in_flight", 0),
        ("max_in_flight", -1),
        ("iterations_per_epoch", 0),
        ("speed_trace", ((0.0, math.nan),)),
        ("speed_trace", ((math.nan, 1.0),)),
    ],
)
def test_job_model_refuses_a_bad_field_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        JobModel(**{**JOB, field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("hours", [0.0, -1.0, math.nan, math.inf, 1e12])
def test_for_hours_refuses_bad_hours(hours: float) -> None:
    with pytest.raises(ValueError, match="hours"):
        JobModel.for_hours(hours, iter_secs=0.5, stall_secs=0.05, persist_secs=0.7)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"mtbf_secs": 0.0}, "mtbf_secs"),
        ({"mtbf_secs": -1.0}, "mtbf_secs"),
        ({"mtbf_secs": math.nan}, "mtbf_secs"),
        ({"mtbf_secs": math.inf}, "mtbf_secs"),
        ({"mtbf_secs": 60.0, "weibull_shape": 0.0}, "weibull_shape"),
        ({"mtbf_secs": 60.0, "weibull_shape": -1.0}, "weibull_shape"),
        ({"mtbf_secs": 60.0, "weibull_shape": math.nan}, "weibull_shape"),
        ({"mtbf_secs": 60.0, "trace": (1.0, math.nan)}, "trace"),
        ({"mtbf_secs": 60.0, "trace": (-1.0,)}, "trace"),
        ({"mtbf_secs": 60.0, "restart_trace": (math.inf,)}, "restart_trace"),
        ({"mtbf_secs": 60.0, "trace_jitter_secs": math.nan}, "trace_jitter_secs"),
        ({"mtbf_secs": 60.0, "classes": (FailureClass("x", 0.0),)}, "classes"),
    ],
)
def test_failure_model_refuses_a_bad_field_naming_it(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FailureModel(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("mtbf", "nodes"), [(4.0, 0), (4.0, -1), (math.nan, 1), (1e308, 1)])
def test_per_node_refuses_bad_values(mtbf: float, nodes: int) -> None:
    with pytest.raises(ValueError):
        FailureModel.per_node(mtbf, nodes)


@pytest.mark.parametrize(
    "kw", [{"tau_secs": 0.0}, {"tau_secs": math.nan}, {"stop_min": -1.0}, {"stop_min": 2.0}]
)
def test_loss_model_refuses_bad_values(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        LossModel(**kw)


def test_simulate_refuses_failures_faster_than_it_can_draw() -> None:
    job = JobModel(**JOB)  # type: ignore[arg-type]
    with pytest.raises(TooManyFailures, match="limit"):
        simulate(job, FailureModel(mtbf_secs=1e-300), EveryN(10))
    with pytest.raises(TooManyFailures, match="Weibull"):  # bursts past the limit
        FailureModel(mtbf_secs=36.0, weibull_shape=0.05).times(1.8e7, random.Random(0))


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"until_secs": math.nan}, "until_secs"),
        ({"until_secs": 0.0}, "until_secs"),
        ({"max_wall_factor": math.inf}, "max_wall_factor"),
        ({"loss_every_secs": 0.0}, "loss_every_secs"),
    ],
)
def test_simulate_refuses_bad_arguments(kw: dict[str, float], name: str) -> None:
    job = JobModel(**JOB)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=name):
        simulate(job, FailureModel(mtbf_secs=600.0), EveryN(10), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seeds", [0, -1])
def test_compare_refuses_no_seeds(seeds: int) -> None:
    job = JobModel(**JOB)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seeds"):
        compare(job, FailureModel(mtbf_secs=600.0), {"n": EveryN(10)}, seeds=seeds)


def test_load_trace_and_profile_name_the_file_and_line(tmp_path: object) -> None:
    trace = os.path.join(str(tmp_path), "t.csv")
    with open(trace, "w") as f:
        f.write("time_secs\n5\n\n-3\n")
    with pytest.raises(ValueError, match=r"t\.csv: line 4"):
        load_trace(trace)
    with open(trace, "w") as f:
        f.write("time_secs\n")
    with pytest.raises(ValueError, match="only a header"):
        load_trace(trace)
    profile = os.path.join(str(tmp_path), "p.json")
    with open(profile, "w") as f:
        f.write('{"iter_secs": 0.5, "restart_secs": NaN, "state_bytes": 7}')
    with pytest.raises(ValueError, match=r"p\.json: restart_secs is nan"):
        load_profile(profile)
    with open(profile, "w") as f:
        f.write('{"iter_secs": 0.5, "iterations": 7, "max_in_flight": 3}')
    assert load_profile(profile) == {"iter_secs": 0.5}  # the job's times only


# ---------------------------------------------------------------- benchmarks/goodput.py


def _goodput() -> ModuleType:
    name = "_goodput_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", "goodput.py")
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("seconds", "mtbf", "name"),
    [
        (10.0, -5.0, "mtbf"),
        (10.0, math.nan, "mtbf"),
        (10.0, math.inf, "mtbf"),
        (10.0, 1e-9, "mtbf"),
        (math.nan, 5.0, "seconds"),
        (math.inf, 5.0, "seconds"),
        (-10.0, 5.0, "seconds"),
    ],
)
def test_goodput_failure_trace_refuses_bad_values(seconds: float, mtbf: float, name: str) -> None:
    goodput = _goodput()
    with pytest.raises(ValueError, match=name):
        goodput.failure_trace(seconds, mtbf, 26)
    assert len(goodput.failure_trace(10.0, 5.0, 26)) == 3  # the good one still works


@pytest.mark.parametrize(
    "argv",
    [
        ["--mtbf", "0"],
        ["--seconds", "0"],
        ["--mtbf", "nan"],
        ["--seconds", "1e9"],
        ["--sweep", "0,x"],
        ["--sweep", "0"],
        ["--mtbf", "0.01"],  # thousands of failures, each a warm spare process
    ],
)
def test_goodput_cli_refuses_bad_values_naming_the_option(argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "goodput.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert argv[0] in out.stderr and "Traceback" not in out.stderr, out.stderr
