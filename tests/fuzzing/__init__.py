"""Fuzzing damaged and hostile checkpoint metadata: manifest.json and objects-00000.json.

::

    from fuzzing import run_campaign
    result = run_campaign(cases=200, seed=0, workers=2)
    result.counts      # Counter({"ok_fallback": 61, "pitstop_error": 40, ...})
    result.failures    # the cases in a BAD category, each with its mutation and message

A campaign builds one pristine root with two committed steps (:func:`.root.make_root`),
then for each case copies it into a case directory, damages step 2 with one
:class:`.cases.Mutation` (a pure function of the seed and the case number, see
:func:`.mutations.make_case`) and runs one operation on it (:data:`.cases.OPS`) in a
persistent worker process, under a timeout, with its address space limited. Families of
mutations:

* ``bytes``: bit flips, overwritten, inserted, deleted or appended bytes, truncation;
* structured edits of the parsed JSON: ``permute`` (swapped keys, offsets, entries),
  ``retype``, ``huge`` numbers, ``long_string``, ``deep`` nesting, ``duplicate`` keys,
  ``remove``-d and ``extra`` fields, changed ``field`` values (world size, format
  version, step, dtype, shape, nbytes, offset, names); each is done *sealed* (the
  manifest made to vouch for the edit again, see :func:`.seal.reseal`) or not, so that
  both the checksum path and the validation path are exercised;
* ``special`` files in place of a metadata file (FIFO, symlinks to /dev/zero and out
  of the root, a directory, a 3 GiB sparse file, ...), and ``step_symlink``: step 2's
  directory replaced by a symlink to a directory outside the root (nothing outside may
  change).

Outcomes (:data:`.classify.GOOD` and :data:`BAD`):

* ``ok_newest`` / ``ok_fallback``: the values of step 2 / step 1, exactly (digests of
  every tensor's bytes and every plain value with its type, :func:`.root.digest_state`);
* ``pitstop_error``: a CheckpointError. From restore (step 1 is always intact) only
  those raised by design without trying step 1: CheckpointIOError, FormatVersionError,
  MissingExtraError (a checksum package this machine lacks), and a StateMismatchError
  found before anything was touched when the edit is a forgery (a consistent
  checkpoint of another shape); any other error from restore is ``half_restore``;
* ``forged_value``: a *forgery* loaded with other values. A sealed edit is a forgery
  when it leaves a consistent checkpoint that the writer could have produced (swapped
  keys or offsets with their checksums, a reshaped tensor, an objects file that
  :func:`.seal.objects_well_formed` accepts): no reader can tell, so it is not a failure;
* ``cli_exit_0``, ``cli_exit_1``, ``cli_exit_2``: the command's exit code, no traceback;
* failures: ``wrong_value`` (values of neither step, from a checkpoint that is not a
  forgery), ``half_restore`` (restore raised although the intact step 1 was there, or
  left the state neither untouched nor equal to a step), ``non_pitstop_exception``
  (any other exception, or a traceback from the CLI), ``hang`` (the timeout), ``crash``
  (the worker died), ``memory`` (MemoryError under the address-space limit),
  ``outside_modified`` (something outside the root changed) and ``harness_error`` (a
  bug of this package).

Call sequence: :func:`run_campaign` or a :class:`Fuzzer` from one thread. It starts
its workers (``python -c``, one per slot, sessions of their own) and one driver
thread per worker; every worker and temporary directory is gone when it returns.

Modules, one concept each: :mod:`.root` (the pristine root and the digests),
:mod:`.cases` (a case, its actions, its directory), :mod:`.seal` (serializing and
resealing edited metadata), :mod:`.jsonpath`, :mod:`.edits` and :mod:`.schema_edits` (the
structured edits), :mod:`.mutations` (a case from a seed, the named mutations),
:mod:`.classify` (running one case and classifying it), :mod:`.worker` (the worker
process) and :mod:`.campaign` (:class:`Fuzzer`, :func:`run_campaign`).
"""

from fuzzing.campaign import CampaignResult, CaseResult, Fuzzer, run_campaign
from fuzzing.classify import BAD
from fuzzing.mutations import NAMED, make_case, named_mutation

__all__ = [
    "BAD",
    "NAMED",
    "CampaignResult",
    "CaseResult",
    "Fuzzer",
    "make_case",
    "named_mutation",
    "run_campaign",
]
