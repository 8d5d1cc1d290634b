"""DeepSpeed AutoTP's uneven shards: AutoTP cuts MLP and LM-head dims in grains of 64 columns
(the last rank also gets the remainder below a grain) and attention dims by KV heads, so a
rank may hold more than its even share, or nothing (`lm_head` of width 64 at world 2: all 64
columns on rank 0, a [256, 0] tensor on rank 1). `load_into` fills those local shapes with
exactly the columns DeepSpeed gives each rank.

Without DeepSpeed: a meta model given AutoTP's local shapes (the table below) is filled, and
its shards tile world 1's tensors. With DeepSpeed (the optional 'deepspeed' test extra; CPU,
gloo): lazyload's rule is DeepSpeed's `get_shard_size_list`, and a model AutoTP made from
`init_inference` gives world 1's logits on every rank."""
from __future__ import annotations

import importlib.util
import os
import traceback

import pytest
import torch

from checkpoints import build_model
from gloo import end_rank, spawn_collecting
from lazyload import LazyCheckpoint

# Llama with hidden 64 (4 heads, 2 KV heads of 16) and an MLP of 200 = 3 grains + 8.
CONFIG = dict(hidden_size=64, intermediate_size=200)
# AutoTP's cut of each layer (the dim it splits: 0 for column-parallel, 1 for row-parallel)
# and every rank's share, as DeepSpeed's get_shard_size_list gives them for CONFIG.
CUTS = {
    2: {"self_attn.q_proj": (0, [32, 32]), "self_attn.k_proj": (0, [16, 16]), "self_attn.v_proj": (0, [16, 16]),
        "self_attn.o_proj": (1, [32, 32]), "mlp.gate_proj": (0, [128, 72]), "mlp.up_proj": (0, [128, 72]),
        "mlp.down_proj": (1, [128, 72]), "lm_head": (1, [64, 0])},
    3: {"self_attn.q_proj": (0, [32, 32, 0]), "self_attn.k_proj": (0, [16, 16, 0]),
        "self_attn.v_proj": (0, [16, 16, 0]), "self_attn.o_proj": (1, [32, 32, 0]),
        "mlp.gate_proj": (0, [64, 64, 72]), "mlp.up_proj": (0, [64, 64, 72]), "mlp.down_proj": (1, [64, 64, 72]),
        "lm_head": (1, [64, 0, 0])},
}
# CI installs the test extra, DeepSpeed with it: there its absence fails instead of skipping.
HAS_DEEPSPEED = bool(os.environ.get("CI")) or importlib.util.find_spec("deepspeed") is not None


def _cut_of(name: str, world: int) -> tuple[int, list[int]] | None:
    """AutoTP's cut of the parameter `name` (AutoTP calls a layer parent.attr, or lm_head)."""
    parts = name.split(".")[:-1]
    return CUTS[world].get(".".join(parts[-2:])) or CUTS[world].get(parts[-1])


def _shard(tensor: torch.Tensor, dim: int, sizes: list[int], rank: int) -> torch.Tensor:
    return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank])


@pytest.mark.parametrize("world", [2, 3])
def test_autotp_local_shapes_are_filled_with_their_columns(checkpoint, world):
    """Every rank's model holds AutoTP's local shapes of the Linear weights (Llama has no biases):
    each is filled with exactly its columns of world 1's tensor."""
    directory, config = checkpoint("llama", **CONFIG)
    full = build_model("llama", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(full, progress=False)
    full = dict(full.named_parameters())
    for rank in range(world):
        model = build_model("llama", config, torch.float32)
        for name, param in list(model.named_parameters()):
            if (cut := _cut_of(name, world)) is not None:
                dim, sizes = cut
                module = model.get_submodule(name.rpartition(".")[0])
                module.weight = torch.nn.Parameter(_shard(param, dim, sizes, rank), requires_grad=False)

        report = LazyCheckpoint(str(directory)).load_into(model, rank, world, progress=False)

        assert report.ok and not report.missing, report
        for name, param in model.named_parameters():
            cut = _cut_of(name, world)
            want = _shard(full[name], *cut, rank) if cut else full[name]
            assert torch.equal(param.detach(), want.detach()), f"rank {rank}: {name} is not its share"
        assert model.lm_head.weight.shape[1] == CUTS[world]["lm_head"][1][rank]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is in the 'test' extra (DS_BUILD_OPS=0 pip install)")
@pytest.mark.parametrize("world", [2, 3, 6])
def test_autotp_rule_is_deepspeeds(world):
    """lazyload's shard sizes are DeepSpeed's own, for names split by KV heads, by grains,
    with a remainder, and under one grain; and the table above is DeepSpeed's cut."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    from lazyload.tp.autotp import shard_sizes

    for kv_heads in (None, 2, 8):
        for grain in (1, 64):
            meta = AutoTPMeta(num_kv_heads=kv_heads, tp_grain_size=grain)
            for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj", "lm_head"):
                for total in (0, 8, 16, 48, 64, 192, 200, 256, 14336):
                    try:
                        want = get_shard_size_list(total, world, meta, name)
                    except AssertionError:  # DeepSpeed refuses a cut that does not tile
                        assert sum(shard_sizes(total, world, name, kv_heads, grain)) != total
                        continue
                    assert shard_sizes(total, world, name, kv_heads, grain) == want, (kv_heads, grain, name, total)
    if world in CUTS:
        shapes = {"self_attn.q_proj": 64, "self_attn.k_proj": 32, "self_attn.v_proj": 32, "self_attn.o_proj": 64,
                  "mlp.gate_proj": 200, "mlp.up_proj": 200, "mlp.down_proj": 200, "lm_head": 64}
        meta = AutoTPMeta(num_kv_heads=2, tp_grain_size=64)
        for name, (_, sizes) in CUTS[world].items():
            assert get_shard_size_list(shapes[name], world, meta, name) == sizes, name


def _deepspeed_worker(rank, world, directory, init_file, errors):
    try:
        from deepspeed_models import autotp_load_matches_world1

        model = autotp_load_matches_world1(rank, world, directory, init_file)
        assert model.lm_head.weight.shape[1] == CUTS[world]["lm_head"][1][rank]  # AutoTP's uneven cut
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
    end_rank()


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is in the 'test' extra (DS_BUILD_OPS=0 pip install)")
def test_deepspeed_autotp_uneven_shards_give_world1_logits(checkpoint, tmp_path):
    directory, _ = checkpoint("llama", **CONFIG)
    spawn_collecting(_deepspeed_worker, (2, str(directory), str(tmp_path / "pg")), 2)
