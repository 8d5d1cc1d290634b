"""A sync into an engine that stores its weights quantized per channel in compressed-tensors'
layout (FP8_DYNAMIC, W8A8: `X.weight` in 8 bits, `X.weight_scale` a scale per row): the
trainer's full-precision weights are quantized as the library itself writes a checkpoint
(`lazyload.quant.channel`), each box with the scales of its whole rows (`BoxTarget(quantized=)`,
`sync.wire.ChannelWire`). The references are checkpoints compressed-tensors writes
(`quant_checkpoints.write_ct_packed_checkpoint`). The sync over the wire between ranks is
test_sync.py's "own-group-channel" case."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from checkpoints import shard_files, write_checkpoint
from quant_checkpoints import write_ct_packed_checkpoint
from safetensors.torch import load_file

import lazyload
from lazyload.quant.channel import channel_dtype, quantize_rows
from lazyload.sync.box_target import BoxTarget

SCHEMES = {"FP8_DYNAMIC": torch.float8_e4m3fn, "W8A8": torch.int8}
SIZES = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=2)


def tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for path in shard_files(directory) for k, v in load_file(path).items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """dtype -> a Llama checkpoint in it, q_proj's first rows edited to the edge cases of the
    math: a zero row (scale eps), a row of -0.0 and one that starts with -0.0 (stored +0.0),
    a tiny row, one tiny value among zeros."""
    def write(dtype: str):
        directory, _ = write_checkpoint("llama", dtype, tmp_path_factory.mktemp(dtype), **SIZES)
        state = tensors(directory)
        name = "model.layers.0.self_attn.q_proj.weight"
        path = next(p for p in shard_files(directory) if name in load_file(p))
        edited = load_file(path)
        w = edited[name]
        w[0], w[1], w[2, :5], w[3], w[4] = 0, -0.0, -0.0, -1e-30, 0
        w[4, 3] = 1e-6
        from safetensors.torch import save_file
        save_file(edited, path, metadata={"format": "pt"})
        assert not torch.equal(tensors(directory)[name], state[name])
        return directory
    return {dtype: write(dtype) for dtype in ("fp32", "bf16")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rows_quantized_as_compressed_tensors_writes_them(source, tmp_path, dtype):
    """Every quantized weight of the checkpoint compressed-tensors writes, FP8 and int8, is
    bit-equal to `quantize_rows` of the full-precision weight (its data and its scales, in
    the weight's dtype), and the checkpoint's config names that dtype (`channel_dtype`).
    lazyload's own quantization (`load_into(quantize=)`) differs: int8 over 127 not 127.5,
    a zero row's scale 1 not eps, -0.0 kept."""
    full = tensors(source[dtype])
    for scheme, qdtype in SCHEMES.items():
        written = write_ct_packed_checkpoint(source[dtype], tmp_path / scheme, scheme)
        stored = tensors(written)
        config = json.loads((written / "config.json").read_text())["quantization_config"]
        assert channel_dtype(config) == qdtype
        scales = [name for name in stored if name.endswith(".weight_scale")]
        assert len(scales) == 7 * SIZES["num_hidden_layers"]
        for scale_name in scales:
            name = scale_name[:-len("_scale")]
            data, scale = quantize_rows(full[name], qdtype)
            assert stored[name].dtype == qdtype and torch.equal(data.view(torch.uint8), stored[name].view(torch.uint8)), \
                (scheme, name)
            assert scale.dtype == stored[scale_name].dtype and torch.equal(scale, stored[scale_name]), (scheme, name)


def group_of_its_own():
    store = dist.HashStore()
    return dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30)), store


def test_box_target_receives_the_stored_layout(source, tmp_path):
    """A worker of a TP-2 engine serving the FP8_DYNAMIC checkpoint asks for its half of
    q_proj (rows) and of o_proj (columns, every row), each with the scales of its rows, and
    a norm: from the trainer's float32 weights it receives exactly the FP8 data and scales
    compressed-tensors wrote from them (o_proj's half quantized with its whole rows'
    scales), and the norm as it is; `stored` gives what the engine holds."""
    full = tensors(source["fp32"])
    stored = tensors(write_ct_packed_checkpoint(source["fp32"], tmp_path / "fp8", "FP8_DYNAMIC"))
    q, o, norm = (f"model.layers.0.{n}" for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight",
                                                  "input_layernorm.weight"))
    boxes = [(q, ((32, 64), (0, 64))), (q + "_scale", ((32, 64), (0, 1))),
             (o, ((0, 64), (32, 64))), (o + "_scale", ((0, 64), (0, 1))), (norm, ((0, 64),))]
    target = BoxTarget(boxes, quantized=torch.float8_e4m3fn)
    group, store = group_of_its_own()
    sync = lazyload.WeightSync(source=full, target=target, group=group, store=store, rank_timeout=30)
    sync()
    for name, box in boxes:
        expected = stored[name][tuple(slice(a, b) for a, b in box)]
        received = target.received(name, box)
        assert received.dtype == expected.dtype and torch.equal(received.view(torch.uint8), expected.view(torch.uint8)), name
    assert target.stored[q] == ((64, 64), torch.float8_e4m3fn) and target.stored[o + "_scale"] == ((64, 1), torch.float32)
    assert target.stored[norm] == ((64,), torch.float32)


def test_box_target_refuses_what_it_cannot_quantize():
    """Before any byte moves, an ArgumentError naming the tensor: scales asked for without
    their weight's rows; a weight whose source pieces hold only some of its columns (a
    trainer's row-parallel TP shards: a row's scale needs the whole row); and a checkpoint
    quantized otherwise than per channel in 8 bits."""
    from lazyload.sync.layout import Held, SourceTensor
    from lazyload.sync.source_index import source_index

    full = {"m.weight": torch.randn(4, 8)}
    for boxes in ([("m.weight", ((0, 4), (0, 8))), ("m.weight_scale", ((0, 2), (0, 1)))],
                  [("m.weight_scale", ((0, 4), (0, 1)))]):
        group, store = group_of_its_own()
        with pytest.raises(lazyload.ArgumentError, match="'m.weight_scale'.*same rows of 'm.weight'"):
            lazyload.WeightSync(source=full, target=BoxTarget(boxes, quantized=torch.int8), group=group, store=store)
    columns = {rank: [SourceTensor("m.weight", "torch.float32", (4, 8), (Held(((0, 4), (4 * rank, 4 * rank + 4)),
                                                                               (0, 0)),))] for rank in (0, 1)}
    index, _ = source_index(columns)
    target = BoxTarget([("m.weight", ((0, 4), (0, 8))), ("m.weight_scale", ((0, 4), (0, 1)))], quantized=torch.int8)
    with pytest.raises(lazyload.ArgumentError, match="'m.weight' is stored quantized per channel.*whole rows"):
        target.plan(index, None)
    assert channel_dtype({}) is None and channel_dtype(None) is None
    group = {"weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}}
    for config in ({"quant_method": "compressed-tensors", "config_groups": {"group_0": group}},
                   {"quant_method": "fp8", "weight_block_size": [128, 128]}):
        with pytest.raises(lazyload.ArgumentError, match="quantized otherwise"):
            channel_dtype(config)
