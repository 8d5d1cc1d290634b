"""transformers' fine-grained FP8 layers (FP8Linear, FP8Experts) filled from FP8 block-scaled
checkpoints: the stored bytes and 128x128 block scales, no dequantization, at world 1 and as
each tensor-parallel rank's slices; a split that cuts a block is refused before any byte."""
from __future__ import annotations

import pytest
import torch
from checkpoints import EXPERTS_TP, build_model, default_experts
from gloo import spawn_cases
from quant_checkpoints import QUANTIZED, expand, fp8_model, write_fp8_checkpoint
from test_dequant import read_all

from lazyload import LazyCheckpoint, PlanError

pytest.importorskip("transformers.integrations.finegrained_fp8")

# Every TP slice of these is whole 128-blocks at world 2: 256 rows or columns everywhere.
ALIGNED = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
               num_hidden_layers=2)
EXPERT_NAMES = QUANTIZED + ("w1", "w2", "w3")  # Mixtral's per-expert projections, quantized too
SCALE = "_scale_inv"


def fp8_tensors(model) -> dict[str, torch.Tensor]:
    """Every FP8 weight and its block scales, by name (a DTensor's local shard)."""
    out = {}
    for name, param in model.named_parameters():
        base = name.removesuffix(SCALE)
        if param.dtype == torch.float8_e4m3fn or (name.endswith(SCALE) and base in dict(model.named_parameters())):
            out[name] = param.to_local() if hasattr(param, "to_local") else param.detach()
    return out


def stored(raw: dict, name: str, experts: int) -> torch.Tensor:
    """The checkpoint's bytes of an FP8 layer's tensor: itself, or Mixtral's per-expert
    w1|w3 (gate_up_proj) and w2 (down_proj) stacked as transformers fuses them."""
    if ".experts." not in name:
        return raw[name]
    module, _, attr = name.rpartition(".")
    prefix = module.replace("mlp.experts", "block_sparse_moe.experts")
    leaf = "weight" + (SCALE if attr.endswith(SCALE) else "")
    parts = ("w1", "w3") if attr.startswith("gate_up_proj") else ("w2",)
    return torch.stack([torch.cat([raw[f"{prefix}.{e}.{p}.{leaf}"] for p in parts]) for e in range(experts)])


def share(name: str, full: torch.Tensor, rank: int, world: int, experts: str = "tp") -> torch.Tensor:
    """A rank's share under transformers' TP plans (Llama, Mixtral), weight and scale alike:
    colwise rows, rowwise columns, the experts' gate|up halves each split; experts="ep" (the
    default plan where the TP plan leaves the experts whole): whole experts per rank."""
    attr = name.removesuffix(SCALE).rpartition(".")[2]
    if experts == "ep" and ".experts." in name:
        return full.chunk(world, 0)[rank]
    module = name.removesuffix(SCALE).removesuffix(".weight").rpartition(".")[2]
    if attr == "gate_up_proj":
        return torch.cat([half.chunk(world, 1)[rank] for half in full.chunk(2, 1)], 1)
    if module in ("o_proj", "down_proj") or attr == "down_proj":
        return full.chunk(world, -1)[rank]
    return full.chunk(world, 0)[rank]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    block = (1,) * (weight.ndim - 2) + (128, 128)
    return (weight.float() * expand(scale, block, tuple(weight.shape))).to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoint, tmp_path_factory):
    out = {}
    for arch in ("llama", "mixtral"):
        src, config = checkpoint(arch, "bf16", **ALIGNED)
        out[arch] = (str(write_fp8_checkpoint(src, tmp_path_factory.mktemp(f"{arch}-fp8"), names=EXPERT_NAMES)),
                     config)
    return out


def _experts(config) -> int:
    return getattr(config, "num_local_experts", 0)


def _check_filled(model, directory, config, rank, world, experts=None):
    raw = read_all(directory)
    got = fp8_tensors(model)
    assert len(got) == 2 * (7 if not _experts(config) else 6) * config.num_hidden_layers
    for name, tensor in got.items():
        want = share(name, stored(raw, name, _experts(config)), rank, world, experts or default_experts(config))
        assert tensor.dtype == want.dtype and torch.equal(bits(tensor), bits(want)), f"rank {rank}/{world}: {name}"


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_fp8_layers_hold_the_stored_bytes_and_dequantize_to_the_dequantized_load(fp8_checkpoints, arch):
    """World 1: every FP8 weight and block scale is the checkpoint's bytes (Mixtral's
    per-expert tensors stacked as transformers fuses them, scales too), and dequantized they
    equal lazyload's own dequantizing load into the bf16 model."""
    directory, config = fp8_checkpoints[arch]
    model = fp8_model(arch, config)
    assert LazyCheckpoint(directory).load_into(model, progress=False).ok
    _check_filled(model, directory, config, 0, 1)
    full = build_model(arch, config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)
    got = fp8_tensors(model)
    for name, weight in got.items():
        if not name.endswith(SCALE):
            assert torch.equal(dequantized(weight, got[name + SCALE]), full.get_parameter(name).detach()), name


@pytest.mark.parametrize("arch,experts", [("llama", None), ("mixtral", None), ("mixtral", "tp")])
def test_every_rank_gets_its_weight_slice_and_its_scale_blocks(fp8_checkpoints, arch, experts):
    """World 2 from rank and world alone: each rank's FP8 weights are its slices of the
    stored bytes and its scales the blocks of those slices (experts="tp": the experts' scales
    split as their packed gate|up weight, not left whole)."""
    directory, config = fp8_checkpoints[arch]
    for rank in range(2):
        model = fp8_model(arch, config)
        plan = EXPERTS_TP if experts == "tp" else None
        assert LazyCheckpoint(directory).load_into(model, rank, 2, plan=plan, progress=False).ok
        _check_filled(model, directory, config, rank, 2, experts)


def _case_gloo(arch, directory, rank, world):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    model = fp8_model(arch, config)
    assert LazyCheckpoint(directory).load_into(model, rank, world, progress=False).ok
    _check_filled(model, directory, config, rank, world)


def _run_case(case, rank, world):
    _case_gloo(*case, rank, world)


def test_fp8_layers_under_gloo_world_2(fp8_checkpoints, tmp_path):
    """Under a real gloo process group, each rank's FP8 layers hold its slices and scale blocks."""
    spawn_cases(2, [(arch, fp8_checkpoints[arch][0]) for arch in ("llama", "mixtral")], tmp_path, _run_case)


def test_a_split_inside_a_block_is_refused_before_anything_changes(checkpoint, tmp_path):
    """intermediate_size 1000 at world 2: the gate/up slices start at row 500, inside the
    4th 128-block, whose one scale no rank can split. The scale grid (8 rows) does split
    evenly, so without the check each rank would silently get the wrong scale blocks."""
    overrides = dict(ALIGNED, intermediate_size=1000, num_hidden_layers=1)
    src, config = checkpoint("llama", "bf16", **overrides)
    directory = str(write_fp8_checkpoint(src, tmp_path / "fp8"))
    model = fp8_model("llama", config)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(PlanError, match=r"gate_proj\.weight: rank 1 of 2 .*inside a block.*whole blocks \(1\)"):
        LazyCheckpoint(directory).load_into(model, 1, 2, progress=False)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(p.is_meta for p in model.parameters())


def test_expert_parallel_ranks_get_whole_experts_with_their_scales(fp8_checkpoints):
    """plan="ep": Mixtral's FP8Experts split by expert, each scale grid with its weight."""
    directory, config = fp8_checkpoints["mixtral"]
    raw = read_all(directory)
    for rank in range(2):
        model = fp8_model("mixtral", config)
        assert LazyCheckpoint(directory).load_into(model, rank, 2, plan="ep", progress=False).ok
        got = {n: t for n, t in fp8_tensors(model).items() if ".experts." in n}
        assert len(got) == 4 * config.num_hidden_layers
        for name, tensor in got.items():
            want = stored(raw, name, config.num_local_experts).chunk(2, 0)[rank]
            assert torch.equal(bits(tensor), bits(want)), f"rank {rank}: {name}"
