"""A remote checkpoint: the storage (`formats.protocol.Storage`) of a URL's store, so that
every format registered with `remote=True` reads its metadata here as it reads local files
(safetensors files and index jsons, lazyload's pre-sharded layout), from range requests
alone. A path is the object's URL (`store.url(key)`); `keys` maps the files of the Index
back to their keys, for the reader.

Each object's first `header_bytes` come in one GET, which also tells its size and ETag
(its identity for the readers) and is kept: a probe (`exists`) costs no second request
when the object is then read. A longer header or json costs a second GET of the rest,
from the same version of the object. All files' headers are read concurrently. Nothing
else is read until a load.
"""
from __future__ import annotations

import logging
import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from ..errors import AccessDeniedError, CheckpointError, ObjectNotFoundError, RemoteError
from ..formats import CheckpointSource, OpenOptions, open_in, resolve_in
from ..formats.ranges import FileRanges, merged
from ..headers import MAX_HEADER, TensorEntry, entries_of_header, header_length, load_json
from ..index import CheckpointIndex
from .store import ObjectIdentity, RemoteOptions, Response, Stats, Store

logger = logging.getLogger("lazyload")

SCHEMES = ("s3://", "http://", "https://", "hf://")
CONFIG_JSON = "config.json"
MAX_CONFIG = 16 << 20  # the largest config.json read; real ones are kilobytes
# A URL ending in one of these names an object; any other names a prefix (a folder).
FILE_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth")


def is_remote(path: object) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def open_store(url: str, options: RemoteOptions) -> tuple[Store, str]:
    """(the store a URL lives in, the key or prefix it names there)."""
    if url.startswith("s3://"):
        bucket, _, key = url[len("s3://"):].partition("/")
        if not bucket:
            raise RemoteError(f"{url}: an s3:// URL names a bucket, s3://bucket/prefix/.")
        from .s3 import S3Store

        return S3Store(bucket, options), key
    from .http import hf_store, http_store

    return hf_store(url, options) if url.startswith("hf://") else http_store(url, options)


class _Keys(dict):
    """URL -> key, worked out when first asked (any file a format names under the store's root)."""

    def __init__(self, key):
        super().__init__()
        self._key = key

    def __missing__(self, url: str) -> str:
        self[url] = self._key(url)
        return self[url]


class RemoteCheckpoint:
    """What a URL names in its store, by the registered formats: `s3://bucket/prefix/` (its
    index json, else every `*.safetensors` directly under it), `https://host/path/` and
    `hf://org/repo[@rev]` (the index json, else `model.safetensors`: HTTP cannot list), one
    `.safetensors` or `.index.json` object, a pre-sharded copy's folder or its
    `lazyload_sharded.json`."""

    remote = True

    def __init__(self, url: str, options: RemoteOptions | None = None, iteration: int | None = None):
        self.options = options or RemoteOptions()
        self.store, key = open_store(url, self.options)
        self.stats = Stats()  # indexing's requests
        self.keys: dict[str, str] = _Keys(self.key)  # file URL -> key, for the reader
        self.config_json: tuple[str, bytes] | None = None  # (URL, bytes) of its config.json, once indexed
        self._first: dict[str, Response] = {}  # key -> its first GET, kept for the read that follows a probe
        self._read: dict[str, bytes] = {}  # key -> a small object read whole
        self._absent: set[str] = set()  # keys a probe found missing: another format's probe costs no request
        self._listed: dict[str, list[str] | None] = {}  # prefix -> its listing
        self._root = self.store.url("")
        self.source: CheckpointSource = resolve_in(self, self.store.url(key), iteration)
        self.files = self.source.files

    # The storage protocol, over URLs.

    def key(self, url: str) -> str:
        if not url.startswith(self._root):
            raise CheckpointError(f"{url}: outside the store of this checkpoint ({self._root}); a description "
                                  "names files beside it only.")
        return url[len(self._root):]

    def join(self, folder: str, name: str) -> str:
        return posixpath.join(folder, name)

    def dirname(self, path: str) -> str:
        return posixpath.dirname(path)

    def is_dir(self, path: str) -> bool:
        return not path.endswith(FILE_SUFFIXES)

    def exists(self, path: str) -> bool:
        """On S3 a refused probe counts as absent: S3 answers 403 for a missing key to a
        caller without ListBucket (a real denial is raised by the read that follows). Other
        stores say 404 for a missing object, so their denial is raised here."""
        key = self.key(path)
        if key in self._absent:
            return False
        try:
            self._first_get(key)
        except ObjectNotFoundError:
            self._absent.add(key)
            return False
        except AccessDeniedError:
            if not self._root.startswith("s3://"):
                raise
            self._absent.add(key)
            return False
        return True

    def list(self, folder: str) -> list[str] | None:
        prefix = self.key(folder)
        prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        if prefix not in self._listed:  # formats asked in turn list the same folder
            self._listed[prefix] = self.store.list(prefix)
        listed = self._listed[prefix]
        if listed is None:
            return None
        names = (k[len(prefix):].removesuffix("/") for k in listed if k.startswith(prefix))  # folders end in "/"
        return sorted(name for name in names if name and "/" not in name)

    def read(self, path: str, what: str, limit: int = MAX_HEADER) -> bytes:
        key = self.key(path)
        if key not in self._read:
            self._read[key] = self._whole(key, limit, what)
        return self._read[key]

    def read_json(self, path: str, what: str) -> Any:
        return load_json(path, self.read(path, what), what)

    def ranges(self, windows: Mapping[str, Sequence[tuple[int, int]]]) -> dict[str, FileRanges]:
        """Each file's windows fetched ahead: touching ones by one GET; its first GET tells
        its identity (or finds it missing), the others are checked against it; all
        concurrently. A failure is kept for the first read of the file (where the format
        names the tensor); a later GET that failed is fetched again by the read that needs it."""
        gets = {url: merged(list(spans)) or [(0, 1)] for url, spans in windows.items()}
        windows_count = sum(len(g) for g in gets.values())
        with ThreadPoolExecutor(max(1, min(self.options.concurrency, windows_count))) as pool:
            firsts = dict(zip(gets, pool.map(self._window, gets, [g[0] for g in gets.values()])))
            later = [(url, window, firsts[url]) for url, g in gets.items() for window in g[1:]
                     if not isinstance(firsts[url], Exception)]
            spans = list(pool.map(lambda job: (job[0], self._window(*job)), later))
        fetched: dict[str, dict[int, bytes]] = {}  # per file, grouped once (not a pass over all spans per file)
        for url, span in spans:
            if not isinstance(span, Exception):
                fetched.setdefault(url, {})[span[0]] = span[1]
        out = {}
        for url, first in firsts.items():
            if isinstance(first, Exception):
                out[url] = FileRanges.failed(url, first)
                continue
            out[url] = FileRanges(url, first[2], self._fetcher(url, first[2]),
                                  {first[0]: first[1], **fetched.get(url, {})})
        return out

    def _window(self, url: str, window: tuple[int, int], first: Any = None) -> tuple | Exception:
        """(start, bytes, identity) of one window, or why it failed; `first`: the file's first."""
        identity = first[2] if first is not None else None
        try:
            response = self.store.get(self.keys[url], *window, self.stats, identity)
        except CheckpointError as exc:  # RemoteError among them
            return exc
        return window[0], bytes(response.data), response.identity

    def _fetcher(self, url: str, identity: ObjectIdentity):
        def fetch(start: int, end: int) -> bytes:
            return bytes(self.store.get(self.keys[url], start, end, self.stats, identity).data)

        return fetch

    def headers(self, files: Sequence[str]) -> list[tuple[list[TensorEntry], int, ObjectIdentity]]:
        with ThreadPoolExecutor(max(1, min(self.options.concurrency, len(files)))) as pool:
            return list(pool.map(self._header, files))

    # Requests.

    def _first_get(self, key: str) -> Response:
        if key not in self._first:
            self._first[key] = self.store.get(key, 0, self.options.header_bytes, self.stats)
        return self._first[key]

    def _whole(self, key: str, limit: int, what: str) -> bytes:
        """A small object, whole: its first `header_bytes`, then the rest (from the same
        version of the object); refused when longer than `limit`."""
        first = self._first_get(key)
        if first.size > limit:
            raise CheckpointError(f"{self.store.url(key)}: {first.size} bytes, too big for {what}; it is not one.")
        raw = bytes(first.data)
        if first.size > len(raw):  # the rest, from the same version of the object
            raw += bytes(self.store.get(key, len(raw), first.size, self.stats, first.identity).data)
        return raw

    def _header(self, url: str) -> tuple[list[TensorEntry], int, ObjectIdentity]:
        key = self.keys[url]
        first = self._first.pop(key, None) or self.store.get(key, 0, self.options.header_bytes, self.stats)
        identity = first.identity
        raw = bytes(first.data)
        length = header_length(url, raw[:8], identity.size)
        if 8 + length > len(raw):  # a long header: the rest, from the same version of the object
            raw += bytes(self.store.get(key, len(raw), 8 + length, self.stats, identity).data)
        return entries_of_header(url, raw[8:8 + length], 8 + length, identity.size), 8 + length, identity

    def _config_json(self) -> tuple[str, bytes] | None:
        """(URL, bytes) of the config.json beside the checkpoint's files (where a local
        checkpoint's is read: beside its first file); None when there is none."""
        key = posixpath.join(posixpath.dirname(self.key(self.files[0])), CONFIG_JSON)
        try:
            return self.store.url(key), self._whole(key, MAX_CONFIG, "a config.json")
        except ObjectNotFoundError:
            return None

    def index(self, trust_pickle: bool = False) -> CheckpointIndex:
        """The Index by the checkpoint's format (its headers read concurrently), and
        `config_json`, fetched beside them. `header_bytes_read`: every byte indexing fetched."""
        try:
            with ThreadPoolExecutor(1) as pool:
                config = pool.submit(self._config_json)
                index = open_in(self.source, self, OpenOptions(trust_pickle))
                self.config_json = config.result()
        finally:
            self.store.close()
        index.header_bytes_read = self.stats.bytes_served
        for url, identity in index.identities.items():
            if not identity.versioned:
                logger.warning("lazyload: %s: the server sends neither ETag nor Last-Modified, so a change of the "
                               "file during a load cannot be detected (the model would hold a mix of old and new "
                               "weights); the load report lists it under `unversioned`", url)
        return index
