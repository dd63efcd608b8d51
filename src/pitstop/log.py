"""The ``pitstop`` logger. Every record names the rank and the phase:

    2026-11-22 06:41:02 pitstop.engine INFO [rank 0] commit: checkpoint step=1200 bytes=... GB/s

Call sequence: modules call ``get_logger(__name__)`` once and log with
``phase="persist"`` (a phase name of DESIGN: plan, stage, persist, commit, verify,
restore, gc). PITSTOP_LOG_LEVEL (read in ``options``) sets the level and adds a
stderr handler; without it, records go wherever the application's logging sends them.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from pitstop.options import env_log_level, env_rank

__all__ = ["PhaseLogger", "get_logger"]

_configured = False


def _current_rank() -> int:
    return env_rank()


class PhaseLogger(logging.LoggerAdapter):
    """Adds ``rank`` and ``phase`` to each record (as attributes and in the message)."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        phase = kwargs.pop("phase", "-")
        rank = _current_rank()
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "rank": rank, "phase": phase}
        return f"[rank {rank}] {phase}: {msg}", kwargs


def get_logger(name: str = "pitstop") -> PhaseLogger:
    """A child of the ``pitstop`` logger, configured once from PITSTOP_LOG_LEVEL."""
    global _configured
    root = logging.getLogger("pitstop")
    if not _configured:
        _configured = True
        level = env_log_level()
        if level is not None:
            root.setLevel(level)
            if not root.handlers:
                handler = logging.StreamHandler()
                handler.setFormatter(
                    logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s")
                )
                root.addHandler(handler)
    logger = root if name == "pitstop" else root.getChild(name.removeprefix("pitstop."))
    return PhaseLogger(logger, {})
