"""A plan is data (lazyload/digest.py): `lazyload plan --json` prints every rank's whole
plan and its digest; the digest is the same for the same load wherever the checkpoint
lies, and differs (in the field that differs) when the load does; the bytes replicas
exchange per target are the plan's."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from checkpoints import build_model, shard_files, write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base = tmp_path_factory.mktemp("digest")
    directory, config = write_checkpoint("llama", torch.float32, base / "llama")
    return str(directory), config


def _plan(directory, config, world=2, rank=0, **options):
    from lazyload import LazyCheckpoint
    from lazyload.planner import LoadOptions, plan_load

    model = build_model("llama", config, torch.float32)
    return plan_load(LazyCheckpoint(directory), model, rank, world, LoadOptions(**options), preview=True)


def test_plan_json_prints_every_rank_whole_plan_with_its_digest(llama, capsys):
    from lazyload.cli import main
    from lazyload.digest import plan_digest
    from lazyload.summary import plan_ranks

    directory, _ = llama
    assert main(["plan", directory, "--world", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    plans, warnings = plan_ranks(directory, 2)
    assert (printed["world"], printed["warnings"], len(printed["ranks"])) == (2, warnings, 2)
    for data, plan in zip(printed["ranks"], plans):
        assert data["digest"] == plan_digest(plan) and data["rank"] == plan.rank
        assert [t["local_shape"] for t in data["targets"]] == [list(t.local_shape) for t in plan.targets]
        assert [(i["entry"]["key"], i["entry"]["file"], i["src_box"]) for i in data["items"]] == [
            (i.entry.key, i.entry.file, [list(b) for b in i.src_box]) for i in plan.items]
        assert data["placements"]["placements"]["model.layers.0.self_attn.q_proj.weight"]["kind"] == "shard"
    assert printed["ranks"][0]["digest"] != printed["ranks"][1]["digest"]  # another share, another plan


def test_the_digest_is_the_load_not_where_the_files_lie(llama, tmp_path):
    from lazyload.digest import plan_digest, plan_json

    directory, config = llama
    copy = shutil.copytree(directory, tmp_path / "elsewhere")
    here, there = _plan(directory, config), _plan(str(copy), config)
    assert plan_digest(here) == plan_digest(there) == plan_digest(_plan(directory, config))
    assert plan_json(here) != plan_json(there)  # the JSON shows the files; the digest leaves them out


@pytest.mark.parametrize("options,field", [({"dtype": "bfloat16"}, "dtypes"), ({"plan": {}}, "placements"),
                                           ({"max_host_bytes": 1 << 20}, "budget")])
def test_a_different_load_has_another_digest_in_the_field_that_differs(llama, options, field):
    from lazyload.digest import field_digests, plan_digest

    directory, config = llama
    base, other = _plan(directory, config), _plan(directory, config, **options)
    assert plan_digest(base) != plan_digest(other)
    differ = [name for name, digest in field_digests(base).items() if field_digests(other)[name] != digest]
    assert field in differ, differ


def test_the_header_digest_tells_a_copy_storing_a_tensor_in_another_dtype(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from lazyload import LazyCheckpoint
    from lazyload.digest import header_digest

    directory, _ = llama
    copy = shutil.copytree(directory, tmp_path / "bf16")
    same = shutil.copytree(directory, tmp_path / "same")
    path = shard_files(copy)[0]
    tensors = load_file(path)
    key = next(iter(tensors))
    tensors[key] = tensors[key].to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    digests = [header_digest(LazyCheckpoint(str(d)).index) for d in (directory, same, copy)]
    assert digests[0] == digests[1] != digests[2]


def test_message_bytes_are_what_the_destinations_hold(llama):
    """Quantized on load (8-bit data and float32 scales) and plain: the bytes the plan gives
    each target are those of the destination allocated for it, which the exchange checks."""
    from lazyload import Quantization
    from lazyload.digest import check_messages, message_bytes
    from lazyload.errors import ExchangeError
    from lazyload.placer import TensorDest, allocate_quantized

    directory, config = llama
    plan = _plan(directory, config, quantize=Quantization("int8", group_size=16, torchao=False))
    assert plan.quantized
    dests = {t.name: (allocate_quantized(t, plan.quantized[t.name], torch.device("cpu"), t.dtype, 1) if t.name in plan.quantized
                      else TensorDest(torch.empty(t.local_shape, dtype=t.dtype))) for t in plan.targets}
    sizes = message_bytes(plan)
    check_messages(sizes, dests)  # every destination as planned
    name = next(iter(plan.quantized))
    assert sizes[name] > dests[name].data.nbytes  # the scales travel too
    short = {**dests, name: TensorDest(torch.empty(dests[name].data.shape, dtype=torch.int8))}
    with pytest.raises(ExchangeError, match=f"{name}: its destination holds"):
        check_messages(sizes, short)
