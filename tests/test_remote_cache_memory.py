"""A remote load with `RemoteOptions(cache_dir=...)` keeps the byte budget too: a GET's body
is written to its cache entry and into its place chunk by chunk as it arrives, and a cache
hit is read from the entry into its place the same way (no buffer of the whole range).
A GET that fails leaves no entry a later load would trust.

The memory tests load in fresh processes, the server in this one (as in
test_remote_memory.py): the first load fills the cache, the second, in another process, is
served from it.
"""
from __future__ import annotations

import hashlib
import os
import re

import pytest
import torch

from no_secrets import no_secret_shown  # noqa: F401 (an autouse fixture: no planted secret shows)
from remote_servers import RangeServer
from test_remote import local_state, remote_load, s3, served, upload  # noqa: F401 (s3, served: fixtures)
from test_remote_memory import SHAPE, assert_peak_within_budget, measured_remote_load
from test_streaming import in_fresh_process

from lazyload.errors import ReadError
from lazyload.remote import RemoteOptions

_ENTRY = re.compile(r"([0-9]+)-([0-9]+)")  # a cache entry's name: the range it holds


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for k, v in state.items()}


def _cold_then_warm(url: str, config, directory, cache: str, server: RangeServer | None = None) -> None:
    """Load into an empty cache, then from it (each in a fresh process); both within the
    budget and bit-identical to a local load. The warm load's process asks `server` for
    headers only (GETs from byte 0), no tensor bytes."""
    cold = in_fresh_process(measured_remote_load, url, config, torch.bfloat16, cache)
    seen = len(server.log) if server else 0
    warm = in_fresh_process(measured_remote_load, url, config, torch.bfloat16, cache)
    expected = _digests(local_state(directory, config))
    for r in (cold, warm):
        assert_peak_within_budget(r)
        assert r["digests"] == expected
    assert cold["requests"] > 4 * 8 and cold["bytes_cached"] == 0
    assert warm["requests"] == 0 and warm["bytes_cached"] > 8 * (8 << 20)
    if server is not None:
        gets = [e for e in server.log[seen:] if e.method == "GET"]
        assert gets and all(e.start == 0 for e in gets)


def test_http_load_with_a_cache_keeps_the_budget_cold_and_warm(checkpoint, tmp_path):
    directory, config = checkpoint("llama", "bf16", **SHAPE)
    with RangeServer(str(directory)) as server:
        _cold_then_warm(server.url + "/", config, directory, str(tmp_path / "cache"), server)


def test_s3_load_with_a_cache_keeps_the_budget_cold_and_warm(s3, checkpoint, tmp_path):
    client, bucket = s3
    directory, config = checkpoint("llama", "bf16", **SHAPE)
    upload(client, bucket, directory, "cache-memory")
    _cold_then_warm(f"s3://{bucket}/cache-memory/", config, directory, str(tmp_path / "cache"))


def _entries(cache) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(cache) for name in names]


def _assert_entries_hold_the_files_bytes(cache, directory) -> None:
    """Every file in the cache is a complete entry (no temp file left) whose bytes are the
    range of a checkpoint file, after their sha256."""
    files = [open(os.path.join(directory, name), "rb").read() for name in os.listdir(directory)
             if name.endswith(".safetensors")]
    for path in _entries(cache):
        match = _ENTRY.fullmatch(os.path.basename(path))
        assert match, f"{path}: not an entry (a temp file left behind)"
        start, end = int(match.group(1)), int(match.group(2))
        stored = open(path, "rb").read()
        digest, data = stored[:32], stored[32:]
        assert hashlib.sha256(data).digest() == digest
        assert any(f[start:end] == data for f in files), f"{path}: not the file's bytes {start}..{end}"


def _load_with_a_cut_get(server, url, config, options):
    """A load whose first GET of tensor bytes is cut after half its body; its report."""
    from checkpoints import build_model

    from lazyload import LazyCheckpoint

    ckpt = LazyCheckpoint(url, remote=options)
    ckpt.index  # the headers first: the cut GET is a tensor's
    server.drop(1)
    return ckpt.load_into(build_model("llama", config, torch.bfloat16), progress=False)


def test_a_get_cut_mid_body_and_retried_caches_the_whole_range(served, tmp_path):
    """The retry starts its entry over: the next load is served from the cache, exactly."""
    server, url, directory, config = served
    cache = tmp_path / "cache"
    options = RemoteOptions(cache_dir=str(cache), retries=2, backoff=0.0)
    report = _load_with_a_cut_get(server, url, config, options)
    assert report.retries == 1 and report.bytes_cached == 0
    _assert_entries_hold_the_files_bytes(cache, directory)
    model, report = remote_load(url, config, options)
    assert report.requests == 0 and report.bytes_cached == report.bytes_read
    expected = local_state(directory, config)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_a_retried_get_starts_its_entry_over(served, tmp_path):
    """A GET written through many views, cut after half of them were written to its entry:
    the retry writes the entry from its start, and reading it back gives the file's bytes
    without another GET."""
    from lazyload.remote.source import open_store
    from lazyload.remote.store import Stats

    server, url, directory, config = served
    name = max(os.listdir(directory), key=lambda n: os.path.getsize(os.path.join(directory, n)))
    expected = open(os.path.join(directory, name), "rb").read()[1000:]
    store, key = open_store(url + name, RemoteOptions(cache_dir=str(tmp_path / "cache"), retries=1, backoff=0.0))
    stats = Stats()
    identity = store.get(key, 0, 8, stats).identity

    def read() -> bytearray:
        out = bytearray(len(expected))
        pieces = lambda: (memoryview(out)[i:i + 4096] for i in range(0, len(out), 4096))  # noqa: E731
        store.get(key, 1000, 1000 + len(expected), stats, identity, into=pieces)
        return out

    server.drop(1)
    assert read() == expected and stats.retries == 1 and stats.bytes_cached == 0
    gets = len(server.log)
    assert read() == expected and stats.bytes_cached == len(expected) and len(server.log) == gets
    _assert_entries_hold_the_files_bytes(tmp_path / "cache", directory)


def test_a_get_that_fails_mid_body_leaves_no_entry_a_later_load_trusts(served, tmp_path):
    """With no retry left, the cut GET fails the load: its half-written entry is removed, every
    entry left is whole, and the next load fetches that range again and equals a local load."""
    server, url, directory, config = served
    cache = tmp_path / "cache"
    options = RemoteOptions(cache_dir=str(cache), retries=0)
    with pytest.raises(ReadError, match="still failing after 0 retries"):
        _load_with_a_cut_get(server, url, config, options)
    _assert_entries_hold_the_files_bytes(cache, directory)
    model, report = remote_load(url, config, options)
    assert report.requests > 0 and report.bytes_served > 0
    expected = local_state(directory, config)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
