"""Pre-quantized checkpoints for the tests (and benchmarks/bench_quant.py), written in the
published layouts from a full-precision checkpoint that transformers' save_pretrained wrote:

- FP8 block-scaled, as DeepSeek-V3 and transformers' FineGrainedFP8 store it: `X.weight`
  float8_e4m3fn, `X.weight_scale_inv` float32 [ceil(out/b0), ceil(in/b1)] holding the
  multiplier that dequantizes each block (amax / 448; tail blocks zero-padded first), and
  `quantization_config = {"quant_method": "fp8", "weight_block_size": [b0, b1], ...}`.
- compressed-tensors `int-quantized` / `float-quantized`: `X.weight` int8 or float8 with
  `X.weight_scale` per tensor [1], channel [out, 1], group [out, ceil(in/g)] or block, and
  `X.weight_zero_point` when asked for; `config_groups` as compressed-tensors writes them.

`dequantize` is the reference every load is compared with: the scale grid expanded with
repeat_interleave and cropped, then `((q.float() - zero) * scale).to(dtype)`.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The projections a quantized Llama/DeepSeek checkpoint stores quantized; embeddings,
# norms and the head stay full precision (DeepSeek-V3's layout).
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj", "proj")


def is_quantized(key: str, tensor: torch.Tensor, names=QUANTIZED) -> bool:
    parts = key.split(".")
    return tensor.ndim == 2 and parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in names


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |w| per block, tail blocks zero-padded: shape [ceil(out/b0), ceil(in/b1)]."""
    rows, cols = w.shape
    b0, b1 = block
    padded = torch.zeros(math.ceil(rows / b0) * b0, math.ceil(cols / b1) * b1)
    padded[:rows, :cols] = w.float().abs()
    return padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1)).amax(dim=(1, 3))


def expand(scale: torch.Tensor, block: tuple[int | None, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The scale of every element: the grid repeated `block` times per dim (None: the whole
    dim), cropped."""
    out = scale.reshape(scale.shape if scale.numel() > 1 else (1,) * len(shape))
    for d, b in enumerate(block):
        b = shape[d] if b is None else b
        out = out.repeat_interleave(b, d).narrow(d, 0, shape[d])
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int | None, ...], dtype: torch.dtype,
               zero: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ((q.float() - zero) * scale).to(dtype), each element by its block."""
    shape = tuple(q.shape)
    values = q.float()
    if zero is not None:
        values = values - expand(zero.float(), block, shape)
    return (values * expand(scale.float(), block, shape)).to(dtype)


def quantize_fp8_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 weight_scale_inv) of DeepSeek's layout."""
    amax = block_amax(w, block)
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()
    q = (w.float() / expand(scale_inv, block, tuple(w.shape))).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv


def quantize_compressed(w: torch.Tensor, num_type: str, strategy: str, group_size: int | None = None,
                        symmetric: bool = True, scale_dtype=torch.bfloat16):
    """compressed-tensors' weight, weight_scale and weight_zero_point (None when symmetric)."""
    rows, cols = w.shape
    block = {"tensor": (rows, cols), "channel": (1, cols), "group": (1, group_size)}[strategy]
    values = w.float()
    if symmetric:
        amax = block_amax(values, block)
        top = FP8_MAX if num_type == "float" else 127.0
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax)).to(scale_dtype)
        zero = None
    else:  # int only: [lo, hi] onto [-128, 127]
        lo = -block_amax(-values.clamp(max=0), block)
        hi = block_amax(values.clamp(min=0), block)
        scale = ((hi - lo) / 255).clamp(min=1e-8).to(scale_dtype)
        zero = (-128 - torch.round(lo / scale.float())).clamp(-128, 127).to(torch.int8)
    full_scale = expand(scale.float(), block, (rows, cols))
    scaled = values / full_scale
    if zero is not None:
        scaled = scaled + expand(zero.float(), block, (rows, cols))
    if num_type == "float":
        q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:
        q = torch.round(scaled).clamp(-128, 127).to(torch.int8)
    if strategy == "tensor":
        scale = scale.reshape(1)
    return q, scale, zero


def _rewrite(src: Path, dst: Path, quantize_one, quantization_config: dict, names=QUANTIZED,
             select=None) -> Path:
    """Every shard of `src` with the weights of the modules `names` (or those `select(key,
    tensor)` picks) replaced by `quantize_one(key, w)` (a dict of tensors), the index json and
    config.json to match."""
    select = select or (lambda key, tensor: is_quantized(key, tensor, names))
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        for key, tensor in load_file(str(shard)).items():
            out.update(quantize_one(key, tensor) if select(key, tensor) else {key: tensor})
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})
        weight_map.update({k: shard.name for k in out})
        del out
    index = src / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        meta["weight_map"] = dict(sorted(weight_map.items()))
        (dst / index.name).write_text(json.dumps(meta, indent=2))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy2(src / extra, dst / extra)
    return dst


def write_fp8_checkpoint(src, dst, block=(128, 128), names=QUANTIZED) -> Path:
    """The checkpoint at `src` as an FP8 block-scaled checkpoint in `dst` (the weights of
    the modules `names` quantized)."""
    def one(key, w):
        q, scale_inv = quantize_fp8_blocks(w, block)
        return {key: q, key + "_scale_inv": scale_inv}

    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
              "weight_block_size": list(block)}
    return _rewrite(src, dst, one, config, names)


def write_compressed_checkpoint(src, dst, num_type="int", strategy="channel", group_size=None,
                                symmetric=True, static_input=False) -> Path:
    """The checkpoint at `src` as a compressed-tensors checkpoint in `dst` (int8 or fp8
    weights; `static_input` adds the `input_scale` of static activation quantization)."""
    def one(key, w):
        q, scale, zero = quantize_compressed(w, num_type, strategy, group_size, symmetric)
        out = {key: q, key + "_scale": scale}
        if zero is not None:
            out[key + "_zero_point"] = zero
        if static_input:
            out[key.rsplit(".", 1)[0] + ".input_scale"] = torch.ones(1, dtype=scale.dtype)
        return out

    weights = {"num_bits": 8, "type": num_type, "strategy": strategy, "group_size": group_size,
               "symmetric": symmetric, "dynamic": False, "block_structure": None, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}}
    inputs = dict(weights, strategy="tensor", group_size=None, observer=None) if static_input else None
    config = {"quant_method": "compressed-tensors", "format": f"{num_type}-quantized",
              "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": inputs, "output_activations": None}}}
    return _rewrite(src, dst, one, config)


def write_mxfp4_checkpoint(src, dst, seed: int = 0, scales=(118, 134)) -> Path:
    """The gpt-oss checkpoint at `src` with its experts in gpt-oss's MXFP4 layout in `dst`:
    each `experts.{gate_up,down}_proj` [E, K, R] replaced by random packed E2M1 bytes
    `_blocks` uint8 [E, R, K/32, 16] and E8M0 exponents `_scales` uint8 [E, R, K/32] drawn
    from `scales` (transformers' own MXFP4 quantizer needs triton's kernels, not on CPU), and
    `quantization_config = {"quant_method": "mxfp4", ...}` as gpt-oss ships it."""
    g = torch.Generator().manual_seed(seed)

    def one(key, w):
        experts, k, r = w.shape
        blocks = torch.randint(0, 256, (experts, r, k // 32, 16), generator=g, dtype=torch.uint8)
        exps = torch.randint(scales[0], scales[1], (experts, r, k // 32), generator=g, dtype=torch.uint8)
        return {key + "_blocks": blocks, key + "_scales": exps}

    config = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                   "model.embed_tokens", "lm_head"]}
    return _rewrite(src, dst, one, config, select=lambda key, w: key.endswith(("experts.gate_up_proj", "experts.down_proj")))


def needs_torchao() -> None:
    """Skip a test without torchao (an optional extra), except in CI, whose test extra
    installs it: there its absence fails the test instead of hiding it."""
    import os

    import pytest

    if os.environ.get("CI"):
        import torchao  # noqa: F401
    else:
        pytest.importorskip("torchao", reason="the optional extra lazyload[torchao] (the test extra has it)")


def fp8_model(arch: str, config) -> torch.nn.Module:
    """A meta model whose Linear layers and fused experts are transformers' FP8 layers, as
    its FP8 quantizer prepares it (the head and the router stay full precision)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    from checkpoints import build_model

    model = build_model(arch, config, torch.bfloat16)
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head", "gate"],
                            quantization_config=FineGrainedFP8Config(), pre_quantized=True)
    return model


def write_ct_packed_checkpoint(src, dst, scheme: str, group_size: int | None = None,
                               min_shards: int = 3) -> Path:
    """The full-precision checkpoint at `src` (save_pretrained) quantized and written by
    compressed-tensors' own code into `dst`: `scheme` a preset ("NVFP4": nvfp4-pack-quantized
    with a global scale and static input global scales; "W4A16": pack-quantized INT4, with
    `group_size`; "W8A8" / "FP8_DYNAMIC": int8 / float8 weights with per-channel scales,
    dynamic per-token inputs) on every Linear but the head; the scales from its own
    observers' math (`generate_gparam`, `compute_dynamic_scales_and_zp`, `calculate_qparams`), `ModelCompressor` packing the
    weights, save_pretrained writing several shards and `update_config` the config."""
    from inspect import signature

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import (calculate_qparams, compute_dynamic_scales_and_zp,
                                                                generate_gparam)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    quant = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None:
        quant.weights.group_size = group_size
    quiet = {"show_progress": False} if "show_progress" in signature(apply_quantization_config).parameters else {}
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": quant}, ignore=["lm_head"]),
                              **quiet)  # compressed-tensors < 0.18 (vLLM's pin) has no show_progress
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight.data
            glob = None
            if hasattr(module, "weight_global_scale"):  # NVFP4: the tensor's amax onto FP8 x FP4's range
                glob = generate_gparam(w.float().amin(), w.float().amax())
                module.weight_global_scale.copy_(glob)
            args = module.quantization_scheme.weights
            if args.strategy == "channel":  # its MinMax observer's per-row range (not a dynamic strategy)
                scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
            else:
                scale, _ = compute_dynamic_scales_and_zp(w, args, module, global_scale=glob)
            module.weight_scale.copy_(scale)
            if hasattr(module, "input_global_scale"):  # as a calibration would leave it
                module.input_global_scale.fill_(448.0 * 6.0 / 4.0)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(str(dst), max_shard_size=max(1, total // (min_shards + 1)))
    compressor.update_config(str(dst))
    return Path(dst)


def write_modelopt_checkpoint(src, dst, seed: int = 0) -> Path:
    """The full-precision checkpoint at `src` quantized to NVFP4 by ModelOpt itself
    (`mtq.quantize` with NVFP4_DEFAULT_CFG, calibrated on a few random token batches, on
    CPU) and exported by `export_hf_checkpoint` into `dst` (`hf_quant_config.json`)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=str(dst))
    return Path(dst)


def modelopt_dequantized(directory, reference: torch.nn.Module) -> torch.nn.Module:
    """`reference` (the full-precision model the checkpoint was quantized from) with each of
    its NVFP4 weights replaced by ModelOpt's own dequantization of the exported tensors
    (`NVFP4QTensor.dequantize`, as its `fake quant` export round trip does), in place."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    for key, packed in tensors.items():
        if packed.dtype != torch.uint8 or key + "_scale_2" not in tensors:
            continue
        param = reference.get_parameter(key)
        values = NVFP4QTensor(param.shape, param.dtype, packed).dequantize(
            dtype=param.dtype, scale=tensors[key + "_scale"], double_scale=tensors[key + "_scale_2"],
            block_sizes={-1: 16})
        param.data.copy_(values)
    return reference


def write_ct_experts_checkpoint(src, dst, group_size: int = 32) -> Path:
    """The MoE checkpoint at `src` (per-expert `mlp.experts.N.{gate,up,down}_proj.weight`, as
    save_pretrained writes them) with its routed experts in compressed-tensors' INT4
    `pack-quantized` W4A16 layout, as Kimi-K2 ships them: each expert's scales from
    compressed-tensors' own math (`compute_dynamic_scales_and_zp`) and its weight packed by
    its `PackedQuantizationCompressor` (what ModelCompressor runs per module; transformers'
    fused experts are no Linear modules for it to find), the config from its
    `QuantizationConfig` (targets `re:.*mlp\\.experts.*`)."""
    import compressed_tensors
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    scheme = preset_name_to_scheme("W4A16", [r"re:.*mlp\.experts.*"])
    scheme.weights.group_size = group_size
    scheme.format = "pack-quantized"

    def one(key, w):
        scale, _ = compute_dynamic_scales_and_zp(w, scheme.weights, None)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype)}, scheme)
        return {key[:-len("weight")] + name: t for name, t in packed.items()}

    quant = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                               quantization_status="compressed", ignore=[])
    config = {"quant_method": "compressed-tensors", "version": compressed_tensors.__version__,
              **quant.model_dump(exclude=["quant_method"])}
    return _rewrite(src, dst, one, config, select=lambda key, w: ".mlp.experts." in key and key.endswith(".weight"))
