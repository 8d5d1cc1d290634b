"""An optional local cache of fetched ranges (`RemoteOptions(cache_dir=...)`), for repeated
loads of the same checkpoint at the same rank and world: each GET's bytes are kept in a
file named by the object's URL and identity (ETag, version, size) and the range, so that a
changed object is never answered from the cache. Files are written whole, then renamed."""
from __future__ import annotations

import hashlib
import os
import tempfile


class RangeCache:
    """Ranges of objects; `version`: what identifies the object's content (its ETag,
    version id and size), part of every name."""

    def __init__(self, directory: str):
        self.directory = directory

    def _path(self, url: str, version: str, start: int, end: int) -> str:
        name = hashlib.sha256(f"{url}\0{version}".encode()).hexdigest()
        return os.path.join(self.directory, name[:32], f"{start}-{end}")

    def get(self, url: str, version: str, start: int, end: int) -> bytes | None:
        try:
            with open(self._path(url, version, start, end), "rb") as f:
                data = f.read()
        except OSError:
            return None
        return data if len(data) == end - start else None

    def put(self, url: str, version: str, start: int, end: int, data) -> None:
        """Best effort: a cache that cannot be written (full, read-only) is only a slower load."""
        path = self._path(url, version, start, end)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            pass
