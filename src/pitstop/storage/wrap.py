"""StorageWrapper: the base of storages that wrap another one and intercept its calls.

A subclass implements ``_call(name, fn)``, which returns what stands for the inner
storage's method ``name`` (``fn``); ``url`` and ``io`` and everything else pass through.
A reader returned by ``open_data`` is wrapped too: its ``read_into`` goes through
``_call("read_into", ...)``.
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
        if not callable(attr):
            return attr
        fn = self._call(name, attr)
        if name != "open_data":
            return fn

        def open_data(*args: Any, **kwargs: Any) -> _Reader:
            reader = fn(*args, **kwargs)
            return _Reader(reader, self._call("read_into", reader.read_into))

        return open_data

    def _call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn


class _Reader:
    """A data reader whose ``read_into`` is the wrapper's."""

    def __init__(self, inner: Any, read_into: Callable[..., int]) -> None:
        self.inner, self.read_into = inner, read_into

    @property
    def direct(self) -> bool:
        return bool(self.inner.direct)

    def close(self) -> None:
        self.inner.close()
