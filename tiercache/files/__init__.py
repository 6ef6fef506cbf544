"""The file tier: one file per block and pool under a root directory.

- :mod:`.blockfile`: the block-file format (4 KiB header, checksummed data) and file names;
- :mod:`.blockcheck`: one block file checked against itself as it is on disk;
- :mod:`.posix_io`: atomic writes (temporary file, ``fdatasync``, rename) and verified reads;
- :mod:`.nativeio`: the native I/O engine (``kernels/blockio.c``: io_uring or C threads) and
  the choice of engine;
- :mod:`.blockbatch`: requests as native batches (headers, checksums, staging) and the group
  commit both engines share;
- :mod:`.kvikio_io`: ``CuFile`` reads and writes straight between VRAM and files (GDS or
  kvikio's compat mode);
- :mod:`.devicepath`: which path device blocks take (GDS / compat / POSIX) and why;
- :mod:`.devicehash`: block checksums (XXH3-64) of device memory, computed on the GPU;
- :mod:`.blockio`: :class:`BlockIO`, one block's file between a buffer and the disk, chosen once
  from the device path (POSIX, or kvikio for device buffers);
- :mod:`.rootdir`: the root's marker, single-writer lock, stats file and entry names;
- :mod:`.rootarray`: several roots (one per device) as one: the array's record and table,
  opening, adding and removing members;
- :mod:`.sharing`: shared roots: boot-tagged temporary names, abandoned temporaries, published
  blocks;
- :mod:`.indexfile`: the root's saved index (what an open starts from instead of every header);
- :mod:`.rowreads`: reads into the rows of one host buffer with no Python per block;
- :mod:`.rowwrites`: writes from the rows of one host buffer, laid out as arrays;
- :mod:`.blockpieces`: blocks in pieces of the caller's host memory, read and written in place;
- :mod:`.iothreads`: the I/O threads (reads that wait for nothing go ahead of queued writes);
- :mod:`.file_tier`: :class:`FileTier`: index rebuild, quarantine, submitting I/O.

Depends on :mod:`tiercache.memory` (pinned staging) and the foundation.
"""

from .blockbatch import BlockFuture, Outcome, when_all_settled
from .blockcheck import verify_file
from .blockfile import (
    ALIGN,
    DATA_OFFSET,
    FANOUT,
    SUBDIRS,
    block_filename,
    block_relpath,
    block_subdir,
    block_subdir_index,
    checksum,
    decode_header,
    file_size,
    header_checksum,
    is_temporary_name,
    parse_filename,
    usual_header_tail,
)
from .blockpieces import BlockPieces
from .devicehash import DeviceHasher, device_checksums
from .devicehash import applies as device_hash_applies
from .devicehash import hasher as device_hasher
from .devicepath import IOPath, select_io_path
from .file_tier import FileTier, ScanResult
from .indexfile import IndexUnusable, SavedIndex, changed_dirs, dir_times, index_summary, load_index, save_index
from .nativeio import (
    CHECK,
    DIRECT,
    HASH,
    IO_ENGINES,
    NOT_REGULAR,
    READ,
    UNLINK,
    NativeIO,
    Ops,
    choose_engine,
    native_hash,
    native_pieces,
    native_status,
    set_uring_meta,
    uring_meta,
    uring_status,
)
from .openfiles import FREE_FILES
from .rootarray import (
    ARRAY,
    ArrayRecord,
    MemberState,
    RootArray,
    balanced_table,
    member_states,
    members_of,
    open_roots,
    read_record,
    record_of,
    subdir_owner,
)
from .rootdir import (
    DIR_MODE,
    INDEX,
    LAYOUT,
    QUARANTINE,
    STATS,
    NotRegularFileError,
    RootDir,
    RootLock,
    RootPath,
    claim_layout,
    classify,
    is_root,
    lock_holder,
    write_stats,
)
from .rootreshape import ReshapeResult, reshape
from .sharing import BOOT_TAG, tmp_abandoned, tmp_name, tmp_owner

__all__ = [
    "verify_file",
    "DeviceHasher",
    "device_checksums",
    "device_hash_applies",
    "device_hasher",
    "BlockPieces",
    "BlockFuture",
    "ARRAY",
    "ArrayRecord",
    "MemberState",
    "ReshapeResult",
    "RootArray",
    "balanced_table",
    "member_states",
    "members_of",
    "open_roots",
    "read_record",
    "record_of",
    "reshape",
    "subdir_owner",
    "ALIGN",
    "BOOT_TAG",
    "CHECK",
    "DATA_OFFSET",
    "DIRECT",
    "DIR_MODE",
    "FANOUT",
    "FREE_FILES",
    "FileTier",
    "HASH",
    "INDEX",
    "LAYOUT",
    "IOPath",
    "IO_ENGINES",
    "IndexUnusable",
    "NOT_REGULAR",
    "NativeIO",
    "NotRegularFileError",
    "Ops",
    "QUARANTINE",
    "READ",
    "RootDir",
    "RootLock",
    "RootPath",
    "STATS",
    "SUBDIRS",
    "SavedIndex",
    "ScanResult",
    "UNLINK",
    "block_filename",
    "block_relpath",
    "block_subdir",
    "block_subdir_index",
    "changed_dirs",
    "checksum",
    "choose_engine",
    "claim_layout",
    "classify",
    "decode_header",
    "dir_times",
    "file_size",
    "header_checksum",
    "index_summary",
    "is_root",
    "is_temporary_name",
    "load_index",
    "lock_holder",
    "native_hash",
    "native_pieces",
    "native_status",
    "parse_filename",
    "save_index",
    "select_io_path",
    "tmp_abandoned",
    "tmp_name",
    "tmp_owner",
    "set_uring_meta",
    "uring_meta",
    "uring_status",
    "usual_header_tail",
    "Outcome",
    "when_all_settled",
    "write_stats",
]
