"""HTTP(S) objects: `https://host/path` and the Hugging Face Hub (`hf://`, through its
`/{repo}/resolve/{revision}/{file}` URLs), one ranged GET per request.

Client: the standard library's `http.client`, one keep-alive connection per thread and
host. Measured against the tests' Range server (`benchmarks/bench_clients.py`; ranged 4 KiB
GETs, one thread): 1,000 in 0.25 s with http.client, 0.42 s with obstore's HTTPStore,
0.45-1.0 s with urllib3; 300 in 0.12, 0.14 and 0.20 s. 1 MiB ranges cost the same with
each. Fewest microseconds per request, and no dependency.
"""
from __future__ import annotations

import http.client
import os
import socket
import threading
from urllib.parse import quote, urljoin, urlsplit

from ..errors import RemoteError
from .store import ObjectIdentity, RemoteOptions, Response, Store, Transient

_REDIRECTS = (301, 302, 303, 307, 308)
_TRANSIENT = (408, 425, 429, 500, 502, 503, 504)


class HttpStore(Store):
    """Objects under `base` (scheme://host[:port]/prefix/); keys are paths below it.
    `token`: a bearer token sent to `base`'s host only (never to a redirect's other host)."""

    def __init__(self, base: str, options: RemoteOptions, token: str | None = None, display: str | None = None,
                 credentials_hint: str = "lazyload sends none over https://; the server must allow the read"):
        super().__init__(options)
        self.base = base if base.endswith("/") else base + "/"
        self.display = display or self.base  # what messages call the prefix (hf://org/repo@rev/)
        self.endpoint = "{0.scheme}://{0.netloc}".format(urlsplit(self.base))
        self._token = token
        self.secrets = (token,) if token else ()
        self.credentials_hint = credentials_hint
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()  # every thread's, to close
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return self.display + key

    def attempt(self, key: str, start: int, end: int, identity: ObjectIdentity | None) -> Response:
        url = self.base + quote(key)
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        if identity is not None and identity.etag and not identity.etag.startswith("W/"):
            headers["If-Match"] = identity.etag  # a strong ETag: the store refuses another version (412)
        host = urlsplit(url).netloc
        for _ in range(5):
            send = dict(headers)
            if self._token and urlsplit(url).netloc == host:
                send["Authorization"] = f"Bearer {self._token}"
            response, data = self._request(url, send, key)
            if response.status in _REDIRECTS and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                continue
            return self._answer(key, start, end, identity, response, data)
        raise RemoteError(f"{self.url(key)}: too many redirects; check the URL.")

    def _request(self, url: str, headers: dict, key: str) -> tuple[http.client.HTTPResponse, bytes]:
        parts = urlsplit(url)
        conn = self._connection(parts.scheme, parts.netloc)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        served = 0
        try:
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            data = response.read()
            return response, data
        except http.client.IncompleteRead as exc:
            served = len(exc.partial)
            reason = f"connection closed after {served} of {served + (exc.expected or 0)} bytes"
        except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, a closed keep-alive
            reason = type(exc).__name__ if isinstance(exc, socket.timeout) else f"{type(exc).__name__}: {exc}"
        self._drop(parts.scheme, parts.netloc)
        raise Transient(reason, served)

    def _answer(self, key, start, end, identity, response, data) -> Response:
        status = response.status
        if status in (200, 206):
            size = _object_size(response, len(data))
            if status == 200:  # the server ignored the range: the whole object came
                data = memoryview(data)[start:end]
            if len(data) != min(end, size) - start:
                raise Transient(f"{len(data)} bytes instead of {min(end, size) - start}", len(data))
            return Response(data, size, response.getheader("ETag") or response.getheader("Last-Modified"))
        if status in (404, 410):
            raise self.not_found(key)
        if status in (401, 403):
            raise self.denied(key, f"HTTP {status}")
        if status == 416 and identity is None and start == 0:  # an empty object, while indexing
            return Response(b"", 0, response.getheader("ETag"))
        if status in (412, 416):
            raise self.changed(key, identity)
        if status in _TRANSIENT:
            raise Transient(f"HTTP {status}")
        raise RemoteError(f"{self.url(key)}: HTTP {status} {response.reason}; lazyload needs a server that "
                          "answers ranged GETs (206).")

    def _connection(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((scheme, netloc))
        if conn is None:
            cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = conns[(scheme, netloc)] = cls(netloc, timeout=self.options.timeout)
        with self._lock:  # again after a close: a closed connection reconnects on its next request
            self._open.add(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()

    def _drop(self, scheme: str, netloc: str) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((scheme, netloc), None)
        if conn is not None:
            with self._lock:
                self._open.discard(conn)
            conn.close()


def _object_size(response: http.client.HTTPResponse, length: int) -> int:
    content_range = response.getheader("Content-Range") or ""
    total = content_range.rpartition("/")[2]
    return int(total) if total.isdigit() else length


def hf_store(url: str, options: RemoteOptions) -> tuple[HttpStore, str]:
    """`hf://org/repo[@revision][/path]` -> (a store over its resolve URLs, the path).
    The endpoint is HF_ENDPOINT (default the Hub), the token huggingface_hub's (HF_TOKEN,
    or `hf auth login`) when it is installed, else HF_TOKEN."""
    rest = url[len("hf://"):]
    parts = rest.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1] or parts[0] in ("datasets", "spaces"):
        raise RemoteError(f"{url}: an hf:// URL names a model repo, hf://org/name[@revision][/path] (datasets "
                          "and spaces are not supported).")
    name, _, revision = parts[1].partition("@")
    repo, path = f"{parts[0]}/{name}", "/".join(parts[2:])
    revision = revision or "main"
    endpoint = os.environ.get("HF_ENDPOINT")
    token = os.environ.get("HF_TOKEN")
    try:
        from huggingface_hub import constants, get_token

        endpoint = endpoint or constants.ENDPOINT
        token = get_token()
    except ImportError:
        pass
    endpoint = (endpoint or "https://huggingface.co").rstrip("/")
    base = f"{endpoint}/{repo}/resolve/{quote(revision, safe='')}/"
    return HttpStore(base, options, token, display=f"hf://{repo}@{revision}/",
                     credentials_hint="HF_TOKEN, or `hf auth login`"), path


def http_store(url: str, options: RemoteOptions) -> tuple[HttpStore, str]:
    """`http(s)://host/path` -> (a store over the host, the path)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise RemoteError(f"{parts.scheme}://{parts.hostname}{parts.path}: credentials in the URL are not "
                          "supported (they would end up in messages).")
    return HttpStore(f"{parts.scheme}://{parts.netloc}/", options), parts.path.lstrip("/")
