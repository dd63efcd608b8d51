"""StorageWrapper: the base of storages that wrap another one and intercept its calls.

A subclass implements ``_call(name, fn)``, which returns what stands for the inner
storage's method ``name`` (``fn``); ``url`` and ``io`` and everything else pass through.
:class:`~pitstop.storage.retry.RetryingStorage` retries; the test doubles in
``pitstop.testing`` fail or hold calls.

Call sequence: as :class:`~pitstop.storage.base.Storage`, from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StorageWrapper"]


class StorageWrapper:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def url(self) -> str:
        return str(self.inner.url)

    @property
    def io(self) -> Any:
        return self.inner.io

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        return self._call(name, attr) if callable(attr) else attr

    def _call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn
