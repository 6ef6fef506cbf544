"""Whole-root operations, above the file tier: what ``tiercache inspect``, ``verify``, ``purge``
and ``top`` do to a root as a whole, without opening a cache on it.

- :mod:`.inventory`: a read-only survey of a root (block files, temporaries, quarantine, foreign
  names, the saved stats), and the check of one file;
- :mod:`.check`: ``verify`` and ``purge`` of a whole root in native chunks (:class:`RootCheck`).

Depends on :mod:`tiercache.files` (the block format, the root, the native I/O engine).
"""

from .check import DELETE, OWN, VERIFY, Recheck, RootCheck, delete_own, own_entries, quick_gil_handoff, recheck, \
    unlink_all, verify_entries
from .inventory import FileEntry, RootSurvey, entry_path, gc_paused, is_own_block_file, survey, verify_file

__all__ = [
    "DELETE", "FileEntry", "OWN", "Recheck", "RootCheck", "RootSurvey", "VERIFY", "delete_own", "entry_path",
    "gc_paused", "is_own_block_file", "own_entries", "quick_gil_handoff", "recheck", "survey", "unlink_all",
    "verify_entries", "verify_file",
]
