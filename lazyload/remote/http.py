"""HTTP(S) objects: `https://host/path` and the Hugging Face Hub (`hf://`, through its
`/{repo}/resolve/{revision}/{file}` URLs), one ranged GET per request.

Client: the standard library's `http.client`, one keep-alive connection per thread and
host. Measured against the tests' Range server (`benchmarks/bench_clients.py`; ranged 4 KiB
GETs, one thread): 1,000 in 0.25 s with http.client, 0.42 s with obstore's HTTPStore,
0.45-1.0 s with urllib3; 300 in 0.12, 0.14 and 0.20 s. 1 MiB ranges cost the same with
each. Fewest microseconds per request, and no dependency.

Nothing the server says is trusted: an answer must be a 206 whose `Content-Range` is
exactly the bytes asked for, unencoded, and no longer than asked (a body is never read
past that); a server that ignores Range is refused (it would send the whole object for
every request). The token goes to the endpoint's own https origin only, never after a
redirect has left it. Each attempt has one deadline for its name lookups, connects, TLS
handshakes and reads.
"""
from __future__ import annotations

import concurrent.futures
import functools
import http.client
import io
import logging
import os
import re
import socket
import ssl
import threading
import time
from typing import Iterable
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urljoin, urlsplit

from ..errors import RemoteError
from ..hub import repo_id_problem
from ..redact import printable, redact, register_secret
from .proxy import Proxy, proxy_for
from .store import TRANSIENT_STATUS, Into, ObjectIdentity, RemoteOptions, Response, Store, Transient, refused

logger = logging.getLogger("lazyload")

_REDIRECTS = (301, 302, 303, 307, 308)
_MAX_HOPS = 5
_DISCARD = 64 << 10  # a redirect's or an error's body is read up to this, to keep the connection
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)", re.ASCII)
_DEFAULT_PORT = {"http": 80, "https": 443}
# OpenSSL's reasons when the other side answers a ClientHello in plain text (an http:// server)
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL", "HTTP_REQUEST")
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")  # control characters and spaces: never in a URL or a header


class HttpStore(Store):
    """Objects under `base` (scheme://host[:port]/prefix/); keys are paths below it.
    `token`: a bearer token sent to `base`'s origin (scheme, host, port) only, and only over
    https. `query`: appended to every object's URL (a presigned URL's signature), never shown."""

    def __init__(self, base: str, options: RemoteOptions, token: str | None = None, display: str | None = None,
                 credentials_hint: str = "lazyload sends none over https://; the server must allow the read",
                 query: str = ""):
        super().__init__(options)
        self.base = base if base.endswith("/") else base + "/"
        self.display = display or self.base  # what messages call the prefix (hf://org/repo@rev/)
        parts = urlsplit(self.base)
        self.endpoint = f"{parts.scheme}://{parts.netloc}"
        self._token = token if token and parts.scheme == "https" else None
        self._origin = _origin(parts)
        self._query = f"?{query}" if query else ""
        self.hold_secrets(token, query, *(value for _, value in parse_qsl(query)))
        self.credentials_hint = credentials_hint
        self._local = threading.local()
        self._open: set[_Connection] = set()  # every thread's, to close
        self._lock = threading.Lock()

    def url(self, key: str) -> str:
        return self.display + key

    def attempt(self, key: str, start: int, end: int, identity: ObjectIdentity | None, into: Into | None = None
                ) -> Response:
        url = self.base + self._path(key) + self._query
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity", **_conditions(identity)}
        token = self._token
        deadline = time.monotonic() + self.options.timeout  # for every hop, connect and read of this attempt
        for _ in range(_MAX_HOPS):
            parts = urlsplit(url)
            if _origin(parts) != self._origin:
                token = None  # left the endpoint: no later hop gets it either (no bounce back for it)
            send = headers if token is None else {**headers, "Authorization": f"Bearer {token}"}
            conn = self._connection(parts.scheme, parts.netloc)
            reused, response = conn.sock is not None, None  # a kept-alive connection: it served an answer before
            try:
                response = self._send(conn, parts, send, deadline)
                location = response.getheader("Location")
                if response.status not in _REDIRECTS or not location:
                    return self._answer(key, start, end, identity, response, into)
                url = self._redirect(key, parts, location)
                response.read(_DISCARD)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise self._failure(key, parts, exc, reused, conn.proxy) from None
            finally:
                if response is None or not response.isclosed():  # a body left unread: the connection is spent
                    self._drop(parts.scheme, parts.netloc)
        raise RemoteError(f"{self.url(key)}: too many redirects; check the URL.")

    def _path(self, key: str) -> str:
        if any(segment in (".", "..") for segment in key.split("/")):
            raise RemoteError(f"{self.url(key)}: '.' and '..' path segments are not followed; name the object "
                              "by its plain path.")
        return quote(key)

    def _send(self, conn: _Connection, parts: SplitResult, headers: dict, deadline: float) -> http.client.HTTPResponse:
        conn.deadline = deadline  # a new connection's connect ends by it too
        if conn.sock is not None:  # a kept-alive connection: the send too waits at most what is left
            conn.sock.settimeout(_time_left(deadline))
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        if conn.proxy is not None and parts.scheme == "http":  # forwarded by the proxy: it needs the whole URL
            target, headers = f"http://{parts.netloc}{target}", {**headers, **conn.proxy.headers}
        conn.request("GET", target, headers=headers)
        return conn.getresponse()

    def _redirect(self, key: str, parts: SplitResult, location: str) -> str:
        url = urljoin(parts.geturl(), location)
        target = urlsplit(url)
        problem = url_problem(target)
        if problem is None and parts.scheme == "https" and target.scheme == "http":
            problem = "a redirect from https to plain http (the answer would travel unencrypted)"
        if problem is not None:
            raise RemoteError(f"{self.url(key)}: {parts.hostname} redirected to {problem}; refused. Fix the "
                              "server's redirect or read the files from where it points.")
        return url

    def _answer(self, key, start, end, identity, response, into) -> Response:
        status = response.status
        if status == 206:
            return self._partial(key, start, end, response, into)
        if status == 200:
            return self._whole(key, start, end, identity, response, into)
        response.read(_DISCARD)
        if status in (404, 410):
            raise self.not_found(key)
        if status in (401, 403):
            raise self.denied(key, f"HTTP {status}")
        if status == 416 and identity is None and start == 0:  # an empty object, while indexing
            return Response(b"", 0, response.getheader("ETag"), last_modified=response.getheader("Last-Modified"))
        if status in (412, 416):
            raise self.changed(key, identity)
        if status in TRANSIENT_STATUS:
            raise Transient(f"HTTP {status}")
        raise RemoteError(f"{self.url(key)}: HTTP {status} {printable(response.reason, 80)}; lazyload needs a server "
                          "that answers ranged GETs (206).")

    def _partial(self, key: str, start: int, end: int, response: http.client.HTTPResponse, into: Into | None
                 ) -> Response:
        """A 206: exactly bytes [start, min(end, size)) of the object, as stored, or an error."""
        self._check_encoding(key, response)
        header = response.getheader("Content-Range") or ""
        match = _CONTENT_RANGE.fullmatch(header)
        if match is None:
            raise RemoteError(f"{self.url(key)}: answered Content-Range {header[:80]!r}, not 'bytes START-END/SIZE' "
                              "(in ASCII digits); the server or a proxy on the way is broken.")
        first, last, size = (int(g) for g in match.groups())
        if first != start or last + 1 != min(end, size) or first > last:
            raise RemoteError(f"{self.url(key)}: answered bytes {first}-{last} of {size} when asked for bytes "
                              f"{start}-{min(end, size) - 1}; the server or a proxy on the way is broken (these "
                              "would be the wrong bytes).")
        return self._body(key, response, last + 1 - first, size, into)

    def _whole(self, key: str, start: int, end: int, identity: ObjectIdentity | None,
               response: http.client.HTTPResponse, into: Into | None) -> Response:
        """A 200: the whole object, usable only when it is no longer than the range asked
        from byte 0 (a small file's header GET); another object than the one indexed (its
        ETag, date or length) has changed; otherwise the server ignores Range."""
        self._check_encoding(key, response)
        length = response.getheader("Content-Length") or ""
        length_ok = length.isascii() and length.isdigit()
        if identity is not None:
            found = (response.getheader("ETag"), response.getheader("Last-Modified"), int(length) if length_ok else None)
            for what, old, new in zip(("ETag", "Last-Modified", "size"), (identity.etag, identity.last_modified,
                                                                           identity.size), found):
                if old is not None and new is not None and old != new:
                    raise self.changed(key, identity, f"answered with the whole object, whose {what} is now "
                                                      f"{printable(new, 80)}")
        if start == 0 and length_ok and int(length) <= end:
            return self._body(key, response, int(length), int(length), into)
        size = f"{length}-byte " if length_ok else ""
        raise RemoteError(f"{self.url(key)}: the server ignores Range requests (it answered bytes {start}-{end - 1} "
                          f"with 200 and the whole {size}object, as `python -m http.server` does); lazyload reads "
                          "byte ranges and needs a server that answers them with 206 (nginx, a CDN, object "
                          "storage), or download the files and load the directory.")

    def _check_encoding(self, key: str, response: http.client.HTTPResponse) -> None:
        encoding = (response.getheader("Content-Encoding") or "identity").strip().lower()
        if encoding != "identity":
            raise RemoteError(f"{self.url(key)}: the server sent the bytes {printable(encoding, 40)!r}-encoded "
                              "(Content-Encoding) although lazyload asked for identity; byte ranges must be the "
                              "stored bytes.")

    def _body(self, key: str, response: http.client.HTTPResponse, n: int, size: int, into: Into | None
              ) -> Response:
        """The answer with its body, which must be `n` bytes: never more is read. With `into`,
        the body is read straight into its buffers (no copy of it is held)."""
        length = response.getheader("Content-Length")
        if length is not None and length != str(n):
            raise RemoteError(f"{self.url(key)}: answered {printable(length, 40)} bytes (Content-Length) for the {n} "
                              "asked; the server or a proxy on the way is broken.")
        if into is None:
            data = response.read(n)
            got = len(data)
        else:
            data, got = b"", _read_into(response, into(), n)
        if got < n and response.chunked and response.isclosed():  # its last chunk came: the server ended it
            raise Transient(f"the server ended its (chunked) body after {got} of {n} bytes", got)
        if got < n:
            raise Transient(f"connection closed after {got} of {n} bytes", got)
        if not response.isclosed() and response.read(1):  # no Content-Length: it must end here
            raise refused(RemoteError(f"{self.url(key)}: the server sent more than the {n} bytes asked; the server or "
                                      "a proxy on the way is broken."), got + 1)
        return Response(data, size, response.getheader("ETag"), last_modified=response.getheader("Last-Modified"),
                        landed=0 if into is None else got)

    def _failure(self, key: str, parts: SplitResult, exc: BaseException, reused: bool, proxy: Proxy | None
                 ) -> Exception:
        """A client-side failure as Transient (worth retrying) or RemoteError (it cannot heal).
        `reused`: the connection had served an answer before (a stray byte after that answer
        reads as a broken status line: a fresh connection heals it)."""
        where = f"{self.url(key)}: {parts.scheme}://{parts.hostname}" + (f" (through {proxy.shown})" if proxy else "")
        reason = printable(redact(f"{type(exc).__name__}: {exc}", self.secrets))
        if isinstance(exc, http.client.IncompleteRead):
            return Transient(f"connection closed after {len(exc.partial)} bytes", len(exc.partial))
        if isinstance(exc, ssl.SSLError) and getattr(exc, "reason", None) in _NOT_TLS:
            return RemoteError(f"{where}: the server does not speak TLS on port {parts.port or 443} ({reason}): it "
                               "answered in plain text, as an http:// server does; check the URL's scheme and port.")
        if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return RemoteError(f"{where}: TLS failed ({reason}); check the server's certificate (a private CA "
                               "goes in SSL_CERT_FILE).")
        if isinstance(exc, socket.gaierror):
            return RemoteError(f"{where}: cannot resolve the host ({reason}); check the URL"
                               + (f" and {proxy.setting}." if proxy else "."))
        if isinstance(exc, ConnectionRefusedError):
            return RemoteError(f"{where}: connection refused; check the URL (host and port)"
                               + (f", {proxy.setting} and NO_PROXY" if proxy else "") + " and that the server is up.")
        if isinstance(exc, _TunnelRefused):
            said = printable(str(exc))
            return Transient(said) if exc.status in TRANSIENT_STATUS else RemoteError(
                f"{where}: the proxy refused the tunnel ({said}); check {proxy.setting} (its credentials) and "
                "NO_PROXY.")
        if isinstance(exc, _ConnectTimeout):
            return Transient(str(exc))
        if isinstance(exc, http.client.BadStatusLine) and reused and not isinstance(exc, ConnectionError):
            return Transient(f"the kept-alive connection answered out of turn ({reason}); retried on a fresh one")
        if isinstance(exc, OSError):  # timeouts (also the attempt's deadline), resets, a closed keep-alive
            return Transient(type(exc).__name__ if isinstance(exc, TimeoutError) else reason)
        return RemoteError(f"{where}: not a valid HTTP exchange ({reason}); check the URL and the server.")

    @functools.cached_property
    def _tls(self) -> ssl.SSLContext:
        return ssl.create_default_context()  # once per store: loading the CA bundle costs milliseconds

    def _connection(self, scheme: str, netloc: str) -> _Connection:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((scheme, netloc))
        if conn is None:
            proxy = proxy_for(scheme, netloc)
            conn = _TLSConnection(netloc, self._tls, proxy) if scheme == "https" else _Connection(netloc, proxy)
            conns[(scheme, netloc)] = conn
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


class _TunnelRefused(OSError):
    """The proxy answered CONNECT with another status than 200."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _ConnectTimeout(TimeoutError):
    """A phase of a connect (the name lookup, the TCP connect, the TLS handshake) that did
    not end by the attempt's deadline; the message says which, and the host."""


def _time_left(deadline: float) -> float:
    """Seconds until an attempt's `deadline` (time.monotonic()); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the attempt's deadline passed")
    return left


def _lookup(host: str, port: int, deadline: float) -> list:
    """getaddrinfo(host, port), waited for at most until `deadline`: it has no timeout of its
    own, so it runs on a daemon thread (one that hangs holds that thread until the system
    resolver gives up, but neither the attempt nor the process's exit)."""
    answer: concurrent.futures.Future = concurrent.futures.Future()

    def look_up() -> None:
        try:
            answer.set_result(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the attempt, which raises it
            answer.set_exception(exc)

    threading.Thread(target=look_up, daemon=True, name="lazyload-lookup").start()
    return answer.result(timeout=_time_left(deadline))


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to host:port whose name lookup and connect end by `deadline`;
    each address the name has is tried in turn, as socket.create_connection does."""
    try:
        addresses = _lookup(host, port, deadline)
    except TimeoutError:
        raise _ConnectTimeout(f"looking up {host} did not finish within the attempt's timeout") from None
    failure: OSError = OSError(f"{host} has no address")
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(_time_left(deadline))
            sock.connect(address)
            return sock
        except TimeoutError:
            sock.close()
            raise _ConnectTimeout(f"connecting to {host}:{port} did not finish within the attempt's timeout") from None
        except OSError as exc:  # refused, unreachable: the next address
            sock.close()
            failure = exc
    raise failure


class _Connection(http.client.HTTPConnection):
    """http.client's connection whose connect (name lookup, TCP, the TLS handshake of
    `_TLSConnection`) and response reads (`_DeadlineResponse`) end by `deadline`, set by
    each attempt, so that no phase is given more than what is left of it."""

    deadline = 0.0  # time.monotonic()

    def __init__(self, netloc: str, proxy: Proxy | None = None):
        """With a `proxy`, the connection is to it: a tunnel (CONNECT) to `netloc` for TLS,
        else requests forwarded by their absolute URL (`HttpStore._send`)."""
        super().__init__(f"{proxy.host}:{proxy.port}" if proxy else netloc)
        self.proxy = proxy
        self.response_class = functools.partial(_DeadlineResponse, self)

    def connect(self) -> None:
        self.sock = _connect(self.host, self.port, self.deadline)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as http.client does
        if self._tunnel_host:
            try:
                self._tunnel()  # http.client's CONNECT exchange, read through `_DeadlineResponse`
            except OSError as exc:
                status = re.match(r"Tunnel connection failed: ([0-9]{3})", str(exc))
                if status is None:
                    raise
                raise _TunnelRefused(str(exc), int(status.group(1))) from None


class _TLSConnection(_Connection):
    default_port = 443

    def __init__(self, netloc: str, context: ssl.SSLContext, proxy: Proxy | None = None):
        super().__init__(netloc, proxy)
        self.context = context
        if proxy is not None:
            target = urlsplit(f"//{netloc}")
            self.set_tunnel(target.hostname, target.port or self.default_port, headers=proxy.headers)

    def connect(self) -> None:
        super().connect()
        host = self._tunnel_host or self.host  # the server's name, not the proxy's
        try:  # the handshake as a whole ends by the deadline (the ssl module keeps one across its reads)
            self.sock.settimeout(_time_left(self.deadline))
            self.sock = self.context.wrap_socket(self.sock, server_hostname=host)
        except TimeoutError:
            self.close()
            raise _ConnectTimeout(f"the TLS handshake with {host}:{self._tunnel_port or self.port} did not finish "
                                  "within the attempt's timeout") from None


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most until `deadline` (time.monotonic()): a server
    that trickles a byte at a time cannot hold an attempt past its timeout."""

    def __init__(self, sock: socket.socket, deadline: float):
        super().__init__()
        self._sock, self._raw, self._deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._sock.settimeout(_time_left(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineResponse(http.client.HTTPResponse):
    """http.client's response, reading through a `_DeadlineReader` (the connection's deadline)."""

    def __init__(self, conn, sock, *args, **kwargs):
        super().__init__(sock, *args, **kwargs)
        self.fp.close()
        self.fp = io.BufferedReader(_DeadlineReader(sock, conn.deadline))


def _read_into(response: http.client.HTTPResponse, views: Iterable[memoryview], n: int) -> int:
    """Read up to `n` body bytes into `views` in turn; how many arrived."""
    got = 0
    for view in views:
        want = min(len(view), n - got)
        if want <= 0:
            break
        k = response.readinto(view[:want])
        got += k
        if k < want:  # the connection closed early
            break
    return got


def _origin(parts: SplitResult) -> tuple[str, str | None, int | None]:
    return parts.scheme, parts.hostname, parts.port or _DEFAULT_PORT.get(parts.scheme)


def _conditions(identity: ObjectIdentity | None) -> dict[str, str]:
    """The precondition that makes the store refuse another version of the object (412)."""
    if identity is None:
        return {}
    if identity.etag and not identity.etag.startswith("W/"):  # a strong ETag
        return {"If-Match": identity.etag}
    if identity.last_modified:  # no strong ETag: the date (a date is never an ETag)
        return {"If-Unmodified-Since": identity.last_modified}
    return {}


def url_problem(parts: SplitResult) -> str | None:
    """What makes a URL unusable for lazyload, said without quoting it, or None."""
    if parts.scheme not in ("http", "https"):
        return f"a {parts.scheme or 'relative'}: URL; lazyload reads http:// and https:// only"
    if _UNSAFE.search(parts.netloc + parts.query):  # a path's are escaped per request
        return "a URL with a control character or a space"
    if "@" in parts.netloc:
        return "a URL with credentials (user:password@host), which would end up in messages; remove them"
    try:
        parts.port
    except ValueError:
        return "a URL with an invalid port"
    return None if parts.hostname else "a URL without a host"


def _shown(parts: SplitResult) -> str:
    """A URL as messages may show it: scheme and host, never userinfo."""
    return f"{parts.scheme}://{parts.hostname or ''}"


def clean_token(token: str | None) -> str | None:
    """huggingface_hub's cleaning (no CR/LF, no surrounding spaces; empty is None), then
    anything else unfit for a header refused, without showing the token."""
    token = (token or "").replace("\r", "").replace("\n", "").strip() or None
    if token is not None and (_UNSAFE.search(token) or not token.isascii()):
        raise RemoteError("the Hugging Face token (HF_TOKEN, or `hf auth login`) holds a control character, a space "
                          "or a non-ASCII character; set it again (the token is not shown here).")
    return token


def _hub_settings() -> tuple[str, str | None]:
    """(HF_ENDPOINT or the Hub, the token) as huggingface_hub finds them, HF_TOKEN without it."""
    endpoint, token = os.environ.get("HF_ENDPOINT"), os.environ.get("HF_TOKEN")
    try:
        from huggingface_hub import constants, get_token

        endpoint, token = endpoint or constants.ENDPOINT, get_token()
    except ImportError:
        pass
    return (endpoint or "https://huggingface.co").rstrip("/"), clean_token(token)


_HF_URL = re.compile(r"hf://([^/@]*)/([^/@]*)(?:@(refs/pr/[0-9]+|[^/]*))?(?:/(.*))?", re.DOTALL)
# userinfo before the first '/', or a query or fragment anywhere (an hf:// path holds neither)
_HF_CREDENTIALS = re.compile(r"hf://[^/]*@|[^?#]*[?#]", re.DOTALL)
_plain_http_endpoints: set[str] = set()  # warned about once each


def hf_store(url: str, options: RemoteOptions) -> tuple[HttpStore, str]:
    """`hf://org/repo[@revision][/path]` -> (a store over its resolve URLs, the path).
    The endpoint is HF_ENDPOINT (default the Hub), the token huggingface_hub's (HF_TOKEN,
    or `hf auth login`) when it is installed, else HF_TOKEN."""
    if _HF_CREDENTIALS.match(url):
        raise RemoteError(f"{printable(url)}: an hf:// URL with credentials (user:token@, or a query string, "
                          "which may carry a token), which would end up in messages and requests; remove them and set "
                          "HF_TOKEN (or `hf auth login`).")
    match = _HF_URL.fullmatch(url)
    if match is None or match.group(1) in ("datasets", "spaces") or match.group(3) == "":
        raise RemoteError(f"{printable(url)}: an hf:// URL names a model repo, hf://org/name[@revision][/path] "
                          "(datasets and spaces are not supported).")
    namespace, name, revision, path = match.groups()
    repo, revision = f"{namespace}/{name}", revision or "main"
    problem = repo_id_problem(repo) or ("a control character in the revision" if _UNSAFE.search(revision) else None)
    if problem is not None:
        raise RemoteError(f"{printable(url)}: not a Hub repo ({problem}); check the URL.")
    endpoint, token = _hub_settings()
    register_secret(token)
    parts = urlsplit(endpoint)
    problem = "a control character or a space" if _UNSAFE.search(endpoint) else url_problem(parts)
    if problem is not None:
        raise RemoteError(f"HF_ENDPOINT: {problem}; set it to https://host[:port] (it is not shown here).")
    if parts.scheme == "http" and endpoint not in _plain_http_endpoints:
        _plain_http_endpoints.add(endpoint)
        logger.warning("lazyload: HF_ENDPOINT %s is plain http: no token is sent to it (it would travel "
                       "unencrypted), so only public repos can be read; use https://", _shown(parts))
    base = f"{endpoint}/{repo}/resolve/{quote(revision, safe='')}/"
    return HttpStore(base, options, token, display=f"hf://{repo}@{revision}/",
                     credentials_hint="HF_TOKEN, or `hf auth login`; it goes to an https:// endpoint only"), path or ""


def http_store(url: str, options: RemoteOptions) -> tuple[HttpStore, str]:
    """`http(s)://host/path[?query]` -> (a store over the host, the path). The path is taken
    as the URL spells it (percent-escapes decoded once, encoded again per request); the query
    (a presigned URL's signature) goes with every request and into no message."""
    parts = urlsplit(url)
    problem = url_problem(parts)
    if problem is not None:
        raise RemoteError(f"{_shown(parts)}: {problem}.")
    return (HttpStore(f"{parts.scheme}://{parts.netloc}/", options, query=parts.query),
            unquote(parts.path.lstrip("/")))
