"""Whole-root operations, above the file tier: what ``tiercache inspect``, ``verify``, ``purge``
and ``top`` do to a root as a whole, without opening a cache on it.

- :mod:`.inventory`: a read-only survey of a root (block files, temporaries, quarantine, foreign
  names, the saved stats), and the check of one file;
- :mod:`.check`: ``verify`` and ``purge`` of a whole root in native chunks (:class:`RootCheck`);
- :mod:`.verify` and :mod:`.purge`: the rules of ``tiercache verify`` and ``purge`` (what is bad,
  what is the cache's to delete, the locks they take), which the CLI only asks for and prints.

The CLI reaches the root's format and files through this package only: it re-exports the few
names of :mod:`tiercache.files` those commands need (``is_root``, ``members_of``, ...).

Depends on :mod:`tiercache.files` (the block format, the root, the native I/O engine).
"""

from tiercache.files import (
    RootDir,
    index_summary,
    is_root,
    member_states,
    members_of,
    reshape,
    select_io_path,
    subdir_owner,
)

from .check import (
    DELETE,
    OWN,
    VERIFY,
    Recheck,
    RootCheck,
    delete_own,
    own_entries,
    quick_gil_handoff,
    recheck,
    unlink_all,
    verify_entries,
)
from .inventory import FileEntry, RootSurvey, entry_path, gc_paused, is_own_block_file, survey, verify_file
from .purge import PurgePlan, PurgeResult, Selection, execute_plan, locked_for_purge, plan_purge, purge_now
from .verify import verify_root

__all__ = [
    "DELETE",
    "FileEntry",
    "OWN",
    "PurgePlan",
    "PurgeResult",
    "Recheck",
    "RootCheck",
    "RootSurvey",
    "Selection",
    "VERIFY",
    "delete_own",
    "entry_path",
    "execute_plan",
    "gc_paused",
    "is_own_block_file",
    "locked_for_purge",
    "own_entries",
    "plan_purge",
    "purge_now",
    "quick_gil_handoff",
    "recheck",
    "survey",
    "unlink_all",
    "verify_entries",
    "verify_file",
    "verify_root",
    # of tiercache.files, for the CLI
    "RootDir",
    "index_summary",
    "is_root",
    "member_states",
    "members_of",
    "reshape",
    "select_io_path",
    "subdir_owner",
]
