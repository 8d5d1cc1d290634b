"""Checkpoints read from where they are stored: an HTTP server with Range support (also as
a Hugging Face endpoint) and moto's S3 server, both real servers on localhost. Loads from
them equal loads of the same files from disk, bit for bit; at world 2 each rank's GETs
carry only its own byte ranges (the server's log says so); faults injected on the server
(5xx, dropped connections, objects replaced or removed mid-load, wrong credentials) are
retried or become clear errors naming the URL and never a credential."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from checkpoints import build_model, copy_checkpoint, header_bytes, shard_files
from gloo import spawn_cases
from no_secrets import SECRET, no_secret_shown  # noqa: F401 (an autouse fixture: no planted secret shows)
from remote_servers import RangeServer, moto_s3, replace_file, self_signed


def local_state(directory, config, **kwargs) -> dict[str, torch.Tensor]:
    from lazyload import LazyCheckpoint

    model = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(directory)).load_into(model, progress=False, **kwargs)
    return _state(model)


def _state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{key} differs"


def remote_load(url, config, options=None, **kwargs):
    from lazyload import LazyCheckpoint

    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(url, remote=options).load_into(model, progress=False, **kwargs)
    return model, report


@pytest.fixture
def served(checkpoint, tmp_path):
    """A private copy of a bf16 Llama checkpoint under an HTTP server: (server, url, dir, config)."""
    directory, config = checkpoint("llama", "bf16")
    copy = copy_checkpoint(directory, tmp_path / "root" / "ckpt")
    with RangeServer(str(tmp_path / "root")) as server:
        yield server, server.url + "/ckpt/", copy, config


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server with throwaway credentials in the environment: (boto3 client, bucket)."""
    with moto_s3("models", SECRET) as client:
        yield client, "models"


def upload(client, bucket: str, directory, prefix: str, only=None) -> None:
    for path in sorted(directory.iterdir()):
        if only is None or only(path.name):
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


def test_http_load_equals_the_local_load(served):
    server, url, directory, config = served
    model, report = remote_load(url, config)
    assert_same_state(_state(model), local_state(directory, config))
    gets = [e for e in server.log if e.method == "GET"]
    assert report.reader == "remote" and report.retries == 0
    # Every byte the server sent is counted: the index's GETs, then the load's.
    assert report.bytes_served == report.bytes_requested == report.bytes_read
    assert server.served() == report.bytes_served + _header_bytes(url)
    # + a header GET per file, the index json, config.json, and the probes (404 each) for a pre-sharded
    # copy's json, a Megatron save directory's tracker and a DCP directory's .metadata
    assert len(gets) == report.requests + len(shard_files(directory)) + 5


def _header_bytes(url) -> int:
    from lazyload import LazyCheckpoint

    return LazyCheckpoint(url).header_bytes_read


def test_s3_load_equals_the_local_load(s3, checkpoint):
    client, bucket = s3
    directory, config = checkpoint("llama", "bf16")
    upload(client, bucket, directory, "llama")
    model, report = remote_load(f"s3://{bucket}/llama/", config)
    assert_same_state(_state(model), local_state(directory, config))
    assert report.bytes_served == report.bytes_read > 0 and report.retries == 0


def test_s3_prefix_without_index_json_is_listed(s3, checkpoint):
    from lazyload import LazyCheckpoint

    client, bucket = s3
    directory, config = checkpoint("llama", "bf16")
    upload(client, bucket, directory, "listed", only=lambda name: name.endswith(".safetensors"))
    ckpt = LazyCheckpoint(f"s3://{bucket}/listed/")
    assert ckpt.files == [f"s3://{bucket}/listed/{p.name}" for p in shard_files(directory)]
    assert ckpt.source.description is None
    model, _ = remote_load(f"s3://{bucket}/listed/", config)
    assert_same_state(_state(model), local_state(directory, config))


def test_s3_object_replaced_after_indexing_is_a_read_error(s3, checkpoint):
    from lazyload import LazyCheckpoint, ReadError

    client, bucket = s3
    directory, config = checkpoint("llama", "bf16")
    upload(client, bucket, directory, "replaced")
    ckpt = LazyCheckpoint(f"s3://{bucket}/replaced/")
    ckpt.index
    shard = shard_files(directory)[0].name
    client.put_object(Bucket=bucket, Key=f"replaced/{shard}", Body=shard_files(directory)[0].read_bytes()[::-1])
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(ReadError, match=f"s3://{bucket}/replaced/{shard}: changed since it was indexed") as err:
        ckpt.load_into(model, progress=False)
    assert SECRET not in str(err.value)


def test_s3_missing_object_names_the_url_and_no_credential(s3):
    from lazyload import LazyCheckpoint
    from lazyload.errors import ObjectNotFoundError

    _, bucket = s3
    with pytest.raises(ObjectNotFoundError, match=f"s3://{bucket}/nothing/here/model.safetensors") as err:
        LazyCheckpoint(f"s3://{bucket}/nothing/here/model.safetensors").index
    assert SECRET not in str(err.value) and "testing-key-id" not in str(err.value)


def test_hf_url_reads_through_the_endpoint_with_the_token(checkpoint, tmp_path, monkeypatch):
    from lazyload import LazyCheckpoint
    from lazyload.errors import AccessDeniedError

    directory, config = checkpoint("llama", "bf16")
    copy_checkpoint(directory, tmp_path / "org" / "tiny" / "resolve" / "v1.0")
    tls = self_signed(tmp_path)  # the token goes over https only
    monkeypatch.setenv("SSL_CERT_FILE", tls[0])
    with RangeServer(str(tmp_path), token=SECRET, tls=tls) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", SECRET)
        model, report = remote_load("hf://org/tiny@v1.0", config)
        assert_same_state(_state(model), local_state(directory, config))
        monkeypatch.setenv("HF_TOKEN", "hf_wrong-token")
        with pytest.raises(AccessDeniedError, match=r"hf://org/tiny@v1.0/[\w.]+\.json: access denied") \
                as err:
            LazyCheckpoint("hf://org/tiny@v1.0")
        assert "hf_wrong-token" not in str(err.value) and SECRET not in str(err.value)


def test_hf_token_goes_to_the_endpoint_only_not_to_where_it_redirects(checkpoint, tmp_path, monkeypatch):
    directory, config = checkpoint("llama", "bf16")
    copy_checkpoint(directory, tmp_path / "org" / "tiny" / "resolve" / "main")
    tls = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", tls[0])
    with RangeServer(str(tmp_path), tls=tls) as cdn, \
            RangeServer(str(tmp_path), token=SECRET, redirect=cdn.url, tls=tls) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url.replace("127.0.0.1", "localhost"))  # another host than the CDN's
        monkeypatch.setenv("HF_TOKEN", SECRET)
        model, report = remote_load("hf://org/tiny", config)
        assert_same_state(_state(model), local_state(directory, config))
        assert hub.log and all(e.authorized and e.status == 302 for e in hub.log)
        assert cdn.log and not any(e.authorized for e in cdn.log)
        assert report.bytes_served == report.bytes_read


def test_progress_bar_shows_the_requests(served, capsys):
    from lazyload import LazyCheckpoint

    server, url, directory, config = served
    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(url).load_into(model, progress=True)
    assert f"{report.requests} GETs, 0 retries" in capsys.readouterr().err


def test_cache_dir_serves_a_repeated_load_and_never_a_changed_object(served, tmp_path):
    from lazyload.remote import RemoteOptions

    server, url, directory, config = served
    options = RemoteOptions(cache_dir=str(tmp_path / "cache"))
    first, report = remote_load(url, config, options)
    assert report.bytes_served == report.bytes_read and report.bytes_cached == 0
    second, report = remote_load(url, config, options)
    assert report.requests == 0 and report.bytes_cached == report.bytes_read
    assert_same_state(_state(second), local_state(directory, config))
    for path in shard_files(directory):  # new versions of every object: other ETags, nothing cached for them
        replace_file(str(path))
    third, report = remote_load(url, config, options)
    assert report.bytes_cached == 0 and report.bytes_served == report.bytes_read
    assert_same_state(_state(third), local_state(directory, config))


def test_transient_failures_are_retried(served):
    from lazyload.remote import RemoteOptions

    server, url, directory, config = served
    from lazyload import LazyCheckpoint

    ckpt = LazyCheckpoint(url, remote=RemoteOptions(backoff=0.01))
    ckpt.index
    server.fail(2, 503)
    server.drop(1)
    model = build_model("llama", config, torch.bfloat16)
    report = ckpt.load_into(model, progress=False)
    assert report.retries == 3
    assert_same_state(_state(model), local_state(directory, config))
    assert report.bytes_requested > report.bytes_read  # the failed attempts asked too


def test_a_store_that_keeps_failing_is_a_read_error_naming_the_url(served):
    from lazyload import LazyCheckpoint, ReadError
    from lazyload.remote import RemoteOptions

    server, url, directory, config = served
    ckpt = LazyCheckpoint(url, remote=RemoteOptions(backoff=0.001, retries=2, concurrency=1))
    ckpt.index
    server.fail(1000, 500)
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(ReadError, match=rf"{url}model-\S+.safetensors: bytes \d+..\d+ still failing after 2 retries "
                                        r"\(HTTP 500\)") as err:
        ckpt.load_into(model, progress=False)
    assert err.value.not_loaded and all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("fault", ["replaced", "removed"])
def test_object_changed_mid_load_is_a_read_error(served, monkeypatch, fault):
    from lazyload import LazyCheckpoint, ReadError
    from lazyload.readers import RemoteReader

    server, url, directory, config = served
    ckpt = LazyCheckpoint(url, remote=None)
    ckpt.index
    last = shard_files(directory)[-1]
    original, seen, lock = RemoteReader.read_into, [], threading.Lock()

    def hooked(self, item, out):
        with lock:
            seen.append(item)
            if len(seen) == 3:  # mid-load: the last shard is read at the end
                replace_file(str(last)) if fault == "replaced" else last.unlink()
        return original(self, item, out)

    monkeypatch.setattr(RemoteReader, "read_into", hooked)
    model = build_model("llama", config, torch.bfloat16)
    expected = "changed since it was indexed" if fault == "replaced" else "no such object"
    with pytest.raises(ReadError, match=f"{url}{last.name}: {expected}") as err:
        ckpt.load_into(model, progress=False)
    assert err.value.loaded and err.value.not_loaded
    assert all(not p.is_meta for n, p in model.named_parameters() if n in err.value.loaded)


def test_missing_checkpoint_names_the_url(served):
    from lazyload import LazyCheckpoint
    from lazyload.errors import ObjectNotFoundError

    server, url, _, _ = served
    with pytest.raises(ObjectNotFoundError, match=f"{url}nope/model.safetensors: no such object"):
        LazyCheckpoint(url + "nope/").index


def test_reader_other_than_auto_is_refused_before_reading(served):
    from lazyload import LazyCheckpoint
    from lazyload.errors import ArgumentError

    server, url, _, config = served
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(ArgumentError, match="reader='mmap' reads local files"):
        LazyCheckpoint(url).load_into(model, reader="mmap", progress=False)
    assert all(p.is_meta for p in model.parameters())


def test_gets_coalesce_near_runs_and_split_long_ones():
    from lazyload.readers.remote import plan_gets, scatter

    rng = np.random.default_rng(0)
    for _ in range(200):
        run = int(rng.integers(1, 40))
        gaps = rng.integers(0, 60, size=int(rng.integers(1, 30)))
        offsets = np.cumsum(np.concatenate([[int(rng.integers(0, 50))], gaps[1:] + run])).astype(np.int64)
        merge_gap, part = int(rng.integers(0, 50)), int(rng.integers(1, 200))
        gets = plan_gets(offsets, run, merge_gap, part)
        file = rng.integers(0, 256, size=int(offsets[-1]) + run, dtype=np.uint8)
        out = np.zeros(len(offsets) * run, dtype=np.uint8)
        for get in gets:
            assert get.end - get.start <= max(part, 1)
            scatter(memoryview(file[get.start:get.end]), get, offsets, run, out)
        expected = np.concatenate([file[o:o + run] for o in offsets.tolist()])
        assert np.array_equal(out, expected)
        covered = sum(g.end - g.start for g in gets)
        exact_gaps = np.diff(offsets) - run
        assert covered <= len(offsets) * run + int(exact_gaps[exact_gaps <= merge_gap].sum())
    # Exact runs only with merge_gap 0; everything in one GET when the gaps are small.
    offsets = np.arange(0, 1000, 100, dtype=np.int64)
    assert len(plan_gets(offsets, 50, 0, 1 << 20)) == 10
    assert len(plan_gets(offsets, 50, 50, 1 << 20)) == 1


def test_redact_removes_secret_values_and_credential_fields():
    from lazyload.remote.store import redact

    text = (f"GET https://h/o?X-Amz-Signature=abc123&X-Amz-Credential=AKIA/2026 failed; {SECRET}; "
            "Authorization: Bearer hf_other; aws_secret_access_key=wJalr; key 'model.x' at byte 4")
    out = redact(text, (SECRET,))
    for secret in (SECRET, "abc123", "AKIA", "hf_other", "wJalr"):
        assert secret not in out
    assert "https://h/o" in out and "key 'model.x' at byte 4" in out


def test_importing_lazyload_imports_no_remote_client():
    code = ("import sys, lazyload; bad = [m for m in ('obstore', 'boto3', 's3fs', 'fsspec', 'http.client') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert json.loads(out.strip().replace("'", '"')) in ([], ["http.client"])


# World 2 under gloo: each rank loads from its own server (the same files), so that each
# server's log is one rank's traffic.

HEADER_GET = 4096  # the first GET of each file while indexing (these headers are 1-2 KiB)


def _run_rank(case, rank, world):
    urls, directory, merge_gap, out = case
    from lazyload import LazyCheckpoint
    from lazyload.remote import RemoteOptions
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    ckpt = LazyCheckpoint(urls[rank], remote=RemoteOptions(merge_gap=merge_gap, header_bytes=HEADER_GET))
    model = build_model("llama", config, torch.bfloat16)
    report = ckpt.load_into(model, rank, world, progress=False)
    assert_same_state(_state(model), local_state(directory, config, rank=rank, world=world))
    with open(f"{out}-{rank}.json", "w") as f:
        json.dump({"header": ckpt.header_bytes_read, "read": report.bytes_read, "served": report.bytes_served,
                   "requests": report.requests}, f)


def test_world2_ranks_request_only_their_ranges(checkpoint, tmp_path):
    directory, config = checkpoint("llama", "bf16")
    files = shard_files(directory)
    total = sum(p.stat().st_size for p in files)
    # Indexing: each file's length and header (and what else its first GET covers), the index json.
    index_json = (directory / "model.safetensors.index.json").stat().st_size
    indexing = header_bytes(files) + HEADER_GET * len(files) + index_json
    cases, servers = [], []
    for merge_gap in (0, 1 << 20):
        pair = [RangeServer(str(directory)).__enter__() for _ in range(2)]
        servers.append(pair)
        cases.append(([s.url + "/" for s in pair], str(directory), merge_gap, str(tmp_path / f"gap{merge_gap}")))
    try:
        spawn_cases(2, cases, tmp_path, _run_rank)
    finally:
        for pair in servers:
            for server in pair:
                server.__exit__()
    for (urls, _, merge_gap, out), pair in zip(cases, servers):
        for rank, server in enumerate(pair):
            with open(f"{out}-{rank}.json") as f:
                got = json.load(f)
            # The server's count and the rank's agree; the load serves what the rank reads.
            assert server.served() == got["header"] + got["served"] and got["header"] <= indexing
            assert got["read"] < 0.75 * total  # its share (half of the sharded tensors, all the replicated)
            if merge_gap == 0:
                assert server.served() <= got["read"] * 1.1 + indexing
            else:  # gaps merged: fewer requests, the gaps read too, never beyond the tensors
                assert got["served"] <= total
