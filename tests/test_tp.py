"""Tensor-parallel placements without a process group: rank/world alone give each rank its
share, from the model's transformers TP plan, plan=, local shapes or the structural rule;
errors before any byte is read; a rank reads only its share."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from checkpoints import EXPERTS_TP, build_model, default_experts, meta_tensors, shard_files
from lazyload import LazyCheckpoint, Placement
from lazyload.errors import PlanError
from lazyload.summary import plan_ranks

PAGE = os.sysconf("SC_PAGE_SIZE")


def full_model(arch, directory, config):
    model = build_model(arch, config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, progress=False)
    return dict(model.named_parameters())


def shard_of(name: str, full: torch.Tensor, rank: int, world: int, kv: int) -> torch.Tensor:
    """Llama/Qwen2 under transformers' plan, computed here from the style names alone."""
    parts = name.split(".")
    last = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
    if last in ("k_proj", "v_proj"):
        groups = min(kv, world)
        return full.chunk(groups, 0)[rank // (world // groups)]
    if last in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
        return full.chunk(world, 0)[rank]
    if last in ("o_proj", "down_proj"):
        return full if parts[-1] == "bias" else full.chunk(world, 1)[rank]
    return full


@pytest.mark.parametrize("arch,world,overrides", [("llama", 4, {}), ("llama", 2, {"num_key_value_heads": 1}),
                                                  ("qwen2", 2, {})])
def test_every_rank_gets_its_share_from_the_model_plan(checkpoint, arch, world, overrides):
    directory, config = checkpoint(arch, **overrides)
    full = full_model(arch, directory, config)
    for rank in range(world):
        model = build_model(arch, config, torch.float32)
        report = LazyCheckpoint(str(directory)).load_into(model, rank, world, progress=False)
        assert report.ok and not meta_tensors(model)
        for name, param in model.named_parameters():
            expected = shard_of(name, full[name].detach(), rank, world, config.num_key_value_heads)
            assert torch.equal(param.detach(), expected), f"rank {rank}: {name}"


def test_mixtral_experts_tp_and_ep(checkpoint):
    directory, config = checkpoint("mixtral")
    full = full_model("mixtral", directory, config)
    world, E = 2, config.num_local_experts
    for rank in range(world):
        tp = build_model("mixtral", config, torch.float32)
        LazyCheckpoint(str(directory)).load_into(tp, rank, world, plan=EXPERTS_TP, progress=False)
        ep = build_model("mixtral", config, torch.float32)
        LazyCheckpoint(str(directory)).load_into(ep, rank, world, plan="ep", progress=False)
        default = build_model("mixtral", config, torch.float32)
        assert LazyCheckpoint(str(directory)).load_into(default, rank, world, progress=False).plan == \
            default_experts(config)
        same = ep if default_experts(config) == "ep" else tp
        assert all(torch.equal(t, same.state_dict()[k]) for k, t in default.state_dict().items())
        for layer in range(config.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts."
            gate_up, down = full[prefix + "gate_up_proj"].detach(), full[prefix + "down_proj"].detach()
            packed = torch.cat([half.chunk(world, 1)[rank] for half in gate_up.chunk(2, 1)], 1)
            assert torch.equal(tp.get_parameter(prefix + "gate_up_proj"), packed)
            assert torch.equal(tp.get_parameter(prefix + "down_proj"), down.chunk(world, 2)[rank])
            mine = slice(rank * E // world, (rank + 1) * E // world)
            assert torch.equal(ep.get_parameter(prefix + "gate_up_proj"), gate_up[mine])
            assert torch.equal(ep.get_parameter(prefix + "down_proj"), down[mine])
            router = f"model.layers.{layer}.mlp.gate.weight"
            assert torch.equal(ep.get_parameter(router), full[router])  # routers replicated


def test_gpt2_structural_rule_conv1d_packed(checkpoint):
    directory, config = checkpoint("gpt2")
    full = full_model("gpt2", directory, config)
    model = build_model("gpt2", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, 1, 2, progress=False)
    w = full["transformer.h.0.attn.c_attn.weight"].detach()  # Conv1D [in, 3 * out]
    expected = torch.cat([p.chunk(2, 1)[1] for p in w.chunk(3, 1)], 1)
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, expected)
    assert torch.equal(model.transformer.h[0].mlp.c_proj.weight, full["transformer.h.0.mlp.c_proj.weight"].chunk(2, 0)[1])
    assert torch.equal(model.transformer.h[0].mlp.c_proj.bias, full["transformer.h.0.mlp.c_proj.bias"])
    assert model.lm_head.weight is model.transformer.wte.weight  # replicated, still tied


def test_structural_rule_splits_each_half_of_a_fused_gated_mlp(checkpoint):
    """Moshi's fc1 holds [gate; up] (fc2 takes half its output): each rank gets its rows of
    both halves, not the gates on one rank and the ups on the other."""
    directory, config = checkpoint("moshi")
    full = full_model("moshi", directory, config)
    model = build_model("moshi", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, 1, 2, progress=False)
    fc1 = full["model.layers.0.mlp.fc1.weight"].detach()
    expected = torch.cat([half.chunk(2, 0)[1] for half in fc1.chunk(2, 0)])
    assert torch.equal(model.model.layers[0].mlp.fc1.weight, expected)
    assert torch.equal(model.model.layers[0].mlp.fc2.weight, full["model.layers.0.mlp.fc2.weight"].chunk(2, 1)[1])


def test_plan_overrides_in_transformers_format_and_placements(checkpoint):
    directory, config = checkpoint("llama")
    full = full_model("llama", directory, config)
    model = build_model("llama", config, torch.float32)
    plan = {"layers.*.mlp.down_proj": "rowwise", "model.norm.weight": Placement("shard", 0),
            "layers.*.mlp.gate_proj": "replicate"}
    LazyCheckpoint(str(directory)).load_into(model, 1, 2, plan=plan, progress=False)
    assert torch.equal(model.model.layers[2].mlp.down_proj.weight, full["model.layers.2.mlp.down_proj.weight"].chunk(2, 1)[1])
    assert torch.equal(model.model.norm.weight, full["model.norm.weight"].chunk(2, 0)[1])
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, full["model.layers.0.mlp.gate_proj.weight"])
    # plan= overrides entries of the model's own plan: what it does not name follows the model's plan
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q.chunk(2, 0)[1])


@pytest.mark.parametrize("overrides,world,match", [
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}, 2, "KV heads"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48}, 4, "attention heads"),
    ({"vocab_size": 250}, 4, "does not split evenly"),
])
def test_uneven_splits_refused_before_reading(checkpoint, overrides, world, match):
    directory, config = checkpoint("llama", **overrides)
    model = build_model("llama", config, torch.float32)
    with pytest.raises(PlanError, match=match):
        LazyCheckpoint(str(directory)).load_into(model, 0, world, progress=False)
    assert len(meta_tensors(model)) == len(list(model.parameters())) + len(list(model.buffers()))


class LocalMLP(nn.Module):
    """The user's own parallel layers: already the local shapes of rank `rank` of 2."""

    def __init__(self, hidden=8, inter=16, world=2):
        super().__init__()
        self.up = nn.Linear(hidden, inter // world)
        self.down = nn.Linear(inter // world, hidden)
        self.norm = nn.LayerNorm(hidden)


def test_local_shapes_are_filled_as_they_are(tmp_path):
    torch.manual_seed(0)
    full = {"up.weight": torch.randn(16, 8), "up.bias": torch.randn(16), "down.weight": torch.randn(8, 16),
            "down.bias": torch.randn(8), "norm.weight": torch.randn(8), "norm.bias": torch.randn(8)}
    save_file(full, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        model = LocalMLP()
        report = LazyCheckpoint(str(tmp_path)).load_into(model, rank, 2, progress=False)
        assert report.ok
        assert torch.equal(model.up.weight, full["up.weight"].chunk(2, 0)[rank])
        assert torch.equal(model.up.bias, full["up.bias"].chunk(2, 0)[rank])
        assert torch.equal(model.down.weight, full["down.weight"].chunk(2, 1)[rank])
        assert torch.equal(model.down.bias, full["down.bias"])


def test_plan_cli_per_rank_bytes(checkpoint, capsys):
    from lazyload.cli import main

    directory, config = checkpoint("llama")
    ranks, warnings = plan_ranks(str(directory), 4)
    assert len(ranks) == 4 and any("KV heads replicated" in w for w in warnings)
    assert main(["plan", str(directory), "--world", "4"]) == 0
    assert "KV heads replicated" in capsys.readouterr().out
    with pytest.raises(PlanError, match="attention heads"):  # unplannable: an error, exit 2 from the CLI
        plan_ranks(str(directory), 8)
    assert main(["plan", str(directory), "--world", "8"]) == 2


# ------------------------------------------------------------------ bytes actually read


def _data_start_and_entries(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _slice_pages_and_bytes(directory, rank, world, kv):
    """Independently of lazyload: the bytes of this rank's slices of each checkpoint tensor
    (Llama checkpoint, transformers' plan) and the file pages they touch."""
    total, pages = 0, set()
    for path in shard_files(directory):
        start, header = _data_start_and_entries(path)
        for key, meta in header.items():
            shape, itemsize = meta["shape"], 4
            full = torch.arange(int(torch.tensor(shape).prod()) if shape else 1).reshape(shape)
            local = shard_of(key, full, rank, world, kv)
            flat = local.reshape(-1)
            total += flat.numel() * itemsize
            offsets = start + meta["data_offsets"][0] + flat * itemsize
            pages.update((str(path), p) for p in (offsets // PAGE).tolist())
            pages.update((str(path), p) for p in ((offsets + itemsize - 1) // PAGE).tolist())
    return total, len(pages) * PAGE


@pytest.mark.parametrize("reader", ["mmap", "pread"])
def test_rank_reads_only_its_share(checkpoint, reader):
    """mmap: exactly the slices (copied, or mapped when a slice is a whole contiguous
    local tensor); pread: the slices, or for short strided runs their span, at most twice
    the page-granular minimum."""
    directory, config = checkpoint("llama")
    world = 4
    for rank in range(world):
        share, page_min = _slice_pages_and_bytes(directory, rank, world, config.num_key_value_heads)
        assert plan_ranks(str(directory), world)[0][rank].bytes_to_read == share
        model = build_model("llama", config, torch.float32)
        report = LazyCheckpoint(str(directory)).load_into(model, rank, world, progress=False, reader=reader)
        taken = report.bytes_read + report.bytes_mapped
        if reader == "mmap":
            assert taken == share, (rank, share, report.bytes_read, report.bytes_mapped)
        else:
            assert report.bytes_mapped == 0
            assert share <= taken <= max(2 * page_min, share), (rank, share, page_min, taken)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


@pytest.mark.parametrize("reader", ["auto", "pread"])  # auto on CPU: mmap with exact prefetch
def test_cold_cache_os_reads_stay_near_the_page_minimum(checkpoint, reader):
    directory, config = checkpoint("llama", hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=2048, num_hidden_layers=2)
    world, rank = 4, 1
    _, page_min = _slice_pages_and_bytes(directory, rank, world, config.num_key_value_heads)
    ckpt = LazyCheckpoint(str(directory))
    # The same load once first, from a cold cache too, so that the code it runs is mapped:
    # dropping the page cache evicts library pages not mapped yet, and faulting them back
    # in would count as reads of the checkpoint here.
    if not _drop_caches():
        pytest.skip("dropping the page cache needs root (/proc/sys/vm/drop_caches not writable)")
    ckpt.load_into(build_model("llama", config, torch.float32), rank, world, progress=False, reader=reader)
    model = build_model("llama", config, torch.float32)
    _drop_caches()
    before = _read_bytes()
    report = ckpt.load_into(model, rank, world, progress=False, reader=reader)
    read = _read_bytes() - before
    assert report.reader == ("mmap" if reader == "auto" else "pread")
    assert read <= 1.05 * page_min + 4 * 2**20, f"OS read {read} bytes for a page-granular minimum of {page_min}"
