"""One block file checked against itself, as it is on disk now: what ``tiercache verify``
checks per file, and what a failed read asks before its file is quarantined (a read whose
destination changed under it fails its checksum, though the file is good)."""

from __future__ import annotations

import os
from pathlib import Path

from tiercache.errors import CorruptBlockError
from tiercache.files.blockfile import DATA_OFFSET, checksum, decode_header, file_size, parse_filename
from tiercache.files.rootdir import NotRegularFileError, RootPath


def verify_file(path: RootPath | Path) -> str | None:
    """Check one block file against itself: a regular file (not a symlink), its header, that
    the header names the file's key and pool, its exact size and its data checksum. Returns the
    problem, or None when it verifies."""
    path = RootPath.of(path)
    name = path.name.rsplit("/", 1)[-1]
    parsed = parse_filename(name)
    try:
        fd = path.open(os.O_RDONLY)
    except NotRegularFileError:
        return f"{name}: not a regular file (a symlink or directory)"
    except OSError as exc:
        return f"{name}: unreadable ({exc.strerror})"
    try:
        with os.fdopen(fd, "rb") as f:
            header = decode_header(f.read(DATA_OFFSET), name)
            if parsed is None or (header.key, header.pool) != parsed:
                return f"{name}: header names key/pool {header.key!r}/{header.pool!r}, not its file name"
            data = f.read(header.nbytes)
            size = os.fstat(f.fileno()).st_size
    except CorruptBlockError as exc:
        return str(exc)
    except OSError as exc:
        return f"{name}: unreadable ({exc.strerror})"
    if len(data) < header.nbytes:
        return f"{name}: truncated ({len(data)} of {header.nbytes} data bytes)"
    if size != file_size(header.nbytes):
        return f"{name}: {size} bytes, expected {file_size(header.nbytes)} (trailing bytes)"
    if checksum(data) != header.checksum:
        return f"{name}: data checksum mismatch"
    return None
