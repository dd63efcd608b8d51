"""Failure simulator: compare checkpoint policies on a model of your job, without torch.

::

    from pitstop.sim import JobModel, FailureModel, simulate, compare
    job = JobModel.for_hours(72, iter_secs=0.5, stall_secs=0.05, persist_secs=0.7)
    failures = FailureModel.per_node(mtbf_hours_per_node=4 * 64, nodes=64)
    table = compare(job, failures, {"CheckFreq": CheckFreq(), "Daly": YoungDaly(3600)}, seeds=10)
"""

from pitstop.sim.compare import PolicySummary, compare, default_policies
from pitstop.sim.engine import RunResult, simulate
from pitstop.sim.model import (
    FailureClass,
    FailureModel,
    JobModel,
    LossModel,
    TooManyFailures,
    load_profile,
    load_trace,
)

__all__ = [
    "FailureClass",
    "FailureModel",
    "JobModel",
    "LossModel",
    "PolicySummary",
    "RunResult",
    "TooManyFailures",
    "compare",
    "default_policies",
    "load_profile",
    "load_trace",
    "simulate",
]
