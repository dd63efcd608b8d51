"""Copies between levels stream through bounded buffers: the peak host memory of a flush, a
partner copy or XOR parity, a rebuild and a fetch from the shared level of a state four
times ``host_memory_bytes`` stays within about ``host_memory_bytes``; and what they write
is byte for byte what the multi-level format says (the parity of docs/format.md, partner
copies equal to their files, rebuilt files equal to the lost ones).

Peak memory is the growth of the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the operation; ``ru_maxrss`` where that is refused),
measured in the spawned rank processes; the state and the save's ring are allocated before
the reset, so only what the operation adds counts.
"""

from __future__ import annotations

import filecmp
import json
import os
import resource
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pitstop
from pitstop.format.checksum import get_checksum
from pitstop.format.manifest import Manifest, manifest_digest
from pitstop.options import ALIGN_BYTES, IOOptions, SaveOptions
from pitstop.testing.distributed import run_ranks

pytestmark = pytest.mark.dist

MIB = 1 << 20
HOST = 64 * MIB  # host_memory_bytes: the smallest allowed
STATE = 4 * HOST  # per rank: four times host_memory_bytes
ALLOWANCE = 32 * MIB  # threads, the interpreter, the allocator's slack, a restore's buffers
LIMIT = HOST * 3 // 2 + ALLOWANCE
TIMEOUT = 120.0
STEP = "step-0000000001"


# --------------------------------------------------------------------------- measuring
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _growth(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(how far ``fn()`` raised this process's peak RSS above its RSS before, its value)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        base, peak = _status("VmRSS"), lambda: _status("VmHWM")
    except OSError:  # peak so far instead: an underestimate, never an overestimate
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    value = fn()
    return peak() - base, value


def _state(rank: int, nbytes: int = STATE) -> dict[str, torch.Tensor]:
    """Each rank's own tensors (four of them), different on every rank."""
    g = torch.Generator().manual_seed(rank + 1)
    return {f"t{i}": torch.rand(nbytes // 16, generator=g) for i in range(4)}


def _manager(base: str, levels: list[Any], nodes: list[str], **io: Any) -> Any:
    options = SaveOptions(host_memory_bytes=HOST, dist_timeout_secs=TIMEOUT, io=IOOptions(**io))
    return pitstop.CheckpointManager(levels, topology=nodes, options=options)


def _local(base: str, scheme: str) -> Any:
    return pitstop.Local(os.path.join(base, "local", "{node}"), redundancy=scheme)


def _shared(base: str, every: int) -> Any:
    return pitstop.Shared(os.path.join(base, "shared"), every=every)


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


# --------------------------------------------------------------------------- flush, fetch
def _flush_and_fetch(rank: int, world: int, base: str) -> dict[str, Any]:
    """Save, flush (measured); lose the local step; restart from the shared level, which
    fetches the step back into the local level (measured: load and fetch)."""
    state = _state(rank)
    levels = [_local(base, "single"), _shared(base, 1000)]
    with _manager(base, levels, ["n0"]) as ckpt:
        ckpt.save(1, state)
        flush, record = _growth(ckpt.flush)
    shutil.move(os.path.join(base, "local", "n0", STEP), os.path.join(base, "lost"))
    with _manager(base, levels, ["n0"]) as ckpt:
        fetch, step = _growth(lambda: ckpt.restore(state))
        level = ckpt.last_restore.level if ckpt.last_restore else None
    return {
        "flush": flush, "flushed": record is not None and record.ok, "fetch": fetch,
        "step": step, "level": level,
    }  # fmt: skip


_RUNS: dict[str, tuple[str, list[dict[str, Any]]]] = {}


def _run(tmp_path_factory: Any, key: str) -> tuple[str, list[dict[str, Any]]]:
    """One run of each kind for the tests of its parts (spawning ranks is what they wait for)."""
    if key not in _RUNS:
        base = str(tmp_path_factory.mktemp(f"memory-{key}"))
        if key == "levels":
            out = run_ranks(_flush_and_fetch, 1, base, timeout_secs=TIMEOUT)
        else:
            out = run_ranks(_protect_and_rebuild, 2, base, key, timeout_secs=TIMEOUT * 2)
        _RUNS[key] = (base, out)
    return _RUNS[key]


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Any:
    yield
    for base, _ in _RUNS.values():
        shutil.rmtree(base, ignore_errors=True)


def test_a_flush_of_a_state_four_times_host_memory_stays_within_it(tmp_path_factory: Any) -> None:
    base, [r] = _run(tmp_path_factory, "levels")
    assert r["flushed"]
    assert r["flush"] < LIMIT, f"a flush of {_mib(STATE)} grew the peak RSS by {_mib(r['flush'])}"
    for name in ("rank-00000.bin", "objects-00000.json"):
        assert filecmp.cmp(
            os.path.join(base, "lost", name), os.path.join(base, "shared", STEP, name),
            shallow=False,
        )  # fmt: skip


def test_a_fetch_from_the_shared_level_stays_within_host_memory(tmp_path_factory: Any) -> None:
    base, [r] = _run(tmp_path_factory, "levels")
    assert (r["step"], r["level"]) == (1, "shared")
    assert r["fetch"] < LIMIT, (
        f"a restart that fetched {_mib(STATE)} grew the peak RSS by {_mib(r['fetch'])}"
    )
    fetched = os.path.join(base, "local", "n0", STEP)
    assert os.path.exists(os.path.join(fetched, "manifest.json"))
    for name in ("rank-00000.bin", "objects-00000.json"):
        assert filecmp.cmp(
            os.path.join(base, "lost", name), os.path.join(fetched, name), shallow=False
        )


# --------------------------------------------------------------------------- partner, xor
def _protect_and_rebuild(rank: int, world: int, base: str, scheme: str) -> dict[str, Any]:
    """Save twice (the second, measured, writes the redundancy), lose node n1's newest step,
    restart (measured: rebuild, protect again, load)."""
    import torch.distributed as dist

    state = _state(rank)
    nodes, levels = ["n0", "n1"], [_local(base, scheme)]
    with _manager(base, levels, nodes) as ckpt:
        ckpt.save(1, state)  # warm-up: the ring, the peer group
        protect, _ = _growth(lambda: ckpt.save(2, state))
    dist.barrier()
    if rank == 1:
        shutil.move(os.path.join(base, "local", "n1", "step-0000000002"), base + "/lost")
    dist.barrier()
    with _manager(base, levels, nodes) as ckpt:
        rebuild, step = _growth(lambda: ckpt.restore(state))
        info = ckpt.last_restore
    return {
        "protect": protect, "rebuild": rebuild, "step": step,
        "level": info.level if info else None, "repaired": info.repaired if info else None,
    }  # fmt: skip


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_a_partner_copy_or_parity_stays_within_host_memory(
    tmp_path_factory: Any, scheme: str
) -> None:
    base, out = _run(tmp_path_factory, scheme)
    for rank, r in enumerate(out):
        assert r["protect"] < LIMIT, (
            f"rank {rank}: a save of {_mib(STATE)} with its {scheme} redundancy grew the peak "
            f"RSS by {_mib(r['protect'])}"
        )
    if scheme == "partner":  # rank 0's copy on n1 (rank 1's on n0 was rewritten by the restart)
        step = os.path.join(base, "local", "{}", "step-0000000002")
        for name in ("rank-00000.bin", "objects-00000.json"):
            assert filecmp.cmp(
                os.path.join(step.format("n0"), name),
                os.path.join(step.format("n1"), f"partner-{name}"),
                shallow=False,
            )


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_a_rebuild_stays_within_host_memory(tmp_path_factory: Any, scheme: str) -> None:
    base, out = _run(tmp_path_factory, scheme)
    for rank, r in enumerate(out):
        assert (r["step"], r["level"]) == (2, "local"), r
        assert r["repaired"] and r["repaired"][0] == "rank 1", r
        assert r["rebuild"] < LIMIT, (
            f"rank {rank}: a restart that rebuilt {_mib(STATE)} ({scheme}) grew the peak RSS "
            f"by {_mib(r['rebuild'])}"
        )
    for name in ("rank-00001.bin", "objects-00001.json"):
        rebuilt = os.path.join(base, "local", "n1", "step-0000000002", name)
        assert filecmp.cmp(os.path.join(base, "lost", name), rebuilt, shallow=False)


# --------------------------------------------------------------------------- the bytes
def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _payload(step_dir: str, manifest: Manifest, rank: int) -> bytes:
    """Rank ``rank``'s payload (docs/format.md): its files in name order, each padded to 4 KiB."""
    out = b""
    for f in sorted((f for f in manifest.files if f.rank == rank), key=lambda f: f.name):
        with open(os.path.join(step_dir, f.name), "rb") as fh:
            data = fh.read()
        out += data + bytes(_align(len(data)) - len(data))
    return out


def _expected_parity(step_dir: str, manifest: Manifest, members: list[int], k: int) -> bytes:
    payloads = {j: _payload(step_dir.format(j), manifest, j) for j in members}
    block = _align(-(-max(len(p) for p in payloads.values()) // (len(members) - 1)))
    parity = bytearray(block)
    for j in members:
        if j == k:
            continue
        others = [m for m in members if m != j]
        padded = payloads[j] + bytes(block * (len(members) - 1) - len(payloads[j]))
        i = others.index(k)
        for at, byte in enumerate(padded[i * block : (i + 1) * block]):
            parity[at] ^= byte
    return bytes(parity)


def _small_state(rank: int) -> dict[str, Any]:
    """Tensors of odd sizes, different on every rank: payloads of different lengths."""
    g = torch.Generator().manual_seed(rank)
    return {
        "a": torch.rand(3000 + 1500 * rank, generator=g),
        "b": torch.randint(0, 255, (7001 * (rank + 1),), dtype=torch.uint8, generator=g),
        "meta": {"rank": rank, "name": "x" * (100 * rank + 1)},
    }


def _save_and_rebuild_small(rank: int, world: int, base: str, scheme: str) -> Any:
    """Save step 1 on three nodes through 4 KiB pieces (many rounds, blocks that straddle
    files), lose node n1's step, restart: rebuilt (and protected again) through the same
    pieces."""
    import torch.distributed as dist

    state = _small_state(rank)
    io = {"read_chunk_bytes": ALIGN_BYTES, "read_buffers": 2}
    levels, nodes = [_local(base, scheme)], ["n0", "n1", "n2"]
    with _manager(base, levels, nodes, **io) as ckpt:
        ckpt.save(1, state)
    dist.barrier()
    if rank == 1:
        shutil.move(os.path.join(base, "local", "n1", STEP), os.path.join(base, "lost"))
    dist.barrier()
    with _manager(base, levels, nodes, **io) as ckpt:
        step = ckpt.restore(state)
        return step, ckpt.last_restore.repaired if ckpt.last_restore else None


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_redundancy_and_rebuilt_files_are_the_bytes_of_the_format(
    tmp_path: Any, scheme: str
) -> None:
    base = str(tmp_path)
    out = run_ranks(_save_and_rebuild_small, 3, base, scheme, timeout_secs=TIMEOUT)
    assert [o[0] for o in out] == [1, 1, 1] and out[0][1][0] == "rank 1", out
    step_dir = os.path.join(base, "local", "n{}", STEP)
    with open(os.path.join(step_dir.format(0), "manifest.json"), "rb") as f:
        manifest = Manifest.loads(f.read(), path=step_dir)
    for entry in (e for e in manifest.files if e.rank == 1):
        rebuilt = os.path.join(step_dir.format(1), entry.name)
        lost = os.path.join(base, "lost", entry.name)
        assert filecmp.cmp(lost, rebuilt, shallow=False), entry.name
    for k in range(3):  # the redundancy the restart wrote again, as the save did
        here = step_dir.format(k)
        if scheme == "partner":  # rank k's node keeps the copy of rank k - 1
            src = (k - 1) % 3
            for entry in (e for e in manifest.files if e.rank == src):
                theirs = os.path.join(step_dir.format(src), entry.name)
                copy = os.path.join(here, f"partner-{entry.name}")
                assert filecmp.cmp(theirs, copy, shallow=False)
            continue
        parity = _expected_parity(step_dir, manifest, [0, 1, 2], k)
        with open(os.path.join(here, f"xor-{k:05d}.bin"), "rb") as f:
            assert f.read() == parity, f"parity of rank {k}"
        with open(os.path.join(here, f"xor-{k:05d}.json"), "rb") as f:
            meta = json.loads(f.read())
        assert meta == {
            "version": 1, "step": 1, "set": [0, 1, 2], "manifest": manifest_digest(manifest),
            "block_bytes": len(parity), "algorithm": manifest.checksum_algorithm,
            "checksum": get_checksum(manifest.checksum_algorithm)(parity),
        }  # fmt: skip


# --------------------------------------------------------------------------- failures
def _partner_that_cannot_read(rank: int, world: int, base: str) -> str:
    """Rank 1 cannot read its own files when it sends its partner copy: rank 0 is told by
    the transfer's last exchange (its link would time out after 5 s otherwise)."""
    from pitstop.levels.redundancy import Member
    from pitstop.levels.spec import Placement
    from pitstop.ranks.group import make_group
    from pitstop.ranks.peers import make_link
    from pitstop.storage.local import LocalStorage
    from pitstop.testing import FaultyStorage

    nodes = ["n0", "n1"]
    with _manager(base, [_local(base, "partner")], nodes) as ckpt:
        ckpt.save(1, _small_state(rank))
    storage: Any = LocalStorage(os.path.join(base, "local", nodes[rank]))
    if rank == 1:
        storage = FaultyStorage(storage, fail={"read_into": [1]})
    with open(os.path.join(base, "local", "n0", STEP, "manifest.json"), "rb") as f:
        manifest = Manifest.loads(f.read(), path=STEP)
    link = make_link(make_group(5.0))
    try:
        placement = Placement(nodes, "partner")
        placement.redundancy.protect(Member(storage, STEP, manifest, placement, link, rank))
        return "ok"
    except pitstop.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        link.close()


def test_a_rank_that_cannot_read_what_it_sends_fails_its_peer_at_once(tmp_path: Any) -> None:
    out = run_ranks(_partner_that_cannot_read, 2, str(tmp_path), timeout_secs=TIMEOUT)
    assert out[1].startswith("CheckpointIOError") and "injected EIO in read_into" in out[1]
    assert out[0].startswith("DistributedCheckpointError"), out[0]
    assert "rank(s) [1] could not read what they sent here" in out[0], out[0]
