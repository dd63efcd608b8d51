"""Campaigns: a :class:`Fuzzer` (a pristine root and a pool of workers, one driver thread
each, a timeout per case) and :func:`run_campaign`; results per case and per campaign.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fuzzing.cases import Case, Mutation, diff_snapshots, prepare_case, snapshot
from fuzzing.classify import BAD, where
from fuzzing.mutations import make_case
from fuzzing.root import Pristine, make_root
from fuzzing.worker import MEMORY_BYTES, Abort, Worker, WorkerDied

__all__ = ["CampaignResult", "CaseResult", "Fuzzer", "run_campaign"]


@dataclass(frozen=True)
class CaseResult:
    index: int
    op: str
    family: str
    mutation: str
    category: str
    message: str
    secs: float

    @property
    def bad(self) -> bool:
        return self.category in BAD


@dataclass
class CampaignResult:
    results: list[CaseResult] = field(default_factory=list)
    secs: float = 0.0

    @property
    def counts(self) -> Counter[str]:
        return Counter(r.category for r in self.results)

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.bad]

    def by_family(self) -> dict[str, Counter[str]]:
        out: dict[str, Counter[str]] = {}
        for r in self.results:
            out.setdefault(r.family, Counter())[r.category] += 1
        return out


class Fuzzer:
    """A pristine root and a pool of workers, reused across runs (a context manager).

    ``timeout`` bounds each case; ``memory_bytes`` each worker's address space; a worker is
    replaced after a hang, a crash, or ``recycle_every`` cases.
    """

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout: float = 20.0,
        memory_bytes: int = MEMORY_BYTES,
        workdir: str | None = None,
        recycle_every: int = 250,
        startup_secs: float = 180.0,
    ) -> None:
        self.workers, self.timeout, self.memory_bytes = max(1, workers), timeout, memory_bytes
        self.recycle_every, self.startup_secs = recycle_every, startup_secs
        self.base = tempfile.mkdtemp(prefix="pitstop-fuzz-", dir=workdir)
        self._slots: list[Worker | None] = [None] * self.workers
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = 0
        try:
            root = os.path.join(self.base, "pristine")
            self.expected = make_root(root)
            self.pristine = Pristine.read(root)
        except BaseException:
            shutil.rmtree(self.base, ignore_errors=True)
            raise

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker and remove every temporary directory."""
        self._stop.set()
        with self._lock:
            slots, self._slots = self._slots, [None] * self.workers
        for worker in slots:
            if worker is not None:
                worker.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def run(
        self,
        cases: int | Sequence[int],
        make: Callable[[Pristine, int], Case],
        *,
        progress: Callable[[CaseResult, int, int], None] | None = None,
    ) -> CampaignResult:
        """Run ``make(pristine, i)`` for each case number (``range(cases)`` for an int)."""
        indices = list(range(cases)) if isinstance(cases, int) else list(cases)
        todo = iter(indices)
        result = CampaignResult()
        errors: list[BaseException] = []
        t0 = time.perf_counter()

        def drive(slot: int) -> None:
            try:
                while not self._stop.is_set():
                    with self._lock:
                        index = next(todo, None)
                    if index is None:
                        return
                    r = self._run_one(slot, make, index)
                    with self._lock:
                        result.results.append(r)
                        done = len(result.results)
                    if progress is not None:
                        progress(r, done, len(indices))
            except BaseException as e:
                errors.append(e)
                self._stop.set()

        threads = [
            threading.Thread(target=drive, args=(s,), daemon=True) for s in range(self.workers)
        ]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except BaseException:
            self.close()
            raise
        if errors:
            raise errors[0]
        result.results.sort(key=lambda r: r.index)
        result.secs = time.perf_counter() - t0
        return result

    def run_one(self, mutation: Mutation, op: str) -> CaseResult:
        """One case, for tests."""
        return self.run([0], lambda p, i: Case(i, mutation, op)).results[0]

    def _worker(self, slot: int) -> Worker:
        worker = self._slots[slot]
        if worker is not None and worker.cases >= self.recycle_every:
            worker.stop()
            worker = None
        if worker is None:
            self._started += 1
            log = os.path.join(self.base, f"worker-{slot}-{self._started}.log")
            worker = Worker(log, self.expected, self.memory_bytes, self.startup_secs)
            with self._lock:
                if self._stop.is_set():
                    worker.kill()
                    raise Abort("the fuzz campaign was stopped")
                self._slots[slot] = worker
        return worker

    def _discard(self, slot: int) -> None:
        with self._lock:
            worker, self._slots[slot] = self._slots[slot], None
        if worker is not None:
            worker.kill()

    def _run_one(self, slot: int, make: Callable[[Pristine, int], Case], index: int) -> CaseResult:
        t0 = time.perf_counter()
        case_dir = tempfile.mkdtemp(prefix=f"case-{index}-", dir=self.base)
        family, what, op = "?", "?", "?"
        try:
            case = make(self.pristine, index)
            m = case.mutation
            family, what, op = f"{m.family}/{m.target}", m.describe(), case.op
            prepare_case(case_dir, self.pristine, m)
            outside = os.path.join(case_dir, "outside")
            before = snapshot(outside)
            worker = self._worker(slot)
            msg = {
                "root": os.path.join(case_dir, "root"),
                "op": op,
                "forgery": m.forgery,
                "seed": index,
            }
            try:
                answer = worker.call(msg, self.timeout)
            except WorkerDied as e:
                self._discard(slot)
                answer = ("crash", str(e))
            if answer is None:
                self._discard(slot)
                answer = ("hang", f"no answer within {self.timeout:g} s")
            category, message = answer
            changed = diff_snapshots(before, snapshot(outside))
            if changed:
                category, message = "outside_modified", f"{changed} (outcome: {category} {message})"
        except Abort:
            raise
        except Exception as e:
            category, message = "harness_error", f"{type(e).__name__}: {e}{where(e)}"
        finally:
            shutil.rmtree(case_dir, ignore_errors=True)
        secs = time.perf_counter() - t0
        return CaseResult(index, op, family, _printable(what), category, _printable(message), secs)


def _printable(text: str) -> str:
    """``text`` without lone surrogates (a forged key may carry one into a message)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def run_campaign(
    cases: int,
    seed: int,
    workers: int = 2,
    timeout: float = 20.0,
    *,
    indices: Sequence[int] | None = None,
    progress: Callable[[CaseResult, int, int], None] | None = None,
    workdir: str | None = None,
    memory_bytes: int = MEMORY_BYTES,
) -> CampaignResult:
    """``cases`` cases of the campaign ``seed`` (or only ``indices``); see the module docstring."""
    with Fuzzer(workers=workers, timeout=timeout, workdir=workdir, memory_bytes=memory_bytes) as fz:
        return fz.run(
            list(indices) if indices is not None else cases,
            lambda p, i: make_case(p, seed, i),
            progress=progress,
        )
