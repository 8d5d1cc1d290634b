"""What the fourth review found in remote reads, each against real servers on 127.0.0.1 (the
tests' Range server, also as an S3 endpoint, and an HTTP proxy): an S3 body is exactly the
range asked (not encoded, not one byte longer, counted as it arrives, never buffered whole);
presigned signatures, tokens and proxy passwords show nowhere (the autouse `no_secret_shown`
scans every message, log line and printed line of every remote test); a server that cannot
tell versions apart is named; a server's words are escaped; proxies are honoured on every
path; and errors say what happened."""
from __future__ import annotations

import base64
import os
import re

import pytest
import torch

from checkpoints import build_model, copy_checkpoint, shard_files
from no_secrets import PAIR_ID, POLICY, PROXY_PASSWORD, SECRET, SESSION, SIGNATURE, no_secret_shown  # noqa: F401
from remote_servers import ConnectProxy, RangeServer, replace_file, self_signed
from test_remote import _state, assert_same_state, local_state, remote_load, served  # noqa: F401 (served: fixture)
from test_remote_edges import s3_endpoint, settled_log  # noqa: F401 (s3_endpoint: a fixture)
from test_remote_hostile import first_shard, hub_repo, one_store, tls  # noqa: F401 (hub_repo, tls: fixtures)

MiB = 1 << 20


def _stats():
    from lazyload.remote.store import Stats

    return Stats()


def into(n: int):
    """A GET's `into`: one writable view of n bytes (as the remote reader hands out)."""
    buffer = bytearray(n)
    return buffer, lambda: iter([memoryview(buffer)])


# 1. An S3 body is the range asked: not encoded, not longer; every byte that came is counted.

def test_s3_encoded_body_is_refused(s3_endpoint):
    from lazyload.errors import RemoteError

    server, url = s3_endpoint
    server.extra_headers = {"Content-Encoding": "gzip"}
    store, key = one_store(url, retries=2, backoff=0.001)
    with pytest.raises(RemoteError, match=r"the store sent the bytes 'gzip'-encoded \(Content-Encoding\)"):
        store.get(key, 0, 100, _stats())
    assert len(settled_log(server)) == 1  # not retried


def test_s3_junk_before_the_range_fails_the_load(s3_endpoint, checkpoint):
    """100 bytes before the range, counted by Content-Length, the Content-Range honest: the
    body is 100 bytes longer than the range, and every tensor would be shifted."""
    from lazyload import LazyCheckpoint, ReadError

    server, _ = s3_endpoint
    _, config = checkpoint("llama", "bf16")
    ckpt = LazyCheckpoint("s3://models/llama/", remote=None)
    ckpt.index
    server.junk = b"J" * 100
    with pytest.raises(ReadError, match=r"s3://models/llama/\S+: the store sent more than the \d+ bytes asked"):
        ckpt.load_into(build_model("llama", config, torch.bfloat16), progress=False)


def test_s3_body_past_the_range_is_refused_at_once_and_counted(s3_endpoint):
    from lazyload.errors import RemoteError

    server, url = s3_endpoint
    server.pad = 20 * MiB  # 20 MiB after the 100 bytes asked, Content-Length counting them
    store, key = one_store(url, retries=0)
    stats = _stats()
    buffer, views = into(100)
    with pytest.raises(RemoteError, match=r"sent more than the 100 bytes asked \(at least (\d+)\)") as err:
        store.get(key, 0, 100, stats, into=views)
    counted = int(re.search(r"at least (\d+)", str(err.value)).group(1))
    assert stats.requests == 1 and stats.bytes_served == counted > 100  # what came, not what was asked
    assert settled_log(server)[0].sent < 20 * MiB  # it stopped reading: the rest was never pulled


def test_s3_endless_body_is_not_pulled(s3_endpoint):
    from lazyload.errors import RemoteError

    server, url = s3_endpoint
    server.length, server.endless = 1 << 40, True  # a Content-Length of 1 TiB, and zeros that never end
    store, key = one_store(url, retries=0)
    _, views = into(4096)
    with pytest.raises(RemoteError, match="sent more than the 4096 bytes asked"):
        store.get(key, 0, 4096, _stats(), into=views)
    assert settled_log(server)[0].sent < 64 * MiB


# 2. An S3 header, index or config GET is streamed with the same bound (never `bytes()`).

@pytest.mark.parametrize("target", ["header", "index json"])
def test_s3_index_reads_are_bounded(s3_endpoint, target):
    """Content-Length 1 TiB for the 64 KiB header GET, 32 MiB sent, then the connection closed:
    refused after the bytes asked (a buffered read took all 32 MiB, then failed on the cut)."""
    from lazyload import LazyCheckpoint
    from lazyload.errors import RemoteError

    server, url = s3_endpoint
    server.length, server.pad = 1 << 40, 32 * MiB
    with pytest.raises(RemoteError, match=r"the store sent more than the \d+ bytes asked"):
        LazyCheckpoint(url if target == "header" else "s3://models/llama/").index
    assert settled_log(server)[0].sent < 32 * MiB


# 3. Presigned signatures and tokens show nowhere; hf:// URLs with credentials are refused.

QUERIES = {"S3": f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature={SIGNATURE}",
           "Azure": f"sv=2024-05-04&sp=r&sig={SIGNATURE}",
           "CloudFront": f"Policy={POLICY}&Signature={SIGNATURE}&Key-Pair-Id={PAIR_ID}"}


@pytest.fixture(params=sorted(QUERIES))
def presigned(request, checkpoint, tmp_path):
    """A checkpoint without config.json behind a server that wants a presigned query: (url, config)."""
    directory, config = checkpoint("llama", "bf16")
    copy = copy_checkpoint(directory, tmp_path / "root" / "ckpt")
    os.remove(copy / "config.json")
    with RangeServer(str(tmp_path / "root")) as server:
        server.query = QUERIES[request.param]
        yield f"{server.url}/ckpt/model.safetensors.index.json?{server.query}", config


def test_presigned_query_shows_in_no_cli_output(presigned, capsys):
    from lazyload.cli import main

    url, _ = presigned
    assert main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors.index.json?" in out and "***" in out  # the parameters' names, not their values
    assert main(["plan", url, "--world", "2"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_presigned_query_shows_in_no_error(presigned):
    from lazyload import LazyCheckpoint, load_model
    from lazyload.errors import ArgumentError, LazyLoadError

    url, config = presigned
    with pytest.raises(LazyLoadError, match="no config.json"):
        load_model(url)
    with pytest.raises(ArgumentError, match="reads local files"):
        LazyCheckpoint(url).load_into(build_model("llama", config, torch.bfloat16), reader="mmap", progress=False)


@pytest.mark.parametrize("url", [f"hf://user:{SECRET}@org/tiny", f"hf://org/tiny?token={SECRET}",
                                 f"hf://org/tiny@main?access_token={SECRET}", f"hf://org/tiny#{SECRET}"])
def test_hf_urls_with_credentials_are_refused(hub_repo, url, monkeypatch, capsys):
    from lazyload import LazyCheckpoint
    from lazyload.cli import main
    from lazyload.errors import RemoteError

    root, _, _ = hub_repo
    with RangeServer(root) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(RemoteError, match="an hf:// URL with credentials"):
            LazyCheckpoint(url)
        assert main(["inspect", url]) == 2
        assert "an hf:// URL with credentials" in capsys.readouterr().err
    assert hub.log == []  # nothing was sent, the token in no request path


def test_redact_masks_every_credential_form(monkeypatch):
    from lazyload import redact as redaction
    from lazyload.redact import redact

    # the patterns alone: secrets that earlier tests' stores registered (a signed query whole,
    # say) would mask more than the patterns do, whatever ran before
    monkeypatch.setattr(redaction, "_secrets", ())

    text = (f"https://acct.blob.core.windows.net/c/x?sv=2024&sig={SIGNATURE}, https://d.cloudfront.net/x?Policy="
            f"{POLICY}&Key-Pair-Id={PAIR_ID}; hf://user:{SECRET}@org/tiny; Key-Pair-Id={PAIR_ID} sig={SIGNATURE}; "
            f"Proxy-Authorization: Basic {POLICY}; model.embed_tokens: 'replicate'; vit.cls_token: [1, 768]")
    out = redact(text)
    for secret in (SIGNATURE, POLICY, PAIR_ID, SECRET):
        assert secret not in out
    assert "https://acct.blob.core.windows.net/c/x?sv=***&sig=***," in out and "hf://***@org/tiny" in out
    assert "model.embed_tokens: 'replicate'; vit.cls_token: [1, 768]" in out  # names that are no credential
    assert redact("a\x1b[2Jb\r\nc\td\u202e") == "a\\x1b[2Jb\\r\nc\td\\u202e"


# 4. A server that sends neither ETag nor Last-Modified: named once per file, and in the report.

def test_a_server_without_validators_is_named(served, caplog):
    server, url, directory, config = served
    server.etag, server.dates = False, False
    model, report = remote_load(url, config)
    assert_same_state(_state(model), local_state(directory, config))
    files = [url + p.name for p in shard_files(directory)]
    warned = [r.getMessage() for r in caplog.records if "neither ETag nor Last-Modified" in r.getMessage()]
    assert sorted(w.split(": the server")[0].removeprefix("lazyload: ") for w in warned) == files  # once each
    assert report.unversioned == files
    assert "without ETag or Last-Modified (a change during the load cannot be detected)" in str(report)


def test_a_server_with_validators_is_not_named(served, caplog):
    server, url, directory, config = served
    _, report = remote_load(url, config)
    assert report.unversioned == [] and "neither ETag" not in caplog.text


# 5. A server's or a repo's words are escaped.

def test_reason_phrase_and_etag_are_escaped(served):
    from lazyload import LazyCheckpoint, ReadError
    from lazyload.errors import RemoteError

    server, url, _, config = served
    server.reason = "Tea\x1b[2Jpot\x07\x9b31m"  # a terminal's escapes (a CR or LF would end the status line)
    server.fail(1, 418)
    store, key = one_store(first_shard(served), retries=0)
    with pytest.raises(RemoteError, match=r"HTTP 418 Tea\\x1b\[2Jpot\\x07\\x9b31m;") as err:
        store.get(key, 0, 100, _stats())
    assert not {"\x1b", "\x07", "\x9b"} & set(str(err.value))
    server.reason = None
    server.etag_value = '"v1\x1b]0;owned\x07"'
    ckpt = LazyCheckpoint(url)
    ckpt.index
    server.etag_value = '"v2"'  # If-Match of the indexed ETag: 412
    with pytest.raises(ReadError, match=r"changed since it was indexed \(ETag \"v1\\x1b\]0;owned\\x07\"") as err:
        ckpt.load_into(build_model("llama", config, torch.bfloat16), progress=False)
    assert "\x1b" not in str(err.value) and "\x07" not in str(err.value)


def test_shard_name_with_a_control_character_is_refused(served):
    from lazyload import LazyCheckpoint
    from lazyload.errors import CheckpointError

    server, url, directory, _ = served
    index = directory / "model.safetensors.index.json"
    first = shard_files(directory)[0].name
    index.write_text(index.read_text().replace(first, first.replace(".safetensors", "\\u001b[2J.safetensors")))
    with pytest.raises(CheckpointError, match=r"names the file 'model-\S+\\x1b\[2J.safetensors', with a control "
                                              "character") as err:
        LazyCheckpoint(url)
    assert "\x1b" not in str(err.value)


# 6. HTTPS_PROXY (CONNECT), HTTP_PROXY and NO_PROXY, on every path.

@pytest.fixture
def no_proxy_settings(monkeypatch):
    for name in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


@pytest.mark.parametrize("bypass", [False, True])
def test_hf_over_https_goes_through_the_proxy(hub_repo, tls, no_proxy_settings, bypass):
    monkeypatch = no_proxy_settings
    root, directory, config = hub_repo
    with RangeServer(root, token=SECRET, tls=tls) as hub, ConnectProxy() as proxy:
        endpoint = hub.url.replace("127.0.0.1", "localhost")
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("://", f"://user:{PROXY_PASSWORD}@"))
        if bypass:
            monkeypatch.setenv("NO_PROXY", "example.com, localhost")
        model, _ = remote_load("hf://org/tiny", config)
    assert_same_state(_state(model), local_state(directory, config))
    assert hub.log and all(e.tls and e.authorized for e in hub.log)  # TLS end to end, the token with it
    if bypass:
        assert proxy.lines == []
    else:
        assert proxy.lines and set(proxy.lines) == {f"CONNECT {endpoint.removeprefix('https://')} HTTP/1.0"}
        expected = "Basic " + base64.b64encode(f"user:{PROXY_PASSWORD}".encode()).decode()
        assert set(proxy.authorizations) == {expected}


def test_http_goes_through_the_proxy(served, no_proxy_settings):
    server, url, directory, config = served
    with ConnectProxy() as proxy:
        no_proxy_settings.setenv("http_proxy", proxy.url)
        model, _ = remote_load(url, config)
    assert_same_state(_state(model), local_state(directory, config))
    assert proxy.lines and all(line.startswith(f"GET {url}") for line in proxy.lines)
    assert len(proxy.lines) == len([e for e in server.log if e.method == "GET"])


def test_a_proxy_that_refuses_the_tunnel_is_named(served, tls, no_proxy_settings, tmp_path):
    from lazyload.errors import RemoteError

    with RangeServer(str(tmp_path / "root"), tls=tls) as server, ConnectProxy() as proxy:
        no_proxy_settings.setenv("HTTPS_PROXY", proxy.url.replace("://", f"://user:{PROXY_PASSWORD}@"))
        store, key = one_store(f"https://example.com:{server.server_address[1]}/ckpt/x.safetensors", retries=2,
                               backoff=0.001)  # the proxy tunnels to 127.0.0.1 and localhost only
        with pytest.raises(RemoteError, match=r"https://example.com \(through HTTPS_PROXY 127.0.0.1:\d+\): the proxy "
                                              r"refused the tunnel \(Tunnel connection failed: 403"):
            store.get(key, 0, 100, _stats())
    assert len(proxy.lines) == 1  # not retried


# 7. Errors that say what happened.

def test_a_200_with_another_object_is_a_change(served):
    from lazyload import LazyCheckpoint, ReadError

    server, url, directory, config = served
    server.ignore_range = True  # the whole object, with its ETag, whatever is asked
    ckpt = LazyCheckpoint(url)
    ckpt.index  # each file is shorter than its header GET: whole, as asked
    server.ignore_conditions = True  # a cache in front answers the new object, If-Match or not
    replace_file(str(shard_files(directory)[0]))
    with pytest.raises(ReadError, match=r"changed since it was indexed \(ETag .* when indexed; answered with the "
                                        r"whole object, whose ETag is now"):
        ckpt.load_into(build_model("llama", config, torch.bfloat16), progress=False)


def test_s3_400_for_a_bad_session_token_names_the_credentials(s3_endpoint):
    from lazyload.errors import RequestRefusedError

    server, url = s3_endpoint
    server.error_body = (f"<?xml version=\"1.0\"?><Error><Code>InvalidToken</Code><Message>The provided token is "
                         f"malformed</Message><Token-0>{SESSION}</Token-0></Error>").encode()
    server.fail(1, 400)
    store, key = one_store(url, retries=2, backoff=0.001)
    with pytest.raises(RequestRefusedError, match=r"HTTP 400 \(InvalidToken\), which retrying cannot change; check "
                                                  r"the credentials \(.*AWS_SESSION_TOKEN"):
        store.get(key, 0, 100, _stats())


def test_plain_http_on_an_https_port_is_named(served):
    from lazyload.errors import RemoteError

    server, _, _, _ = served
    store, key = one_store(first_shard(served).replace("http://", "https://"), retries=2, backoff=0.001)
    with pytest.raises(RemoteError, match=r"the server does not speak TLS on port \d+ .*check the URL's scheme and "
                                          "port") as err:
        store.get(key, 0, 100, _stats())
    assert "certificate" not in str(err.value)


def test_a_stray_crlf_after_a_body_is_retried_on_a_fresh_connection(served):
    server, url, directory, config = served
    server.stray_crlf = True  # after every body, a moment later: the next answer on that connection is garbage
    model, report = remote_load(url, config)
    assert_same_state(_state(model), local_state(directory, config))
    assert report.retries > 0  # it happened, and healed


def test_a_short_chunked_body_is_named(served):
    from lazyload.errors import RemoteError

    server, _, _, _ = served
    server.chunked = 50  # a chunked 206 that ends after 50 of the 100 bytes
    store, key = one_store(first_shard(served), retries=0)
    with pytest.raises(RemoteError, match=r"\(the server ended its \(chunked\) body after 50 of 100 bytes\)"):
        store.get(key, 0, 100, _stats())
