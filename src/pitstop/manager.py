"""CheckpointManager: the object a training loop holds.

Call sequence (training thread)::

    ckpt = CheckpointManager("ckpts", keep_last=3)
    start = ckpt.restore(state)            # newest valid step, loaded in place; None if none
    for step in range(start or 0, ...):
        ...                                # forward, backward, optimizer.step()
        ckpt.async_save(step, state)       # or ckpt.save(step, state): durable on return
    ckpt.close()                           # waits for saves in flight

Retention runs on the persist thread right after a commit: older checkpoints
beyond ``keep_last`` are un-committed (manifest removed first) and deleted;
the newest committed one and any save in flight are never touched.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

from pitstop.engine.catalog import Entry, committed, read_manifest, scan
from pitstop.engine.handle import SaveHandle
from pitstop.engine.restore import load_checkpoint
from pitstop.engine.saver import Saver
from pitstop.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from pitstop.faults import killpoint
from pitstop.format.names import quarantine_dir_name, step_dir_name
from pitstop.log import get_logger
from pitstop.options import IOOptions, SaveOptions
from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage

__all__ = ["CheckpointManager"]

_log = get_logger("pitstop")


class CheckpointManager:
    """Saves, restores and retires the checkpoints of one training job.

    ``root`` is a directory (or a :class:`~pitstop.storage.Storage`). ``keep_last``
    keeps that many committed checkpoints (None: all). ``allow_pickle`` lets
    values that JSON cannot hold be stored, and loaded, as pickles. Other knobs
    live in :class:`~pitstop.options.SaveOptions` (``options=``) or in their
    keyword shortcuts.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        keep_last: int | None = None,
        *,
        options: SaveOptions | None = None,
        allow_pickle: bool | None = None,
        max_in_flight: int | None = None,
        overlap: bool | None = None,
        io_threads: int | None = None,
        chunk_bytes: int | None = None,
        direct_io: str | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        io = (options.io if options else None) or IOOptions.from_env(
            threads=io_threads, chunk_bytes=chunk_bytes, direct=direct_io
        )
        base = options or SaveOptions.from_env(io=io)
        self.options = base.replace(
            io=io,
            **{
                k: v
                for k, v in {
                    "allow_pickle": allow_pickle,
                    "max_in_flight": max_in_flight,
                    "overlap": overlap,
                }.items()
                if v is not None
            },
        )
        self.storage: Storage = root if isinstance(root, Storage) else LocalStorage(root, io)
        self.keep_last = keep_last
        self._saver = Saver(self.storage, self.options, on_commit=self._retain)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.storage.url!r}, keep_last={self.keep_last})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ save
    def async_save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Stage ``state`` and return; it is persisted and committed in the background.

        The call stalls the loop only for copying the tensors that the next
        forward pass may change; parameters and optimizer state finish copying
        while training goes on (``optimizer.step()`` waits for them).
        """
        return self._saver.async_save(step, state)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Save ``state`` as ``step``; durable and committed when it returns."""
        return self._saver.save(step, state)

    def wait(self) -> None:
        """Wait for every save in flight; raise the error of a failed one."""
        self._saver.wait_all()

    def close(self) -> None:
        """Wait for saves in flight and release memory and threads."""
        self._saver.close()

    @property
    def host_bytes(self) -> int:
        """Host memory held by staging arenas."""
        return self._saver.host_bytes

    @property
    def history(self) -> list[SaveHandle]:
        """Handles of the most recent saves (their ``stats`` hold the timings)."""
        return list(self._saver.history)

    # ------------------------------------------------------------------ query
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return [e.step for e in committed(self.storage) if e.step is not None]

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def entries(self) -> list[Entry]:
        return scan(self.storage)

    # ------------------------------------------------------------------ restore
    def restore(
        self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the step loaded, or None when there is no checkpoint. A
        checkpoint that fails verification is logged, set aside and the next
        older one is tried; if every checkpoint fails, CorruptCheckpointError
        lists why. A checkpoint that does not fit the state raises
        StateMismatchError naming the keys (no fallback: an older one would not fit either).
        """
        self._saver.raise_pending()
        entries = scan(self.storage)
        candidates = [e for e in entries if e.status == "committed"]
        if step is not None:
            candidates = [e for e in candidates if e.step == step]
            if not candidates:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint of step {step}", step=step, path=self.storage.url
                )
        if not candidates:
            return None
        failures: list[tuple[Entry, CheckpointError]] = []
        for entry in reversed(candidates):
            try:
                self._load(entry, state, strict)
            except CorruptCheckpointError as e:
                _log.warning(
                    "checkpoint %s failed verification, trying an older one: %s", entry.name, e
                )
                failures.append((entry, e))
                continue
            unreadable = [
                e
                for e in entries
                if e.status == "corrupt" and e.step is not None and e.step > (entry.step or 0)
            ]
            self._set_aside([f for f, _ in failures] + unreadable)
            _log.info("restored step %d from %s", entry.step, self.storage.url)
            return entry.step
        reasons = "; ".join(f"{e.name}: {err.message}" for e, err in failures)
        raise CorruptCheckpointError(
            f"no checkpoint passed verification ({reasons})", path=self.storage.url, phase="restore"
        )

    def _load(self, entry: Entry, state: Mapping[str, Any] | None, strict: bool) -> Any:
        manifest = entry.manifest or read_manifest(self.storage, entry.name)
        size = max((f.nbytes for f in manifest.files if f.name.endswith(".bin")), default=0)
        with self._saver.borrow_buffer(size) as (view, buffer):
            return load_checkpoint(
                self.storage, entry.name, manifest, state, view, buffer,
                pool=self._saver.io_pool, allow_pickle=self.options.allow_pickle, strict=strict,
            )  # fmt: skip

    def load(self, step: int | None = None) -> Any:
        """The saved state as fresh objects (tensors on CPU; Statefuls as their state dicts)."""
        candidates = committed(self.storage)
        if step is not None:
            candidates = [e for e in candidates if e.step == step]
        if not candidates:
            raise CheckpointNotFoundError(
                "no committed checkpoint" + (f" of step {step}" if step is not None else ""),
                path=self.storage.url,
            )
        return self._load(candidates[-1], None, True)

    def _set_aside(self, entries: list[Entry]) -> None:
        """Rename checkpoints that failed verification so that a new save of their step can commit."""
        for entry in entries:
            if entry.step is None:
                continue
            target = quarantine_dir_name(entry.step, uuid.uuid4().hex[:8])
            try:
                self.storage.rename(entry.name, target)
                _log.warning("set aside corrupt checkpoint %s as %s", entry.name, target)
            except CheckpointError as e:
                _log.warning("could not set aside %s: %s", entry.name, e)

    # ------------------------------------------------------------------ retention and gc
    def _retain(self, newest: int) -> None:
        """Persist thread, after ``newest`` committed: keep the newest ``keep_last``."""
        if self.keep_last is None:
            return
        steps = [s for s in self.steps() if s <= newest]
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            if step == newest:
                continue
            directory = step_dir_name(step)
            self.storage.uncommit(directory)
            killpoint("retention.mid")
            self.storage.remove(directory)

    def gc(self, *, dry_run: bool = False) -> list[str]:
        """Remove debris of interrupted saves (directories without a manifest). Returns the names."""
        with self._saver._cond:
            busy = {step_dir_name(s) for s in self._saver._inflight}
        names = [e.name for e in scan(self.storage) if e.status == "partial" and e.name not in busy]
        if not dry_run:
            for name in names:
                self.storage.remove(name)
        return names
