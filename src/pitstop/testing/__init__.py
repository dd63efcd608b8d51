"""Test aids that ship with pitstop: storage that fails on demand, kill-point runners.

::

    from pitstop.testing import FaultyStorage
    storage = FaultyStorage(LocalStorage(tmp), fail={"persist": [2]}, errno=errno.ENOSPC)
    mgr = CheckpointManager(storage)
    mgr.save(1, state)         # ok
    mgr.save(2, state)         # raises CheckpointIOError(ENOSPC); step 1 untouched

Kill points are named in :data:`pitstop.faults.KILL_POINTS`; a child process
started with ``PITSTOP_KILL_AT=NAME[:N]`` SIGKILLs itself there.
"""

from pitstop.testing.faulty import CALLS, PHASES, FaultyStorage, GateStorage

__all__ = ["CALLS", "PHASES", "FaultyStorage", "GateStorage"]
