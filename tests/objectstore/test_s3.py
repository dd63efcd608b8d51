"""Checkpoints in an S3 bucket (a real S3 server on loopback: tests/objectstore/conftest.py):
save, restore, retention, damage, a server that fails or stops, a shared level in a bucket,
the CLI on a URL."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import pitstop
from pitstop.options import IOOptions
from pitstop.storage.object_store import ObjectStorage

pytestmark = pytest.mark.fault  # a server process per session: not in the fast tier


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(16, 64, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_and_restore_through_a_bucket_bit_exact(
    bucket: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    model, opt = _model()
    with pitstop.CheckpointManager(bucket.url(), keep_last=2) as ckpt:
        for step in range(1, 6):
            _train(model, opt, step)
            ckpt.save(step, {"model": model, "opt": opt})
    keys = bucket.list_keys("run/")
    steps = sorted({k.split("/")[1] for k in keys})
    assert steps == ["step-0000000004", "step-0000000005"]  # retention deleted 1-3
    assert "run/step-0000000005/manifest.json" in keys
    assert any(k.startswith("run/step-0000000005/rank-00000.bin/") for k in keys)
    assert os.listdir(tmp_path) == []  # nothing local, no directory named 's3:'

    fresh, fresh_opt = _model(seed=1)
    with pitstop.CheckpointManager(bucket.url()) as ckpt:
        assert ckpt.restore({"model": fresh, "opt": fresh_opt}) == 5
    assert _same(model, fresh)
    assert bucket.open_uploads() == []


def test_async_save_and_parts_larger_than_one_object(bucket: Any) -> None:
    """A data file larger than ``part_bytes`` is several part objects, uploaded in parallel
    and read back with ranged GETs that cross part boundaries."""
    state = {"w": torch.randn(3 * 1024 * 1024 // 4 + 123), "b": torch.arange(1000)}
    io = IOOptions(threads=4, chunk_bytes=1024 * 1024, read_chunk_bytes=768 * 1024)
    storage = ObjectStorage(bucket.url("big"), io, part_bytes=512 * 1024)
    with pitstop.CheckpointManager(storage) as ckpt:
        handle = ckpt.async_save(7, state)
        handle.wait()
        assert handle.committed
    parts = [k for k in bucket.list_keys("big/step-0000000007/rank-00000.bin/")]
    assert len(parts) >= 6
    out = {"w": torch.zeros_like(state["w"]), "b": torch.zeros_like(state["b"])}
    with pitstop.CheckpointManager(ObjectStorage(bucket.url("big"), io)) as ckpt:
        assert ckpt.restore(out) == 7
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def test_a_damaged_object_falls_back_to_the_previous_checkpoint(bucket: Any, caplog: Any) -> None:
    model, opt = _model()
    with pitstop.CheckpointManager(bucket.url(), keep_last=3) as ckpt:
        for step in (1, 2):
            _train(model, opt, step)
            ckpt.save(step, {"model": model, "opt": opt})
            if step == 1:
                expected = {k: v.clone() for k, v in model.state_dict().items()}
    part = next(k for k in bucket.list_keys("run/step-0000000002/rank-00000.bin/"))
    raw = bytearray(bucket.get(part))
    raw[100] ^= 0x40
    bucket.put(part, bytes(raw))
    fresh, fresh_opt = _model(seed=3)
    with caplog.at_level(logging.WARNING), pitstop.CheckpointManager(bucket.url()) as ckpt:
        assert ckpt.restore({"model": fresh, "opt": fresh_opt}) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    assert "step-0000000002" in caplog.text
    assert "run/step-0000000002/DAMAGED" in bucket.list_keys("run/") or any(
        "damaged-step-0000000002" in k for k in bucket.list_keys("run/")
    )


def test_a_missing_part_is_damage_not_a_short_read(bucket: Any) -> None:
    state = {"w": torch.randn(300_000)}
    io = IOOptions(chunk_bytes=256 * 1024)
    pitstop.save(bucket.url(), state, step=1)
    pitstop.save(bucket.url(), {"w": state["w"] * 2}, step=2)
    storage = ObjectStorage(bucket.url(), io)
    parts = bucket.list_keys("run/step-0000000002/rank-00000.bin/")
    bucket.delete(parts[0])
    with pytest.raises(pitstop.CorruptCheckpointError, match="missing"):
        storage.file_size("step-0000000002", "rank-00000.bin")
    out = {"w": torch.zeros(300_000)}
    assert pitstop.load(bucket.url(), out) == 1 and torch.equal(out["w"], state["w"])


def test_a_server_that_stops_mid_upload_commits_nothing(flaky_bucket: Any) -> None:
    bucket = flaky_bucket
    assert bucket.proxy is not None
    model, opt = _model()
    io = IOOptions(retries=2, retry_backoff_secs=0.01, chunk_bytes=64 * 1024)
    with pitstop.CheckpointManager(ObjectStorage(bucket.url(), io)) as ckpt:
        _train(model, opt, 1)
        ckpt.save(1, {"model": model, "opt": opt})
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, opt, 2)
        bucket.proxy.die_after_puts = 2  # the owner object and one data part, then nothing
        t0 = time.monotonic()
        with pytest.raises(pitstop.CheckpointIOError):
            ckpt.save(2, {"model": model, "opt": opt})
        assert time.monotonic() - t0 < 120  # bounded retries, not a hang
    bucket.proxy.dead = False
    bucket.proxy.die_after_puts = None
    assert "run/step-0000000002/manifest.json" not in bucket.list_keys("run/")
    fresh, fresh_opt = _model(seed=5)
    with pitstop.CheckpointManager(bucket.url()) as ckpt:
        assert ckpt.restore({"model": fresh, "opt": fresh_opt}) == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_server_errors_are_retried_then_raised(flaky_bucket: Any) -> None:
    bucket = flaky_bucket
    assert bucket.proxy is not None
    state = {"w": torch.randn(1000)}
    io = IOOptions(retries=2, retry_backoff_secs=0.01)
    storage = ObjectStorage(bucket.url(), io)
    bucket.proxy.fail_status, bucket.proxy.fail_count = 503, 3  # a while, then fine
    with pitstop.CheckpointManager(storage) as ckpt:
        ckpt.save(1, state)
    assert bucket.proxy.failed == 3
    assert "run/step-0000000001/manifest.json" in bucket.list_keys("run/")
    bucket.proxy.fail_status, bucket.proxy.fail_count = 500, 10**6  # for good
    with (
        pytest.raises(pitstop.CheckpointIOError) as err,
        pitstop.CheckpointManager(ObjectStorage(bucket.url(), io)) as ckpt,
    ):
        ckpt.save(2, state)
    assert "s3://" in str(err.value)
    bucket.proxy.fail_count = 0
    out = {"w": torch.zeros(1000)}
    assert pitstop.load(bucket.url(), out) == 1 and torch.equal(out["w"], state["w"])


def test_flush_to_a_bucket_and_restart_from_it_when_every_local_copy_is_gone(
    bucket: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    model, opt = _model()
    levels = [pitstop.Local(tmp_path / "local" / "{node}"), pitstop.Shared(bucket.url(), every=2)]
    with pitstop.CheckpointManager(levels) as ckpt:
        for step in range(1, 5):
            _train(model, opt, step)
            ckpt.save(step, {"model": model, "opt": opt})
            if step == 4:
                expected = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.wait()
    assert "run/step-0000000004/manifest.json" in bucket.list_keys("run/")
    import shutil

    shutil.rmtree(tmp_path / "local")
    assert os.listdir(tmp_path) == []  # the shared level wrote nothing local
    fresh, fresh_opt = _model(seed=9)
    with pitstop.CheckpointManager(levels) as ckpt:
        assert ckpt.restore({"model": fresh, "opt": fresh_opt}) == 4
        assert ckpt.last_restore is not None and ckpt.last_restore.level == "shared"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_secrets_given_as_options_are_never_logged_or_written(bucket: Any, caplog: Any) -> None:
    secret = "S3CR3T-never-to-be-seen"
    os.environ.pop("AWS_SECRET_ACCESS_KEY")
    opts = {"access_key_id": "testing", "secret_access_key": secret}
    with caplog.at_level(logging.DEBUG):
        storage = ObjectStorage(bucket.url(), options=opts)
        with pitstop.CheckpointManager(storage) as ckpt:
            ckpt.save(1, {"w": torch.ones(4)})
        bad = ObjectStorage(bucket.url("other"), options={**opts, "region": "nowhere-9"})
        repr(bad)
    for key in bucket.list_keys():
        assert secret.encode() not in bucket.get(key), key
    assert secret not in caplog.text and secret not in repr(storage)


def test_the_cli_works_on_a_url(bucket: Any, tmp_path: Any) -> None:
    model, opt = _model()
    with pitstop.CheckpointManager(bucket.url(), keep_last=5) as ckpt:
        for step in (1, 2, 3):
            _train(model, opt, step)
            ckpt.save(step, {"model": model, "opt": opt})
    cli = [os.path.join(os.path.dirname(sys.executable), "pitstop")]
    env = bucket.env()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=120)

    ls = run("ls", bucket.url())
    assert ls.returncode == 0, ls.stderr
    assert all(f"{s}" in ls.stdout for s in ("1", "2", "3"))
    assert run("inspect", bucket.url()).returncode == 0
    ok = run("verify", bucket.url())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    diff = run("diff", f"{bucket.url()}/step-0000000001", f"{bucket.url()}/step-0000000003")
    assert diff.returncode in (0, 1), diff.stderr
    assert "differ" in diff.stdout
    out = tmp_path / "model.pt"
    exp = run("export", bucket.url(), str(out), "--to", "torch", "--step", "3")
    assert exp.returncode == 0, exp.stderr
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["model"]["2.bias"], model.state_dict()["2.bias"])
    part = next(k for k in bucket.list_keys("run/step-0000000003/rank-00000.bin/"))
    raw = bytearray(bucket.get(part))
    raw[7] ^= 1
    bucket.put(part, bytes(raw))
    bad = run("verify", bucket.url())
    assert bad.returncode == 1 and "step-0000000003" in bad.stdout + bad.stderr
    bucket.put("run/step-0000000009/rank-00000.bin/0000000000000000", b"debris")
    dead = {"host": socket.gethostname(), "pid": 2**22 + 77, "time": 0, "token": "t"}
    bucket.put("run/step-0000000009/.owner", json.dumps(dead).encode())  # a killed save's
    bucket.put("run/step-0000000010/rank-00000.bin/0000000000000000", b"someone's, now")
    gc = run("gc", bucket.url(), "--min-age", "0")
    assert gc.returncode == 0, gc.stdout + gc.stderr
    assert not any("step-0000000009" in k for k in bucket.list_keys("run/"))
    assert any("step-0000000010" in k for k in bucket.list_keys("run/"))  # young: kept
    assert "no locks on" in gc.stdout  # and why
    empty = run("ls", f"s3://{bucket.name}/nothing-here")
    assert empty.returncode == 2 and "no objects under this prefix" in empty.stderr


def test_a_bucket_that_does_not_exist_is_refused_when_the_manager_is_built(
    bucket: Any, tmp_path: Any
) -> None:
    url = f"s3://{bucket.name}-missing/run"
    with pytest.raises(pitstop.CheckpointIOError, match="NoSuchBucket"):
        pitstop.CheckpointManager(url)
    with pytest.raises(pitstop.CheckpointIOError, match="NoSuchBucket"):
        pitstop.CheckpointManager([pitstop.Local(tmp_path / "l" / "{node}"), pitstop.Shared(url)])
    assert not (tmp_path / "l").exists()


def test_a_key_the_client_cannot_list_is_named_with_what_to_do(bucket: Any) -> None:
    pitstop.save(bucket.url(), {"w": torch.ones(3)}, step=1)
    bucket.put("run/step-0000000001//odd", b"x")
    with pytest.raises(pitstop.CheckpointError, match="delete that object"):
        pitstop.load(bucket.url(), {"w": torch.zeros(3)})


def test_a_restart_never_starts_from_scratch_when_a_level_cannot_be_listed(
    flaky_bucket: Any, tmp_path: Any
) -> None:
    """The bucket holds the newest steps, the node's disk is new (empty), the bucket is out
    of reach at restore: an error, not a silent restart from step 0."""
    bucket = flaky_bucket
    assert bucket.proxy is not None
    levels = [pitstop.Local(tmp_path / "local" / "{node}"), pitstop.Shared(bucket.url(), every=1)]
    with pitstop.CheckpointManager(levels) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)})
        ckpt.flush()
    import shutil

    shutil.rmtree(tmp_path / "local")
    io = IOOptions(retries=1)
    storage = ObjectStorage(bucket.url(), io)
    with pitstop.CheckpointManager([levels[0], pitstop.Shared(storage, every=1)]) as ckpt:
        bucket.proxy.dead = True
        with pytest.raises(pitstop.CheckpointIOError, match="does not start from scratch"):
            ckpt.restore({"w": torch.zeros(3)})
        bucket.proxy.dead = False
        out = {"w": torch.zeros(3)}
        assert ckpt.restore(out) == 1 and torch.equal(out["w"], torch.ones(3))


def test_export_to_a_url_and_crashtest_in_a_bucket_are_refused(bucket: Any, tmp_path: Any) -> None:
    pitstop.save(bucket.url(), {"w": torch.ones(3)}, step=1)
    cli = os.path.join(os.path.dirname(sys.executable), "pitstop")
    env = bucket.env()
    exp = subprocess.run(
        [cli, "export", bucket.url(), f"s3://{bucket.name}/out.pt", "--to", "torch"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert exp.returncode == 2 and "export writes a local file" in exp.stderr
    ct = subprocess.run(
        [cli, "crashtest", "--workdir", bucket.url("ct"), "--", "python", "x.py", "{dir}"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert ct.returncode == 2 and "local directory" in ct.stderr, ct.stderr
    assert os.listdir(tmp_path) == []
    assert not bucket.list_keys("ct/")
