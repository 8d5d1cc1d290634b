"""The edges of remote reads, against real servers and sockets on 127.0.0.1: an S3 status
that retrying cannot change fails at once (408/429/5xx and a body cut short are still
retried), an S3 answer the client cannot use is a RemoteError naming the object, and the
name lookup, the TCP connect and the TLS handshake of an HTTP attempt end by the attempt's
deadline, the error saying which. No credential shows in any of these errors."""
from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest

from checkpoints import copy_checkpoint, shard_files
from no_secrets import KEY_ID, SECRET, SESSION, no_secret_shown  # noqa: F401 (an autouse fixture)
from remote_servers import RangeServer
from test_remote_hostile import one_store


def assert_no_secret(exc: BaseException, log: str = "") -> None:
    """No credential of these tests in the error's message, its repr or the log."""
    for text in (str(exc), repr(exc), log):
        for secret in (SECRET, KEY_ID, SESSION):
            assert secret not in text


def settled_log(server: RangeServer, at_least: int = 1) -> list:
    """The server's log once it holds `at_least` entries (a 206 is logged after its body is
    sent, so maybe after the client has it): what the server received."""
    for _ in range(1000):
        if len(server.log) >= at_least:
            break
        time.sleep(0.01)
    return list(server.log)


@pytest.fixture
def s3_endpoint(checkpoint, tmp_path, monkeypatch):
    """The tests' Range server as a bucket's S3 endpoint (path-style GETs of
    /models/llama/..., answered 206 with Content-Range and ETag, as S3 answers them), with
    throwaway credentials in the environment: (server, s3:// URL of the first shard)."""
    pytest.importorskip("obstore", reason="the remote extra: pip install -e '.[remote,test]'")
    directory, _ = checkpoint("llama", "bf16")
    copy = copy_checkpoint(directory, tmp_path / "root" / "models" / "llama")
    with RangeServer(str(tmp_path / "root")) as server:
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_REGION"):
            monkeypatch.delenv(name, raising=False)
        for name, value in (("AWS_ENDPOINT_URL", server.url), ("AWS_ACCESS_KEY_ID", KEY_ID),
                            ("AWS_SECRET_ACCESS_KEY", SECRET), ("AWS_SESSION_TOKEN", SESSION),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        yield server, f"s3://models/llama/{shard_files(copy)[0].name}"


# S3: what retrying cannot change fails at once; what can, is retried.

@pytest.mark.parametrize("status", [400, 405, 409, 501])
def test_s3_status_that_retrying_cannot_change_fails_at_once(s3_endpoint, status, caplog):
    from lazyload.errors import RequestRefusedError
    from lazyload.remote.store import Stats

    server, url = s3_endpoint
    server.fail(3, status)
    caplog.set_level(logging.DEBUG)
    store, key = one_store(url, retries=3, backoff=0.001)
    stats = Stats()
    check = "the credentials .*, the URL" if status == 400 else "the URL"  # a bad session token is a 400
    with pytest.raises(RequestRefusedError, match=f"^{url}: the store answered HTTP {status}, which retrying "
                                                  f"cannot change; check {check}, the endpoint") as err:
        store.get(key, 0, 100, stats)
    assert [e.status for e in server.log] == [status]  # one request: no retry
    assert stats.retries == 0
    assert_no_secret(err.value, caplog.text)


def test_s3_range_not_satisfiable_is_a_changed_object_at_once(s3_endpoint):
    from lazyload.errors import ObjectChangedError
    from lazyload.remote.store import ObjectIdentity, Stats

    server, url = s3_endpoint
    server.fail(3, 416)  # the range indexed is past the end now: the object shrank
    store, key = one_store(url, retries=3, backoff=0.001)
    with pytest.raises(ObjectChangedError, match=f"^{url}: changed since it was indexed") as err:
        store.get(key, 0, 100, Stats(), ObjectIdentity(100, '"indexed"'))
    assert [e.status for e in server.log] == [416]
    assert_no_secret(err.value)


@pytest.mark.parametrize("fault", [503, 429, "drop"])
def test_s3_transient_failures_are_still_retried(s3_endpoint, fault):
    from lazyload.remote.store import Stats

    server, url = s3_endpoint
    if fault == "drop":
        server.drop(2)  # headers and half the body, then the connection is closed
    else:
        server.fail(2, fault)
    store, key = one_store(url, retries=3, backoff=0.001)
    stats = Stats()
    response = store.get(key, 0, 100, stats)
    assert len(response.data) == 100
    assert stats.requests == 3 and stats.retries == 2
    if fault != "drop":
        assert [e.status for e in settled_log(server, 3)] == [fault, fault, 206]


def test_s3_answer_the_client_cannot_use_is_a_remote_error_naming_the_object(s3_endpoint):
    from lazyload.errors import RemoteError
    from lazyload.remote.store import Stats

    server, url = s3_endpoint
    server.content_range = lambda start, last, size: f"items {start}-{last}/{size}"  # a broken proxy's
    store, key = one_store(url, retries=3, backoff=0.001)
    stats = Stats()
    with pytest.raises(RemoteError, match=f"^{url}: the S3 client could not make the request or use the answer "
                                          r"\(.*CONTENT_RANGE.*\); check the URL and that the endpoint") as err:
        store.get(key, 0, 100, stats)
    assert type(err.value) is RemoteError
    assert len(settled_log(server)) == 1  # no retry
    assert_no_secret(err.value)


# HTTP connects: the name lookup, the TCP connect and the TLS handshake end by the attempt's deadline.

def still_failing(url: str, retries: int, reason: str) -> str:
    """The message (a regex) of a GET of bytes 0..100 of `url` that failed every attempt."""
    return (f"^{url}: bytes 0..100 still failing after {retries} retries \\({reason}\\); check the store and "
            "the network, then load again.$")


@pytest.fixture
def never_accepted():
    """A port whose listener never accepts and whose accept queue is full: a TCP connect to
    it is never answered (the kernel drops the SYN), as with an overloaded server."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port, queued = listener.getsockname()[1], []
        for _ in range(8):  # until a connect is not answered: the queue is full
            queued.append(socket.socket())
            queued[-1].settimeout(0.2)
            try:
                queued[-1].connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.fail("the accept queue never filled")
        yield port
        for sock in queued:
            sock.close()


@pytest.fixture
def never_answered():
    """A port whose listener never accepts, with room in its queue: the kernel completes the
    TCP connect, and nothing ever answers what the client sends (a TLS ClientHello)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


@pytest.mark.parametrize("scheme, port_kind, phase", [
    ("http", "never_accepted", "connecting to 127.0.0.1:{port}"),
    ("https", "never_answered", "the TLS handshake with 127.0.0.1:{port}")])
def test_a_connect_never_answered_ends_with_the_attempt(request, scheme, port_kind, phase, caplog):
    from lazyload.errors import RemoteError
    from lazyload.remote.store import Stats

    port = request.getfixturevalue(port_kind)
    store, key = one_store(f"{scheme}://127.0.0.1:{port}/ckpt/x.safetensors?X-Amz-Signature={SECRET}",
                           retries=1, backoff=0.001, timeout=0.3)
    stats = Stats()
    caplog.set_level(logging.DEBUG)
    reason = phase.format(port=port) + " did not finish within the attempt's timeout"
    with pytest.raises(RemoteError, match=still_failing(f"{scheme}://127.0.0.1:{port}/ckpt/x.safetensors", 1,
                                                        reason)) as err:
        store.get(key, 0, 100, stats)
    assert stats.requests == 2 and stats.retries == 1
    assert_no_secret(err.value, caplog.text)


def test_a_name_lookup_that_hangs_ends_with_the_attempt(monkeypatch):
    """getaddrinfo has no timeout: a resolver that never answers (here the real one, held
    for one name until the test ends) must not hold the attempt."""
    from lazyload.errors import RemoteError
    from lazyload.remote.store import Stats

    release, real_lookup = threading.Event(), socket.getaddrinfo

    def hanging_lookup(host, *args, **kwargs):
        if host == "slow-lookup.test":
            release.wait()
            host = "127.0.0.1"
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging_lookup)
    store, key = one_store(f"https://slow-lookup.test/ckpt/x.safetensors?sig={SECRET}", retries=1, backoff=0.001,
                           timeout=0.3)
    stats, outcome = Stats(), {}

    def get() -> None:
        try:
            store.get(key, 0, 100, stats)
        except Exception as exc:
            outcome.update(error=exc, lookup_still_held=not release.is_set())

    getter = threading.Thread(target=get, daemon=True)
    getter.start()
    getter.join(60)  # only a bound for a client that waits for the lookup: it then ends, and fails below
    release.set()
    getter.join(60)
    assert outcome["lookup_still_held"]  # the attempts ended while the lookup hung
    assert isinstance(outcome["error"], RemoteError)
    assert re.match(still_failing("https://slow-lookup.test/ckpt/x.safetensors", 1,
                                  "looking up slow-lookup.test did not finish within the attempt's timeout"),
                    str(outcome["error"]))
    assert stats.requests == 2 and stats.retries == 1
    assert_no_secret(outcome["error"])
