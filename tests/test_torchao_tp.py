"""torchao holders under tensor parallelism (gloo, world 2 and 4): a Llama quantized on load
with `Quantization(torchao=True)` holds every projection as torchao's `Int8Tensor` /
`Float8Tensor`, each rank's local shard equals world 1's quantized values' slice (data and
scales), and its logits equal world 1's torchao logits; OPT (no TP plan) keeps its
row-parallel layers as QuantizedLinear. And torchao is the default holder where installed.

Logits are compared with test_tp_dist's tolerance (1e-5, float32 model), not exactly: a
row-parallel layer (o_proj, down_proj) sums its ranks' partial products over the mesh, a
different order of float32 additions than world 1's one matmul. The shards compare exactly."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model, fixed_input
from gloo import spawn_cases
from quant_checkpoints import needs_torchao

GROUP = 8  # row-parallel shards at world 4: 64 / 4 = 16 columns, two groups each
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "fc2")
# OPT has no transformers TP plan: its row-parallel layers run lazyload's structural rule
# (a forward of lazyload's own, installed on the QuantizedLinear), so they stay QuantizedLinear.
KEPT = {"llama": (), "opt": ("out_proj", "fc2")}


def _share(name: str, full: torch.Tensor, rank: int, world: int, kv: int) -> torch.Tensor:
    """This rank's slice of world 1's tensor (quantized values or scales) of layer `name`."""
    layer = name.rpartition(".")[2]
    if layer in ROW_PARALLEL:
        return full.chunk(world, 1)[rank]
    if layer in ("k_proj", "v_proj") and world > kv:  # KV heads replicated over groups of ranks
        return full.chunk(kv, 0)[rank // (world // kv)]
    return full.chunk(world, 0)[rank]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.dtype == torch.float8_e4m3fn else t


def _run_case(case, rank, world):
    from torchao.quantization import Float8Tensor, Int8Tensor
    from transformers import AutoConfig

    from lazyload import LazyCheckpoint, Quantization
    from lazyload.quant.linear import QuantizedLinear

    arch, directory, qdtype = case
    config = AutoConfig.from_pretrained(directory)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    quantize = Quantization(qdtype, group_size=GROUP, torchao=True)
    ref = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, quantize=quantize, progress=False)
    model = build_model(arch, config, torch.float32)
    assert LazyCheckpoint(directory).load_into(model, rank, world, quantize=quantize, progress=False).ok
    kind = Int8Tensor if qdtype == "int8" else Float8Tensor
    held = {n: m for n, m in ref.named_modules() if isinstance(getattr(m, "weight", None), kind)}
    assert len(held) == (7 if arch == "llama" else 6) * config.num_hidden_layers, sorted(held)
    for name, whole in held.items():
        local = model.get_submodule(name)
        label = f"{arch} {qdtype} world={world} rank={rank} {name}"
        if name.rpartition(".")[2] in KEPT[arch]:
            assert isinstance(local, QuantizedLinear), label
            continue
        assert type(local) is torch.nn.Linear and isinstance(local.weight, kind), f"{label}: {type(local)}"
        for attr in ("qdata", "scale"):
            want = _share(name, getattr(whole.weight, attr), rank, world, kv)
            assert torch.equal(_bits(getattr(local.weight, attr)), _bits(want)), f"{label}: {attr}"
    ids = fixed_input(config)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{arch} {qdtype} world={world}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_torchao_holders_under_tensor_parallel_equal_world1(checkpoint, tmp_path, world):
    """Llama int8 and fp8 in one spawn per world; at world 4 the KV projections (2 KV heads)
    are plain shards replicated over pairs of ranks, the row-parallel shards two groups wide.
    At world 2 also OPT (no TP plan): torchao holds its column-parallel layers, lazyload its
    row-parallel ones."""
    needs_torchao()
    llama = str(checkpoint("llama")[0])
    cases = [("llama", llama, "int8"), ("llama", llama, "fp8")]
    if world == 2:
        cases.append(("opt", str(checkpoint("opt")[0]), "int8"))
    spawn_cases(world, cases, tmp_path, _run_case)


def test_torchao_is_the_default_holder_where_it_fits(checkpoint):
    """quantize="int8" with torchao installed: torchao holds the layers whose rows are whole
    groups (down_proj: 128 input columns, one group of 128), QuantizedLinear the others (64
    columns: one short group, which torchao 0.18 does not take), and the report says so."""
    needs_torchao()
    from torchao.quantization import Int8Tensor

    from lazyload import LazyCheckpoint, Quantization
    from lazyload.quant.linear import QuantizedLinear

    directory, config = checkpoint("llama")
    assert Quantization("int8").torchao and not Quantization("int8", torchao=False).torchao
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, quantize="int8", progress=False)
    layer = model.model.layers[0]
    assert type(layer.mlp.down_proj) is torch.nn.Linear and isinstance(layer.mlp.down_proj.weight, Int8Tensor)
    assert isinstance(layer.self_attn.q_proj, QuantizedLinear) and isinstance(layer.mlp.up_proj, QuantizedLinear)
    assert report.quantized_to == f"int8, a float32 scale per 128 input columns ({config.num_hidden_layers} as " \
                                  "torchao tensors)"
