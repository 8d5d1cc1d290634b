"""Opening a checkpoint file for reading: as it was indexed, or a ReadError.

The index records each file's identity (size, inode, device, mtime) when it reads the
header; a file truncated, replaced or rewritten since would be read as if that header
still described it, so every open is checked against it, and `check_size` re-checks the
size of an open file before bytes are copied out of its mapping (a page beyond the end
of a shrunk file is SIGBUS, which no Python code can catch).
"""
from __future__ import annotations

import os

from ..errors import ReadError
from ..headers import FileIdentity

RERUN = "re-run the load (and re-index: a new LazyCheckpoint) once the checkpoint is complete and stable."


def open_checked(path: str, expected: FileIdentity | None) -> int:
    """An O_RDONLY fd of `path`, the file it was when indexed (`expected` None: not checked)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ReadError(f"{path}: cannot open for reading ({exc.strerror}); {RERUN}") from exc
    try:
        if expected is not None:
            found = FileIdentity.of(os.fstat(fd))
            if found != expected:
                raise ReadError(f"{path}: changed since it was indexed ({_difference(expected, found)}); {RERUN}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_size(fd: int, path: str, expected: FileIdentity | None, end: int) -> None:
    """The open file still holds byte `end - 1` and has its indexed size."""
    size = os.fstat(fd).st_size
    if size < end or (expected is not None and size != expected.size):
        indexed = f"{expected.size} bytes when indexed, " if expected is not None else ""
        raise ReadError(f"{path}: changed since it was indexed ({indexed}{size} now, data needed up to byte {end}); "
                        f"{RERUN}")


def _difference(expected: FileIdentity, found: FileIdentity) -> str:
    if (found.inode, found.device) != (expected.inode, expected.device):
        return "replaced by another file"
    if found.size != expected.size:
        return f"{expected.size} bytes when indexed, {found.size} now"
    return "modified since (another mtime)"
