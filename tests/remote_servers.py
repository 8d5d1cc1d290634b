"""Real servers for the remote-checkpoint tests: an HTTP server with Range support that logs
every request and can inject faults, and moto's standalone S3 server (ThreadedMotoServer).

`RangeServer(root)` serves the files under `root` (GET and HEAD, one `bytes=a-b` range per
request, ETag from the file's inode, size and mtime, `If-Match` honoured with 412). Faults:
`fail(n, status)` answers the next n requests with that status, `drop(n)` sends the headers
and part of the body of the next n requests and then closes the connection.
`token`: when set, requests without `Authorization: Bearer <token>` get 401. `redirect`:
when set, every GET is answered 302 to that base URL + the same path (as the Hub sends
file downloads to its CDN). Each logged request says whether it carried an Authorization.
`tls`: (certfile, keyfile): the port speaks https, and plain http too (told apart by the
first byte), so that a client sent to `http://` the same host and port is seen; each
logged request says which it came over. `self_signed(directory)` makes such a pair.

Misbehaviour, for the hostile-server tests (attributes, settable while serving):
`ignore_range` answers 200 with the whole file (as `python -m http.server` does); `shift`
serves the asked length from `shift` bytes later, with an honest Content-Range for it;
`content_range(start, last, size)` writes another Content-Range; `extra_headers` are added
to each 200/206; `pad` bytes of zeros follow the body (with a Content-Length that counts them,
or none and a closed connection with `no_length`); `trickle` seconds pass between body
bytes; `etag=False` sends Last-Modified instead of an ETag (If-Match then never matches,
If-Unmodified-Since is honoured, as a strict server does), and `dates=False` too sends
neither (nothing tells versions apart). `query`: when set, a request without exactly that
query string gets 403 (a presigned URL's signature).
More, for the hostile tests: `junk` bytes come before the body (Content-Length counting them);
`length` replaces the Content-Length sent (the connection is closed after the body);
`ignore_conditions` answers as if no If-Match came (a cache in front); `endless` sends zeros after the body until the
client goes away; `stray_crlf` sends one CRLF after the body, a moment later (a separate
packet); `chunked` sends the body in chunked transfer coding, cut to `chunked` bytes when it
is an int; `reason` is the reason phrase of every status line; `etag_value` replaces the
ETag; `error_body` is the body of the statuses `fail` injects (an S3 error document).
`ConnectProxy()`: an HTTP proxy that tunnels CONNECT and forwards absolute-URI GETs, logging
each request line (`lines`).
"""
from __future__ import annotations

import contextlib
import http.client
import itertools
import logging
import os
import re
import select
import shutil
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from email.utils import formatdate, parsedate_to_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_ZEROS = bytes(1 << 16)


def _zeros(n: int | None):
    """`n` zero bytes in 64 KiB pieces (endless for None), none held whole."""
    view = memoryview(_ZEROS)
    for at in itertools.count(0, len(view)) if n is None else range(0, n, len(view)):
        yield view if n is None else view[:min(len(view), n - at)]


@dataclass(frozen=True)
class Logged:
    method: str
    path: str
    status: int
    start: int  # first byte served (0 without a range)
    sent: int  # body bytes written
    authorized: bool = False  # the request carried an Authorization header
    tls: bool = False  # it came over https


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as against a real store
    disable_nagle_algorithm = True  # headers and body are two writes: without it, 40 ms delayed ACKs
    server: "RangeServer"

    def log_message(self, *args) -> None:  # the request log is `server.log`, not stderr
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        fault = self.server.take_fault()
        if fault is not None and fault != "drop":
            return self._status(fault, self.server.error_body)
        if self.server.token is not None and self.headers.get("Authorization") != f"Bearer {self.server.token}":
            return self._status(401)
        if self.server.redirect is not None:
            self.server.record(Logged(self.command, self.path, 302, 0, 0, self._authorized(), self._tls()))
            self.send_response(302)  # logged first: a client that stops at the answer finds it in the log
            self.send_header("Location", self.server.redirect + self.path)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        path, _, query = self.path.partition("?")
        if self.server.query is not None and query != self.server.query:
            return self._status(403)
        path = os.path.join(self.server.root, unquote(path).lstrip("/"))
        if not os.path.isfile(path):
            return self._status(404)
        server = self.server
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            etag = (server.etag_value or f'"{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}"') if server.etag else None
            if not server.ignore_conditions and (self.headers.get("If-Match") not in (None, etag)
                                                 or self._modified_since(info.st_mtime)):
                return self._status(412)
            size, start, end = info.st_size, 0, info.st_size
            match = None if server.ignore_range else _RANGE.match(self.headers.get("Range", ""))
            if match:
                start = int(match.group(1))
                end = min(size, int(match.group(2)) + 1) if match.group(2) else size
                if start >= size:
                    return self._status(416)
                start, end = min(start + server.shift, size), min(end + server.shift, size)
            f.seek(start)
            data = f.read(end - start) if body else b""
        self.send_response(206 if match else 200)
        self._send_headers(server, len(data), etag, info.st_mtime, match and server.content_range(start, end - 1, size))
        if fault == "drop" or server.no_length or server.length is not None:  # then the connection is gone
            data = data[:len(data) // 2] if fault == "drop" else data
            self.close_connection = True
        sent = self._write(data)
        self.server.record(Logged(self.command, self.path, 206 if match else 200, start, sent,
                                  self._authorized(), self._tls()))
        if self.close_connection:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # already gone
                pass

    def _send_headers(self, server: "RangeServer", n: int, etag: str | None, mtime: float, content_range) -> None:
        if server.chunked is not False:
            self.send_header("Transfer-Encoding", "chunked")
        elif server.length is not None:
            self.send_header("Content-Length", str(server.length))
        elif not server.no_length:
            self.send_header("Content-Length", str(len(server.junk) + n + server.pad))
        if etag:
            self.send_header("ETag", etag)
        elif server.dates:
            self.send_header("Last-Modified", formatdate(mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if content_range:
            self.send_header("Content-Range", content_range)
        for name, value in server.extra_headers.items():
            self.send_header(name, value)
        self.end_headers()

    def send_response(self, code: int, message: str | None = None) -> None:
        super().send_response(code, self.server.reason or message)

    def _write(self, data: bytes) -> int:
        """The body (after `junk`, a byte per `trickle` seconds when set, chunked when
        asked), then `pad` zeros in 64 KiB pieces (none held whole, endless when asked);
        returns what the client took."""
        server, sent = self.server, 0
        if server.chunked is not False:
            return self._write_chunked(data if server.chunked is True else data[:server.chunked])
        step = 1 if server.trickle else max(len(data), 1)
        pieces = [server.junk] + [data[i:i + step] for i in range(0, len(data), step)]
        try:
            for piece in itertools.chain(pieces, _zeros(None if server.endless else server.pad)):
                self.wfile.write(piece)
                sent += len(piece)
                time.sleep(server.trickle)
            if server.stray_crlf:
                self.wfile.flush()
                time.sleep(0.05)  # its own packet: the client has the whole answer before it
                self.wfile.write(b"\r\n")
        except OSError:  # the client went away
            self.close_connection = True
        return sent

    def _write_chunked(self, data: bytes) -> int:
        try:
            if data:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
        return len(data)

    def _modified_since(self, mtime: float) -> bool:
        date = self.headers.get("If-Unmodified-Since")
        return date is not None and int(mtime) > parsedate_to_datetime(date).timestamp()

    def _status(self, status: int, body: bytes = b"") -> None:
        self.server.record(Logged(self.command, self.path, status, 0, 0, self._authorized(), self._tls()))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        return "Authorization" in self.headers

    def _tls(self) -> bool:
        return isinstance(self.connection, ssl.SSLSocket)


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: str, token: str | None = None, redirect: str | None = None,
                 tls: tuple[str, str] | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.token, self.redirect = root, token, redirect
        self.tls = None
        if tls is not None:
            self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.tls.load_cert_chain(*tls)
        self.ignore_range, self.shift, self.pad, self.no_length, self.trickle, self.etag = False, 0, 0, False, 0.0, True
        self.dates, self.junk, self.length, self.endless, self.stray_crlf = True, b"", None, False, False
        self.ignore_conditions = False
        self.chunked: bool | int = False
        self.reason: str | None = None
        self.etag_value: str | None = None
        self.error_body = b""
        self.extra_headers: dict[str, str] = {}
        self.query: str | None = None  # when set, requests with another query string get 403
        self.content_range = lambda start, last, size: f"bytes {start}-{last}/{size}"
        self.log: list[Logged] = []
        self._faults: list = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.server_address[1]}"

    def get_request(self):
        sock, address = self.socket.accept()
        if self.tls is not None and sock.recv(1, socket.MSG_PEEK) == b"\x16":  # a TLS ClientHello
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request, client_address) -> None:
        pass  # a client that refused the certificate or went away: the log says what was served

    def __enter__(self) -> "RangeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def record(self, entry: Logged) -> None:
        with self._lock:
            self.log.append(entry)

    def take_fault(self):
        with self._lock:
            return self._faults.pop(0) if self._faults else None

    def fail(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._faults += [status] * n

    def drop(self, n: int) -> None:
        with self._lock:
            self._faults += ["drop"] * n

    def served(self, method: str = "GET") -> int:
        with self._lock:
            return sum(e.sent for e in self.log if e.method == method)


class _ProxyHandler(BaseHTTPRequestHandler):
    """CONNECT host:port: a tunnel (bytes both ways until either side closes); GET of an
    absolute URI: forwarded, the whole answer relayed. Only 127.0.0.1 and localhost."""

    protocol_version = "HTTP/1.1"
    server: "ConnectProxy"

    def log_message(self, *args) -> None:
        pass

    def do_CONNECT(self) -> None:
        self.server.record(self.requestline, self.headers.get("Proxy-Authorization"))
        host, _, port = self.path.rpartition(":")
        if host not in ("127.0.0.1", "localhost"):
            self.send_response(403)
            self.send_header("Content-Length", "0")
            return self.end_headers()
        upstream = socket.create_connection((host, int(port)), timeout=30)
        self.send_response(200, "Connection established")
        self.end_headers()
        self.close_connection = True
        with upstream:
            self._pipe(upstream)

    def _pipe(self, upstream: socket.socket) -> None:
        sockets = [self.connection, upstream]
        while True:
            ready, _, _ = select.select(sockets, [], [], 30)
            if not ready:
                return
            for sock in ready:
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                (upstream if sock is self.connection else self.connection).sendall(data)

    def do_GET(self) -> None:
        self.server.record(self.requestline, self.headers.get("Proxy-Authorization"))
        target = urlsplit(self.path)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-authorization", "connection")}
        conn.request("GET", target.path + (f"?{target.query}" if target.query else ""), headers=headers)
        answer = conn.getresponse()
        body = answer.read()
        conn.close()
        self.send_response(answer.status, answer.reason)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class ConnectProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.lines: list[str] = []
        self.authorizations: list[str | None] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, line: str, authorization: str | None) -> None:
        with self._lock:
            self.lines.append(line)
            self.authorizations.append(authorization)

    def __enter__(self) -> "ConnectProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


def replace_file(path: str) -> None:
    """Put a new file (same bytes, another inode and mtime) in place of `path`, as an upload
    of a new version of an object does."""
    shutil.copyfile(path, path + ".new")
    os.replace(path + ".new", path)


def self_signed(directory) -> tuple[str, str]:
    """(certfile, keyfile) of a self-signed certificate for 127.0.0.1 and localhost, written
    under `directory`: trusted where SSL_CERT_FILE names the certfile, untrusted elsewhere."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(names, critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(certfile, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(keyfile, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return certfile, keyfile


@contextlib.contextmanager
def moto_s3(bucket: str, secret: str):
    """moto's S3 server holding an empty `bucket`, throwaway credentials (`secret` the secret
    key) in the environment while it runs; yields a boto3 client. Skips where the remote and
    test extras are not installed."""
    import pytest  # here, not at the top: benchmarks/gpu_check.py imports this module without pytest

    pytest.importorskip("obstore", reason="the remote extra: pip install -e '.[remote,test]'")
    pytest.importorskip("moto", reason="the test extra: pip install -e '.[remote,test]'")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    saved = dict(os.environ)
    os.environ.update(AWS_ACCESS_KEY_ID="testing-key-id", AWS_SECRET_ACCESS_KEY=secret, AWS_DEFAULT_REGION="us-east-1")
    server, endpoint = moto_server()
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        yield client
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)


def moto_server():
    """moto's standalone S3 server on a free port, with throwaway credentials in the
    environment (the caller restores it); returns (server, endpoint url)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"
