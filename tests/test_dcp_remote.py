"""torch DCP checkpoints read where they are stored: a checkpoint written by `dcp.save` (a
Llama state dict beside its AdamW state) served by a local HTTP server and by moto's S3
server loads bit for bit as the same files load from disk, at world 1 and at world 2 under
gloo, each rank fetching less than 0.75x the checkpoint's tensor bytes. Indexing fetches
`.metadata` and the chunks' zip headers only (no tensor byte), the headers of neighbouring
chunks by one GET; a server that answers short or with the wrong range is an error naming
the URL (never its signature) and the tensor."""
from __future__ import annotations

import os

import pytest
import torch

from checkpoints import build_model
from dcp_checkpoints import llama, save_plain
from gloo import spawn_cases
from no_secrets import SECRET, SIGNATURE, no_secret_shown  # noqa: F401 (autouse: no planted secret shows)
from remote_servers import RangeServer, moto_s3

QUERY = f"sig={SIGNATURE}"  # a presigned URL's: sent with every request, shown nowhere


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`plain/`: dcp.save of a Llama and its AdamW state; `hf/`: the Llama by DCP's
    HuggingFaceStorageWriter (per-rank safetensors files, here one rank's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    root = tmp_path_factory.mktemp("dcp_remote")
    save_plain(root / "plain")
    writer = HuggingFaceStorageWriter(str(root / "hf"), save_distributed=True)
    dcp.save(llama(torch.float32)[0].state_dict(), storage_writer=writer, no_dist=True)
    return root


@pytest.fixture(scope="module")
def http(saved):
    with RangeServer(str(saved)) as server:
        server.query = QUERY
        yield server


@pytest.fixture(scope="module")
def s3(saved):
    """The checkpoint uploaded to moto's S3 server, throwaway credentials in the environment."""
    with moto_s3("train", SECRET) as client:
        for path in sorted((saved / "plain").iterdir()):
            client.upload_file(str(path), "train", f"step-10/{path.name}")
        for path in sorted((saved / "hf").iterdir()):
            client.upload_file(str(path), "train", f"hf/{path.name}")
        client.upload_file(str(saved / "plain" / ".metadata"), "train", "save/iter_0000100/.metadata")
        client.put_object(Bucket="train", Key="save/iter_0000100/metadata.json", Body=b'{"sharded_backend": "torch_dist"}')
        yield "s3://train/step-10/"


def _url(http) -> str:
    return f"{http.url}/plain/?{QUERY}"


def _state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}


def _load(path, rank=0, world=1):
    from lazyload import LazyCheckpoint

    model = build_model("llama", llama()[1], torch.float32)
    checkpoint = LazyCheckpoint(path)
    report = checkpoint.load_into(model, rank, world, progress=False)
    assert report.ok
    return _state(model), report, checkpoint


def _assert_same(got, want, label):
    assert sorted(got) == sorted(want), label
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{label}: {key} differs"


def test_http_and_s3_load_as_the_local_files(saved, http, s3):
    want, _, local = _load(str(saved / "plain"))
    for url in (_url(http), s3):
        got, report, checkpoint = _load(url)
        _assert_same(got, want, url)
        assert report.reader == "remote" and report.bytes_served == report.bytes_read < 1.05 * local.total_bytes
        assert not [n for n in checkpoint.index.names() if n.startswith("optimizer.")]


def test_dcp_safetensors_flavour_over_s3(saved, s3):
    """Its per-rank files found by listing the prefix, their headers (DCP_SHARDING_INFO) by
    ranged GETs: the same tensors as from disk."""
    from lazyload import LazyCheckpoint

    url = s3.replace("step-10", "hf")
    assert LazyCheckpoint(url).source.kind == "dcp_safetensors"
    want, _, _ = _load(str(saved / "hf"))
    got, report, _ = _load(url)
    _assert_same(got, want, url)
    assert report.reader == "remote"


def test_iterations_of_an_s3_save_directory_are_listed(s3):
    """iteration= over S3: the iteration's folder is found, a missing one is named with those
    the prefix lists (found from `.metadata` and `metadata.json` alone: nothing else is read)."""
    from lazyload import CheckpointError, LazyCheckpoint

    url = s3.replace("step-10", "save")
    assert LazyCheckpoint(url, iteration=100).source.description.rstrip("/").endswith("/save/iter_0000100")
    with pytest.raises(CheckpointError, match="no iteration 300 .*the iterations present: 100"):
        LazyCheckpoint(url, iteration=300)


def test_indexing_fetches_headers_only_and_neighbours_together(saved, http):
    """No indexing GET touches a tensor's bytes; the tail of a chunk and the head of the next
    come in one GET: one GET per chunk and file, not two per chunk."""
    from lazyload import LazyCheckpoint

    http.log.clear()
    index = LazyCheckpoint(_url(http)).index
    gets = [e for e in http.log if e.method == "GET" and e.path.split("?")[0].endswith(".distcp")]
    entries = list(index.entries())
    overlapping = [(e.path, e.start) for e in gets for t in entries if t.file.endswith(e.path.split("?")[0])
                   and e.start < t.end and t.start < e.start + e.sent]
    assert {http.url + e.path.split("?")[0] for e in gets} == {t.file for t in entries} and not overlapping
    assert len(gets) <= len(entries) + len(index.files) < 2 * len(entries)
    assert index.header_bytes_read < 0.25 * os.path.getsize(saved / "plain" / "__0_0.distcp")


def _case_world2(case, rank, world):
    url, local = case
    got, report, checkpoint = _load(url, rank, world)
    want, _, _ = _load(local, rank, world)
    _assert_same(got, want, f"{url} rank {rank}")
    assert report.bytes_served < 0.75 * checkpoint.total_bytes, (report.bytes_served, checkpoint.total_bytes)


def test_world_2_each_rank_fetches_its_share(saved, http, s3, tmp_path):
    local = str(saved / "plain")
    spawn_cases(2, [(_url(http), local), (s3, local)], tmp_path, _case_world2)


@pytest.mark.parametrize("hostile", ["short", "wrong_range"])
def test_a_hostile_answer_to_a_chunk_header_names_the_url_and_tensor(http, hostile):
    """Once `.metadata` is read, every answer is short (a Content-Length below the range) or
    for another range: the index fails naming the data file (its signature redacted) and
    the tensor whose chunk header it was."""
    from lazyload import CheckpointError, LazyCheckpoint
    from lazyload.remote import RemoteOptions

    checkpoint = LazyCheckpoint(_url(http), remote=RemoteOptions(retries=0))  # .metadata read (and kept)
    try:
        if hostile == "short":
            http.length = 10
        else:
            http.content_range = lambda start, last, size: f"bytes {start + 1}-{last + 1}/{size}"
        with pytest.raises(CheckpointError) as failure:
            checkpoint.index
    finally:
        http.length = None
        http.content_range = lambda start, last, size: f"bytes {start}-{last}/{size}"
    message = str(failure.value)
    assert "/plain/__0_0.distcp" in message and "tensor 'model." in message, message
    assert SIGNATURE not in message


def test_a_short_answer_while_loading_names_the_url_and_tensor(http):
    """Indexed from a good server, then every answer cut short: the load is a ReadError
    naming the data file (its signature redacted) and the tensor, the model left on meta."""
    from lazyload import LazyCheckpoint, ReadError
    from lazyload.remote import RemoteOptions

    checkpoint = LazyCheckpoint(_url(http), remote=RemoteOptions(retries=0))
    checkpoint.index
    model = build_model("llama", llama()[1], torch.float32)
    http.length = 10
    try:
        with pytest.raises(ReadError) as failure:
            checkpoint.load_into(model, progress=False)
    finally:
        http.length = None
    message = str(failure.value)
    assert "/plain/__0_0.distcp" in message and "model." in message and SIGNATURE not in message, message
    assert all(t.is_meta for t in model.state_dict().values())


def test_reshard_from_a_url(saved, http, tmp_path):
    """`lazyload reshard URL OUT --world 2`: the chunks read by ranged GETs; each rank's file of
    the copy holds that rank's shards of the local checkpoint, bit for bit."""
    from lazyload import LazyCheckpoint
    from lazyload.cli import main

    llama()[1].save_pretrained(tmp_path / "config")
    out = tmp_path / "resharded"
    assert main(["reshard", _url(http), str(out), "--world", "2", "--config", str(tmp_path / "config")]) == 0
    for rank in range(2):
        want = build_model("llama", llama()[1], torch.float32)
        LazyCheckpoint(str(saved / "plain")).load_into(want, rank, 2, shards_only=True, progress=False)
        got = build_model("llama", llama()[1], torch.float32)
        LazyCheckpoint(str(out)).load_into(got, rank, 2, shards_only=True, progress=False)
        _assert_same(_state(got), _state(want), f"rank {rank}")
