"""Remote reads that trust nothing they did not check, against real servers on localhost
(the tests' Range server, moto's S3): a range cache that a mirror, a weak ETag, a corrupt
entry or another user cannot poison; S3 URLs whose keys obstore would refuse or rewrite
are clear errors; a remote checkpoint's quantization_config comes from its own config.json."""
from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest
import torch

from checkpoints import build_model, shard_files
from quant_checkpoints import write_compressed_checkpoint, write_fp8_checkpoint
from no_secrets import no_secret_shown  # noqa: F401 (an autouse fixture: no planted secret shows)
from remote_servers import RangeServer
from test_remote import SECRET, assert_same_state, local_state, remote_load, s3, upload  # noqa: F401 (s3: fixture)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def cache_entries(cache) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(cache) for name in names]


def rewrite_in_place(path, data: bytes, offset: int) -> None:
    """Other bytes at `offset` with the file's inode, size and mtime kept: the Range server
    answers the same ETag for them (as a mirror answers the published ETag)."""
    info = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


@pytest.fixture
def hub_copy(checkpoint, tmp_path):
    """A bf16 Llama checkpoint as a Hub repo (org/tiny@main) in files of its own (not hard
    links: tests rewrite them): (root to serve, repo directory, original directory, config)."""
    directory, config = checkpoint("llama", "bf16")
    repo = tmp_path / "root" / "org" / "tiny" / "resolve" / "main"
    shutil.copytree(directory, repo)
    return tmp_path / "root", repo, directory, config


def test_cache_entries_of_a_mirror_are_not_served_for_the_real_endpoint(hub_copy, tmp_path, monkeypatch):
    """A mirror answers the published ETag with other bytes; a later load from the real
    endpoint with the same cache_dir gets the real bytes."""
    from lazyload.remote import RemoteOptions

    root, repo, original, config = hub_copy
    shard = shard_files(repo)[0]
    genuine = shard.read_bytes()
    data_start = 8 + int.from_bytes(genuine[:8], "little")
    options = RemoteOptions(cache_dir=str(tmp_path / "cache"))
    with RangeServer(str(root)) as mirror, RangeServer(str(root)) as real:
        rewrite_in_place(shard, bytes(b ^ 0xFF for b in genuine[data_start:data_start + 4096]), data_start)
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        poisoned, report = remote_load("hf://org/tiny", config, options)
        assert report.bytes_cached == 0 and cache_entries(tmp_path / "cache")
        rewrite_in_place(shard, genuine[data_start:data_start + 4096], data_start)
        monkeypatch.setenv("HF_ENDPOINT", real.url)
        model, report = remote_load("hf://org/tiny", config, options)
    assert report.bytes_cached == 0 and report.bytes_served == report.bytes_read
    assert_same_state(state(model), local_state(original, config))
    bad, good = state(poisoned), state(model)
    assert any(not torch.equal(bad[k], good[k]) for k in good)  # the mirror's bytes did differ


@pytest.fixture
def served(hub_copy):
    root, repo, original, config = hub_copy
    with RangeServer(str(root)) as server:
        yield server, server.url + "/org/tiny/resolve/main/", original, config


def test_a_corrupt_cache_entry_is_a_miss_removed_and_said(served, tmp_path, caplog):
    from lazyload.remote import RemoteOptions

    server, url, original, config = served
    cache = tmp_path / "cache"
    options = RemoteOptions(cache_dir=str(cache))
    remote_load(url, config, options)
    entry = max(cache_entries(cache), key=os.path.getsize)
    size = os.path.getsize(entry)
    with open(entry, "r+b") as f:  # one byte flipped, the length kept
        f.seek(size - 1)
        last = f.read(1)
        f.seek(size - 1)
        f.write(bytes([last[0] ^ 1]))
    with caplog.at_level(logging.WARNING, logger="lazyload"):
        model, report = remote_load(url, config, options)
    assert_same_state(state(model), local_state(original, config))
    assert f"{entry}: cache entry of bytes" in caplog.text and "does not match its digest; removed" in caplog.text
    assert 0 < report.bytes_served < report.bytes_read and report.bytes_cached == report.bytes_read - \
        report.bytes_served
    again, report = remote_load(url, config, options)  # the entry was written again, whole
    assert report.requests == 0 and report.bytes_cached == report.bytes_read


def test_objects_without_a_strong_etag_are_not_cached(hub_copy, tmp_path):
    """A weak ETag (W/...) allows other bytes of the same meaning: nothing may be cached."""
    from lazyload.remote import RemoteOptions

    root, repo, original, config = hub_copy
    options = RemoteOptions(cache_dir=str(tmp_path / "cache"))
    with RangeServer(str(root)) as server:
        plain = server.RequestHandlerClass

        class WeakETags(plain):
            def send_header(self, keyword, value):
                super().send_header(keyword, "W/" + value if keyword == "ETag" else value)

        server.RequestHandlerClass = WeakETags
        url = server.url + "/org/tiny/resolve/main/"
        remote_load(url, config, options)
        model, report = remote_load(url, config, options)
    assert report.bytes_cached == 0 and report.bytes_served == report.bytes_read
    assert cache_entries(tmp_path / "cache") == []
    assert_same_state(state(model), local_state(original, config))


def test_cache_dir_is_created_private_and_entries_are_fsynced_before_the_rename(served, tmp_path, monkeypatch):
    from lazyload.remote import RemoteOptions

    server, url, _, config = served
    cache = tmp_path / "new" / "cache"
    synced = []
    fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))  # the temp file, under its temp name
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    remote_load(url, config, RemoteOptions(cache_dir=str(cache)))
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    entries = cache_entries(cache)
    assert entries and len([p for p in synced if p.startswith(str(cache))]) == len(entries)
    assert not set(synced) & set(entries)  # fsynced before it had its name


@pytest.mark.parametrize("unsafe", ["group", "other", "owner"])
def test_a_cache_dir_others_can_write_is_refused_before_any_request(served, tmp_path, unsafe):
    from lazyload import LazyCheckpoint
    from lazyload.errors import RemoteError
    from lazyload.remote import RemoteOptions

    server, url, _, _ = served
    cache = tmp_path / "shared-cache"
    cache.mkdir(mode=0o700)
    if unsafe == "owner":
        if os.geteuid() != 0:
            pytest.skip("giving the directory to another user needs root")
        os.chown(cache, 65534, 65534)
    else:
        os.chmod(cache, 0o770 if unsafe == "group" else 0o707)
    expected = "owned by user 65534" if unsafe == "owner" else "writable by its group or by others"
    with pytest.raises(RemoteError, match=f"cache_dir {cache}: {expected}"):
        LazyCheckpoint(url, remote=RemoteOptions(cache_dir=str(cache)))
    assert server.log == []


@pytest.mark.parametrize("path", ["llama/../llama/", "/llama/", "llama//", "llama/./model.safetensors",
                                  "llama/\x01.safetensors", "llama/\udcff.safetensors"])
def test_s3_keys_obstore_would_refuse_or_rewrite_are_remote_errors(s3, checkpoint, path):
    from lazyload import LazyCheckpoint
    from lazyload.errors import RemoteError

    client, bucket = s3
    directory, _ = checkpoint("llama", "bf16")
    upload(client, bucket, directory, "llama")
    with pytest.raises(RemoteError, match=r"not a valid S3 key \(") as err:
        LazyCheckpoint(f"s3://{bucket}/{path}").index
    assert SECRET not in str(err.value) and "testing-key-id" not in str(err.value)


def test_s3_bucket_names_are_checked(s3):
    from lazyload import LazyCheckpoint
    from lazyload.errors import RemoteError

    with pytest.raises(RemoteError, match="s3://models\\?x=\\*\\*\\*: not a valid bucket name"):  # a query's values: never shown
        LazyCheckpoint("s3://models?x=1/llama/")


@pytest.mark.parametrize("kind", ["fp8", "compressed-tensors"])
def test_a_remote_prequantized_checkpoint_uses_its_own_config_json(checkpoint, tmp_path, kind, monkeypatch):
    """Blocks of 16 (not the 128 the tensors alone would suggest) are known only from the
    quantization_config of the config.json beside the files, on the server."""
    from lazyload import LazyCheckpoint

    src, config = checkpoint("llama", "bf16")
    directory = (write_fp8_checkpoint(src, tmp_path / "root" / "q", block=(16, 16)) if kind == "fp8" else
                 write_compressed_checkpoint(src, tmp_path / "root" / "q", "int", "group", group_size=16))
    expected = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(str(directory)).load_into(expected, progress=False)
    monkeypatch.chdir(tmp_path)  # a config.json looked for on the local disk would not be found either
    with RangeServer(str(tmp_path / "root")) as server:
        ckpt = LazyCheckpoint(server.url + "/q/")
        assert ckpt.quantization.leaves and ckpt.remote.config_json[0] == server.url + "/q/config.json"
        model = build_model("llama", config, torch.bfloat16)
        ckpt.load_into(model, progress=False)
    assert_same_state(state(model), state(expected))


def test_load_model_builds_a_remote_checkpoint_from_its_own_config_json(served):
    from lazyload import load_model

    server, url, original, config = served
    model, report = load_model(url, dtype=torch.bfloat16, progress=False)
    assert model.config.num_hidden_layers == config.num_hidden_layers and report.reader == "remote"
    assert_same_state(state(model), local_state(original, config))
