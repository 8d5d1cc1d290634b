"""Real servers for the remote-checkpoint tests: an HTTP server with Range support that logs
every request and can inject faults, and moto's standalone S3 server (ThreadedMotoServer).

`RangeServer(root)` serves the files under `root` (GET and HEAD, one `bytes=a-b` range per
request, ETag from the file's inode, size and mtime, `If-Match` honoured with 412). Faults:
`fail(n, status)` answers the next n requests with that status, `drop(n)` sends the headers
and part of the body of the next n requests and then closes the connection.
`token`: when set, requests without `Authorization: Bearer <token>` get 401. `redirect`:
when set, every GET is answered 302 to that base URL + the same path (as the Hub sends
file downloads to its CDN). Each logged request says whether it carried an Authorization.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Logged:
    method: str
    path: str
    status: int
    start: int  # first byte served (0 without a range)
    sent: int  # body bytes written
    authorized: bool = False  # the request carried an Authorization header


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
            return self._status(fault)
        if self.server.token is not None and self.headers.get("Authorization") != f"Bearer {self.server.token}":
            return self._status(401)
        if self.server.redirect is not None:
            self.send_response(302)
            self.send_header("Location", self.server.redirect + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return self.server.record(Logged(self.command, self.path, 302, 0, 0, self._authorized()))
        path = os.path.join(self.server.root, self.path.split("?")[0].lstrip("/"))
        if not os.path.isfile(path):
            return self._status(404)
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            etag = f'"{info.st_ino:x}-{info.st_size:x}-{info.st_mtime_ns:x}"'
            if self.headers.get("If-Match") not in (None, etag):
                return self._status(412)
            size, start, end = info.st_size, 0, info.st_size
            match = _RANGE.match(self.headers.get("Range", ""))
            if match:
                start = int(match.group(1))
                end = min(size, int(match.group(2)) + 1) if match.group(2) else size
                if start >= size:
                    return self._status(416)
            f.seek(start)
            data = f.read(end - start) if body else b""
        self.send_response(206 if match else 200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        if match:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if fault == "drop":  # part of the body, then the connection is gone
            data = data[:len(data) // 2]
            self.close_connection = True
        self.wfile.write(data)
        self.server.record(Logged(self.command, self.path, 206 if match else 200, start, len(data),
                                  self._authorized()))
        if fault == "drop":
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _status(self, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()
        self.server.record(Logged(self.command, self.path, status, 0, 0, self._authorized()))

    def _authorized(self) -> bool:
        return "Authorization" in self.headers


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: str, token: str | None = None, redirect: str | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.token, self.redirect = root, token, redirect
        self.log: list[Logged] = []
        self._faults: list = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

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


def replace_file(path: str) -> None:
    """Put a new file (same bytes, another inode and mtime) in place of `path`, as an upload
    of a new version of an object does."""
    shutil.copyfile(path, path + ".new")
    os.replace(path + ".new", path)


def moto_server():
    """moto's standalone S3 server on a free port, with throwaway credentials in the
    environment (the caller restores it); returns (server, endpoint url)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"
