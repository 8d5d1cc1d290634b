"""An optional local cache of fetched ranges (`RemoteOptions(cache_dir=...)`), for repeated
loads of the same checkpoint at the same rank and world.

Each GET's bytes are kept in a file named by where they came from (the store's endpoint,
scheme://host:port, and the object's URL), the object's identity (a strong ETag, version,
size) and the range: a changed object is never answered from the cache, nor are bytes one
endpoint (a mirror) served for the ETag another published. Objects without a strong ETag
are not cached: nothing would tell their versions apart. Each entry holds the sha256 of its
bytes, checked on every read (a mismatch is a miss, the entry removed). Entries are written
to a temp file, fsynced, then renamed. The directory must be the user's own (created 0700):
bytes anyone else can write there would be loaded into the model as they are.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile

from ..errors import RemoteError

logger = logging.getLogger("lazyload")
_DIGEST = hashlib.sha256().digest_size


def is_strong(etag: str | None) -> bool:
    """An ETag that names one exact content (a weak `W/` one allows equivalent others)."""
    return bool(etag) and not etag.startswith("W/")


class RangeCache:
    """Ranges of objects under `directory`, which is created 0700 or refused (`RemoteError`)
    when other users can write it."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(os.fspath(directory))
        _own_directory(self.directory)

    def path(self, endpoint: str, url: str, identity, start: int, end: int) -> str | None:
        """The entry's file; None for an object that must not be cached (no strong ETag)."""
        if identity is None or not is_strong(identity.etag):
            return None
        name = hashlib.sha256(f"{endpoint}\0{url}\0{identity.etag}\0{identity.version}\0{identity.size}".encode())
        return os.path.join(self.directory, name.hexdigest()[:32], f"{start}-{end}")

    def get(self, path: str, start: int, end: int) -> bytes | None:
        try:
            with open(path, "rb") as f:
                stored = f.read()
        except OSError:
            return None
        digest, data = stored[:_DIGEST], stored[_DIGEST:]
        if len(data) == end - start and hashlib.sha256(data).digest() == digest:
            return data
        logger.warning("%s: cache entry of bytes %d..%d does not match its digest; removed, fetched again",
                       path, start, end)
        try:
            os.remove(path)
        except OSError:
            pass
        return None

    def put(self, path: str, data) -> None:
        """Best effort: a cache that cannot be written (full, read-only) is only a slower load."""
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(data).digest())
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # a crash leaves the old entry or none, never a torn one
            os.replace(tmp, path)
        except OSError:
            pass


def _own_directory(directory: str) -> None:
    """Create `directory` 0700, or check that only the current user can write it."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory)
    except OSError as exc:
        raise RemoteError(f"cache_dir {directory}: cannot be created ({exc.strerror}); pass another "
                          "RemoteOptions(cache_dir=...), or None.") from None
    if not stat.S_ISDIR(info.st_mode):
        raise RemoteError(f"cache_dir {directory}: not a directory; pass a directory of your own.")
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise RemoteError(f"cache_dir {directory}: owned by user {info.st_uid}, not by you ({os.geteuid()}); "
                          "whoever owns it could put other bytes in the cache. Use a directory of your own.")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RemoteError(f"cache_dir {directory}: writable by its group or by others (mode "
                          f"{stat.S_IMODE(info.st_mode):o}), who could put other bytes in the cache; "
                          f"`chmod 700 {directory}` or use a directory of your own.")
