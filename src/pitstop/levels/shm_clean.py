"""Stale segments: recognising and removing the shared memory of jobs whose processes
are all dead, never a living job's. No torch.

Part of :mod:`pitstop.levels.shm` (which re-exports ``remove_stale``, ``remove_job`` and
``iter_slots``). A job's lock file is held (flock, shared) by its training process and its
keeper while they live: flocks die with their holders, whatever pids are reused. Without a
lock file, the slots' owner decides: its pid gone, or a header written in another boot.

Call sequence: any process (a starting training process with ``keep=`` its own job, the
keeper at the end of its job, ``pitstop gc``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Callable, Collection, Iterator

from pitstop.errors import CheckpointError
from pitstop.io.locks import pid_alive
from pitstop.levels.shm_header import (
    SHM_DIR,
    SlotHeader,
    boot_id,
    lock_name,
    parse_segment_name,
    read_header,
    segment_names,
)

__all__ = ["iter_slots", "job_slots", "remove_job", "remove_rank_if_dead", "remove_stale"]


def _jobs(directory: str) -> dict[tuple[str, int], list[str]]:
    """Segments under ``directory`` by (job, rank)."""
    out: dict[tuple[str, int], list[str]] = {}
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            parsed = parse_segment_name(name)
            if parsed is not None:
                out.setdefault((parsed[0], parsed[1]), []).append(name)
    return out


def _stale(directory: str, job: str, rank: int, names: list[str]) -> Callable[[bool], None] | None:
    """If the segments of (job, rank) belong to no living process, a function that removes
    them (``unlink=False``: only lets go; it must be called at once: it holds the job's lock
    until it is done)."""
    path = os.path.join(directory, lock_name(job, rank))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        fd = -1
    except PermissionError:
        return None  # another user's job: not ours to judge or remove
    if fd >= 0:  # the lock says it: flocks die with their holders (pids are reused)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None  # a living training process or keeper holds it
    else:  # no lock file (removed by hand, or a crash while creating): the slots' owners say
        for name in names:
            try:  # never a FIFO's open that waits for a writer, nor a symlink followed
                sfd = os.open(os.path.join(directory, name),
                              os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # fmt: skip
            except PermissionError:
                return None  # another user's job
            except OSError:
                continue
            with contextlib.suppress(OSError):
                try:
                    if not stat.S_ISREG(os.fstat(sfd).st_mode):
                        continue  # not a slot: no owner to ask (the finally closes it)
                    h = read_header(sfd, retries=1)
                finally:
                    os.close(sfd)
                if h is not None and h.boot == boot_id() and pid_alive(h.pid):
                    return None

    def remove(unlink: bool) -> None:
        try:
            for name in names if unlink else ():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, name))
        finally:
            if fd >= 0:
                os.close(fd)

    return remove


def remove_stale(
    directory: str = SHM_DIR, *, keep: str | Collection[str] | None = None, dry_run: bool = False
) -> list[str]:
    """Remove the segments of every job whose processes are all dead: nobody holds its lock
    file (flocks die with their holders, in any boot), or, without a lock file, its slots'
    owner pid is gone or was written in another boot. ``keep``: job tokens never touched.
    Returns the names removed (``dry_run``: the names that would be, nothing removed)."""
    removed: list[str] = []
    kept = {keep} if isinstance(keep, str) else set(keep or ())
    for (job, rank), names in sorted(_jobs(directory).items()):
        if job in kept:
            continue
        remove = _stale(directory, job, rank, names)
        if remove is not None:
            remove(not dry_run)
            removed += sorted(names)
    return removed


def remove_rank_if_dead(directory: str, job: str, rank: int) -> list[str]:
    """Remove the segments of (``job``, ``rank``) if no process of it lives (as
    :func:`remove_stale` judges); the names removed."""
    names = _jobs(directory).get((job, rank), [])
    remove = _stale(directory, job, rank, names) if names else None
    if remove is None:
        return []
    remove(True)
    return sorted(names)


def job_slots(directory: str, job: str) -> list[SlotHeader]:
    """The headers of ``job``'s slots under ``directory`` (any rank; unreadable ones left
    out), by rank and slot: what ``pitstop ls`` shows of a directory's memory snapshots."""
    out = []
    for name in segment_names(directory, job):
        parsed = parse_segment_name(name)
        if parsed is None or parsed[2] is None:
            continue
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                         | os.O_NONBLOCK)  # fmt: skip
        except OSError:
            continue
        try:
            head = read_header(fd)
        except (OSError, CheckpointError):
            head = None
        finally:
            os.close(fd)
        if head is not None and (head.job, head.rank, head.index) == parsed:  # the name's
            out.append(head)  # (a slot renamed or crafted to another's name is none)
    return sorted(out, key=lambda h: (h.rank, h.index))


def remove_job(directory: str, job: str) -> list[str]:
    """Remove every segment of ``job`` (its keeper, at the end of the job)."""
    names = segment_names(directory, job)
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    return names


def iter_slots(directory: str, job: str, rank: int) -> Iterator[str]:
    """Paths of the slot files of (job, rank)."""
    for name in segment_names(directory, job):
        parsed = parse_segment_name(name)
        if parsed is not None and parsed[2] is not None and parsed[1] == rank:
            yield os.path.join(directory, name)
