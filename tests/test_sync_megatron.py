"""WeightSync from a Megatron-Core trainer, over real gloo ranks: a GPTModel (a Llama: RMSNorm,
SwiGLU, grouped-query attention; fused `linear_qkv` and `linear_fc1`) at TP 2 on ranks 0-1
is the source, as its `sharded_state_dict()` describes it; a transformers Llama at TP 2 on
ranks 2-3, built on meta, the target. After each of two syncs (the weights changed in place
between), every server tensor equals bit for bit `load_into` of the torch_dist checkpoint
the same Megatron model saves then (`dist_checkpointing.save`), and each server rank
receives exactly its share: the torch_dist reader's mapping splits the fused tensors, so
each asks for only the heads and rows it holds."""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

from gloo import spawn_cases


def _perturb(model, seed: int) -> None:
    """Every parameter moved by noise seeded by its name (and, for TP-split ones, the TP rank;
    the norms, replicated, alike on both ranks): no two tensors alike, no norm all ones."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 100_003 + sum(i * ord(c) for i, c in enumerate(name))
                                              + (tp if param.dim() > 1 else 0))
            param.add_(torch.randn(param.shape, generator=g) * 0.05)


def _save(model, iteration: str) -> None:
    """The Megatron model's torch_dist checkpoint, as Megatron-LM saves it (its args in the
    common state); every rank of the job calls it, the server ranks with nothing to save."""
    from megatron.core import dist_checkpointing

    from megatron_dist_checkpoints import GROUPS, HEAD_DIM, HEADS, HIDDEN

    state = model.sharded_state_dict() if model is not None else {}
    state["args"] = argparse.Namespace(num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
                                       hidden_size=HIDDEN, kv_channels=HEAD_DIM["llama"])
    os.makedirs(iteration, exist_ok=True)
    dist_checkpointing.save(state, iteration)


def _described_twice_is_refused(model) -> None:
    """A sharded state dict naming one tensor by shards of two parameters (two entries under
    the embedding's key): an ArgumentError naming it, not one tensor pieced from both."""
    import pytest
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lazyload.errors import ArgumentError
    from lazyload.sync.megatron_source import megatron_tensors

    own = model.sharded_state_dict
    other = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", torch.zeros(128, 64), (0, 0, 2))
    model.sharded_state_dict = lambda: {**own(), "another.weight": other}
    try:
        with pytest.raises(ArgumentError, match="'embedding.word_embeddings.weight' is described twice"):
            megatron_tensors(model)
    finally:
        del model.sharded_state_dict


def _unsyncable_shards_are_refused() -> None:
    """Megatron's own ShardedTensors that no dense GPT layer makes: an expert axis prepended
    to the layer axis (MoE experts), and a shard that is no block of rows of its parameter
    (a factory cutting columns): each an ArgumentError naming the tensor (run in a rank: the
    test process does not import megatron, whose import brings torch._dynamo)."""
    import pytest
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lazyload.errors import ArgumentError
    from lazyload.sync.megatron_source import described_shard

    experts = torch.zeros(4, 3)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    shard = ShardedTensor.from_rank_offsets(key, experts, (0, 1, 2), (1, 3, 4), prepend_axis_num=2)
    with pytest.raises(ArgumentError, match="linear_fc1.weight' has 2 axes prepended"):
        described_shard(shard, experts)
    param = torch.zeros(4, 6)
    columns = ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc1.weight", param[:, 3:], (0, 1, 2),
                                              prepend_axis_num=1)
    with pytest.raises(ArgumentError, match="layers.1.mlp.linear_fc1.weight': a shard that is no block of rows"):
        described_shard(columns, param)
    rows = ShardedTensor.from_rank_offsets("module.decoder.layers.mlp.linear_fc1.weight", param[2:], (0, 1, 2),
                                           (1, 1, 2), prepend_axis_num=1)  # a wrapper's prefix, as the reader drops it
    name, shape, held = described_shard(rows, param)
    assert (name, shape, held) == ("decoder.layers.1.mlp.linear_fc1.weight", (4, 6), (((2, 4), (0, 6)), (2, 0)))


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _check_against_load_into(server, report, iteration: str, mesh) -> None:
    """The server rank's tensors equal load_into's of the torch_dist checkpoint, bit for bit,
    and it received exactly its share of them."""
    import lazyload
    from transformers import LlamaForCausalLM

    from megatron_dist_checkpoints import hf_config

    with torch.device("meta"):
        reference = LlamaForCausalLM(hf_config())
    lazyload.LazyCheckpoint(iteration).load_into(reference, mesh=mesh, progress=False)
    got, want = server.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(_local(got[name]), _local(tensor)), name
    share = sum(math.prod(_local(t).shape) * t.element_size() for t in want.values())
    assert (report.bytes_received, report.bytes_local) == (share, 0)


def _megatron_into_tp2(case, rank, world):
    """The trainer Megatron TP `tp` x PP `pp` (stages in order over ranks 0-1), the server
    a transformers Llama TP 2 on ranks 2-3."""
    import lazyload
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    from megatron_dist_checkpoints import _cpu_only, _gpt_model, hf_config

    directory, tp, pp = case
    _cpu_only()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             order="tp-cp-ep-pp-dp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = server = None
    if rank < 2:
        trainer = _gpt_model("llama", tp, pp=pp)
        _perturb(trainer, 1)
    else:
        with torch.device("meta"):
            server = LlamaForCausalLM(hf_config())
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["x"] if server is not None else None,
                               rank_timeout=60)
    for number in (1, 2):
        if number == 2 and trainer is not None:
            _perturb(trainer, 2)
        report = sync()
        iteration = f"{directory}/iter{number}"
        _save(trainer, iteration)
        if server is not None:
            _check_against_load_into(server, report, iteration, mesh["x"])
    if trainer is not None and pp > 1:  # each stage held its own layer alone, numbered globally
        from lazyload.sync.megatron_source import megatron_tensors

        layers = {n.split(".")[2] for n in megatron_tensors(trainer) if n.startswith("decoder.layers.")}
        assert layers == {str(parallel_state.get_pipeline_model_parallel_rank())}, layers
    elif trainer is not None:
        _described_twice_is_refused(trainer)
        _unsyncable_shards_are_refused()
    parallel_state.destroy_model_parallel()


def _run_case(case, rank, world):
    _megatron_into_tp2(case, rank, world)


def test_sync_from_a_megatron_trainer(tmp_path):
    """Megatron TP 2, and PP 2 (each stage its layers, the embedding on the first, the head on
    the last: layers numbered globally), into a TP-2 Llama; at TP 2 the trainer ranks also
    check that the shards lazyload does not sync are refused."""
    spawn_cases(4, [(str(tmp_path / "tp2"), 2, 1), (str(tmp_path / "pp2"), 1, 2)], tmp_path, _run_case)

