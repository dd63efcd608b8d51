"""ObjectStorage's lifecycle on fsspec's in-process ``memory://`` file system (no server: the
fast tier): commit last and conditional, parts, damage, debris, retention, markers, and the
conformance with a directory root where users see the same behaviour."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import torch

pytest.importorskip("fsspec")

import pitstop
from pitstop.format.names import MANIFEST
from pitstop.options import IOOptions
from pitstop.storage.object_store import ObjectStorage


@pytest.fixture
def url() -> str:
    return f"memory://pitstop-tests/{uuid.uuid4().hex[:10]}"


def _keys(storage: ObjectStorage, directory: str) -> list[str]:
    return sorted(o.key for o in storage.client.scan(f"{directory}/"))


def test_save_restore_and_retention_on_memory_urls(url: str) -> None:
    states = [{"w": torch.randn(5000) * i, "n": i} for i in range(4)]
    with pitstop.CheckpointManager(url, keep_last=2) as ckpt:
        for i, st in enumerate(states):
            ckpt.save(i, st)
    storage = ObjectStorage(url)
    assert [e for e in storage.entries() if e.startswith("step-")] == [
        "step-0000000002", "step-0000000003",
    ]  # fmt: skip
    out = {"w": torch.zeros(5000), "n": 0}
    assert pitstop.load(url, out) == 3 and torch.equal(out["w"], states[3]["w"])
    assert pitstop.load(f"{url}/step-0000000002", out) == 2 and out["n"] == 2


def test_a_file_is_its_parts_and_a_gap_or_overlap_is_damage(url: str) -> None:
    io = IOOptions(chunk_bytes=64 * 1024)
    storage = ObjectStorage(url, io, part_bytes=16 * 1024)
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    with pitstop.CheckpointManager(storage) as ckpt:
        ckpt.save(1, state)
    parts = [k for k in _keys(storage, "step-0000000001") if "/rank-00000.bin/" in k]
    assert len(parts) >= 20
    size = storage.file_size("step-0000000001", "rank-00000.bin")
    buf = bytearray(size)
    reader = storage.open_data("step-0000000001", "rank-00000.bin")
    assert reader.read_into(0, memoryview(buf)) == size  # one read across every part
    assert reader.read_into(size - 10, memoryview(bytearray(100))) == 10  # short at the end
    storage.client.delete([parts[3]])
    with pytest.raises(pitstop.CorruptCheckpointError, match="part at byte"):
        storage.file_size("step-0000000001", "rank-00000.bin")
    out = {"w": torch.zeros(100_000)}
    with pytest.raises(pitstop.CorruptCheckpointError):
        pitstop.load(url, out)


def test_commit_is_last_and_never_replaces_a_manifest(url: str) -> None:
    storage = ObjectStorage(url)
    token = storage.prepare("step-0000000005")
    assert token
    storage.write_object("step-0000000005", "objects-00000.json", b"{}")
    assert not storage.has_manifest("step-0000000005")
    storage.commit("step-0000000005", b"manifest-1")
    with pytest.raises(pitstop.CheckpointExistsError):
        storage.commit("step-0000000005", b"manifest-2")
    assert storage.read_manifest("step-0000000005") == b"manifest-1"
    storage.prepare("step-0000000005")  # a manifest that does not parse: damaged, moved aside
    assert any(e.startswith(".damaged-step-0000000005-") for e in storage.entries())
    with pitstop.CheckpointManager(url) as ckpt:
        ckpt.save(6, {"w": torch.ones(2)})
    with pytest.raises(pitstop.CheckpointExistsError, match="already committed"):
        storage.prepare("step-0000000006")


def test_debris_of_a_dead_save_is_cleared_by_the_next_save_of_that_step(url: str) -> None:
    storage = ObjectStorage(url)
    storage.prepare("step-0000000007")
    storage.write_object("step-0000000007", "objects-00000.json", b"half")  # then killed:
    owner = json.loads(storage.client.get("step-0000000007/.owner", 4096))
    owner["pid"] = 2**22 + 4321  # (a process that no longer exists)
    storage.client.put("step-0000000007/.owner", json.dumps(owner).encode())
    with pitstop.CheckpointManager(url) as ckpt:
        ckpt.save(7, {"w": torch.ones(3)})
    out = {"w": torch.zeros(3)}
    assert pitstop.load(url, out) == 7 and torch.equal(out["w"], torch.ones(3))


def test_another_savers_claim_is_refused_by_join(url: str) -> None:
    a, b = ObjectStorage(url), ObjectStorage(url)
    token = a.prepare("step-0000000001")
    b.join("step-0000000001", token)  # the same claim: fine
    with pytest.raises(pitstop.CheckpointExistsError, match="no longer"):
        b.join("step-0000000001", "another-token")


def test_markers_round_trip_and_bad_ones_read_as_unreadable(url: str) -> None:
    storage = ObjectStorage(url)
    with pitstop.CheckpointManager(url) as ckpt:
        ckpt.save(1, {"w": torch.ones(3)})
    storage.mark("step-0000000001", "damaged", '{"why": "test"}')
    assert storage.read_markers("step-0000000001")["damaged"] == {"why": "test"}
    storage.client.put("step-0000000001/ABANDONED", b"not json{")
    marks = storage.read_markers("step-0000000001")
    assert "not JSON" in str(marks["abandoned"])
    storage.unmark("step-0000000001", "damaged")
    assert "damaged" not in storage.read_markers("step-0000000001")


def test_names_that_leave_the_root_are_refused(url: str) -> None:
    storage = ObjectStorage(url)
    for bad in ("../x", "a/b", "", "."):
        with pytest.raises(pitstop.UnsafePathError):
            storage.has_manifest(bad)
    with pytest.raises(pitstop.UnsafePathError):
        storage.read_object("step-0000000001", "../../other/manifest.json")


def test_a_missing_manifest_is_not_found_and_a_huge_object_is_refused(url: str) -> None:
    storage = ObjectStorage(url, IOOptions(max_metadata_bytes=1000))
    with pytest.raises(pitstop.CheckpointNotFoundError):
        storage.read_manifest("step-0000000001")
    storage.client.put("step-0000000001/objects-00000.json", b"x" * 5000)
    with pytest.raises(pitstop.CorruptCheckpointError, match="limit"):
        storage.read_object("step-0000000001", "objects-00000.json")
    assert MANIFEST == "manifest.json"


def test_a_rename_moves_every_object_and_the_manifest_last(url: str) -> None:
    storage = ObjectStorage(url)
    with pitstop.CheckpointManager(url) as ckpt:
        ckpt.save(3, {"w": torch.ones(3)})
    storage.rename("step-0000000003", ".damaged-step-0000000003-abc")
    assert not storage.has_manifest("step-0000000003")
    assert storage.has_manifest(".damaged-step-0000000003-abc")
    assert storage.entry_kind("step-0000000003") == "missing"


def test_client_choice_and_bad_urls() -> None:
    with pytest.raises(ValueError, match="obstore' or 'fsspec"):
        ObjectStorage("memory://x/y", client="boto")
    with pytest.raises(pitstop.UnsupportedSetupError, match="no installed file system|cannot"):
        ObjectStorage("nosuchscheme://bucket/run")


def test_the_default_client_is_obstore_for_s3_and_fsspec_for_memory(monkeypatch: Any) -> None:
    pytest.importorskip("obstore")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    assert type(ObjectStorage("s3://bucket/run").client).__name__ == "ObstoreClient"
    assert type(ObjectStorage("memory://bucket/run").client).__name__ == "FsspecClient"
    pytest.importorskip("s3fs")
    chosen = ObjectStorage("s3://bucket/run", client="fsspec").client
    assert type(chosen).__name__ == "FsspecClient"


# ------------------------------------------------------------------ hostile review findings
def test_a_save_whose_files_were_removed_meanwhile_is_not_committed(url: str) -> None:
    """Another process's gc (no locks on an object store) removed a save's parts while it
    wrote: the commit checks and refuses; the save never returns for a broken checkpoint."""
    storage = ObjectStorage(url)
    with pitstop.CheckpointManager(url) as ckpt:
        ckpt.save(1, {"w": torch.ones(1000)})

    class Remover(ObjectStorage):
        def commit(self, directory: str, manifest: bytes) -> None:
            parts = [k for k in _keys(self, directory) if "/rank-00000.bin/" in k]
            self.client.delete(parts)  # what a gc elsewhere did
            super().commit(directory, manifest)

    with (
        pytest.raises(pitstop.CheckpointIOError, match="missing or incomplete at commit"),
        pitstop.CheckpointManager(Remover(url)) as ckpt,
    ):
        ckpt.save(2, {"w": torch.ones(1000) * 2})
    assert not storage.has_manifest("step-0000000002")
    out = {"w": torch.zeros(1000)}
    assert pitstop.load(url, out) == 1 and torch.equal(out["w"], torch.ones(1000))


def test_a_save_whose_claim_was_taken_commits_nothing(url: str) -> None:
    """Two jobs on one prefix: the second takes over the step (the first's host cannot be
    asked whether it lives); the first finds its claim gone at commit."""
    a, b = ObjectStorage(url), ObjectStorage(url)
    a.prepare("step-0000000003")
    owner = json.loads(a.client.get("step-0000000003/.owner", 4096))
    owner["host"] = "another-host"  # liveness unknowable: taken over
    a.client.put("step-0000000003/.owner", json.dumps(owner).encode())
    b.prepare("step-0000000003")
    a._tokens["step-0000000003"] = owner["token"]
    with pytest.raises(pitstop.CheckpointExistsError, match="claim is gone"):
        a.commit("step-0000000003", b"{}")
    assert not a.has_manifest("step-0000000003")


def test_a_live_writer_on_this_host_is_never_taken_over(url: str) -> None:
    a, b = ObjectStorage(url), ObjectStorage(url)
    a.prepare("step-0000000004")  # this very process: alive
    with pytest.raises(pitstop.CheckpointExistsError, match="being written by another process"):
        b.prepare("step-0000000004")


def test_debris_of_a_dead_process_is_old_at_once_a_live_ones_is_young(url: str) -> None:
    storage = ObjectStorage(url)
    storage.prepare("step-0000000005")
    assert storage.mtime("step-0000000005") >= time.time() - 1  # alive: in use now
    owner = json.loads(storage.client.get("step-0000000005/.owner", 4096))
    owner["pid"] = 2**22 + 12345  # no such process
    storage.client.put("step-0000000005/.owner", json.dumps(owner).encode())
    assert storage.mtime("step-0000000005") == 0.0
    with pitstop.CheckpointManager(url) as ckpt:
        report = ckpt.gc()
    assert "step-0000000005" not in storage.entries(), report


def test_a_huge_manifest_is_damage_and_restore_falls_back(url: str) -> None:
    with pitstop.CheckpointManager(url, keep_last=3) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)})
        ckpt.save(2, {"w": torch.ones(8) * 2})
    storage = ObjectStorage(url, IOOptions(max_metadata_bytes=4096))
    storage.client.put("step-0000000002/manifest.json", b" " * 10_000)
    with pytest.raises(pitstop.CorruptCheckpointError, match="max_metadata_bytes"):
        storage.read_manifest("step-0000000002")
    out = {"w": torch.zeros(8)}
    with pitstop.CheckpointManager(storage) as ckpt:
        assert ckpt.restore(out) == 1
    assert torch.equal(out["w"], torch.ones(8))


@pytest.mark.parametrize(
    "bad",
    ["memory://b/exp#2", "memory://b/exp?v=1", "memory://b/e%78p", "memory://b/x/../exp",
     "memory://b/a//b", "memory://b/./a", "s3:///run"],
)  # fmt: skip
def test_urls_that_do_not_name_one_literal_prefix_are_refused(bad: str) -> None:
    with pytest.raises(pitstop.UnsupportedSetupError, match="plain prefix"):
        ObjectStorage(bad)


def test_a_step_removed_while_read_is_not_called_damage(url: str) -> None:
    with pitstop.CheckpointManager(url) as ckpt:
        ckpt.save(1, {"w": torch.randn(50_000)})
    storage = ObjectStorage(url)
    reader = storage.open_data("step-0000000001", "rank-00000.bin")
    storage.uncommit("step-0000000001")  # retention elsewhere: manifest first, then files
    storage.remove("step-0000000001")
    with pytest.raises(pitstop.CheckpointNotFoundError, match="removed"):
        reader.read_into(0, memoryview(bytearray(4096)))


def test_a_scan_lists_the_root_once_not_once_per_entry(url: str) -> None:
    with pitstop.CheckpointManager(url, keep_last=10) as ckpt:
        for step in range(1, 9):
            ckpt.save(step, {"w": torch.ones(4) * step})
    storage = ObjectStorage(url)
    calls = []
    real = storage.client.list_dirs
    storage.client.list_dirs = lambda: calls.append(1) or real()  # type: ignore[method-assign]
    with pitstop.CheckpointManager(storage) as ckpt:
        assert ckpt.restore({"w": torch.zeros(4)}) == 8
    assert len(calls) <= 4, len(calls)


def test_secrets_in_server_errors_are_removed() -> None:
    from pitstop.storage.clients import _short

    body = (
        'Server returned non-2xx status code: 403 Forbidden: <?xml version="1.0"?><Error>'
        "<Code>ExpiredToken</Code><Message>The provided token has expired.</Message>"
        "<Token-0>FQoGZXIvYXdzEJr-SESSION-TOKEN</Token-0></Error> http://h/k?X-Amz-Signature=abc"
    )
    said = _short(Exception(body))
    assert said == "ExpiredToken: The provided token has expired. (HTTP 403)"
    from pitstop.storage.clients import scrub

    assert "SESSION-TOKEN" not in scrub(body) and "abc" not in scrub(body)


def test_http_settings_given_with_the_config_do_not_crash_the_client() -> None:
    pytest.importorskip("obstore")
    storage = ObjectStorage(
        "s3://bucket/run",
        options={"endpoint": "http://127.0.0.1:9", "allow_http": True, "timeout": "5s",
                 "access_key_id": "a", "secret_access_key": "b"},
    )  # fmt: skip
    assert type(storage.client).__name__ == "ObstoreClient"
    with pytest.raises(pitstop.UnsupportedSetupError, match="cannot set up"):
        ObjectStorage("s3://bucket/run", options={"no_such_option": 1})


def test_a_storage_built_by_hand_writes_parts_of_an_object_store_size(url: str) -> None:
    """Not a disk's defaults: 8 writer threads, 16 MiB extents, and parts of at most 16 MiB
    even with 64 MiB extents given."""
    assert ObjectStorage(url).io.threads == 8
    assert ObjectStorage(url).io.chunk_bytes == 16 * 1024 * 1024
    storage = ObjectStorage(url, IOOptions(chunk_bytes=64 * 1024 * 1024))
    state = {"w": torch.zeros(40 * 1024 * 1024 // 4)}
    with pitstop.CheckpointManager(storage) as ckpt:
        ckpt.save(1, state)
    sizes = [o.size for o in storage.client.scan("step-0000000001/rank-00000.bin/")]
    assert len(sizes) == 3 and max(sizes) <= 16 * 1024 * 1024
    out = {"w": torch.ones(40 * 1024 * 1024 // 4)}
    assert pitstop.load(url, out) == 1 and torch.equal(out["w"], state["w"])
