"""The storage of local paths (see `protocol.Storage`): files on this host's filesystems,
read with the checks of `headers.py` (regular files only, sizes bounded, strict json)."""
from __future__ import annotations

import os
import stat
from typing import Any, Mapping, Sequence

from ..errors import CheckpointError
from ..headers import MAX_HEADER, FileIdentity, TensorEntry, entries_of_file, read_json
from .ranges import FileRanges, local_ranges


class LocalStorage:
    remote = False

    def join(self, folder: str, name: str) -> str:
        return os.path.join(folder, name)

    def dirname(self, path: str) -> str:
        return os.path.dirname(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)  # anything: reading a directory or a FIFO there is refused, naming it

    def list(self, folder: str) -> list[str] | None:
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []

    def read(self, path: str, what: str, limit: int = MAX_HEADER) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens without waiting
            with os.fdopen(fd, "rb") as f:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
                    raise CheckpointError(f"{path}: not a regular file of at most {limit} bytes, so not {what}.")
                return f.read()
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror or exc}); check the path.") from exc

    def read_json(self, path: str, what: str) -> Any:
        return read_json(path, what)

    def headers(self, files: Sequence[str]) -> list[tuple[list[TensorEntry], int, Any]]:
        return [entries_of_file(path) for path in files]


    def ranges(self, windows: Mapping[str, Sequence[tuple[int, int]]]) -> dict[str, FileRanges]:
        return {path: local_ranges(path, FileIdentity.of) for path in windows}  # pread: nothing ahead
