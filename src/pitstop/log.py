"""The ``pitstop`` logger; its level comes from PITSTOP_LOG_LEVEL (read in options)."""

from __future__ import annotations

import logging

from pitstop.options import env_log_level

__all__ = ["get_logger"]

_configured = False


def get_logger(name: str = "pitstop") -> logging.Logger:
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
    return root if name == "pitstop" else root.getChild(name.removeprefix("pitstop."))
