"""Cooperative reads with one tensor dominating: a Llama whose embedding and head (vocab
4096) are most of the checkpoint, on 4 replicas of tp 1 (gloo, 4 spawned processes). Those
targets are cut into row ranges read by different replicas, so every rank reads about a
quarter of its share (whole, one replica would read a whole embedding: over 40%), and every
tensor equals the world-1 load's bit for bit."""
from __future__ import annotations

import torch

from checkpoints import build_model, write_checkpoint
from gloo import spawn_cases

DP = 4


def _case(directory, rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig
    from lazyload import LazyCheckpoint

    config = AutoConfig.from_pretrained(directory)
    mesh = init_device_mesh("cpu", (DP, 1), mesh_dim_names=("dp", "tp"))
    reports, params = [], []
    for kwargs in ({}, {"mesh": mesh}):
        model = build_model("llama", config, torch.float32)
        reports.append(LazyCheckpoint(directory).load_into(model, progress=False, **kwargs))
        params.append(dict(model.named_parameters()))
    alone, shared = reports
    assert shared.ok and shared.bytes_received > 0
    for name, param in params[0].items():
        assert torch.equal(params[1][name], param), f"rank {rank}: {name} differs from world 1's"
    own = alone.bytes_read + alone.bytes_mapped
    assert shared.bytes_read <= 0.3 * own, f"rank {rank}: read {shared.bytes_read} of a share of {own}"
    total = torch.tensor([shared.bytes_read])
    dist.all_reduce(total)
    assert total.item() == own, f"rank {rank}: {total.item()} bytes read in all, the checkpoint has {own}"


def test_dominant_tensor_split_by_rows(tmp_path):
    directory, _ = write_checkpoint("llama", torch.float32, tmp_path / "llama", vocab_size=4096)
    embedding = 4096 * 64 * 4
    assert 2 * embedding > 0.6 * sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    spawn_cases(DP, [str(directory)], tmp_path, _case)
