"""Quantize on load, and an FP8 block checkpoint loaded dequantized and kept quantized.

    python examples/quantized.py [CHECKPOINT_DIR]

CHECKPOINT_DIR: a full-precision Llama-like checkpoint (e.g. a small model from the Hugging
Face cache). Without it, a small Llama with random weights is written by save_pretrained
into a temporary directory (removed at the end). Prints, for int8 and fp8 loads, the bytes
of the weights against the bf16 load and the logits error against it; then writes the
checkpoint as FP8 128x128 blocks (DeepSeek-V3's layout), loads it dequantized into bf16 and
kept quantized (quantize="fp8"), and checks that the kept weights dequantize to exactly the
dequantized load. Exits non-zero when a check fails.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from lazyload import LazyCheckpoint, Quantization
from lazyload.quant.linear import QuantizedLinear
from load_llama import write_example_checkpoint  # the same small random Llama (examples/ is on sys.path)

BLOCK = 128


def meta_model(path: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in model.state_dict().values())


def logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens).logits.float()


def write_fp8_blocks(src: str, dst: str) -> str:
    """Every 2-D `*_proj.weight` as float8_e4m3fn with one float32 `weight_scale_inv` per
    128x128 block (tail blocks partial), the rest as it is, and the config declaring it."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith(".json"):
            with open(os.path.join(src, name)) as f:
                data = json.load(f)
            if name == "config.json":
                data["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                               "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}
            if name == "model.safetensors.index.json":
                data["weight_map"].update({k + "_scale_inv": f for k, f in data["weight_map"].items()
                                           if k.endswith("proj.weight")})
            with open(os.path.join(dst, name), "w") as f:
                json.dump(data, f)
        elif name.endswith(".safetensors"):
            out = {}
            for key, w in load_file(os.path.join(src, name)).items():
                if key.endswith("proj.weight"):
                    rows, cols = w.shape
                    grid = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
                    grid[:rows, :cols] = w.float()
                    blocks = grid.view(grid.shape[0] // BLOCK, BLOCK, grid.shape[1] // BLOCK, BLOCK)
                    scale = (blocks.abs().amax((1, 3)) / 448).clamp(min=1e-12)
                    q = (blocks / scale[:, None, :, None]).view(grid.shape)[:rows, :cols]
                    out[key], out[key + "_scale_inv"] = q.to(torch.float8_e4m3fn).contiguous(), scale
                else:
                    out[key] = w
            save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
    return dst


def main(path: str, workdir: str) -> int:
    vocab = AutoConfig.from_pretrained(path).vocab_size
    full = meta_model(path)
    LazyCheckpoint(path).load_into(full, progress=False)
    reference, full_bytes = logits(full, vocab), weight_bytes(full)
    print(f"{path}: bf16 weights {full_bytes / 2**20:.1f} MiB")
    ok = True
    for quantize in ("int8", "fp8"):
        model = meta_model(path)
        # lazyload's QuantizedLinear (torchao=False), whose int8 / fp8 tensors weight_bytes counts
        report = LazyCheckpoint(path).load_into(model, quantize=Quantization(quantize, torchao=False), progress=False)
        got = logits(model, vocab)
        error = ((got - reference).norm() / reference.norm()).item()
        top1 = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
        n = weight_bytes(model)
        print(f"  {quantize}: weights {n / 2**20:.1f} MiB ({n / full_bytes:.2f}x, {(full_bytes - n) / 2**20:.1f} MiB "
              f"saved), logits error {error:.2%}, top-1 agreement {top1:.1%}, {report.seconds:.2f} s")
    fp8 = write_fp8_blocks(path, os.path.join(workdir, "fp8"))
    dequantized, kept = meta_model(path), meta_model(path)
    LazyCheckpoint(fp8).load_into(dequantized, progress=False)
    LazyCheckpoint(fp8).load_into(kept, quantize=Quantization("fp8", torchao=False), progress=False)
    layers = {n: m for n, m in kept.named_modules() if isinstance(m, QuantizedLinear)}
    exact = all(torch.equal(m.dequantized_weight(torch.bfloat16), dequantized.get_submodule(n).weight)
                for n, m in layers.items())
    ok &= exact
    print(f"FP8 block checkpoint {weight_bytes(dequantized) / 2**20:.1f} MiB dequantized into bf16, "
          f"{weight_bytes(kept) / 2**20:.1f} MiB kept quantized; {len(layers)} kept layers dequantize exactly "
          f"to the dequantized load: {exact}")
    return 0 if ok else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="lazyload-quant-") as tmp:
        source = sys.argv[1] if len(sys.argv) > 1 else write_example_checkpoint(os.path.join(tmp, "bf16"))
        sys.exit(main(source, tmp))
