"""MXFP4 checkpoints in gpt-oss's layout (experts' `_blocks` / `_scales`), loaded in full
precision into a GptOss model built on the meta device: bit-exact against transformers'
own loader (`Mxfp4Config(dequantize=True)`), at world 1 and per rank under EP and TP,
each rank reading only its experts / rows / whole 32-column groups."""
from __future__ import annotations

import pytest
import torch
from checkpoints import assert_same_weights, build_model, copy_checkpoint, edit_tensor, reference_model
from quant_checkpoints import write_mxfp4_checkpoint

import lazyload
from lazyload import LazyCheckpoint, Placement
from lazyload.errors import CorruptValuesError, PlanError

# K = 64 for both projections: two 32-column groups, so TP 2 splits down_proj's inputs at a
# group boundary and TP 4 would cut them.
SIZES = dict(hidden_size=64, intermediate_size=64)
# TP of the experts by an explicit plan (gpt-oss's own plan shards them only by expert):
# gate_up's output columns (gate/up interleaved: pairs stay together), down's input rows.
TP = {"model.layers.*.mlp.experts.gate_up_proj": Placement("shard", dim=2),
      "model.layers.*.mlp.experts.gate_up_proj_bias": Placement("shard", dim=1),
      "model.layers.*.mlp.experts.down_proj": Placement("shard", dim=1)}
EXPERTS = ("model.layers.{}.mlp.experts.gate_up_proj", "model.layers.{}.mlp.experts.down_proj")


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    from checkpoints import write_checkpoint

    src, config = write_checkpoint("gpt_oss", "bf16", tmp_path_factory.mktemp("gpt_oss"), **SIZES)
    return write_mxfp4_checkpoint(src, tmp_path_factory.mktemp("mxfp4")), config


@pytest.fixture(scope="module")
def reference(mxfp4):
    from transformers import Mxfp4Config

    directory, _ = mxfp4
    return reference_model("gpt_oss", directory, torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True))


def _names(config):
    return [p.format(i) for i in range(config.num_hidden_layers) for p in EXPERTS]


def test_world1_is_bit_exact_against_transformers_dequantize(mxfp4, reference):
    directory, config = mxfp4
    model = build_model("gpt_oss", config, torch.bfloat16)
    report = LazyCheckpoint(str(directory)).load_into(model, progress=False)
    assert report.ok and not report.unexpected and not report.missing
    assert_same_weights(model, reference)
    for name in _names(config):  # a real check: the experts are no zeros and no copies of each other
        assert model.get_parameter(name).abs().sum() > 0


def test_without_a_quantization_config_the_blocks_are_found_by_their_names(mxfp4, reference, tmp_path):
    """A config.json without its quantization_config: the experts are still dequantized
    (other loaders leave them at their random init), not unexpected keys."""
    import json

    directory, config = mxfp4
    bare = copy_checkpoint(directory, tmp_path / "bare")
    meta = json.loads((bare / "config.json").read_text())
    del meta["quantization_config"]
    (bare / "config.json").write_text(json.dumps(meta))
    model = build_model("gpt_oss", config, torch.bfloat16)
    report = LazyCheckpoint(str(bare)).load_into(model, progress=False)
    assert report.ok and not report.unexpected
    assert_same_weights(model, reference)


@pytest.mark.parametrize("plan", ["ep", TP], ids=["ep", "tp"])
def test_each_rank_is_its_slice_of_transformers_dequantize(mxfp4, reference, plan):
    """EP: a rank's experts; TP (transformers' plan): gate_up's output columns and down's
    input rows, split at 32-column group boundaries."""
    directory, config = mxfp4
    world = 2
    for rank in range(world):
        model = build_model("gpt_oss", config, torch.bfloat16)
        assert LazyCheckpoint(str(directory)).load_into(model, rank, world, plan=plan, progress=False).ok
        for name in _names(config):
            full = reference.get_parameter(name).detach()
            mine = model.get_parameter(name).detach()
            mine = mine.to_local() if hasattr(mine, "to_local") else mine
            assert mine.shape != full.shape, f"{name}: not split ({plan})"
            assert torch.equal(mine, _share(full, mine, rank, world)), f"{name} rank {rank} ({plan})"


def test_a_rank_reads_only_its_blocks_and_scales(mxfp4):
    """The plan of rank 1 of 2 under EP reads half of every expert tensor's bytes: its
    experts' blocks and scales, nothing of the other rank's."""
    from lazyload.summary import plan_ranks

    directory, config = mxfp4
    plans, _ = plan_ranks(str(directory), 2, plan="ep")
    experts = config.num_local_experts
    for rank, plan in enumerate(plans):
        reads = [(part.entry.key, part.src_box) for item in plan.items for part in item.reads()]
        packed = [(key, box) for key, box in reads if key.endswith(("_blocks", "_scales"))]
        assert len(packed) == 2 * len(_names(config)), packed  # each tensor's blocks and scales, once
        for key, box in packed:
            mine = (rank * experts // 2, (rank + 1) * experts // 2)
            assert box[0] == mine, f"rank {rank}: {key} reads experts {box[0]}"


def test_a_world_that_cuts_a_group_is_refused_before_any_byte(mxfp4):
    directory, config = mxfp4
    model = build_model("gpt_oss", config, torch.bfloat16)
    with pytest.raises(PlanError, match=r"down_proj_blocks.*groups of 32.*one of \[1, 2\]"):
        LazyCheckpoint(str(directory)).load_into(model, 0, 4, plan=TP, progress=False)
    assert all(p.is_meta for p in model.parameters())  # untouched


@pytest.mark.parametrize("scale, message", [
    (255, r"an MXFP4 scale is 255 \(E8M0 NaN\)"),
    (254, r"MXFP4 scales up to 254 \(2\^127\) make \d+ of the weights read with this box inf or NaN in bfloat16"),
], ids=["nan-255", "finite-254"])
def test_a_scale_that_makes_nan_or_inf_weights_is_refused_naming_the_tensor(mxfp4, tmp_path, scale, message):
    """255 is E8M0's NaN; 254 is finite, but 2^127 times an E2M1 value of 2 or more passes
    bfloat16's range: its group's weights would be inf."""
    directory, config = mxfp4
    broken = copy_checkpoint(directory, tmp_path / "broken")

    def edit(scales):
        scales[2, 5, 1] = scale
        return scales
    edit_tensor(broken, "model.layers.1.mlp.experts.down_proj_scales", edit)
    model = build_model("gpt_oss", config, torch.bfloat16)
    # Found once its scales are read (a value, not a shape): a CheckpointError naming the
    # tensor and file, with the failure path's account (the target left unloaded).
    with pytest.raises(CorruptValuesError, match=rf"{message}.*down_proj_blocks' of \S*{broken}") as info:
        LazyCheckpoint(str(broken)).load_into(model, progress=False)
    assert info.value.not_loaded == ["model.layers.1.mlp.experts.down_proj"]


def _gloo_case(case, rank, world):
    """Under a real process group: EP or TP experts, each rank its slice of world 1's load."""
    plan, directory = case
    from checkpoints import make_config

    config = make_config("gpt_oss", **SIZES)
    if plan == "ep-keep":
        return _kept_under_ep(directory, config, rank, world)
    full = build_model("gpt_oss", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)  # world 1
    model = build_model("gpt_oss", config, torch.bfloat16)
    assert LazyCheckpoint(directory).load_into(model, rank, world, plan=TP if plan == "tp" else plan,
                                               progress=False).ok
    for name in _names(config):
        want, mine = full.get_parameter(name).detach(), model.get_parameter(name).detach()
        mine = mine.to_local() if hasattr(mine, "to_local") else mine
        assert torch.equal(mine, _share(want, mine, rank, world)), f"{name} rank {rank} ({plan})"
        assert mine.shape != want.shape, f"{name}: not split ({plan})"


def _kept_under_ep(directory, config, rank, world):
    """quantize="keep" under EP: each rank holds its experts' stored blocks and scales (its
    slice of world 1's kept load), dequantized to its slice of the dequantized load, and the
    model computes world 1's logits."""
    from checkpoints import fixed_input

    kept1 = build_model("gpt_oss", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(kept1, quantize="keep", progress=False)
    model = build_model("gpt_oss", config, torch.bfloat16)
    assert LazyCheckpoint(directory).load_into(model, rank, world, quantize="keep", plan="ep", progress=False).ok
    for name in _names(config):
        module, _, attr = name.rpartition(".")
        mine, whole = model.get_submodule(module), kept1.get_submodule(module)
        for suffix in ("_blocks", "_scales"):
            held, want = mine.get_parameter(attr + suffix).detach(), whole.get_parameter(attr + suffix).detach()
            held = held.to_local() if hasattr(held, "to_local") else held
            assert held.shape[0] * world == want.shape[0], f"{name}{suffix}: not split by expert"
            assert torch.equal(held, want.chunk(world, 0)[rank]), f"{name}{suffix} rank {rank}"
        assert torch.equal(mine.dequantized(attr), whole.dequantized(attr).chunk(world, 0)[rank]), name
    ids = fixed_input(config)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, kept1(input_ids=ids).logits), f"logits rank {rank}"


def _share(full: torch.Tensor, mine: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The rank's slice of `full` along the one dim a rank's tensor `mine` is split on (or all of it)."""
    split = [d for d in range(full.ndim) if mine.shape[d] != full.shape[d]]
    return full.chunk(world, split[0])[rank] if split else full


def test_world2_under_gloo(mxfp4, tmp_path):
    from gloo import spawn_cases

    directory, _ = mxfp4
    spawn_cases(2, [("ep", str(directory)), ("tp", str(directory)), ("ep-keep", str(directory))], tmp_path,
                _gloo_case)


@pytest.mark.parametrize("plan", ["ep", TP], ids=["ep", "tp"])
def test_a_resharded_copy_loads_back_bit_exact(mxfp4, reference, tmp_path, plan):
    """save_sharded at world 2 writes each rank's blocks and scales (experts, or rows and
    whole groups); the copy loads at world 1 as transformers' dequantization, and at world 2
    each rank its share."""
    directory, config = mxfp4
    lazyload.save_sharded(str(directory), str(tmp_path / "out"), 2, plan=plan)
    model = build_model("gpt_oss", config, torch.bfloat16)
    assert LazyCheckpoint(str(tmp_path / "out")).load_into(model, progress=False).ok
    assert_same_weights(model, reference)
    for rank in range(2):
        model = build_model("gpt_oss", config, torch.bfloat16)
        assert LazyCheckpoint(str(tmp_path / "out")).load_into(model, rank, 2, plan=plan, progress=False).ok
        for name in _names(config):
            full, mine = reference.get_parameter(name).detach(), model.get_parameter(name).detach()
            assert torch.equal(mine, _share(full, mine, rank, 2)), f"{name} rank {rank}"
