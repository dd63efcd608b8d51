"""Damaged and hostile metadata never gives a wrong value, a hang, a foreign exception or a
half-restore: a short fuzz campaign, and a few named cases that read as sentences.

The full campaign is ``python benchmarks/fuzz.py --cases 4000`` (the engine: tests/fuzzing).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fuzzing import BAD, NAMED, CaseResult, Fuzzer, make_case, named_mutation

pytestmark = pytest.mark.fault

CAMPAIGN_CASES = 80
CAMPAIGN_SEED = 20261123


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzer]:
    with Fuzzer(workers=2, timeout=10.0, workdir=str(tmp_path_factory.mktemp("fuzz"))) as fz:
        yield fz


def _explain(results: list[CaseResult]) -> str:
    return "\n".join(
        f"#{r.index} {r.op}: {r.mutation[:160]}\n    -> {r.category}: {r.message[:300]}"
        for r in results
    )


def test_short_campaign(fuzzer: Fuzzer) -> None:
    result = fuzzer.run(CAMPAIGN_CASES, lambda p, i: make_case(p, CAMPAIGN_SEED, i))
    assert len(result.results) == CAMPAIGN_CASES
    assert len(result.by_family()) >= 8  # a mix of families, not one kind of damage
    failures = result.failures
    counts = {c: n for c, n in result.counts.items() if c in BAD}
    assert not failures, f"{counts}\n{_explain(failures)}"


@pytest.mark.parametrize("op", ["restore", "load", "verify"])
@pytest.mark.parametrize("name", NAMED)
def test_named_case(fuzzer: Fuzzer, name: str, op: str) -> None:
    r = fuzzer.run_one(named_mutation(fuzzer.pristine, name), op)
    assert not r.bad, _explain([r])


def test_swapped_bn_keys_fall_back_to_step_1(fuzzer: Fuzzer) -> None:
    """Weight and bias of the BatchNorm have one shape: swapping their keys in the manifest
    (not resealed) is damage, and restore must give step 1, exactly."""
    r = fuzzer.run_one(named_mutation(fuzzer.pristine, "swap_bn_keys"), "restore")
    assert r.category == "ok_fallback", _explain([r])
