"""Pre-quantized checkpoints resharded (`lazyload reshard SRC OUT --world N`): the writer
writes every read of each rank's plan, a quantized weight's scale blocks included, and the
copy's quantized pairs are found by tensor name (pieces paired block by block), so that
the copy loads back bit for bit at world 1 and at its own world (gloo), each rank reading
what `lazyload plan` on the copy says.

The checkpoints are written in the published layouts (tests/quant_checkpoints.py): FP8
with 128x128 `weight_scale_inv` blocks, compressed-tensors int8 with a scale per 128 columns.
Llama with hidden 512, 4 KV heads of 64: every split at TP 2 and 4 holds whole blocks, except
the KV projections at TP 4 (64 rows each), which the writer stores whole with their scales."""
from __future__ import annotations

import json

import pytest
import torch

from checkpoints import build_model
from gloo import spawn_cases
from quant_checkpoints import write_compressed_checkpoint, write_fp8_checkpoint

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=2)
FORMATS = ("fp8", "compressed")


@pytest.fixture(scope="module")
def resharded(checkpoint, tmp_path_factory):
    """fmt -> (source, {world: copy}), each copy written by the CLI."""
    from lazyload.cli import main

    base, _ = checkpoint("llama", "bf16", **SHAPE)
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for fmt in FORMATS:
        src = root / fmt
        if fmt == "fp8":
            write_fp8_checkpoint(base, src)
        else:
            write_compressed_checkpoint(base, src, num_type="int", strategy="group", group_size=128)
        copies = {}
        for world in (2, 4):
            copies[world] = root / f"{fmt}-tp{world}"
            assert main(["reshard", str(src), str(copies[world]), "--world", str(world)]) == 0
        out[fmt] = (src, copies)
    return out


def _state(path, config, rank=0, world=1):
    from lazyload import LazyCheckpoint

    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(str(path)).load_into(model, rank, world, progress=False)
    assert report.ok
    return {n: (t.to_local() if hasattr(t, "to_local") else t) for n, t in model.state_dict().items()}, report


def test_each_rank_file_holds_its_own_scale_blocks(resharded):
    src, copies = resharded["fp8"]
    doc = json.loads((copies[2] / "lazyload_sharded.json").read_text())
    scales = {n: t for n, t in doc["tensors"].items() if n.endswith("_scale_inv")}
    assert scales
    for name, info in scales.items():
        assert sorted({p["file"] for p in info["pieces"]}) == [0, 1], f"{name}: not in every rank's file"
    q = scales["model.layers.0.self_attn.q_proj.weight_scale_inv"]["pieces"]
    assert [p["box"] for p in sorted(q, key=lambda p: p["file"])] == [[[0, 2], [0, 4]], [[2, 4], [0, 4]]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_copy_loads_back_bit_exact_at_world_1(resharded, fmt):
    from transformers import AutoConfig

    src, copies = resharded[fmt]
    config = AutoConfig.from_pretrained(src)
    want, _ = _state(src, config)
    for world, copy in copies.items():
        got, _ = _state(copy, config)
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{fmt} tp{world}: {name} differs"


def _case_own_world(case, rank, world):
    """Under the process group (a runnable TP model): the copy's local tensors equal the
    original's, and the bytes read are those `lazyload plan` on the copy printed."""
    from transformers import AutoConfig

    fmt, src, copy, planned = case
    config = AutoConfig.from_pretrained(src)
    want, _ = _state(src, config, rank, world)
    got, report = _state(copy, config, rank, world)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{fmt} rank {rank} of {world}: {name} differs"
    assert report.bytes_read + report.bytes_mapped == planned[rank], (fmt, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_the_copy_loads_back_bit_exact_at_its_own_world(resharded, world, tmp_path):
    from lazyload.summary import plan_ranks

    cases = []
    for fmt in FORMATS:
        src, copies = resharded[fmt]
        planned = [r.bytes_to_read for r in plan_ranks(str(copies[world]), world)[0]]
        cases.append((fmt, str(src), str(copies[world]), planned))
    spawn_cases(world, cases, tmp_path, _case_own_world)
