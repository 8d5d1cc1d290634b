"""4-bit checkpoints packed with per-group scales, written by the formats' own code and
loaded in full precision into a Llama built on the meta device: compressed-tensors'
`nvfp4-pack-quantized` and `pack-quantized` INT4 (its `ModelCompressor`), ModelOpt's NVFP4
(`mtq.quantize` + `export_hf_checkpoint`). Bit-exact at world 1 against the formats' own
dequantization (transformers' `CompressedTensorsConfig(dequantize=True)`; ModelOpt's
`NVFP4QTensor.dequantize`, transformers having no loader for it), and under TP at worlds 2
and 4 (gloo) each rank its slice, reading only its rows and whole groups of columns."""
from __future__ import annotations

import pytest
import torch
from checkpoints import (assert_same_weights, build_model, copy_checkpoint, edit_tensor, reference_model,
                         weight_map, write_checkpoint)
from quant_checkpoints import (modelopt_dequantized, write_ct_experts_checkpoint, write_ct_packed_checkpoint,
                               write_modelopt_checkpoint)

from lazyload import LazyCheckpoint
from lazyload.errors import CorruptValuesError, PlanError, ReadError, ShapeMismatchError

FORMATS = ("nvfp4", "int4", "modelopt")
# o_proj's input columns are 4 groups (NVFP4: 64 in groups of 16; INT4: 128 in groups of 32),
# whole at TP 2 and 4; 8 heads make TP 8 a world that splits the heads but cuts those groups.
SIZES = {"nvfp4": dict(hidden_size=64, num_attention_heads=8), "int4": dict(hidden_size=128, num_attention_heads=8),
         "modelopt": dict(hidden_size=64, num_attention_heads=8)}
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Which stored names hold a weight's packed data and its scales, per format.
PACKED = {"nvfp4": ("weight_packed", "weight_scale"), "int4": ("weight_packed", "weight_scale"),
          "modelopt": ("weight", "weight_scale")}


def _write(fmt: str, root):
    src, config = write_checkpoint("llama", "bf16", root / "src", **SIZES[fmt])
    if fmt == "modelopt":
        return write_modelopt_checkpoint(src, root / fmt), src, config
    scheme, group = ("NVFP4", None) if fmt == "nvfp4" else ("W4A16", 32)
    return write_ct_packed_checkpoint(src, root / fmt, scheme, group), src, config


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """fmt -> (checkpoint directory, full-precision source, config), each written once."""
    cache = {}

    def get(fmt):
        if fmt not in cache:
            cache[fmt] = _write(fmt, tmp_path_factory.mktemp(fmt))
        return cache[fmt]
    return get


def _reference(fmt, directory, src, dtype):
    if fmt == "modelopt":
        return modelopt_dequantized(directory, reference_model("llama", src, dtype))
    from transformers import CompressedTensorsConfig

    return reference_model("llama", directory, dtype, quantization_config=CompressedTensorsConfig(dequantize=True))


def _weights(config):
    return [f"model.layers.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in PROJECTIONS]


@pytest.mark.parametrize("fmt,dtype", [("nvfp4", torch.bfloat16), ("nvfp4", torch.float32),
                                       ("int4", torch.bfloat16), ("modelopt", torch.bfloat16)])
def test_world1_is_bit_exact_against_the_formats_own_dequantization(written, fmt, dtype):
    directory, src, config = written(fmt)
    reference = _reference(fmt, directory, src, dtype)
    model = build_model("llama", config, dtype)
    reader = "pread" if fmt == "modelopt" else "auto"  # pread's staging of a 0-dim global scale too
    report = LazyCheckpoint(str(directory)).load_into(model, reader=reader, progress=False)
    assert report.ok and not report.unexpected and not report.missing
    assert_same_weights(model, reference)
    source = reference_model("llama", src, dtype)  # a real check: 4-bit values, not the source's
    for name in _weights(config):
        mine = model.get_parameter(name)
        assert mine.abs().sum() > 0 and not torch.equal(mine, source.get_parameter(name)), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_world_that_cuts_a_group_is_refused_before_any_byte(written, fmt):
    """TP 8 by the model's plan splits the 8 heads, but o_proj's 4 groups of input columns
    only over 1, 2 or 4 ranks."""
    directory, _, config = written(fmt)
    model = build_model("llama", config, torch.bfloat16)
    group = 32 if fmt == "int4" else 16
    with pytest.raises(PlanError, match=rf"(o|down)_proj.*columns 0:\d+ cut its .* groups of {group}.*one of \[1, 2, 4\]"):
        LazyCheckpoint(str(directory)).load_into(model, 0, 8, progress=False)
    assert all(p.is_meta for p in model.parameters())  # untouched


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_int4_dequantizer_is_compressed_tensors_own_for_every_scale_dtype(scale_dtype):
    """Random codes packed by compressed-tensors' `pack_to_int32`, dequantized by its
    `unpack_from_int32` + `dequantize`, against `dequantize_int4_into` into the scale's dtype
    and into float32 (a lead dim of experts, a box of rows)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from lazyload.quant.int4 import dequantize_int4_into

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 40, 96), generator=g, dtype=torch.int8)
    scale = (torch.rand(3, 40, 3, generator=g) * 2 - 1).to(scale_dtype)
    packed = pack_to_int32(q, 4)
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=32)
    want = torch.stack([dequantize(unpack_from_int32(packed[e], 4, q.shape[1:]), scale[e], args=args) for e in range(3)])
    for dtype in (scale_dtype, torch.float32):
        out = torch.empty(3, 30, 96, dtype=dtype)
        dequantize_int4_into(out, packed[:, 5:35], scale[:, 5:35])
        assert torch.equal(out, want[:, 5:35].to(dtype)), dtype


def test_the_nvfp4_dequantizers_refuse_nan_scales_and_zero_global_scales():
    from lazyload.errors import CheckpointError
    from lazyload.quant.fp4 import dequantize_nvfp4_into, dequantize_nvfp4_modelopt_into

    packed = torch.full((2, 16), 0x21, dtype=torch.uint8)
    scales = torch.ones(2, 2).to(torch.float8_e4m3fn)
    out = torch.empty(2, 32, dtype=torch.bfloat16)
    dequantize_nvfp4_into(out, packed, scales, torch.tensor([2.0]))  # 0x21: 0.5 low, 1.0 high; / 2
    assert out[0, :2].tolist() == [0.25, 0.5]
    for bad in (0.0, float("nan"), float("inf")):
        with pytest.raises(CheckpointError, match="weight_global_scale"):
            dequantize_nvfp4_into(out, packed, scales, torch.tensor([bad]))
        with pytest.raises(CheckpointError, match="weight_scale_2"):
            dequantize_nvfp4_modelopt_into(out, packed, scales, torch.tensor(bad))
    scales[1, 1] = float("nan")
    with pytest.raises(CheckpointError, match=r"weight_scale is NaN.*\[1, 1\]"):
        dequantize_nvfp4_into(out, packed, scales, torch.tensor([2.0]))


def _set_tensor(directory, key: str, value) -> None:
    """Write `value` into stored tensor `key` of the copy at `directory`."""
    edit_tensor(directory, key, lambda t: torch.as_tensor(value, dtype=t.dtype).reshape(t.shape))


@pytest.mark.parametrize("fmt,key,quantize", [("nvfp4", "weight_global_scale", None),
                                               ("modelopt", "weight_scale_2", None),
                                               ("nvfp4", "weight_global_scale", "keep")])
def test_a_zero_global_scale_is_refused_naming_the_tensor(written, fmt, key, quantize, tmp_path):
    """Found once its bytes are read: the load raises a CheckpointError (not a ReadError)
    naming the tensor and file, with the failure path's account of the model; a kept load
    puts its swapped modules back."""
    directory, _, config = written(fmt)
    broken = copy_checkpoint(directory, tmp_path / "broken")
    _set_tensor(broken, f"model.layers.1.mlp.down_proj.{key}", 0.0)
    model = build_model("llama", config, torch.bfloat16)
    before = {name: type(m) for name, m in model.named_modules()}
    kept = rf"model.layers.1.mlp.down_proj.{key}: the NVFP4 global scale is 0.0"
    with pytest.raises(CorruptValuesError, match=(kept if quantize else rf"an NVFP4 {key} is 0.0")
                       + rf".*reading tensor 'model.layers.1.mlp.down_proj.weight\w*' of \S*{broken}") as info:
        LazyCheckpoint(str(broken)).load_into(model, quantize=quantize, progress=False)
    assert "model.layers.1.mlp.down_proj.weight" in info.value.not_loaded
    assert {name: type(m) for name, m in model.named_modules()} == before


def _set_first(value):
    def edit(tensor):
        tensor.view(-1)[0] = value
        return tensor
    return edit


def _fill(value):
    return lambda tensor: torch.full_like(tensor, value)


# Finite scales whose product passes bfloat16's range: every one an inf (or NaN) weight.
@pytest.mark.parametrize("fmt,edits", [
    ("nvfp4", {"weight_global_scale": _fill(1e-40)}),  # 448 / 1e-40: inf in float32
    ("modelopt", {"weight_scale_2": _fill(1e38), "weight_scale": _set_first(448.0)}),
    ("int4", {"weight_scale": _fill(3e38)}),  # bfloat16 3e38 x (q = -8)
], ids=["nvfp4-global-1e-40", "modelopt-scale_2-1e38", "int4-scale-3e38"])
def test_finite_scales_that_make_inf_weights_are_refused_naming_the_tensor(written, fmt, edits, tmp_path):
    directory, _, config = written(fmt)
    broken = copy_checkpoint(directory, tmp_path / "broken")
    for suffix, edit in edits.items():
        edit_tensor(broken, f"model.layers.1.mlp.down_proj.{suffix}", edit)
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(CorruptValuesError, match=r"inf or NaN in bfloat16.*reading tensor "
                                                 rf"'model.layers.1.mlp.down_proj.weight\w*' of \S*{broken}") as info:
        LazyCheckpoint(str(broken)).load_into(model, progress=False)
    assert "model.layers.1.mlp.down_proj.weight" in info.value.not_loaded
    assert all(torch.isfinite(p).all() for p in model.parameters() if not p.is_meta)


def test_a_weight_shape_that_disagrees_with_the_packed_data_is_refused_before_any_byte(written, tmp_path):
    directory, _, config = written("int4")
    broken = copy_checkpoint(directory, tmp_path / "broken")
    _set_tensor(broken, "model.layers.0.mlp.down_proj.weight_shape", [128, 136])
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(ShapeMismatchError, match=r"down_proj.weight_shape.*\[128, 136\].*\[128, 128\]"):
        LazyCheckpoint(str(broken)).load_into(model, progress=False)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("change,says", [("removed", "cannot open for reading"),
                                          ("replaced", "changed since it was indexed")])
def test_a_weight_shape_file_changed_since_indexing_is_a_read_error_naming_it(written, tmp_path, change, says):
    """`weight_shape` is read while planning; its file removed or replaced after the index
    was read is a ReadError naming the file (as the readers say it), the model untouched."""
    import shutil

    directory, _, config = written("int4")
    copy = copy_checkpoint(directory, tmp_path / "copy")
    checkpoint = LazyCheckpoint(str(copy))
    checkpoint.keys()  # indexed now
    shard = copy / weight_map(copy)["model.layers.0.mlp.down_proj.weight_shape"]
    if change == "removed":
        shard.unlink()
    else:  # same bytes, another file
        shutil.copy2(shard, tmp_path / "new")
        shutil.move(tmp_path / "new", shard)
    model = build_model("llama", config, torch.bfloat16)
    with pytest.raises(ReadError, match=rf"{shard}: {says}.*re-run the load"):
        checkpoint.load_into(model, progress=False)
    assert all(p.is_meta for p in model.parameters())


def test_a_null_config_group_declares_nothing(written, tmp_path):
    """A `config_groups` entry that is null is skipped (by the 8-bit reader and the 4-bit
    one alike): the copy loads as the original does."""
    import json

    directory, _, config = written("int4")
    copy = copy_checkpoint(directory, tmp_path / "copy")
    saved = json.loads((copy / "config.json").read_text())
    saved["quantization_config"]["config_groups"]["group_null"] = None
    (copy / "config.json").write_text(json.dumps(saved))
    want, model = build_model("llama", config, torch.bfloat16), build_model("llama", config, torch.bfloat16)
    assert LazyCheckpoint(str(directory)).load_into(want, progress=False).ok
    assert LazyCheckpoint(str(copy)).load_into(model, progress=False).ok
    assert_same_weights(model, want)


def test_inspect_shows_the_format_group_and_pairs(written, capsys):
    from lazyload.cli import main

    for fmt, label in (("nvfp4", "nvfp4 (group 16)"), ("int4", "int4 (group 32)"),
                       ("modelopt", "nvfp4-modelopt (group 16)")):
        directory, _, _ = written(fmt)
        assert main(["inspect", str(directory)]) == 0
        out = capsys.readouterr().out
        packed, scale = PACKED[fmt]
        assert label in out, out
        assert f"model.layers.{{0...2}}.mlp.down_proj.{packed} + model.layers.{{0...2}}.mlp.down_proj.{scale}" in out, out


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_resharded_copy_loads_back_bit_exact(written, fmt, tmp_path):
    """save_sharded at TP 2 writes each rank's rows and whole groups of packed data and
    scales, and the global scale in every rank's file; the copy loads as the original does,
    at world 1 and per rank."""
    import lazyload

    directory, _, config = written(fmt)
    lazyload.save_sharded(str(directory), str(tmp_path / "tp2"), 2)
    for rank, world in ((0, 1), (1, 2)):
        want = build_model("llama", config, torch.bfloat16)
        assert LazyCheckpoint(str(directory)).load_into(want, rank, world, progress=False).ok
        model = build_model("llama", config, torch.bfloat16)
        assert LazyCheckpoint(str(tmp_path / "tp2")).load_into(model, rank, world, progress=False).ok
        for name, value in want.state_dict().items():
            mine = model.state_dict()[name]
            mine, value = (t.to_local() if hasattr(t, "to_local") else t for t in (mine, value))
            assert torch.equal(mine, value), f"{fmt} {name} rank {rank} of {world}"


def test_over_http_each_item_fetches_its_global_scale_too(written):
    """The remote reader stages a packed box, its scales and its global scale per item: an
    NVFP4 checkpoint served over HTTP loads as from disk."""
    from remote_servers import RangeServer

    directory, _, config = written("nvfp4")
    want = build_model("llama", config, torch.bfloat16)
    assert LazyCheckpoint(str(directory)).load_into(want, progress=False).ok
    model = build_model("llama", config, torch.bfloat16)
    with RangeServer(str(directory.parent)) as server:
        assert LazyCheckpoint(f"{server.url}/{directory.name}/").load_into(model, progress=False).ok
    assert_same_weights(model, want)


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """A Qwen3-MoE whose routed experts are INT4 W4A16 group 32, as Kimi-K2 ships them."""
    src, config = write_checkpoint("qwen3_moe", "bf16", tmp_path_factory.mktemp("moe"), hidden_size=64,
                                   moe_intermediate_size=64)
    return write_ct_experts_checkpoint(src, tmp_path_factory.mktemp("moe_int4")), config


def test_int4_routed_experts_load_fused_and_per_expert_under_ep(experts):
    """Per-expert packed weights become transformers' fused experts, bit-exact; under EP a
    rank reads only its experts' packed data and scales."""
    import re

    from transformers import CompressedTensorsConfig

    from lazyload.summary import plan_ranks

    directory, config = experts
    reference = reference_model("qwen3_moe", directory, torch.bfloat16,
                                quantization_config=CompressedTensorsConfig(dequantize=True))
    model = build_model("qwen3_moe", config, torch.bfloat16)
    assert LazyCheckpoint(str(directory)).load_into(model, progress=False).ok
    assert_same_weights(model, reference)
    names = [n for n, _ in reference.named_parameters() if ".mlp.experts." in n]
    plans, _ = plan_ranks(str(directory), 2, plan="ep")
    for rank in range(2):
        model = build_model("qwen3_moe", config, torch.bfloat16)
        assert LazyCheckpoint(str(directory)).load_into(model, rank, 2, plan="ep", progress=False).ok
        for name in names:
            mine, full = model.get_parameter(name).detach(), reference.get_parameter(name).detach()
            mine = mine.to_local() if hasattr(mine, "to_local") else mine
            assert torch.equal(mine, full.chunk(2)[rank]), f"{name} rank {rank}"
        read = {part.entry.key for item in plans[rank].items for part in item.reads()}
        packed = [k for k in read if k.endswith(("weight_packed", "weight_scale"))]
        mine = range(rank * config.num_experts // 2, (rank + 1) * config.num_experts // 2)
        assert packed and all(int(re.search(r"experts\.(\d+)\.", k).group(1)) in mine for k in packed), packed


def _share(full: torch.Tensor, mine: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The rank's slice of `full` along the dim `mine` is split on (a KV projection over
    fewer heads than ranks: the slice of its group of ranks)."""
    split = [d for d in range(full.ndim) if mine.shape[d] != full.shape[d]]
    if not split:
        return full
    shards = full.shape[split[0]] // mine.shape[split[0]]
    return full.chunk(shards, split[0])[rank // (world // shards)]


def _gloo_case(case, rank, world):
    """TP by the model's plan: each rank its slice of world 1's load (bit-exact against the
    format's own dequantization in the world-1 test), its report's bytes the plan's, and the
    plan reading of each packed weight and its scales exactly the rank's share."""
    fmt, directory = case
    from checkpoints import make_config

    from lazyload.summary import plan_ranks

    config = make_config("llama", **SIZES[fmt])
    full = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)
    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
    assert report.ok
    plans, _ = plan_ranks(directory, world)
    assert report.bytes_read + report.bytes_mapped == plans[rank].bytes_to_read
    read: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for item in plans[rank].items:
        for part in item.reads():
            read[part.entry.key] = read.get(part.entry.key, 0) + part.nbytes
            sizes[part.entry.key] = part.entry.nbytes
    for name in _weights(config):
        want, mine = full.get_parameter(name).detach(), model.get_parameter(name).detach()
        mine = mine.to_local() if hasattr(mine, "to_local") else mine
        assert torch.equal(mine, _share(want, mine, rank, world)), f"{fmt} {name} rank {rank}"
        base = name[:-len("weight")]
        for stored in PACKED[fmt]:
            key = base + stored
            assert read[key] * want.numel() == sizes[key] * mine.numel(), f"{fmt} {key} rank {rank}: {read[key]} bytes"


def test_each_rank_of_world4_without_a_process_group(written):
    """The gloo case's checks for every rank of world 4 in this process (no process group):
    world 4 in the default run; the spawned job of 4 ranks is behind `slow`."""
    for fmt in FORMATS:
        for rank in range(4):
            _gloo_case((fmt, str(written(fmt)[0])), rank, 4)


# World 4 walks the same code as world 2 (4 processes on the suite's 2 cores: a minute).
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_under_gloo(written, world, tmp_path):
    from gloo import spawn_cases

    spawn_cases(world, [(fmt, str(written(fmt)[0])) for fmt in FORMATS], tmp_path, _gloo_case)
