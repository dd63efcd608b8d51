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
``Any(a, b, ...)``    when any of them says so
====================  ==========================================================

What to keep is a policy too (:mod:`pitstop.policy.retention`): ``KeepLast``,
``KeepEvery``, ``KeepBest``, combined with ``|``.
"""

from pitstop.policy.base import CheckpointPolicy, PolicyContext
from pitstop.policy.checkfreq import CheckFreq
from pitstop.policy.fixed import Any, Every, EveryEpoch, EveryN
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
    "Any",
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
    "ValueAware",
    "YoungDaly",
    "daly_higher_order",
    "daly_optimum",
    "lambert_w0",
    "young_interval",
]
