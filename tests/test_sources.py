"""Sources behind one protocol (`lazyload.formats.protocol`): a format registered from
outside the package loads a real model, from a directory and over HTTP; a pre-sharded copy
(`lazyload_sharded.json`) is read by URL (its folder and its json, over http:// and s3://)
exactly as from disk; the registry asks formats in their registered order."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import build_model, shard_files
from remote_servers import RangeServer
from test_remote import s3, upload  # noqa: F401  (the moto S3 fixture)

# A toy format, as a newcomer writes one: a folder holding `toy_manifest.json`, which lists
# safetensors files whose keys carry a "toy/" prefix; the model's names are the keys without it.
MANIFEST = "toy_manifest.json"


def toy_detect(storage, target):
    from lazyload.formats import CheckpointSource

    if not (isinstance(target, str) and storage.is_dir(target)):
        return None
    manifest = storage.join(target, MANIFEST)
    if not storage.exists(manifest):
        return None
    names = storage.read_json(manifest, "a toy manifest")["files"]
    return CheckpointSource("toy", [storage.join(target, name) for name in names], manifest)


def toy_open_index(source, storage, options):
    from lazyload.expr import Source
    from lazyload.formats.logical import Layout, Part
    from lazyload.index import CheckpointIndex

    headers = storage.headers(source.files)
    entries = [(e.key, e) for file_entries, _, _ in headers for e in file_entries]
    layouts = {key.removeprefix("toy/"): Layout(key.removeprefix("toy/"), e.shape, e.dtype,
                                                (Part(Source(key), tuple((0, n) for n in e.shape)),))
               for key, e in entries}
    identities = {f: identity for f, (_, _, identity) in zip(source.files, headers)}
    return CheckpointIndex.of(source.files, entries, layouts, sum(h[1] for h in headers), source.description,
                              identities)


@pytest.fixture
def toy_format():
    from lazyload.formats import Format, formats, register, unregister

    register(Format("toy", toy_detect, toy_open_index, remote=True), before="safetensors")
    try:
        yield
    finally:
        unregister("toy")
    assert "toy" not in [f.name for f in formats()]


def _toy_copy(directory, out):
    """The checkpoint in `directory` rewritten in the toy format under `out`."""
    out.mkdir(parents=True)
    names = []
    for i, path in enumerate(shard_files(directory)):
        tensors = {f"toy/{k}": v for k, v in load_file(str(path)).items()}
        names.append(f"part-{i}.safetensors")
        save_file(tensors, str(out / names[-1]))
    (out / MANIFEST).write_text(json.dumps({"files": names}))
    (out / "config.json").write_bytes((directory / "config.json").read_bytes())
    return out


def _state(path, config, rank=0, world=1, **kwargs):
    from lazyload import LazyCheckpoint

    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(str(path), **kwargs).load_into(model, rank, world, progress=False)
    assert report.ok
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, report


def _assert_equal(got, want, label=""):
    assert sorted(got) == sorted(want), label
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), f"{label}{key} differs"


def test_a_format_registered_from_outside_loads_a_real_model(checkpoint, tmp_path, toy_format):
    from lazyload import LazyCheckpoint

    original, config = checkpoint("llama")
    toy = _toy_copy(original, tmp_path / "toy")
    ckpt = LazyCheckpoint(str(toy))
    assert ckpt.source.kind == "toy" and ckpt.source.description == str(toy / MANIFEST)
    assert all(k.startswith("toy/") for k in ckpt.keys())
    for rank, world in ((0, 1), (1, 2)):
        got, _ = _state(toy, config, rank, world)
        want, _ = _state(original, config, rank, world)
        _assert_equal(got, want, f"rank {rank} of {world}: ")
    with RangeServer(str(tmp_path)) as server:  # the same module, through a URL's storage
        got, report = _state(server.url + "/toy/", config)
        assert report.reader == "remote"
        _assert_equal(got, _state(original, config)[0])


def test_without_its_registration_the_toy_folder_is_not_a_checkpoint(checkpoint, tmp_path):
    from lazyload import ArgumentError, LazyCheckpoint

    original, _ = checkpoint("llama")
    toy = _toy_copy(original, tmp_path / "toy")
    ckpt = LazyCheckpoint(str(toy))  # the safetensors catch-all: the files, under their stored keys
    assert ckpt.source.kind == "safetensors" and all(k.startswith("toy/") for k in ckpt.keys())
    with pytest.raises(ArgumentError, match="no format 'nowhere'"):
        from lazyload.formats import Format, register

        register(Format("never", toy_detect, toy_open_index), before="nowhere")


def test_formats_are_asked_in_their_registered_order(toy_format):
    from lazyload.formats import formats

    assert [f.name for f in formats()] == ["sharded", "deepspeed", "megatron_dist", "dcp_safetensors", "dcp", "megatron",
                                           "torch", "toy", "safetensors"]


@pytest.fixture(scope="module")
def resharded(checkpoint, tmp_path_factory):
    """(root, the original, a TP-2 pre-sharded copy under root/llama-tp2, config)."""
    from lazyload import save_sharded

    original, config = checkpoint("llama")
    root = tmp_path_factory.mktemp("served")
    save_sharded(str(original), root / "llama-tp2", 2)
    return root, original, root / "llama-tp2", config


@pytest.mark.parametrize("name", ["llama-tp2/", "llama-tp2", "llama-tp2/lazyload_sharded.json"])
def test_a_resharded_copy_is_read_by_url(resharded, name):
    from lazyload import LazyCheckpoint

    root, original, copy, config = resharded
    with RangeServer(str(root)) as server:
        url = f"{server.url}/{name}"
        ckpt = LazyCheckpoint(url)
        assert ckpt.source.kind == "sharded" and ckpt.source.description.endswith("/llama-tp2/lazyload_sharded.json")
        assert sorted(ckpt.keys()) == sorted(LazyCheckpoint(str(copy)).keys())
        for rank, world in ((0, 1), (0, 2), (1, 2)):
            got, report = _state(url, config, rank, world)
            _assert_equal(got, _state(copy, config, rank, world)[0], f"{url} rank {rank} of {world}: ")
            assert report.reader == "remote"
        # At the world it was written for, a rank's GETs are for its own file only.
        before = len(server.log)
        _state(url, config, 1, 2)
        files = {e.path.rsplit("/", 1)[1] for e in server.log[before:] if e.start > 0}
        assert files == {json.loads((copy / "lazyload_sharded.json").read_text())["files"][1]["name"]}


def test_a_resharded_copy_is_read_from_s3(resharded, s3):  # noqa: F811
    from lazyload import LazyCheckpoint

    client, bucket = s3
    root, original, copy, config = resharded
    upload(client, bucket, copy, "tp2")
    ckpt = LazyCheckpoint(f"s3://{bucket}/tp2/")
    assert ckpt.source.kind == "sharded"
    got, report = _state(f"s3://{bucket}/tp2/", config, 1, 2)
    _assert_equal(got, _state(copy, config, 1, 2)[0])
    assert report.reader == "remote"


def test_cli_inspects_and_plans_a_resharded_copy_by_url(resharded, capsys):
    from lazyload.cli import main

    root, _, copy, _ = resharded
    assert main(["plan", str(copy), "--world", "2"]) == 0
    local_plan = capsys.readouterr().out.split("\n", 1)[1]  # the table, after the line naming the path
    with RangeServer(str(root)) as server:
        for url in (f"{server.url}/llama-tp2/", f"{server.url}/llama-tp2/lazyload_sharded.json"):
            assert main(["inspect", url]) == 0
            out = capsys.readouterr().out
            assert "self_attn.q_proj.weight" in out and "rank-00001-of-00002" in out, out
            assert main(["plan", url, "--world", "2"]) == 0  # config.json from the store, beside the files
            assert capsys.readouterr().out.split("\n", 1)[1] == local_plan


def test_nothing_dispatches_on_a_format_kind():
    """A new format is one module plus one registration: no module compares a source's
    `kind` with a registered format's name (an if-chain a newcomer would have to edit)."""
    import ast
    import pathlib

    import lazyload
    from lazyload.formats import formats

    names = {f.name for f in formats()}
    found = []
    for path in pathlib.Path(lazyload.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind":
                values = [c.value for c in node.comparators if isinstance(c, ast.Constant)]
                values += [e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.Set, ast.List))
                           for e in c.elts if isinstance(e, ast.Constant)]
                if names & set(values):
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"dispatch on a format's kind at {found}; register the format's hooks instead"


def test_a_refused_probe_on_s3_counts_as_absent(checkpoint, s3, monkeypatch):  # noqa: F811
    """S3 answers 403 for a missing key to a caller without ListBucket: the probe for a
    pre-sharded copy's json, refused, does not fail the load of a plain checkpoint."""
    from lazyload.errors import AccessDeniedError
    from lazyload.remote.s3 import S3Store

    client, bucket = s3
    original, config = checkpoint("llama")
    upload(client, bucket, original, "plain403")
    attempt = S3Store.attempt

    def no_list_bucket(self, key, *args, **kwargs):
        if key.endswith("lazyload_sharded.json"):
            raise AccessDeniedError(f"{self.url(key)}: access denied (HTTP 403)")
        return attempt(self, key, *args, **kwargs)

    monkeypatch.setattr(S3Store, "attempt", no_list_bucket)
    got, _ = _state(f"s3://{bucket}/plain403/", config)
    _assert_equal(got, _state(original, config)[0])


def test_engine_placer_and_executor_ask_destinations_not_their_classes():
    """Destinations (and what a reader hands them) are known by their interface: no
    isinstance against a concrete destination or read-result class where items are placed."""
    import ast
    import pathlib

    import lazyload

    concrete = {"QuantizedBox", "TensorDest", "QuantizedDest", "WholeDest"}
    found = []
    for name in ("engine.py", "placer.py", "executor.py"):
        path = pathlib.Path(lazyload.__file__).parent / name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if concrete & {getattr(c, "id", getattr(c, "attr", None)) for c in classes}:
                    found.append(f"{name}:{node.lineno}")
    assert not found, f"isinstance on a concrete destination class at {found}; ask the destination or the read item"
