"""RNGState: the random number streams of a process, as a Stateful restored last."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RNGState"]


class RNGState:
    """Captures and restores Python ``random``, NumPy's global generator, torch's CPU
    generator and, where CUDA is initialized, every CUDA device's generator.

    Put one in the state (``state["rng"] = pitstop.RNGState()``). It is restored
    after everything else (``restore_last``), so that nothing a restore does
    (building tensors, loading a sampler) consumes random numbers after it.
    Under torch.distributed each rank saves and restores its own streams.
    """

    restore_last = True

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        np = _numpy()
        if np is not None:
            state["numpy"] = np.random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        torch.set_rng_state(state["torch"].contiguous())
        np = _numpy()
        if "numpy" in state and np is not None:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, keys, pos, has_gauss, cached))
        if "cuda" in state and torch.cuda.is_available():
            saved = state["cuda"]
            if len(saved) != torch.cuda.device_count():
                raise ValueError(
                    f"checkpoint has CUDA RNG state for {len(saved)} devices, this process sees "
                    f"{torch.cuda.device_count()}"
                )
            torch.cuda.set_rng_state_all([t.contiguous() for t in saved])


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return None
    return numpy
