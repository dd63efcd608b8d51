"""When to checkpoint: small policy objects with one decision method, ``decide(ctx)``.

Policies are pure: no I/O, no clock, no torch. The manager (``ckpt.step``) and
the failure simulator build the same :class:`PolicyContext` from their
measurements and drive the very same objects.

====================  ==========================================================
``EveryN(n)``         every n iterations
``EveryEpoch()``      at the end of every epoch
``Every(secs=...)``   every so many seconds of training
``YoungDaly(mtbf)``   Daly's exact optimum from the measured cost and the MTBF
``CheckFreq(0.02)``   the smallest interval whose overhead stays under a budget
``ValueAware(mtbf)``  dense early, sparse late, from the fitted loss curve (COCI)
``a | b``             when any of them says so (``AnyPolicy(a, b, ...)``)
====================  ==========================================================

What to keep is a policy too (:mod:`pitstop.policy.retention`): ``KeepLast``,
``KeepEvery``, ``KeepBest``, combined with ``|`` the same way (``KeepAny``). Both kinds
are exported from ``pitstop`` too.
"""

from typing import Any as _Any

from pitstop.policy.base import CheckpointPolicy, PolicyContext, Schedule
from pitstop.policy.checkfreq import CheckFreq
from pitstop.policy.fixed import AnyPolicy, Every, EveryEpoch, EveryN
from pitstop.policy.retention import (
    CheckpointInfo,
    KeepAny,
    KeepBest,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
)
from pitstop.policy.theory import daly_higher_order, daly_optimum, lambert_w0, young_interval
from pitstop.policy.value import LossCurve, ValueAware
from pitstop.policy.youngdaly import YoungDaly

__all__ = [
    "AnyPolicy",
    "CheckFreq",
    "CheckpointInfo",
    "CheckpointPolicy",
    "Every",
    "EveryEpoch",
    "EveryN",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "LossCurve",
    "PolicyContext",
    "RetentionPolicy",
    "Schedule",
    "ValueAware",
    "YoungDaly",
    "daly_higher_order",
    "daly_optimum",
    "lambert_w0",
    "young_interval",
]


def __getattr__(name: str) -> _Any:
    if name == "Any":  # it shadowed typing.Any
        import warnings

        warnings.warn(
            "pitstop.policy.Any is deprecated: combine policies with | (EveryN(100) | "
            "EveryEpoch()) or use pitstop.policy.AnyPolicy",
            DeprecationWarning,
            stacklevel=2,
        )
        return AnyPolicy
    raise AttributeError(f"module 'pitstop.policy' has no attribute {name!r}")
