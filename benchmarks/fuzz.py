"""Fuzz campaign over damaged and hostile checkpoint metadata (manifest.json, objects files).

    python benchmarks/fuzz.py --cases 4000 --seed 0     # the full run (about 10 minutes on 2 cores)
    python benchmarks/fuzz.py --quick                   # 200 cases
    python benchmarks/fuzz.py --seed 0 --case 17 --case 25   # replay single cases

Each case copies a pristine root of two committed steps, damages step 2's metadata with
one mutation (random bytes; permuted, retyped, huge, long, deeply nested, duplicated,
removed, extra or changed fields, sealed or not; special files; a step directory that is
a symlink out of the root) and runs one operation (restore, load, verify, ls, inspect) in
a persistent worker process with a per-case timeout and a 4 GiB address-space limit. See
``tests/fuzzing`` (the engine, kept with the tests) for the categories.

It prints the counts per category and per mutation family, the first failures of each
bad category with their mutation, and a final JSON line. Exit code 1 if any case is in a
bad category (wrong_value, half_restore, non_pitstop_exception, hang, crash, memory,
outside_modified, harness_error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from fuzzing import BAD, CampaignResult, CaseResult, run_campaign

ORDER = ("ok_newest", "ok_fallback", "forged_value", "pitstop_error", "cli_exit_0", "cli_exit_1", "cli_exit_2")  # fmt: skip
SHORT = {
    "ok_newest": "newest", "ok_fallback": "fallbk", "forged_value": "forged",
    "pitstop_error": "p.err", "cli_exit_0": "cli0", "cli_exit_1": "cli1", "cli_exit_2": "cli2",
    "wrong_value": "WRONG", "half_restore": "HALF", "non_pitstop_exception": "EXC",
    "hang": "HANG", "crash": "CRASH", "memory": "MEM", "outside_modified": "OUTSIDE",
    "harness_error": "HARNESS",
}  # fmt: skip


def _columns(counts: Counter[str]) -> list[str]:
    bad = sorted(c for c in counts if c in BAD)
    return [c for c in ORDER if c in counts] + bad + sorted(set(counts) - set(ORDER) - BAD)


def print_report(result: CampaignResult, show: int) -> None:
    counts = result.counts
    total = len(result.results)
    print(f"\n{total} cases in {result.secs:.0f} s")
    print(f"{'CATEGORY':24} {'CASES':>6}")
    for category in _columns(counts):
        mark = "  <- failure" if category in BAD else ""
        print(f"{category:24} {counts[category]:6d}{mark}")
    for category in sorted(BAD - set(counts)):
        print(f"{category:24} {0:6d}")

    columns = _columns(counts)
    print(f"\n{'FAMILY':22} {'CASES':>5} " + " ".join(f"{SHORT.get(c, c)[:7]:>7}" for c in columns))
    for family, c in sorted(result.by_family().items()):
        cells = " ".join(f"{c[k]:7d}" if c[k] else f"{'.':>7}" for k in columns)
        print(f"{family:22} {sum(c.values()):5d} {cells}")

    by_op: dict[str, Counter[str]] = {}
    for r in result.results:
        by_op.setdefault(r.op, Counter())[r.category] += 1
    print(f"\n{'OP':22} {'CASES':>5} " + " ".join(f"{SHORT.get(c, c)[:7]:>7}" for c in columns))
    for op, c in sorted(by_op.items()):
        cells = " ".join(f"{c[k]:7d}" if c[k] else f"{'.':>7}" for k in columns)
        print(f"{op:22} {sum(c.values()):5d} {cells}")

    forged = [r for r in result.results if r.category == "forged_value"]
    if forged:
        print(
            f"\nforged_value: {len(forged)} case(s), not failures (a sealed edit that makes a "
            f"consistent checkpoint of other values); the first {min(show, len(forged))}:"
        )
        for r in forged[:show]:
            _print_case(r)
    failures = result.failures
    for category in sorted({r.category for r in failures}):
        these = [r for r in failures if r.category == category]
        print(f"\n{category}: {len(these)} case(s); the first {min(show, len(these))}:")
        for r in these[:show]:
            _print_case(r)


def _print_case(r: CaseResult) -> None:
    print(f"  #{r.index} {r.op} ({r.secs:.1f} s): {r.mutation[:160]}")
    print(f"      -> {r.category}: {r.message[:400]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per case")
    parser.add_argument("--quick", action="store_true", help="200 cases")
    parser.add_argument("--case", type=int, action="append", help="replay only this case number")
    parser.add_argument("--show", type=int, default=5, help="failures shown per category")
    parser.add_argument("--workdir", help="where the temporary roots go (default: $TMPDIR)")
    args = parser.parse_args(argv)
    cases = 200 if args.quick else args.cases
    total = len(args.case) if args.case else cases
    print(
        f"fuzz: {total} cases, seed {args.seed}, {args.workers} workers, "
        f"timeout {args.timeout:g} s per case",
        flush=True,
    )
    t0 = time.perf_counter()
    step = max(1, total // 10)

    def progress(r: CaseResult, done: int, total: int) -> None:
        if args.case:
            _print_case(r)
        elif r.bad or done % step == 0 or done == total:
            bad = f"  [{r.category} #{r.index} {r.op}: {r.mutation[:90]}]" if r.bad else ""
            print(f"  {done}/{total} done, {time.perf_counter() - t0:.0f} s{bad}", flush=True)

    result = run_campaign(
        cases, args.seed, workers=args.workers, timeout=args.timeout,
        indices=args.case, progress=progress, workdir=args.workdir,
    )  # fmt: skip
    print_report(result, args.show)
    counts = result.counts
    bad = {c: counts.get(c, 0) for c in sorted(BAD)}
    print(
        json.dumps(
            {
                "benchmark": "fuzz",
                "cases": len(result.results),
                "seed": args.seed,
                "secs": round(result.secs, 1),
                "counts": dict(sorted(counts.items())),
                "bad": bad,
                "ok": not any(bad.values()),
            }
        )
    )
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
