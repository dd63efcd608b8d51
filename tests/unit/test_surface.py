"""The manager's public surface: CheckpointManager(root_or_levels, keep_last, *, policy,
retention, options), the hook object integrations use, and what is deprecated (warns, works)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

import pitstop
from pitstop.manager import ManagerHooks


def _state(v: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((4,), v)}


def test_the_constructor_takes_a_root_or_levels_and_policy_retention_options() -> None:
    params = inspect.signature(pitstop.CheckpointManager).parameters
    named = [p for p, v in params.items() if v.kind is not inspect.Parameter.VAR_KEYWORD]
    # main took 15: eight of them copies of SaveOptions / IOOptions fields
    assert named == ["root", "keep_last", "policy", "retention", "options", "topology", "levels"]


def test_option_keywords_are_deprecated_and_still_honoured(root: str) -> None:
    with pytest.warns(DeprecationWarning, match=r"allow_pickle=.*options=pitstop.SaveOptions"):
        ckpt = pitstop.CheckpointManager(root, allow_pickle=True, io_threads=2)
    with ckpt:
        assert ckpt.options.allow_pickle and ckpt.options.io.threads == 2
    with pytest.raises(TypeError, match="'keeplast'"):
        pitstop.CheckpointManager(root, keeplast=3)


def test_a_list_of_levels_is_a_root_and_levels_keyword_is_deprecated(tmp_path: Any) -> None:
    levels = [
        pitstop.Local(tmp_path / "local" / "{node}"),
        pitstop.Shared(tmp_path / "shared", every=1),
    ]
    with pitstop.CheckpointManager(levels, topology=["n0"]) as ckpt:
        ckpt.save(1, _state())
    assert ckpt.flush_records and ckpt.flush_records[-1].ok
    assert os.path.isdir(tmp_path / "shared" / "step-0000000001")
    with pytest.warns(DeprecationWarning, match="list of levels as the root"):
        old = pitstop.CheckpointManager(levels=levels, topology=["n0"])
    with old:
        assert old.latest_step() == 1


def test_internals_are_private_and_reached_through_hooks(root: str) -> None:
    with pitstop.CheckpointManager(root) as ckpt:
        ckpt.save(1, _state())
        assert isinstance(ckpt.hooks, ManagerHooks)
        assert ckpt.hooks.catalog.committed()[0].step == 1
        assert ckpt.hooks.storage.url == ckpt.url and ckpt.hooks.levels.flushers == []
        public = {n for n in vars(ckpt) if not n.startswith("_")}
        assert public == {"retention", "options", "hooks", "last_restore"}  # main: 9
        with pytest.warns(DeprecationWarning, match="ckpt.hooks.catalog"):
            assert ckpt.catalog is ckpt.hooks.catalog  # type: ignore[attr-defined]
        with pytest.warns(DeprecationWarning, match="ckpt.hooks.reached"):
            ckpt.reached(1)
        with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
            ckpt.nonsense  # type: ignore[attr-defined]  # noqa: B018


def test_options_and_a_deprecated_copy_of_one_of_its_fields_is_an_error(root: str) -> None:
    with pytest.raises(ValueError, match="inside options="), pytest.warns(DeprecationWarning):
        pitstop.CheckpointManager(root, options=pitstop.SaveOptions(), allow_pickle=True)


def test_stats_count_from_every_save_and_a_rerun_of_a_finished_run(root: str) -> None:
    state = _state()
    with pitstop.CheckpointManager(root, policy=pitstop.EveryN(10)) as ckpt:
        for step in range(1, 31):
            ckpt.step(step, state)
            if step == 25:
                ckpt.save(25, state)  # outside the policy: still a checkpoint
        assert ckpt.stats().steps_since_checkpoint == 5  # main: 10 (from the policy's 20)
        ckpt.save_final(30, state)
        assert ckpt.stats().steps_since_checkpoint == 0  # main: 10
    with pitstop.CheckpointManager(root, policy=pitstop.EveryN(10)) as ckpt:
        assert ckpt.restore(state) == 30
        assert ckpt.stats().steps_since_checkpoint == 0  # main: -30
