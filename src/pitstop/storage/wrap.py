"""StorageWrapper: the base of storages that wrap another one and intercept its calls.

A subclass implements ``_call(name, fn)``, which returns what stands for the inner
storage's method ``name`` (``fn``); ``url`` and ``io`` and everything else pass through.
A reader returned by ``open_data`` is wrapped too: its ``read_into`` goes through
``_call("read_into", ...)``. Its optional in-place hook ``data_view()``
(:func:`pitstop.engine.verify.data_view_of`: a reader whose file already lies in memory, a
shared-memory slot) bypasses ``read_into`` altogether, so a wrapper passes it on only when
its ``_passes_data_view()`` says so (default False: a wrapper that intercepts reads must
see them); otherwise the wrapped reader's ``data_view()`` returns None ("read me") and the
bytes go through ``read_into`` as from any storage.
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
            view = getattr(reader, "data_view", None) if self._passes_data_view() else None
            return _Reader(reader, self._call("read_into", reader.read_into), view)

        return open_data

    def _call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    def _passes_data_view(self) -> bool:
        """Whether readers opened now offer the inner reader's ``data_view`` hook (asked at
        each ``open_data``). True only where skipping ``read_into`` loses nothing the
        wrapper is for."""
        return False


class _Reader:
    """A data reader whose ``read_into`` is the wrapper's; ``data_view`` is the inner
    reader's hook where the wrapper passes it on, else None ("read me")."""

    def __init__(
        self,
        inner: Any,
        read_into: Callable[..., int],
        data_view: Callable[[], Any] | None = None,
    ) -> None:
        self.inner, self.read_into, self._data_view = inner, read_into, data_view

    def data_view(self) -> Any:
        return None if self._data_view is None else self._data_view()

    @property
    def direct(self) -> bool:
        return bool(self.inner.direct)

    def close(self) -> None:
        self.inner.close()
