"""An optional local cache of fetched ranges (`RemoteOptions(cache_dir=...)`), for repeated
loads of the same checkpoint at the same rank and world.

Each GET's bytes are kept in a file named by where they came from (the store's endpoint,
scheme://host:port, and the object's URL), the object's identity (a strong ETag, version,
size) and the range: a changed object is never answered from the cache, nor are bytes one
endpoint (a mirror) served for the ETag another published. Objects without a strong ETag
are not cached: nothing would tell their versions apart. Each entry holds the sha256 of its
bytes, checked on every read (a mismatch is a miss, the entry removed). Entries are written
to a temp file as the GET's body arrives (`Pending`), fsynced, and renamed only once the
whole range arrived and was checked; a hit is read into the caller's buffers piece by piece,
so neither holds the whole range. The directory must be the user's own (created 0700):
bytes anyone else can write there would be loaded into the model as they are.
"""
from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from typing import Iterable, Iterator

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
        """The entry's bytes, or None for a miss (`read_into`)."""
        data = bytearray(end - start)
        return bytes(data) if self.read_into(path, start, end, [memoryview(data)]) else None

    def read_into(self, path: str, start: int, end: int, views: Iterable[memoryview]) -> bool:
        """Read the entry into `views` (writable, in order, as long as the range together),
        each checked into the sha256 as it is filled: False for a miss, the views then holding
        nothing to trust (no entry; or a torn or altered one, removed and logged)."""
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                stored = f.read(_DIGEST)
                sound = os.fstat(f.fileno()).st_size == _DIGEST + end - start
                for view in views if sound else ():
                    if f.readinto(view) < len(view):  # buffered: short only at the end of the file
                        sound = False
                        break
                    digest.update(view)
        except OSError:
            return False
        if sound and digest.digest() == stored:
            return True
        logger.warning("%s: cache entry of bytes %d..%d does not match its digest; removed, fetched again",
                       path, start, end)
        _remove(path)
        return False

    def put(self, path: str, data) -> None:
        """Best effort: a cache that cannot be written (full, read-only) is only a slower load."""
        pending = Pending(path, len(data))
        for _ in pending.tee([memoryview(data)]):
            pass
        pending.keep()


class Pending:
    """A cache entry written as its GET's body arrives: `tee` hands the GET's views on and
    writes each to a temp file beside the entry once it is filled (a retry calls it again and
    starts the file over); `keep`, called once the GET is complete and checked, renames the
    file into place only when exactly the range was written. A GET that fails (`discard`),
    and a cache that cannot be written (full, read-only), leave no entry: only a slower load."""

    def __init__(self, path: str, n: int):
        self.path, self.n = path, n
        self.tmp: str | None = None
        self.file = None  # the temp file; None once it failed or is done
        self.digest = hashlib.sha256()
        self.written = 0

    def tee(self, views: Iterable[memoryview]) -> Iterator[memoryview]:
        self._start()
        for view in views:
            yield view  # the caller fills it, then asks for the next
            self._write(view)

    def _start(self) -> None:
        try:
            if self.tmp is None:
                os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(self.path))
                self.file = os.fdopen(fd, "wb")
            if self.file is not None:
                self.file.seek(0)
                self.file.truncate()
                self.file.write(bytes(_DIGEST))  # the digest's place, written by `keep`
        except OSError:
            self.discard()
        self.digest, self.written = hashlib.sha256(), 0

    def _write(self, view: memoryview) -> None:
        if self.file is None:
            return
        try:
            self.file.write(view)
        except OSError:
            return self.discard()
        self.digest.update(view)
        self.written += len(view)

    def keep(self) -> None:
        if self.file is None or self.written != self.n:
            return self.discard()
        try:
            self.file.seek(0)
            self.file.write(self.digest.digest())
            self.file.flush()
            os.fsync(self.file.fileno())  # a crash leaves the old entry or none, never a torn one
            self.file.close()
            os.replace(self.tmp, self.path)
            self.file = None
        except OSError:
            self.discard()

    def discard(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # its buffered bytes could not be written: the file goes anyway
                pass
            self.file = None
        if self.tmp is not None:
            _remove(self.tmp)


def _remove(path: str) -> None:
    try:
        os.remove(path)
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
