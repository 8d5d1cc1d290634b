"""Small byte ranges of a checkpoint's files, read while indexing: the zip directory and
local headers of every chunk of a training checkpoint (`torch_zip`), thousands of them.

A format names the windows it expects to need per file (`Storage.ranges(windows)`); a
storage fetches them ahead (for a URL: overlapping or touching windows by one GET, the
files and GETs concurrently; locally nothing ahead, `pread` is cheap) and answers a
`FileRanges`, whose `read` serves a range from what came and fetches what did not (a zip
laid out otherwise than torch writes it costs a GET more, never a wrong answer). A read
past the end of the file, or an answer shorter than asked, is a CheckpointError naming the
file and what was read."""
from __future__ import annotations

import os
from typing import Any, Callable

from ..errors import CheckpointError

Window = tuple[int, int]  # [start, end) of a file


def merged(windows: list[Window], size: int | None = None) -> list[Window]:
    """`windows` sorted, clipped to `size` when known, overlapping or touching ones joined."""
    out: list[list[int]] = []
    for start, end in sorted(windows):
        end = end if size is None else min(end, size)
        if start >= end:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


class FileRanges:
    """Bytes of one file fetched ahead (`spans`: start -> bytes) and the file's identity;
    `fetch(start, end)` reads what the spans lack (exactly that, or fewer at the end).
    `error`: why the file could not be opened, raised by the first use (so that the format
    names the tensor that needed it)."""

    def __init__(self, path: str, identity: Any, fetch: Callable[[int, int], bytes],
                 spans: dict[int, bytes] | None = None, close: Callable[[], None] = lambda: None,
                 error: Exception | None = None):
        self.path, self._identity, self._error = path, identity, error
        self._fetch, self._close = fetch, close
        self._spans = sorted((spans or {}).items())

    @classmethod
    def failed(cls, path: str, error: Exception) -> "FileRanges":
        return cls(path, None, lambda start, end: b"", error=error)

    @property
    def identity(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._identity

    def read(self, offset: int, length: int, what: str) -> bytes:
        """Bytes [offset, offset + length) of the file; `what` names them in errors."""
        if offset < 0 or offset + length > self.identity.size:
            raise CheckpointError(f"{self.path}: the file ends inside {what} (bytes {offset}..{offset + length} of "
                                  f"{self.identity.size}); it is truncated or its metadata is wrong.")
        for start, data in self._spans:
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start:offset - start + length]
        data = self._fetch(offset, offset + length)
        if len(data) != length:
            raise CheckpointError(f"{self.path}: {what}: asked bytes {offset}..{offset + length}, got {len(data)} "
                                  "bytes; the file is truncated or the server answered short.")
        return data

    def close(self) -> None:
        self._close()


def local_ranges(path: str, identity_of: Callable[[os.stat_result], Any]) -> FileRanges:
    """A local file's `FileRanges`: every read a `pread` of exactly its bytes (so indexing
    reads no byte it does not parse), through one descriptor until `close`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return FileRanges.failed(path, CheckpointError(f"{path}: cannot read ({exc.strerror or exc}); the "
                                                       "checkpoint's metadata stores chunks in it."))
    return FileRanges(path, identity_of(os.fstat(fd)), lambda start, end: os.pread(fd, end - start, start),
                      close=lambda: os.close(fd))
