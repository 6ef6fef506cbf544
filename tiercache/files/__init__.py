"""The file tier: one file per block and pool under a root directory.

- :mod:`.blockfile`: the block-file format (4 KiB header, checksummed data) and file names;
- :mod:`.posix_io`: atomic writes (temporary file, ``fdatasync``, rename) and verified reads;
- :mod:`.batchio`: the native I/O engine (``kernels/blockio.c``: io_uring or C threads) and
  the choice of engine;
- :mod:`.blockbatch`: requests as native batches (headers, checksums, staging) and the group
  commit both engines share;
- :mod:`.kvikio_io`: ``CuFile`` reads and writes straight between VRAM and files (GDS or
  kvikio's compat mode);
- :mod:`.iopath`: which path device blocks take (GDS / compat / POSIX) and why;
- :mod:`.rootdir`: the root's marker and single-writer lock;
- :mod:`.sharing`: shared roots: boot-tagged temporary names, abandoned temporaries, published
  blocks;
- :mod:`.indexfile`: the root's saved index (what an open starts from instead of every header);
- :mod:`.rootsurvey`: a read-only survey of a root (for ``inspect``, ``verify``, ``purge``);
- :mod:`.rootcheck`: ``verify`` and ``purge`` of a whole root in native chunks;
- :mod:`.iothreads`: the I/O threads (reads that wait for nothing go ahead of queued writes);
- :mod:`.file_tier`: :class:`FileTier`: index rebuild, quarantine, submitting I/O.

Depends on :mod:`tiercache.memory` (pinned staging) and the foundation.
"""

from .batchio import IO_ENGINES, choose_engine, native_status, uring_status
from .blockfile import DATA_OFFSET, FANOUT, SUBDIRS, block_filename, block_relpath, block_subdir, block_subdir_index, file_size
from .blockbatch import when_all_settled
from .file_tier import FileTier, ScanResult
from .openfiles import FREE_FILES
from .iopath import IOPath, select_io_path
from .rootdir import DIR_MODE, INDEX, QUARANTINE, NotRegularFileError, RootDir, RootLock, RootPath, is_root, lock_holder
from .sharing import BOOT_TAG, tmp_abandoned, tmp_name, tmp_owner
from .indexfile import IndexUnusable, SavedIndex, changed_dirs, dir_times, index_summary, load_index, save_index
from .rootsurvey import (STATS, FileEntry, RootSurvey, classify, entry_path, gc_paused, is_own_block_file, survey, verify_file,
                         write_stats)
from .rootcheck import DELETE, OWN, VERIFY, Recheck, RootCheck, delete_own, quick_gil_handoff, own_entries, recheck, unlink_all, verify_entries

__all__ = [
    "DATA_OFFSET", "DIR_MODE", "FANOUT", "FREE_FILES", "FileEntry", "FileTier", "SUBDIRS", "block_relpath",
    "block_subdir", "block_subdir_index", "entry_path", "when_all_settled", "IOPath", "IO_ENGINES", "choose_engine", "native_status", "uring_status", "NotRegularFileError", "QUARANTINE", "RootDir", "RootLock",
    "RootPath", "RootSurvey",
    "INDEX", "STATS", "IndexUnusable", "SavedIndex", "changed_dirs", "dir_times", "index_summary", "load_index", "save_index", "ScanResult", "block_filename", "classify", "file_size", "is_own_block_file", "is_root", "lock_holder",
    "select_io_path", "survey", "gc_paused", "verify_file", "RootCheck", "quick_gil_handoff", "VERIFY", "OWN", "DELETE", "verify_entries", "own_entries", "delete_own", "Recheck", "recheck", "unlink_all", "write_stats", "BOOT_TAG", "tmp_abandoned", "tmp_name", "tmp_owner",
]
