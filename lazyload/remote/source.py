"""A remote checkpoint: what a URL names (its safetensors files, its index json) and its
Index, from range requests alone.

Each file's first `header_bytes` come in one GET, which also tells the object's size and
ETag (its identity for the readers); a longer header costs a second GET of the rest. All
files are indexed concurrently; `model.safetensors.index.json` is read once. Nothing else
is read until a load.
"""
from __future__ import annotations

import logging
import posixpath
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError, ObjectNotFoundError, RemoteError
from ..headers import (MAX_HEADER, TensorEntry, check_weight_map, entries_of_header, header_length, load_json,
                       weight_map_of)
from ..index import INDEX_JSON, CheckpointIndex
from ..redact import printable
from .store import ObjectIdentity, RemoteOptions, Stats, Store

logger = logging.getLogger("lazyload")

SCHEMES = ("s3://", "http://", "https://", "hf://")
CONFIG_JSON = "config.json"
MAX_CONFIG = 16 << 20  # the largest config.json read; real ones are kilobytes


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


class RemoteCheckpoint:
    """The files a URL names in its store: `s3://bucket/prefix/` (its index json, else every
    `*.safetensors` directly under it), `https://host/path/` and `hf://org/repo[@rev]` (the
    index json, else `model.safetensors`: HTTP cannot list), or one `.safetensors` or
    `.index.json` object."""

    def __init__(self, url: str, options: RemoteOptions | None = None):
        self.options = options or RemoteOptions()
        self.store, key = open_store(url, self.options)
        self.stats = Stats()  # indexing's requests
        self.index_json: str | None = None
        self.config_json: tuple[str, bytes] | None = None  # (URL, bytes) of its config.json, once indexed
        self._weight_map: dict[str, str] | None = None
        if key.endswith(".safetensors"):
            keys = [key]
        elif key.endswith(".index.json"):
            keys = self._from_index_json(key)
        else:
            prefix = key if not key or key.endswith("/") else key + "/"
            try:
                keys = self._from_index_json(prefix + INDEX_JSON)
            except ObjectNotFoundError:
                keys = self._listed(url, prefix)
        self.keys = {self.store.url(k): k for k in keys}  # file URL -> key
        self.files = list(self.keys)

    def _whole(self, key: str, limit: int, what: str) -> bytes:
        """A small object, whole: its first `header_bytes`, then the rest (from the same
        version of the object); refused when longer than `limit`."""
        first = self.store.get(key, 0, self.options.header_bytes, self.stats)
        if first.size > limit:
            raise CheckpointError(f"{self.store.url(key)}: {first.size} bytes, too big for {what}; it is not one.")
        raw = bytes(first.data)
        if first.size > len(raw):  # the rest, from the same version of the object
            identity = first.identity
            raw += bytes(self.store.get(key, len(raw), first.size, self.stats, identity).data)
        return raw

    def _config_json(self) -> tuple[str, bytes] | None:
        """(URL, bytes) of the config.json beside the checkpoint's files (where a local
        checkpoint's is read: beside its first file); None when there is none."""
        key = posixpath.join(posixpath.dirname(self.keys[self.files[0]]), CONFIG_JSON)
        try:
            return self.store.url(key), self._whole(key, MAX_CONFIG, "a config.json")
        except ObjectNotFoundError:
            return None

    def _from_index_json(self, key: str) -> list[str]:
        url = self.store.url(key)
        raw = self._whole(key, MAX_HEADER, "an index json")
        folder = posixpath.dirname(key)
        names = weight_map_of(url, load_json(url, raw, "index json"))
        for name in set(names.values()):
            if printable(name) != name:  # a control character: it would be one in every message naming the file
                raise CheckpointError(f"{url}: names the file {printable(name)!r}, with a control character; no "
                                      "checkpoint file is named so. Fix the index json.")
        self.index_json = url
        self._weight_map = {k: self.store.url(posixpath.join(folder, name)) for k, name in names.items()}
        return sorted({posixpath.join(folder, name) for name in names.values()})

    def _listed(self, url: str, prefix: str) -> list[str]:
        listed = self.store.list(prefix)
        if listed is None:  # HTTP: no listing; a single-file checkpoint has a known name
            return [prefix + "model.safetensors"]
        keys = sorted(k for k in listed if k.endswith(".safetensors"))
        if not keys:
            raise ObjectNotFoundError(f"{url}: holds no {INDEX_JSON} and no *.safetensors object; check the URL.")
        return keys

    def index(self) -> CheckpointIndex:
        """The Index, every file's header read concurrently (and `config_json`, beside them)."""
        try:
            with ThreadPoolExecutor(min(self.options.concurrency, len(self.files) + 1)) as pool:
                config = pool.submit(self._config_json)
                headers = list(pool.map(self._header, self.files))
                self.config_json = config.result()
        finally:
            self.store.close()
        entries = [(e.key, e) for file_entries, _ in headers for e in file_entries]
        identities = {url: identity for url, (_, identity) in zip(self.files, headers)}
        for url, identity in identities.items():
            if not identity.versioned:
                logger.warning("lazyload: %s: the server sends neither ETag nor Last-Modified, so a change of the "
                               "file during a load cannot be detected (the model would hold a mix of old and new "
                               "weights); the load report lists it under `unversioned`", url)
        index = CheckpointIndex.of(self.files, entries, header_bytes_read=self.stats.bytes_served,
                                   description=self.index_json, identities=identities)
        if self._weight_map is not None:
            check_weight_map(self.index_json, self._weight_map, index, lambda a, b: a == b)
        return index

    def _header(self, url: str) -> tuple[list[TensorEntry], ObjectIdentity]:
        key = self.keys[url]
        first = self.store.get(key, 0, self.options.header_bytes, self.stats)
        identity = first.identity
        raw = bytes(first.data)
        length = header_length(url, raw[:8], identity.size)
        if 8 + length > len(raw):  # a long header: the rest, from the same version of the object
            raw += bytes(self.store.get(key, len(raw), 8 + length, self.stats, identity).data)
        return entries_of_header(url, raw[8:8 + length], 8 + length, identity.size), identity
