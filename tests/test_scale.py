"""Published shapes at reduced depth: sparse checkpoints (real headers, key names, dtypes;
data regions are holes that read as zeros, benchmarks/sparse_checkpoint.py) index from
their headers alone, plan per rank with byte totals that add up, and load one rank's share.
The full-depth runs are benchmarks/bench_scale.py."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def _index(directory):
    from lazyload.formats import open_index, resolve

    return open_index(resolve(directory))


@pytest.fixture(scope="module")
def scale():
    return _module("bench_scale")


@pytest.fixture(scope="module")
def llama405b(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-405b-L2")
    summary = _module("sparse_checkpoint").write("llama-405b", str(directory), layers=2)
    assert summary["files"] >= 2
    return str(directory), summary


def test_405b_shaped_checkpoint_indexes_from_headers_and_ranks_add_up(scale, llama405b):
    directory, summary = llama405b
    index = scale.measure_index(directory)
    assert index["tensors"] == summary["tensors"] and index["checkpoint_bytes"] == summary["bytes"]
    assert index["header_bytes"] < 1 << 20  # headers only: no tensor byte is read to index
    model = scale.meta_model(directory)
    for world in (8, 128):
        plan = scale.measure_plan(directory, model, world)
        assert plan["adds_up"], plan
        assert plan["min_bytes"] == plan["max_bytes"]  # every rank reads an equal share


def test_tp8_x_pp2_stages_of_a_405b_shaped_checkpoint_add_up_to_tp8(scale, llama405b):
    directory, _ = llama405b
    model = scale.meta_model(directory)
    result = scale.measure_pipeline(directory, model, 8, 2)
    assert result["adds_up"] and result["unexpected"] == 0, result
    assert all(0 < b < result["whole_bytes"] for b in result["stage_bytes"])
    stage = scale.pipeline_stage(model, 1, 2)
    _, _, _, mapping = scale.rank_plan(directory, stage, 8, 0)
    assert "model.embed_tokens.weight" in mapping.other_stages and "lm_head.weight" in mapping.exprs
    assert all(".layers.0." in k for k in mapping.other_stages if ".layers." in k)


def test_rank_0_of_128_loads_its_share_of_a_405b_shaped_checkpoint(scale, llama405b):
    from lazyload import LazyCheckpoint

    directory, _ = llama405b
    model = scale.meta_model(directory)
    report = LazyCheckpoint(directory).load_into(model, 0, 128, progress=False)
    assert report.ok and report.world == 128
    q = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    assert tuple(q.shape) == (16384 // 128, 16384)  # 128 heads: one per rank
    k = model.get_parameter("model.layers.0.self_attn.k_proj.weight")
    assert tuple(k.shape) == (128, 16384)  # 8 KV heads replicated over groups of 16 ranks
    share = sum(math.prod(p.shape) * p.element_size() for p in model.parameters())
    assert report.bytes_read + report.bytes_mapped == share
    assert all(not torch.count_nonzero(p) for p in model.parameters())  # the holes read as zeros


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("deepseek-L4"))
    summary = _module("sparse_checkpoint").write("deepseek-v3", directory, layers=4)
    assert summary["tensors"] > 1000  # per-expert FP8 weights with their block scales
    return directory


def test_deepseek_v3_shaped_fp8_checkpoint_plans_whole_experts_per_rank(scale, deepseek):
    directory = deepseek
    model = scale.meta_model(directory)
    # The published multi-token-prediction layer (61 at full depth, which transformers ignores
    # by name; 4 here) is the only thing the model does not use (its scales go with its weights).
    mtp = [k for k in _index(directory) if k.startswith("model.layers.4.") and not k.endswith("_scale_inv")]
    for plan in (None, "ep"):
        result = scale.measure_plan(directory, model, 8, plan)
        assert result["adds_up"] and result["unexpected"] == len(mtp), result


# Rank plans of the 4-layer DeepSeek-V3 checkpoint as they were before the index, mapping and
# plan hot paths were made fast: (read items, bytes, digest of every item's file name, key,
# boxes, ops, target and scale blocks, in plan order).
# Planned under transformers 5.24's DeepSeek-V3 TP plan, pinned here so that the digests are
# of one plan on every transformers version (5.25 split MLA attention and left the experts out).
PLANNED = {(8, None, 0): (821, 2779568384, "d30810b7dd1e6974"), (8, None, 3): (821, 2779568384, "03c7c68508ffdac6"),
           (8, "ep", 0): (149, 2779568384, "8e97980b1fe812eb"), (8, "ep", 3): (149, 2779568384, "6093e3674722ed7a"),
           (64, None, 5): (821, 1005969856, "81516dea75dfde96"), (64, "ep", 63): (65, 1005816256, "e9abe19ae19913f1")}
DEEPSEEK_V3_TP_PLAN_524 = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts", "layers.*.mlp.shared_experts.gate_proj": "colwise",
    "layers.*.mlp.shared_experts.up_proj": "colwise", "layers.*.mlp.shared_experts.down_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}


def _digest(items):
    import hashlib
    import os

    h = hashlib.sha256()
    for i in items:
        s = i.scales
        h.update(repr((os.path.basename(i.entry.file), i.entry.key, i.src_box, i.ops, i.target, i.dst_box,
                       s and (s.scale.key, s.box, s.zero and s.zero.key, s.block))).encode())
    return h.hexdigest()[:16]


def test_deepseek_v3_rank_plans_are_the_ones_planned_before_the_fast_paths(scale, deepseek):
    model = scale.meta_model(deepseek, base_model_tp_plan=DEEPSEEK_V3_TP_PLAN_524)
    for (world, plan, rank), expected in PLANNED.items():
        _, items, _, _ = scale.rank_plan(deepseek, model, world, rank, plan)
        assert (len(items), sum(i.nbytes for i in items), _digest(items)) == expected, (world, plan, rank)


def test_deepseek_v3_default_plan_is_expert_parallel_where_the_tp_plan_leaves_experts_whole(scale, deepseek):
    """transformers' own plan of the installed version: where it leaves the experts whole
    (5.25), the default plan is "ep"'s, item for item; where it splits them, its own."""
    from checkpoints import default_experts

    model = scale.meta_model(deepseek)
    planned = {plan: [(i.entry.key, i.src_box, i.target, i.dst_box) for i in scale.rank_plan(deepseek, model, 8, 3,
                                                                                              plan)[1]]
               for plan in (None, "ep")}
    assert (planned[None] == planned["ep"]) == (default_experts(model.config) == "ep")


def test_llama4_maverick_shaped_checkpoint_plans_expert_parallel_where_heads_do_not_split(scale, tmp_path):
    """Llama-4 has no ep_plan: plan="ep" derives whole experts per rank on its fused 3-D
    experts; its 40 heads do not split over 64 ranks, so attention is split over groups of
    8 ranks (the largest divisor of 64 that 40 heads and 8 KV heads fit)."""
    directory = str(tmp_path / "maverick")
    _module("sparse_checkpoint").write("llama4-maverick", directory, layers=2)
    model = scale.meta_model(directory)
    for world in (8, 64):
        result = scale.measure_plan(directory, model, world, "ep")
        assert "error" not in result and result["adds_up"] and result["unexpected"] == 0, result
        assert result["min_bytes"] == result["max_bytes"]
    targets, _, _, _ = scale.rank_plan(directory, model, 64, 9, "ep")
    local = {t.name: t.local_shape for t in targets}
    assert local["model.layers.1.feed_forward.experts.gate_up_proj"] == (128 // 64, 5120, 2 * 8192)  # 2 experts
    assert local["model.layers.0.self_attn.q_proj.weight"] == (40 // 8 * 128, 5120)  # 5 heads: rank 9 in group 1
    assert local["model.layers.0.self_attn.k_proj.weight"] == (128, 5120)  # its one KV head
    assert local["model.layers.0.self_attn.o_proj.weight"] == (5120, 40 // 8 * 128)
    with pytest.raises(Exception, match="attention heads"):  # tensor parallel still refuses 40 heads over 64
        scale.rank_plan(directory, model, 64, 0, None)
