"""quantize on load into transformers' FP8 layers (`Quantization("fp8", format="transformers")`):
a bf16 Llama checkpoint (dims multiples of 128) loaded into `FP8Linear` layers whose weight
and `weight_scale_inv` equal transformers' own quantization of the same weights bit for bit
(its `Fp8Quantize`, on the full weight); at world 2 every rank holds world 1's slices; a
world that cuts a 128x128 block is refused before anything changes."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model
from gloo import spawn_cases

from lazyload import ArgumentError, LazyCheckpoint, PlanError, Quantization

pytest.importorskip("transformers.integrations.finegrained_fp8")
from transformers.integrations.finegrained_fp8 import FP8Linear, Fp8Quantize  # noqa: E402

# hidden 256, 4 heads of 64 (k/v: 256 rows), MLP 512: every Linear is whole 128x128 blocks, at world 2 too.
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=2)
TRANSFORMERS_FP8 = Quantization("fp8", format="transformers")


@pytest.fixture
def llama_bf16(checkpoint):
    return checkpoint("llama", "bf16", **DIMS)


def transformers_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own quantization of a full weight (what its quantizer does on load)."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config())
    out = Fp8Quantize(quantizer).convert({"layer.weight": weight})
    return out["layer.weight"], out["layer.weight_scale_inv"]


def fp8_layers(directory, config, rank=0, world=1) -> dict[str, FP8Linear]:
    model = build_model("llama", config, torch.bfloat16)
    report = LazyCheckpoint(directory).load_into(model, rank, world, quantize=TRANSFORMERS_FP8, progress=False)
    assert report.ok and "FP8Linear" in report.quantized_to
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}


def test_world1_equals_transformers_quantization_bit_for_bit(llama_bf16):
    directory, config = llama_bf16
    full = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)
    layers = fp8_layers(directory, config)
    assert len(layers) == 7 * config.num_hidden_layers  # lm_head stays full precision (default skip)
    for name, layer in layers.items():
        weight, scale_inv = transformers_quantized(full.get_submodule(name).weight.detach())
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
        assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, scale_inv), name


def assert_world1_slices(layers: dict, whole: dict, rank: int, world: int) -> None:
    """Every layer's weight bytes and scales (local shards under a process group) are its
    rank's slices of world 1's: row-parallel layers split the input dim, the others the output dim."""
    from lazyload.targets import local_tensor

    assert layers.keys() == whole.keys()
    for name, layer in layers.items():
        dim = 1 if name.endswith(("o_proj", "down_proj")) else 0
        weight = whole[name].weight.view(torch.uint8).chunk(world, dim)[rank]
        scale = whole[name].weight_scale_inv.chunk(world, dim)[rank]
        assert torch.equal(local_tensor(layer.weight.data).view(torch.uint8), weight), f"rank {rank}: {name}"
        assert torch.equal(local_tensor(layer.weight_scale_inv.data), scale), f"rank {rank}: {name}"


def test_world2_ranks_hold_world1_slices(llama_bf16):
    directory, config = llama_bf16
    whole = fp8_layers(directory, config)
    for rank in range(2):
        assert_world1_slices(fp8_layers(directory, config, rank, 2), whole, rank, 2)


def _gloo_case(case, rank, world):
    from transformers import AutoConfig

    from lazyload.targets import is_dtensor

    directory, config = case, AutoConfig.from_pretrained(case)
    layers = fp8_layers(directory, config, rank, world)
    assert all(is_dtensor(layer.weight) and is_dtensor(layer.weight_scale_inv) for layer in layers.values())
    assert_world1_slices(layers, fp8_layers(directory, config), rank, world)


def test_world2_gloo_ranks_hold_world1_slices(llama_bf16, tmp_path):
    """Under a gloo process group (the layers made parallel: DTensors of the planned split)."""
    spawn_cases(2, [str(llama_bf16[0])], tmp_path, _gloo_case)


def test_a_world_that_cuts_a_block_is_refused_before_anything_changes(llama_bf16):
    directory, config = llama_bf16  # world 4: 64 rows (q/k/v, gate/up) or columns (o_proj) per rank
    model = build_model("llama", config, torch.bfloat16)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(PlanError, match=r"inside a block.*\(1, 2\)"):
        LazyCheckpoint(directory).load_into(model, 1, 4, quantize=TRANSFORMERS_FP8, progress=False)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(p.is_meta for p in model.parameters())


def test_transformers_format_is_fp8_only():
    with pytest.raises(ArgumentError, match="format='transformers'.*'fp8'"):
        Quantization("int8", format="transformers")


def test_layers_that_are_not_whole_blocks_stay_lazyloads_holders(checkpoint):
    """The tiny Llama (hidden 64): no Linear is whole 128x128 blocks, so each stays a
    QuantizedLinear (transformers' quantizer leaves such shapes unquantized)."""
    from lazyload.quant.linear import QuantizedLinear

    directory, config = checkpoint("llama", "bf16")
    model = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(model, quantize=TRANSFORMERS_FP8, progress=False)
    kinds = {type(m) for n, m in model.named_modules() if n.endswith(("_proj", "lm_head"))}
    assert kinds == {QuantizedLinear, torch.nn.Linear}  # lm_head kept full precision


def test_save_sharded_refuses_the_transformers_format(llama_bf16, tmp_path):
    """A written checkpoint is compressed-tensors' groups: the load-time format is refused,
    not silently written as something else."""
    from lazyload import save_sharded

    with pytest.raises(ArgumentError, match="format='transformers'.*compressed-tensors"):
        save_sharded(str(llama_bf16[0]), tmp_path / "out", 1, quantize=TRANSFORMERS_FP8)
    assert not (tmp_path / "out").exists()
