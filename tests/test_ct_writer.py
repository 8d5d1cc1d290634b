"""A quantized checkpoint out: `save_sharded(..., quantize="int8"|"fp8")` and `lazyload reshard
--quantize` write a compressed-tensors checkpoint. transformers' `from_pretrained` (with the
compressed-tensors package, on CPU) loads it with exactly the dequantized weights and logits of
lazyload's own quantized load of the source; lazyload reads it back, at world 1 and per rank at
world 2, with the same 8-bit values and scales; writing it holds about one layer in memory.

compressed-tensors is in the 'test' extra: without it the transformers tests skip, except in CI."""
from __future__ import annotations

import json
import os

import pytest
import torch

from checkpoints import ATTN, build_model, fixed_input, write_checkpoint
from gloo import spawn_cases
from test_streaming import in_fresh_process

from lazyload import ArgumentError, LazyCheckpoint, Quantization, save_sharded
from lazyload.cli import main
from lazyload.quant.linear import QuantizedLinear

# Every input dim a multiple of 128 (compressed-tensors' groups are whole), and halves of them
# at world 2 (o_proj: 256 columns, down_proj: 512).
CONFIG = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_hidden_layers=2)
MiB = 1 << 20


def _compressed_tensors():
    if os.environ.get("CI"):  # CI installs the test extra, compressed-tensors with it: there its absence fails
        import compressed_tensors
        return compressed_tensors
    return pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the 'test' extra")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint("llama", "fp32", tmp_path_factory.mktemp("src"), **CONFIG)


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    """qdtype -> the compressed-tensors directory save_sharded wrote from the source."""
    out = {}
    for qdtype in ("int8", "fp8"):
        out[qdtype] = str(tmp_path_factory.mktemp(f"ct-{qdtype}") / "out")
        save_sharded(str(source[0]), out[qdtype], 1, quantize=qdtype)
    return out


def _lazyload_quantized(directory, config, qdtype, rank=0, world=1):
    model = build_model("llama", config, torch.float32)
    # lazyload's own holders (QuantizedLinear), whose values the written checkpoint holds; where
    # torchao is installed its holders are the default (the same values, other modules).
    LazyCheckpoint(str(directory)).load_into(model, rank, world, quantize=Quantization(qdtype, torchao=False),
                                             progress=False)
    return model


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's (this rank's shard's) bytes, to compare int8 and float8 exactly."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_transformers_loads_the_same_weights_and_logits(source, written, qdtype):
    ct = _compressed_tensors()
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    directory, config = source
    qconfig = json.load(open(os.path.join(written[qdtype], "config.json")))["quantization_config"]
    parsed = ct.quantization.QuantizationConfig.model_validate(qconfig)  # the package's own schema
    assert parsed.format == {"int8": "int-quantized", "fp8": "float-quantized"}[qdtype]
    assert parsed.config_groups["group_0"].weights.strategy == "group" and parsed.ignore == ["lm_head"]
    ours = _lazyload_quantized(directory, config, qdtype)
    dequantized = AutoModelForCausalLM.from_pretrained(written[qdtype], dtype=torch.float32, attn_implementation=ATTN,
                                                       quantization_config=CompressedTensorsConfig(dequantize=True))
    theirs = dict(dequantized.named_parameters())
    linears = {name: m for name, m in ours.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(linears) == 7 * config.num_hidden_layers
    for name, module in linears.items():
        assert torch.equal(theirs[name + ".weight"], module.dequantized_weight(torch.float32)), name
    compressed = AutoModelForCausalLM.from_pretrained(written[qdtype], dtype=torch.float32, attn_implementation=ATTN)
    assert compressed.model.layers[0].mlp.down_proj.weight.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[
        qdtype]  # kept 8-bit, decompressed by compressed-tensors in forward
    ids = fixed_input(config)
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        assert torch.equal(dequantized(input_ids=ids).logits, want)
        assert torch.equal(compressed(input_ids=ids).logits, want)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_lazyload_reads_it_back_at_world_1(source, written, qdtype):
    directory, config = source
    want = _lazyload_quantized(directory, config, qdtype)
    kept = _lazyload_quantized(written[qdtype], config, qdtype)  # 8-bit values and scales kept as stored
    got = dict(kept.named_parameters())
    for name, param in want.named_parameters():
        assert got[name].dtype == param.dtype and torch.equal(_bytes(got[name]), _bytes(param)), name
    full = build_model("llama", config, torch.float32)
    LazyCheckpoint(written[qdtype]).load_into(full, progress=False)  # dequantized into a float32 model
    for name, module in want.named_modules():
        if isinstance(module, QuantizedLinear):
            assert torch.equal(full.get_submodule(name).weight, module.dequantized_weight(torch.float32)), name


def _case_world_2(case, rank, world):
    directory, out, qdtype = case
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    want = _lazyload_quantized(directory, config, qdtype, rank, world)
    model = _lazyload_quantized(out, config, qdtype, rank, world)
    got = dict(model.named_parameters())
    for name, param in want.named_parameters():
        assert torch.equal(_bytes(got[name]), _bytes(param)), f"rank {rank}: {name}"
    ids = fixed_input(config)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want(input_ids=ids).logits), f"rank {rank}"


def test_lazyload_reads_it_back_per_rank_at_world_2(source, written, tmp_path):
    """Each rank reads its slice of the written checkpoint: its 8-bit shards and scales equal
    those it quantizes from the source itself."""
    spawn_cases(2, [(str(source[0]), written[q], q) for q in ("int8", "fp8")], tmp_path, _case_world_2)


def test_cli_writes_the_same_checkpoint(source, written, tmp_path):
    out = tmp_path / "cli"
    assert main(["reshard", str(source[0]), str(out), "--world", "1", "--quantize", "int8"]) == 0
    for name in os.listdir(written["int8"]):
        with open(out / name, "rb") as a, open(os.path.join(written["int8"], name), "rb") as b:
            assert a.read() == b.read(), name
    assert main(["reshard", str(source[0]), str(tmp_path / "w2"), "--world", "2", "--quantize", "int8"]) == 2
    assert not (tmp_path / "w2").exists()


def test_files_cut_by_size_from_a_lazy_checkpoint(source, written, tmp_path):
    """A LazyCheckpoint source (config.json from the model's config) cut into several files
    with their index: the same tensors, bytes for bytes."""
    from safetensors import safe_open

    directory, config = source
    out = tmp_path / "cut"
    save_sharded(LazyCheckpoint(str(directory)), out, 1, config=str(directory), quantize="int8", max_file_bytes=2 * MiB)
    weight_map = json.load(open(out / "model.safetensors.index.json"))["weight_map"]
    assert len(set(weight_map.values())) > 1
    with safe_open(os.path.join(written["int8"], "model.safetensors"), "pt") as whole:
        assert sorted(weight_map) == sorted(whole.keys())
        for key, name in weight_map.items():
            with safe_open(out / name, "pt") as part:
                assert torch.equal(_bytes(part.get_tensor(key)), _bytes(whole.get_tensor(key))), key
    assert json.load(open(out / "config.json"))["quantization_config"] == json.load(
        open(os.path.join(written["int8"], "config.json")))["quantization_config"]


def test_columns_that_are_no_whole_groups_are_refused_before_writing(checkpoint, tmp_path):
    directory, _ = checkpoint("llama")  # hidden 64: less than one group of 128
    with pytest.raises(ArgumentError, match=r"q_proj.weight: 64 input columns .* group_size"):
        save_sharded(str(directory), tmp_path / "out", 1, quantize="int8")
    assert not (tmp_path / "out").exists()
    save_sharded(str(directory), tmp_path / "g16", 1, quantize=Quantization("int8", group_size=16))
    assert json.load(open(tmp_path / "g16" / "config.json"))["quantization_config"]["config_groups"]["group_0"][
        "weights"]["group_size"] == 16


# --------------------------------------------------------------------- memory bound

def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _measured_write(directory, warm, out, layer_bytes):
    """In a fresh process: write the one-layer checkpoint `warm` first (code pages into the
    baseline), reset VmHWM, then write the quantized checkpoint; the peak growth."""
    import gc

    save_sharded(warm, out + "-warm", 1, quantize="int8", max_host_bytes=layer_bytes)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    before = _vm_hwm()
    save_sharded(directory, out, 1, quantize="int8", max_host_bytes=layer_bytes)
    return _vm_hwm() - before


def test_writing_holds_about_one_layer(tmp_path):
    shape = dict(hidden_size=256, intermediate_size=1024, head_dim=64)
    directory, config = write_checkpoint("llama", "fp32", tmp_path / "big", num_hidden_layers=16, **shape)
    warm, _ = write_checkpoint("llama", "fp32", tmp_path / "warm", num_hidden_layers=1, min_shards=1, **shape)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    layer = 4 * (2 * h * h + 2 * kv * h + 3 * h * i)  # the float32 Linear weights of one layer
    total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    assert total > 12 * layer
    grown = in_fresh_process(_measured_write, str(directory), str(warm), str(tmp_path / "out"), layer)
    assert grown < 2 * layer + 16 * MiB, (f"writing grew the peak RSS by {grown / MiB:.1f} MiB; one layer is "
                                          f"{layer / MiB:.1f} MiB, the checkpoint {total / MiB:.1f} MiB")
