"""``PitstopCheckpointIO``: Lightning's checkpoint paths as steps of one pitstop root (see the
package docstring for the call sequence)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from pitstop.engine.handle import SaveHandle
from pitstop.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointIOError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotACheckpointError,
    UnsupportedSetupError,
)
from pitstop.faults import killpoint
from pitstop.integrations.lightning.pointers import (
    POINTER,
    ROOT_MARK,
    STATE_KEY,
    ReferencedSteps,
    as_last_file,
    check_last_file,
    from_mark,
    is_last,
    is_own_tmp,
    map_strings,
    read_pointer,
    read_registry,
    special_file,
    write_json,
    write_registry,
)
from pitstop.io.files import fsync_dir, write_bytes_durable
from pitstop.log import get_logger
from pitstop.manager import CheckpointManager
from pitstop.policy.retention import KeepLast
from pitstop.state.rng import RNGState

_log = get_logger("pitstop.integrations.lightning")


class PitstopCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` on one pitstop root: ``PitstopCheckpointIO(root, **kw)``,
    where ``kw`` are :class:`~pitstop.CheckpointManager` arguments (``keep_last=`` and
    ``retention=`` keep steps beyond those a pointer names; ``policy=`` is Lightning's job).
    ``manager`` is the CheckpointManager; ``close()`` releases it."""

    def __init__(self, root: str | os.PathLike[str] | Any, **manager_kwargs: Any) -> None:
        super().__init__()
        path = os.fspath(root) if isinstance(root, (str, os.PathLike)) else getattr(root, "root", 0)
        if not isinstance(path, str):  # a Storage (FaultyStorage in tests) over a directory
            raise TypeError(f"PitstopCheckpointIO needs a directory, got {root!r}")
        if "policy" in manager_kwargs:
            raise TypeError("PitstopCheckpointIO takes no policy=: ModelCheckpoint decides when")
        user = manager_kwargs.pop("retention", None)
        keep_last = manager_kwargs.pop("keep_last", None)
        if keep_last is not None:
            user = KeepLast(keep_last) if user is None else KeepLast(keep_last) | user
        self.root = os.path.abspath(path)
        self._real_root = os.path.realpath(self.root)
        self._retention = ReferencedSteps(self._referenced, user)
        target = self.root if isinstance(root, (str, os.PathLike)) else root
        self.manager = CheckpointManager(target, retention=self._retention, **manager_kwargs)
        self._lock = threading.Lock()
        self._pointers: dict[str, int] = {}  # pointer path -> the step its file names
        self._pending: dict[str, tuple[int, int]] = {}  # path -> (generation, step) to write
        self._gen = 0
        self._dirs: set[str] = set()  # directories scanned for pointers
        self._handles: dict[int, SaveHandle] = {}  # saves of this process not yet finished
        self._reusable: set[int] = set()  # committed steps a new path may point at as they are
        self._owns_run = False  # this process saved, or adopted the run it loaded
        self._fitting = True  # until teardown: saves are fit's (ModelCheckpoint's), not after it
        self._error: BaseException | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pitstop-lightning")
        self._closed = False
        self._registry_dirs, self._registry_last = read_registry(self.root)
        self._repair()

    def __repr__(self) -> str:
        return f"PitstopCheckpointIO({self.root!r}, retention={self._retention!r})"

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Stage ``checkpoint`` as step ``global_step`` (or reuse that step) and return; the
        pointer at ``path`` follows the commit. Raises the error of a failed earlier save."""
        self._raise_error()
        if self._closed:
            raise UnsupportedSetupError(
                f"PitstopCheckpointIO({self.manager.url!r}) is closed: cannot save {path}"
            )
        if storage_options is not None:
            raise TypeError("PitstopCheckpointIO.save_checkpoint takes no storage_options")
        _one_process("save")
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint for {path} has no global_step >= 0: {step!r}")
        path = os.path.abspath(os.fspath(path))
        self._note_path(path)
        handle = self._handles.get(step)
        if handle is None and step not in self._reusable:
            state = _with_rng_object(map_strings(checkpoint, self._to_mark))
            try:
                handle = self.manager.async_save(step, state)
            except CheckpointExistsError as e:
                raise CheckpointExistsError(
                    f"step {step} is already committed in {self.root} and this run did not "
                    "resume from it: resume with fit(ckpt_path='last') (or ckpt_path=the root) "
                    "or give the run a fresh root", step=step, path=path, phase="plan",
                ) from e  # fmt: skip
            self._owns_run = True
            self._reusable |= {s for s, h in self._handles.items() if h.committed}
            self._handles = {s: h for s, h in self._handles.items() if not h.done()}
            self._handles[step] = handle
        with self._lock:
            self._gen += 1
            gen = self._gen
            self._pending[path] = (gen, step)
        self._writer.submit(self._write_pointer, path, step, gen, handle, not self._fitting)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint a pointer (or a pitstop root: its newest step) names, verified; a
        plain Lightning file is loaded as Lightning would. Pitstop never unpickles (safe
        whatever ``weights_only``); ``map_location`` may be a device."""
        path = os.path.abspath(os.fspath(path))
        kind = special_file(path)
        if kind is not None:  # torch.load would block on a FIFO
            raise NotACheckpointError(
                f"{path} is not a regular file ({kind}): not a checkpoint", path=path,
                phase="restore",
            )  # fmt: skip
        if os.path.isdir(path):
            root, named = path, None
        else:
            pointer = read_pointer(path)
            if pointer is None:
                _log.info("%s is no pitstop pointer: loaded with torch.load", path, phase="restore")
                return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
            root, named = pointer.root, pointer.step
            self._know_dir(os.path.dirname(path))
        own = self._ours(root)
        manager = self.manager if own else CheckpointManager(root)
        try:
            step, value = _load_step(manager, named, path)
        finally:
            if not own:
                manager.close()
        if own:
            self._adopt(step)
        real = os.path.realpath(root)  # as Lightning keeps its paths (ModelCheckpoint.dirpath)
        value = map_strings(value, lambda s: from_mark(s, real))
        if is_last(path):
            as_last_file(value, path)
        if isinstance(map_location, (str, torch.device)):
            value = apply_to_collection(value, torch.Tensor, lambda t: t.to(map_location))
        return value

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the pointer at ``path`` (and cancel one not yet written); its step goes by
        retention once nothing keeps it. A plain file is removed as Lightning would."""
        path = os.path.abspath(os.fspath(path))
        try:
            pointer = read_pointer(path)
        except CheckpointError:
            pointer = None
        with self._lock:  # the pointer thread may have written it since it was read above
            written = self._pointers.pop(path, None) is not None
            known = self._pending.pop(path, None) is not None or written
            if (pointer is not None or written) and os.path.isfile(path):
                os.remove(path)
        if path == self._registry_last:
            self._registry_last = None
            self._write_registry()
        if pointer is None and not known and os.path.isfile(path):
            TorchCheckpointIO().remove_checkpoint(path)

    def teardown(self) -> None:
        """End of fit/validate/test (Lightning's strategy teardown): wait for the saves in
        flight and their pointers, apply retention, raise a failed save's error. The IO stays
        usable (``trainer.save_checkpoint`` after ``fit``); ``close()`` releases it. After
        ``close()`` (a later ``trainer.test()``) there is nothing in flight: it returns."""
        if self._closed:
            return
        self._fitting = False  # a later save is trainer.save_checkpoint(...) after fit
        try:
            self.manager.wait()
        except BaseException as e:
            self._fail(e)
        self._writer.submit(lambda: None).result()  # FIFO: every pointer before it is written
        self._retain_now()
        self._raise_error()

    def close(self) -> None:
        """``teardown()``, then close the manager and the pointer thread (once; loading still
        works afterwards, saving raises)."""
        if self._closed:
            return
        try:
            self.teardown()
        finally:
            self._closed = True
            self._writer.shutdown(wait=True)
            self.manager.close()

    def reached(self, step: int) -> None:
        """Training finished ``step`` (PitstopCallback, once per optimizer step): the manager's
        crash-test hook (``pitstop crashtest`` kills the process here)."""
        self.manager.hooks.reached(step)

    def fit_starts(self, last: str | None) -> None:
        """Training starts (PitstopCallback.on_train_start): the saves until ``teardown()``
        are the fit's. ``last``, the path ModelCheckpoint will save its ``last`` checkpoint
        to, is registered now: a kill after the first commit, before Lightning's first save of
        ``last``, is repaired like any other (see ``_repair``)."""
        self._fitting = True
        if last is not None and not self._closed and "://" not in last:
            self._note_path(os.path.abspath(last))

    # ------------------------------------------------------------------ pointers
    def _write_pointer(
        self, path: str, step: int, gen: int, handle: SaveHandle | None, after_fit: bool
    ) -> None:
        """Pointer thread: once ``handle`` committed, write the pointer unless a newer save to
        (or a removal of) ``path`` came meanwhile. Kill point ``lightning.pointer`` once done
        with each pointer (written or not), in the order of the saves."""
        try:
            self._put_pointer(path, step, gen, handle, after_fit)
        finally:
            killpoint("lightning.pointer")

    def _put_pointer(
        self, path: str, step: int, gen: int, handle: SaveHandle | None, after_fit: bool
    ) -> None:
        try:
            if handle is not None:
                try:
                    handle.wait()
                except BaseException as e:
                    self._fail(e)
                if not handle.committed:
                    self._forget(path, gen)
                    return
            tmp = f"{path}.{gen}.pitstop-tmp"
            body = self._pointer_body(path, step, after_fit)
            write_bytes_durable(tmp, json.dumps(body).encode())
            with self._lock:
                current = self._pending.get(path, (None, 0))[0] == gen
                if current:
                    os.replace(tmp, path)
                    del self._pending[path]
                    self._pointers[path] = step
            if current:
                fsync_dir(os.path.dirname(path))
            else:
                os.unlink(tmp)
        except OSError as e:
            self._fail(CheckpointIOError(f"pointer not written: {e}", step=step, path=path))

    def _pointer_body(self, path: str, step: int, after_fit: bool = False) -> dict[str, Any]:
        rel = os.path.relpath(self.root, os.path.dirname(path))
        body = {"pitstop": POINTER, "version": 1, "step": step, "root": rel, "root_abs": self.root}
        return {**body, "after_fit": True} if after_fit else body

    def _forget(self, path: str, gen: int) -> None:
        """Its save failed: ``path`` keeps naming what its file on disk names."""
        with self._lock:
            if self._pending.get(path, (None, 0))[0] == gen:
                del self._pending[path]

    def _know_dir(self, directory: str) -> None:
        """Training thread, the first time a pointer directory is met (before this process
        writes there): read its pointers, remove temporary files a killed writer left."""
        if directory in self._dirs:
            return
        self._dirs.add(directory)
        try:
            names = os.listdir(directory)
        except OSError:
            return
        for name in names:
            path = os.path.join(directory, name)
            if name.endswith(".pitstop-tmp"):
                if is_own_tmp(path):  # a killed pointer write's, nobody else's
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                continue
            try:
                pointer = read_pointer(path) if os.path.isfile(path) else None
            except (CheckpointError, OSError):
                continue
            if pointer is not None and self._ours(pointer.root):
                with self._lock:
                    self._pointers.setdefault(path, pointer.step)

    def _referenced(self) -> set[int]:
        with self._lock:
            return set(self._pointers.values()) | {step for _, step in self._pending.values()}

    def _ours(self, root: str) -> bool:
        return os.path.realpath(root) == self._real_root

    def _to_mark(self, s: str) -> str:
        if not os.path.isabs(s):
            return s
        for base in (self.root, self._real_root):
            if s == base or s.startswith(base + os.sep):
                return ROOT_MARK + s[len(base) :].replace(os.sep, "/")
        return s

    # ------------------------------------------------------------------ registry
    def _note_path(self, path: str) -> None:
        """Before a save to ``path``: its directory is scanned and registered, and a ``last``
        path registered, so that a restart finds both even if killed before the pointer."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)  # as Lightning's own IO does
        self._know_dir(directory)
        changed = directory not in self._registry_dirs
        self._registry_dirs.add(directory)
        if is_last(path) and path != self._registry_last:
            self._registry_last, changed = path, True
        if changed:
            self._write_registry()

    def _write_registry(self) -> None:
        write_registry(self.root, self._registry_dirs, self._registry_last)

    def _repair(self) -> None:
        """Constructor, before Lightning resolves "last": read the registered pointer
        directories; point the registered ``last`` path at the newest committed step if it
        names another, unless that step was saved after fit (``trainer.save_checkpoint(
        "final.ckpt")``: ``last`` stays what Lightning made it). Any other such state is a kill
        before ``last`` followed the commit: before any pointer of the step, or after its
        top-k pointer (ModelCheckpoint saves the top-k file, then ``last``); a rerun from the
        older step would collide with the newest at its next save.

        Only a pointer of this root, or nothing, is replaced there: a file that is no pointer
        (or no regular file) is left as it is, with a warning (``check_last_file``); the path
        itself was validated when the registry was read (``read_registry``)."""
        for directory in sorted(self._registry_dirs):
            self._know_dir(directory)
        newest, last = self.manager.latest_step(), self._registry_last
        if newest is None or last is None:
            return
        pointer, why = check_last_file(last)
        if why:
            _log.warning("%s, the registered last path, %s: left as it is (the newest committed "
                         "step is %d)", last, why, newest, phase="restore")  # fmt: skip
            return
        if pointer is not None and (not self._ours(pointer.root) or pointer.step == newest):
            return
        if self._saved_after_fit(newest):
            return
        write_json(last, self._pointer_body(last, newest))
        with self._lock:
            self._pointers[last] = newest
        _log.warning(
            "%s named step %s, the newest committed step is %d (the last run ended before this "
            "pointer followed its commit): it names %d now", last,
            pointer.step if pointer else "nothing", newest, newest, phase="restore",
        )  # fmt: skip

    def _saved_after_fit(self, step: int) -> bool:
        """Whether a pointer read from the registered directories names ``step`` and was
        written for a save after fit."""
        with self._lock:
            paths = [path for path, named in self._pointers.items() if named == step]
        for path in paths:
            with contextlib.suppress(CheckpointError):
                pointer = read_pointer(path)
                if pointer is not None and pointer.step == step and pointer.after_fit:
                    return True
        return False

    # ------------------------------------------------------------------ helpers
    def _adopt(self, step: int) -> None:
        """A step of our root was loaded: continue its run (retention, lineage) if this process
        saved nothing yet, and let later saves of that step point at it if it is the newest."""
        result = self.manager.last_restore
        if not self._owns_run and result is not None and result.step == step:
            self.manager.hooks.identity.adopt(result.manifest, step, new_timeline=None)
            self._owns_run = True
        if step == self.manager.latest_step():
            self._reusable.add(step)

    def _retain_now(self) -> None:
        """Teardown: retention as after a commit, for pointers removed since the last one."""
        newest = self.manager.latest_step()
        if newest is None or not self._owns_run:
            return
        try:
            catalog = self.manager.hooks.catalog
            retired = catalog.retire(
                self._retention, newest=newest, identity=self.manager.hooks.identity
            )
            catalog.purge_later(retired)
        except CheckpointError as e:  # a later commit tries again
            _log.warning("retention at teardown failed: %s", e, phase="gc")

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error


class _SavedRNG(RNGState):
    """RNG streams captured by PitstopCallback, saved as pitstop saves an RNGState (the
    crash-test probe recognises it in the state); loads as the plain dict."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def _with_rng_object(checkpoint: dict[str, Any]) -> dict[str, Any]:
    ours = checkpoint.get(STATE_KEY)
    if not (isinstance(ours, dict) and isinstance(ours.get("rng"), dict)):
        return checkpoint
    return {**checkpoint, STATE_KEY: {**ours, "rng": _SavedRNG(ours["rng"])}}


def _load_step(manager: CheckpointManager, named: int | None, path: str) -> tuple[int, Any]:
    """Load ``named`` (None: the newest that verifies); if it is no longer committed or fails
    verification, the newest older committed step, with a warning."""
    if named is None:
        value = manager.load()
    else:
        try:
            value = manager.load(named)
        except (CheckpointNotFoundError, CorruptCheckpointError) as e:
            value = _load_older(manager, named, path, e)
    assert manager.last_restore is not None and manager.last_restore.step is not None
    return manager.last_restore.step, value


def _load_older(manager: CheckpointManager, named: int, path: str, why: CheckpointError) -> Any:
    for step in reversed([s for s in manager.steps() if s < named]):
        try:
            value = manager.load(step)
        except CorruptCheckpointError:
            continue
        _log.warning(
            "%s names step %d, which cannot be loaded (%s): loaded step %d, the newest older one",
            path, named, why.message, step, phase="restore",
        )  # fmt: skip
        return value
    raise CheckpointNotFoundError(
        f"{path} names step {named}, which cannot be loaded ({why.message}), and no older "
        "committed step verifies", step=named, path=path, phase="restore",
    ) from why  # fmt: skip


def _one_process(what: str) -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise UnsupportedSetupError(
            f"pitstop's Lightning integration cannot {what} under {dist.get_world_size()} "
            "processes yet (Lightning saves on rank 0 only; pitstop's saves are collective)"
        )


def find_io(strategy: Any) -> PitstopCheckpointIO | None:
    io = getattr(strategy, "checkpoint_io", None)
    for _ in range(8):  # through wrappers such as AsyncCheckpointIO
        if io is None or isinstance(io, PitstopCheckpointIO):
            return io
        io = getattr(io, "checkpoint_io", None)
    return None


def loaders(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in loaders(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in loaders(v)]
    return [] if obj is None else [obj]
