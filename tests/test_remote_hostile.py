"""HTTP servers that misbehave, on purpose or not, all real servers on 127.0.0.1
(tests/remote_servers.py and its fault knobs): the token never travels in plaintext or to a
host it was not meant for, an answer that is not exactly the bytes asked for is refused
(never read past them), a server that ignores Range is named, Last-Modified is not an ETag,
failures that cannot heal fail at once and slow ones within the timeout, secrets stay out
of every message, and URLs mean what they say."""
from __future__ import annotations

import logging
import os
import socket
import sys
import tracemalloc

import pytest
import torch

from checkpoints import build_model, copy_checkpoint, shard_files
from no_secrets import no_secret_shown  # noqa: F401 (an autouse fixture: no planted secret shows)
from remote_servers import RangeServer, replace_file, self_signed
from test_remote import SECRET, _state, assert_same_state, local_state, remote_load, served  # noqa: F401 (a fixture)


@pytest.fixture
def tls(tmp_path, monkeypatch):
    """A self-signed certificate for 127.0.0.1 and localhost, trusted by the client."""
    pair = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", pair[0])
    return pair


@pytest.fixture
def hub_repo(checkpoint, tmp_path):
    """A bf16 Llama checkpoint laid out as an endpoint's org/tiny/resolve/main: (root, directory, config)."""
    directory, config = checkpoint("llama", "bf16")
    copy_checkpoint(directory, tmp_path / "hub" / "org" / "tiny" / "resolve" / "main")
    return str(tmp_path / "hub"), directory, config


def one_store(url, **options):
    """(store, key) of one object URL, as a load opens it, with `options`."""
    from lazyload.remote import RemoteOptions
    from lazyload.remote.source import open_store

    return open_store(url, RemoteOptions(**options))


def first_shard(served) -> str:
    server, url, directory, _ = served
    return url + shard_files(directory)[0].name


# 1. The token: to the endpoint's https origin only.

@pytest.mark.parametrize("route", ["https to http of the same host", "bounced back by another host"])
def test_token_never_travels_in_plaintext(hub_repo, tls, monkeypatch, route):
    from lazyload.errors import RemoteError

    root, _, config = hub_repo
    with RangeServer(root, token=SECRET, tls=tls) as hub, RangeServer(root) as cdn:
        endpoint = hub.url.replace("127.0.0.1", "localhost")
        plain_hub = endpoint.replace("https://", "http://")  # the same host and port, which also speaks http
        if route.startswith("https to http"):
            hub.redirect = plain_hub
        else:  # the CDN (another host, given no token) sends the client back to the endpoint's host over http
            hub.redirect, cdn.redirect = cdn.url, plain_hub
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        with pytest.raises(RemoteError) as err:
            remote_load("hf://org/tiny", config)
        assert SECRET not in str(err.value)
        assert any(e.authorized and e.tls for e in hub.log)  # the endpoint itself got it, over https
        assert not any(e.authorized and not e.tls for e in hub.log)
        assert not any(e.authorized for e in cdn.log)


def test_redirect_to_another_scheme_is_refused(served):
    from lazyload.errors import RemoteError

    server, url, _, _ = served
    server.redirect = "ftp://127.0.0.1:21"
    store, key = one_store(first_shard(served), retries=2, backoff=0.001)
    with pytest.raises(RemoteError, match=r"redirected to a ftp: URL; lazyload reads http:// and https:// only"):
        store.get(key, 0, 100, _stats())


def test_plain_http_endpoint_gets_no_token_and_one_warning(hub_repo, monkeypatch, caplog):
    root, directory, config = hub_repo
    with RangeServer(root) as hub:  # a public mirror over plain http
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        with caplog.at_level(logging.WARNING, logger="lazyload"):
            model, _ = remote_load("hf://org/tiny", config)
            remote_load("hf://org/tiny", config)
        assert_same_state(_state(model), local_state(directory, config))
        assert hub.log and not any(e.authorized for e in hub.log)
        warnings = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
        assert len(warnings) == 1 and "no token is sent" in warnings[0] and SECRET not in warnings[0]


# 2. Ranges: exactly the bytes asked for, never read past them.

def test_shifted_content_range_is_refused(served):
    from lazyload import LazyCheckpoint, ReadError

    server, url, _, config = served
    ckpt = LazyCheckpoint(url)
    ckpt.index
    server.shift = 4  # the same length, 4 bytes later, with a Content-Range that says so
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(ReadError, match=r"answered bytes (\d+)-\d+ of \d+ when asked for bytes .*wrong bytes"):
        ckpt.load_into(model, progress=False)


def test_non_ascii_digits_in_content_range_are_a_clear_error(served):
    from lazyload.errors import RemoteError

    server, url, _, _ = served
    server.content_range = lambda start, last, size: f"bytes {start}-{last}/" + "\u00b2" * len(str(size))
    store, key = one_store(first_shard(served), retries=0)
    with pytest.raises(RemoteError, match=r"answered Content-Range 'bytes 0-99/²+', not 'bytes START-END/SIZE' "
                                          r"\(in ASCII digits\)"):
        store.get(key, 0, 100, _stats())


def test_content_encoding_is_refused(served):
    from lazyload.errors import RemoteError

    server, _, _, _ = served
    server.extra_headers = {"Content-Encoding": "gzip"}
    store, key = one_store(first_shard(served), retries=0)
    with pytest.raises(RemoteError, match="sent the bytes 'gzip'-encoded"):
        store.get(key, 0, 100, _stats())


@pytest.mark.parametrize("no_length", [False, True])
def test_a_body_longer_than_asked_is_never_read(served, no_length):
    from lazyload.errors import RemoteError

    server, _, _, _ = served
    server.pad, server.no_length = 64 << 20, no_length  # 64 MiB after the (up to) 64 KiB asked
    store, key = one_store(first_shard(served), retries=0)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteError, match=r"(for the \d+ asked|more than the \d+ bytes asked)"):
            store.get(key, 0, 64 << 10, _stats())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# 3. A server that ignores Range.

def test_a_server_that_ignores_range_is_named(served):
    from lazyload import ReadError
    from lazyload.errors import RemoteError
    from lazyload.remote.store import Stats

    server, url, directory, config = served
    server.ignore_range = True  # as `python -m http.server` does
    # Indexing passes (each file is shorter than its first GET, so the whole of it is what was
    # asked); the load's first GET of a later range is refused, before any tensor is placed.
    with pytest.raises(ReadError, match=r"model-\S+.safetensors: the server ignores Range requests .*needs a server "
                                        r"that answers them with 206") as err:
        remote_load(url, config)
    assert not err.value.loaded
    store, key = one_store(first_shard(served))
    stats = Stats()
    with pytest.raises(RemoteError, match="ignores Range"):
        store.get(key, 100, 200, stats)
    assert stats.retries == 0 and stats.bytes_served == 0  # the whole object was not taken


# 5. Last-Modified is not an ETag.

def test_a_server_without_etag_is_read_and_a_change_is_caught(served):
    from lazyload import LazyCheckpoint, ReadError

    server, url, directory, config = served
    server.etag = False  # Last-Modified only; If-Match never matches, as on a strict server
    model, report = remote_load(url, config)
    assert_same_state(_state(model), local_state(directory, config))
    ckpt = LazyCheckpoint(url)
    ckpt.index
    shard = shard_files(directory)[0]
    replace_file(str(shard))
    os.utime(shard, (shard.stat().st_mtime + 10,) * 2)  # a later date (Last-Modified has whole seconds)
    with pytest.raises(ReadError, match=f"{shard.name}: changed since it was indexed"):
        ckpt.load_into(build_model("llama", config, torch.bfloat16), progress=False)


# 6. What cannot heal fails at once; what is slow fails within the timeout.

def test_untrusted_certificate_fails_at_once(served, tmp_path, monkeypatch):
    from lazyload.errors import RemoteError
    from lazyload.remote.store import Stats

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with RangeServer(str(tmp_path / "root"), tls=self_signed(tmp_path)) as server:
        store, key = one_store(f"{server.url}/ckpt/{shard_files(served[2])[0].name}", retries=3, backoff=0.001)
        stats = Stats()
        with pytest.raises(RemoteError, match="TLS failed .*CERTIFICATE_VERIFY_FAILED"):
            store.get(key, 0, 100, stats)
    assert stats.retries == 0


def test_refused_connection_and_invalid_url_fail_at_once():
    from lazyload.errors import RemoteError
    from lazyload.remote.store import Stats

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store, key = one_store(f"http://127.0.0.1:{port}/x.safetensors", retries=3, backoff=0.001)
    stats = Stats()
    with pytest.raises(RemoteError, match="connection refused"):
        store.get(key, 0, 100, stats)
    assert stats.retries == 0
    with pytest.raises(RemoteError, match="an invalid port"):
        one_store("http://127.0.0.1:99999/x.safetensors")


def test_a_trickling_server_cannot_hold_a_get_past_its_timeout(served):
    from lazyload.errors import RemoteError

    server, _, _, _ = served
    server.trickle = 0.25  # a byte every 0.25 s: 16 bytes take 4 s, each read is quick
    store, key = one_store(first_shard(served), retries=0, timeout=0.5)
    with pytest.raises(RemoteError, match=r"still failing after 0 retries \(TimeoutError\)"):
        store.get(key, 0, 16, _stats())


def test_backoff_is_capped():
    from lazyload.remote.store import MAX_BACKOFF, backoff

    assert [backoff(0.2, n) for n in range(3)] == [0.2, 0.4, 0.8]
    assert backoff(0.2, 40) == MAX_BACKOFF and backoff(0.2, 10_000) == MAX_BACKOFF


# 7. Secrets: cleaned as huggingface_hub cleans them, refused when unfit, never quoted.

@pytest.mark.parametrize("hub_installed", [True, False])
def test_token_with_crlf_is_cleaned(hub_repo, tls, monkeypatch, hub_installed):
    root, directory, config = hub_repo
    if not hub_installed:  # HF_TOKEN as lazyload reads it without huggingface_hub
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with RangeServer(root, token=SECRET, tls=tls) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", f" {SECRET}\r\n")  # a CRLF env file
        model, _ = remote_load("hf://org/tiny", config)
    assert_same_state(_state(model), local_state(directory, config))


@pytest.mark.parametrize("setting, value, message", [
    ("HF_TOKEN", f"{SECRET}\x1bx", "holds a control character"),
    ("HF_ENDPOINT", f"https://user:{SECRET}@127.0.0.1:1", "HF_ENDPOINT: a URL with credentials"),
    ("HF_ENDPOINT", f"https://127.0.0.1:1/{SECRET}\n", "HF_ENDPOINT: a control character"),
])
def test_unfit_secrets_are_redacted_errors(monkeypatch, setting, value, message):
    from lazyload import LazyCheckpoint
    from lazyload.errors import RemoteError

    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:1")
    monkeypatch.setenv(setting, value)
    with pytest.raises(RemoteError, match=message) as err:
        LazyCheckpoint("hf://org/tiny")
    assert SECRET not in str(err.value)


# 8. URLs mean what they say.

@pytest.mark.parametrize("url", ["hf://org/na..me", "hf://../x", "hf://org/-x",
                                 "hf://org/x.git", "hf://org/ca\u00e9"])
def test_invalid_repo_ids_are_refused(url, monkeypatch):
    from lazyload.errors import RemoteError

    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1:1")
    with pytest.raises(RemoteError, match="not a Hub repo"):
        one_store(url)


def test_dot_segments_are_refused_before_any_request(served):
    from lazyload import LazyCheckpoint
    from lazyload.errors import RemoteError

    server, url, _, _ = served
    with pytest.raises(RemoteError, match="'.' and '..' path segments are not followed"):
        LazyCheckpoint(url + "../ckpt/model.safetensors.index.json")
    assert server.log == []


def test_refs_pr_revision(checkpoint, tmp_path, monkeypatch):
    directory, config = checkpoint("llama", "bf16")
    copy_checkpoint(directory, tmp_path / "org" / "tiny" / "resolve" / "refs" / "pr" / "1")
    with RangeServer(str(tmp_path)) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        model, _ = remote_load("hf://org/tiny@refs/pr/1", config)
        assert hub.log and all(e.path.startswith("/org/tiny/resolve/refs%2Fpr%2F1/") for e in hub.log)
    assert_same_state(_state(model), local_state(directory, config))


def test_presigned_url_keeps_its_query_and_its_escapes(checkpoint, tmp_path):
    from lazyload import LazyCheckpoint
    from lazyload.errors import AccessDeniedError

    directory, config = checkpoint("llama", "bf16")
    copy_checkpoint(directory, tmp_path / "my ckpt")
    with RangeServer(str(tmp_path)) as server:
        server.query = f"X-Amz-Signature={SECRET}"  # every object needs it, as with a shared access signature
        model, _ = remote_load(f"{server.url}/my%20ckpt/model.safetensors.index.json?{server.query}", config)
        assert server.log and all(e.status == 206 for e in server.log)
        with pytest.raises(AccessDeniedError) as err:
            LazyCheckpoint(f"{server.url}/my%20ckpt/model.safetensors.index.json?X-Amz-Signature=other")
        assert SECRET not in str(err.value) and "other" not in str(err.value)
    assert_same_state(_state(model), local_state(directory, config))


def _stats():
    from lazyload.remote.store import Stats

    return Stats()
