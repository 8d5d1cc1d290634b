"""Ranged GETs of remote objects, with what every store shares: the options of a remote
load, the identity of an object (ETag, version, size), retries with backoff on transient
failures, and the per-rank counts (requests, retries, bytes requested and served).

A store (`http.py`, `s3.py`) answers one attempt: `attempt(key, start, end, identity)`
returns a `Response` or raises `Transient` (timeouts, 5xx, 429, dropped connections) or a
`RemoteError` subclass (missing, denied, changed). `Store.get` retries the transient ones,
checks each answer against the identity the index recorded, and counts.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..errors import AccessDeniedError, ArgumentError, ObjectChangedError, ObjectNotFoundError, RemoteError
from ..redact import printable, redact, register_secret
from .cache import Pending, RangeCache

MAX_BACKOFF = 10.0  # seconds: the longest wait between two attempts, before jitter
TRANSIENT_STATUS = (408, 425, 429, 500, 502, 503, 504)  # HTTP statuses worth another attempt
RERUN = "re-run the load (and re-index: a new LazyCheckpoint) once the checkpoint is complete and stable."


@dataclass(frozen=True)
class RemoteOptions:
    """How a remote checkpoint is read (`LazyCheckpoint(url, remote=RemoteOptions(...))`).

    - `concurrency`: GETs in flight per rank.
    - `merge_gap`: two ranges of one read item at most this many bytes apart are fetched by
      one GET, the gap read and dropped. A request costs about its latency times the
      connection's bandwidth (30 ms at 100 MB/s is 3 MB), so short gaps are cheaper read
      than asked for separately; 0 asks for exact ranges only.
    - `part_bytes`: the largest single GET; longer ranges are split, so that one large
      tensor is fetched over several connections.
    - `header_bytes`: the first GET of each file while indexing; a header that fits is read
      in one request, a longer one costs a second.
    - `retries`, `backoff`: attempts after a transient failure (a timeout, a dropped
      connection, HTTP 408/429/5xx), the first wait in seconds (doubled each time, at most
      `MAX_BACKOFF`, with jitter); a failure that cannot heal (TLS, an unknown host, a
      refused connection, an invalid URL) is not retried. `timeout`: seconds per attempt,
      from the name lookup and connect to its last byte, redirects included (a slow resolver,
      a server slow to accept or trickling bytes cannot stretch it).
    - `cache_dir`: keep every fetched range of tensor bytes in this directory (`cache.py`),
      so that loading again at the same rank and world fetches none of them; None (the
      default) writes nothing to disk."""

    concurrency: int = 16
    merge_gap: int = 1 << 20
    part_bytes: int = 8 << 20
    header_bytes: int = 64 << 10
    retries: int = 5
    backoff: float = 0.2
    timeout: float = 60.0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        timeout = self.timeout  # every attempt's deadline is this many seconds after it starts
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ArgumentError(f"RemoteOptions(timeout={timeout!r}): seconds per attempt, a number > 0 (the "
                                "default is 60.0); an attempt cannot go without a deadline.")


@dataclass(frozen=True)
class ObjectIdentity:
    """What an object was when its header was read: a later GET that finds another ETag,
    version, size or date is refused (as a local file replaced since it was indexed is).
    `etag` is the store's ETag only (None without one); `last_modified` its HTTP date,
    which conditions a GET by `If-Unmodified-Since` where there is no strong ETag."""

    size: int
    etag: str | None
    version: str | None = None
    last_modified: str | None = None

    @property
    def versioned(self) -> bool:
        """Whether another version of the object can be told from this one (by more than its size)."""
        return bool(self.etag or self.version or self.last_modified)


@dataclass(frozen=True)
class Response:
    data: bytes | memoryview  # empty when the body went straight into the caller's buffers (`landed`)
    size: int  # the whole object's
    etag: str | None
    version: str | None = None
    last_modified: str | None = None
    landed: int = 0  # body bytes written into the caller's buffers (`into`) rather than held in `data`

    @property
    def served(self) -> int:
        return len(self.data) + self.landed

    @property
    def identity(self) -> ObjectIdentity:
        return ObjectIdentity(self.size, self.etag, self.version, self.last_modified)


Into = Callable[[], Iterable[memoryview]]  # where a GET's body goes (Store.get's `into`)


def land(response: Response, into: Into | None) -> Response:
    """`response` with the bytes it holds copied into `into()`'s buffers, in order (as a
    store that streams would have written them)."""
    if into is None or not response.data:
        return response
    body = Body(into(), len(response.data))
    body.write(response.data)
    return Response(b"", response.size, response.etag, response.version, response.last_modified, body.landed)


class Body:
    """A GET's body as it arrives, of which `limit` bytes are wanted: each chunk is counted
    (`served`: every byte that came, the honest count) and copied into `views` in turn;
    `over` once more came than wanted (the caller stops reading: an endless body is never
    pulled), the excess dropped."""

    def __init__(self, views: Iterable[memoryview], limit: int):
        self.views, self.limit = iter(views), limit
        self.view, self.used, self.served = next(self.views, None), 0, 0

    @property
    def over(self) -> bool:
        return self.served > self.limit

    @property
    def landed(self) -> int:
        return min(self.served, self.limit)

    def write(self, chunk) -> None:
        data = memoryview(chunk).cast("B")
        keep = max(0, min(len(data), self.limit - self.served))
        self.served += len(data)
        data = data[:keep]
        while data and self.view is not None:
            n = min(len(self.view) - self.used, len(data))
            self.view[self.used:self.used + n] = data[:n]
            self.used, data = self.used + n, data[n:]
            if self.used == len(self.view):
                self.view, self.used = next(self.views, None), 0


class Transient(Exception):
    """A failure worth retrying; `served`: body bytes that arrived before it."""

    def __init__(self, reason: str, served: int = 0):
        super().__init__(reason)
        self.served = served


def refused(error: RemoteError, served: int) -> RemoteError:
    """`error`, marked with the body bytes that arrived before it (counted by `Store.get`)."""
    error.served = served
    return error


@dataclass
class Stats:
    """Per-rank counts of one load (or of indexing): every attempt is a request."""

    requests: int = 0
    retries: int = 0
    bytes_requested: int = 0
    bytes_served: int = 0
    bytes_cached: int = 0  # read from the local cache instead of the store
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, requested: int, served: int, retried: bool) -> None:
        with self._lock:
            self.requests += 1
            self.retries += retried
            self.bytes_requested += requested
            self.bytes_served += served

    def cached(self, n: int) -> None:
        with self._lock:
            self.bytes_cached += n

    def fields(self) -> dict[str, int]:
        """The LoadReport fields."""
        return dict(requests=self.requests, retries=self.retries, bytes_requested=self.bytes_requested,
                    bytes_served=self.bytes_served, bytes_cached=self.bytes_cached)


def backoff(first: float, attempt: int) -> float:
    """The wait before retry `attempt + 1` (before jitter): `first`, doubled each time, capped."""
    return min(first * 2.0 ** min(attempt, 64), MAX_BACKOFF)


class Store:
    """One kind of object store; subclasses implement `attempt` (and `list` where the store
    can list). `secrets`: credential values that must never appear in a message; `endpoint`:
    scheme://host:port its requests go to, part of every cache entry's name."""

    endpoint = ""

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.secrets: tuple[str, ...] = ()  # also registered (`redact.register_secret`): never shown anywhere
        self.cache = RangeCache(options.cache_dir) if options.cache_dir else None

    def hold_secrets(self, *values: str | None) -> None:
        """The credentials this store was given: masked in its messages and in any other."""
        self.secrets = tuple(v for v in values if v)
        register_secret(*self.secrets)

    def url(self, key: str) -> str:
        raise NotImplementedError

    def attempt(self, key: str, start: int, end: int, identity: ObjectIdentity | None, into: Into | None = None
                ) -> Response:
        """One request. A store that can stream writes the body into `into()`'s buffers and
        returns it `landed`; one that cannot ignores `into` (`get` copies its `data` there)."""
        raise NotImplementedError

    def list(self, prefix: str) -> list[str]:
        """Keys directly under `prefix`, and the folders there (ending in "/"); a store that
        cannot list returns None."""
        return None

    def close(self) -> None:
        """Close idle connections (they are opened again when needed)."""

    def get(self, key: str, start: int, end: int, stats: Stats, identity: ObjectIdentity | None = None,
            into: Into | None = None) -> Response:
        """Bytes [start, end) of the object (fewer when it ends first, while indexing),
        retried on transient failures; checked against `identity` when given. With a cache,
        ranges of an object of known identity (a strong ETag) come from it when they are there.
        `into`: a function giving the buffers the bytes go to (writable views, in order, as
        long as the range together; called again for a retry); the response then holds none
        of them. A cached range is read and written through the same views, chunk by chunk."""
        entry = self.cache.path(self.endpoint, self.url(key), identity, start, end) if self.cache else None
        if entry is not None and into is not None:
            return self._through_cache(key, start, end, stats, identity, entry, into)
        if entry is not None:  # wanted whole (header bytes)
            data = self.cache.get(entry, start, end)
            if data is not None:
                stats.cached(len(data))
                return Response(data, identity.size, identity.etag, identity.version)
        response = self._fetch(key, start, end, stats, identity, into)
        if entry is not None:
            self.cache.put(entry, response.data)
        return land(response, into)

    def _through_cache(self, key: str, start: int, end: int, stats: Stats, identity: ObjectIdentity, entry: str,
                       into: Into) -> Response:
        """The range read from its cache entry into `into()`'s views; on a miss fetched into
        them, each view written to a new entry as it is filled (kept once the GET is checked)."""
        if self.cache.read_into(entry, start, end, into()):
            stats.cached(end - start)
            return Response(b"", identity.size, identity.etag, identity.version, landed=end - start)
        pending = Pending(entry, end - start)

        def teed():
            return pending.tee(into())

        try:
            response = land(self._fetch(key, start, end, stats, identity, teed), teed)
        except BaseException:
            pending.discard()
            raise
        pending.keep()
        return response

    def _fetch(self, key: str, start: int, end: int, stats: Stats, identity: ObjectIdentity | None,
               into: Into | None) -> Response:
        for attempt in range(self.options.retries + 1):
            try:
                response = self.attempt(key, start, end, identity, into)
            except RemoteError as exc:  # counted too: a refused answer's bytes came over the wire
                stats.add(end - start, getattr(exc, "served", 0), retried=False)
                raise
            except Transient as exc:
                stats.add(end - start, exc.served, retried=attempt < self.options.retries)
                if attempt == self.options.retries:
                    raise RemoteError(f"{self.url(key)}: bytes {start}..{end} still failing after "
                                      f"{self.options.retries} retries ({redact(str(exc), self.secrets)}); check "
                                      "the store and the network, then load again.") from None
                time.sleep(backoff(self.options.backoff, attempt) * (0.5 + random.random()))
                continue
            stats.add(end - start, response.served, retried=False)
            if identity is not None:
                self.check(key, identity, response)
            return response
        raise AssertionError("unreachable")

    def check(self, key: str, identity: ObjectIdentity, response: Response) -> None:
        found = response.identity
        for what, old, new in (("size", identity.size, found.size), ("ETag", identity.etag, found.etag),
                               ("version", identity.version, found.version),
                               ("Last-Modified", identity.last_modified, found.last_modified)):
            if old != new:
                raise ObjectChangedError(f"{self.url(key)}: changed since it was indexed ({what} {printable(old)} "
                                         f"when indexed, {printable(new)} now); {RERUN}")

    # The errors of one attempt, each naming the URL and nothing secret.

    def not_found(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"{self.url(key)}: no such object; check the URL (and the revision or prefix).")

    def denied(self, key: str, status: str) -> AccessDeniedError:
        return AccessDeniedError(f"{self.url(key)}: access denied ({status}); check the store's credentials "
                                 f"({self.credentials_hint}) and that they grant read access.")

    def changed(self, key: str, identity: ObjectIdentity | None, how: str = "") -> ObjectChangedError:
        """`how`: what the store's answer showed (said after the ETag indexed)."""
        said = [f"ETag {printable(identity.etag)} when indexed"] if identity is not None and identity.etag else []
        said += [how] if how else []
        return ObjectChangedError(f"{self.url(key)}: changed since it was indexed"
                                  f"{' (' + '; '.join(said) + ')' if said else ''}; {RERUN}")

    credentials_hint = "its standard configuration"
