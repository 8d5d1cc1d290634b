"""WeightSync from a Megatron-Core trainer, over real gloo ranks: a GPTModel (a Llama: RMSNorm,
SwiGLU, grouped-query attention; fused `linear_qkv` and `linear_fc1`) at TP 2 on ranks 0-1
is the source, as its `sharded_state_dict()` describes it; a transformers Llama at TP 2 on
ranks 2-3, built on meta, the target. After each of two syncs (the weights changed in place
between), every server tensor equals bit for bit `load_into` of the torch_dist checkpoint
the same Megatron model saves then (`dist_checkpointing.save`), and each server rank
receives exactly its share: the torch_dist reader's mapping splits the fused tensors, so
each asks for only the heads and rows it holds. A MoE GPTModel (a Qwen3-MoE: SequentialMLP's
experts, one parameter each, under the expert axis) at TP 2 x EP 2 and at TP 2 x EP 1
(every expert on both trainer ranks) syncs likewise into a transformers Qwen3-MoE at TP 2,
its experts cut per expert (TP) or whole per rank (the default plan); a Qwen2-MoE (a gated
shared expert, its second layer dense: Megatron describes each layer under its own number,
the experts with the expert axis alone) at TP 2 x EP 2 into the default plan. At expert TP 2
(EP 1) each trainer rank holds half of every expert (fc1's gate and up rows, fc2's columns),
synced into both plans."""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

from gloo import spawn_cases


def _perturb(model, seed: int) -> None:
    """Every parameter moved by noise seeded by its name (and, for TP-split ones, the TP rank;
    an expert by its global index and expert-TP rank; the norms and routers, replicated, alike
    on both ranks): no two tensors alike, no norm all ones, no two EP ranks' experts alike."""
    from megatron.core import parallel_state as ps

    from megatron_dist_checkpoints import EXPERTS

    first = ps.get_expert_model_parallel_rank() * (EXPERTS // ps.get_expert_model_parallel_world_size())
    with torch.no_grad():
        for name, param in model.named_parameters():
            split = ps.get_tensor_model_parallel_rank() if getattr(param, "tensor_model_parallel", False) else 0
            if ".local_experts." in name:
                local = name.split(".local_experts.")[1].split(".")[0]
                name = name.replace(f".local_experts.{local}.", f".expert{first + int(local)}.")
                split = ps.get_expert_tensor_parallel_rank()
            g = torch.Generator().manual_seed(seed * 100_003 + sum(i * ord(c) for i, c in enumerate(name)) + split)
            param.add_(torch.randn(param.shape, generator=g) * 0.05)


def _save(model, iteration: str, kind: str) -> None:
    """The Megatron model's torch_dist checkpoint, as Megatron-LM saves it (its args in the
    common state); every rank of the job calls it, the server ranks with nothing to save."""
    from megatron.core import dist_checkpointing

    from megatron_dist_checkpoints import GROUPS, HEAD_DIM, HEADS, HIDDEN

    state = model.sharded_state_dict() if model is not None else {}
    state["args"] = argparse.Namespace(num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
                                       hidden_size=HIDDEN, kv_channels=HEAD_DIM[kind])
    os.makedirs(iteration, exist_ok=True)
    dist_checkpointing.save(state, iteration)


def _described_twice_is_refused(model, kind: str) -> None:
    """A sharded state dict naming one tensor by shards of two parameters (a second entry under
    the embedding's key; a MoE model's: a second expert 0 of layer 0, beside its own): an
    ArgumentError naming it, not one tensor pieced from both."""
    import pytest
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lazyload.errors import ArgumentError
    from lazyload.sync.megatron_source import megatron_tensors

    if kind == "llama":
        name = "embedding.word_embeddings.weight"
        other = ShardedTensor.from_rank_offsets(name, torch.zeros(128, 64), (0, 0, 2))
    else:
        name = "decoder.layers.0.mlp.experts.experts.linear_fc2.weight"
        expert = parallel_state.get_expert_model_parallel_rank() * 2  # this EP rank's first (2 experts a rank)
        other = ShardedTensor.from_rank_offsets("decoder.layers.mlp.experts.experts.linear_fc2.weight",
                                                torch.zeros(64, 32), (0, 0, 2), (1, expert, 4), prepend_axis_num=2)
    own = model.sharded_state_dict
    model.sharded_state_dict = lambda: {**own(), "another.weight": other}
    try:
        with pytest.raises(ArgumentError, match=f"'{name}' is described twice"):
            megatron_tensors(model)
    finally:
        del model.sharded_state_dict


def _unsyncable_shards_are_refused() -> None:
    """Megatron's own ShardedTensors that no GPT layer makes: an axis prepended beside the
    layer axis on a tensor that is no MoE layer's experts, and a shard that is no block of rows
    of its parameter (a factory cutting columns): each an ArgumentError naming the tensor (run
    in a rank: the test process does not import megatron, whose import brings torch._dynamo).
    An expert's shard (the expert axis after the layer axis) is that expert's box."""
    import pytest
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from lazyload.errors import ArgumentError
    from lazyload.sync.megatron_source import described_shard

    weight = torch.zeros(4, 3)
    key = "decoder.layers.mlp.linear_fc1.weight"
    shard = ShardedTensor.from_rank_offsets(key, weight, (0, 1, 2), (1, 3, 4), prepend_axis_num=2)
    with pytest.raises(ArgumentError, match="linear_fc1.weight' has 2 axes prepended, 1 beside the layer axis"):
        described_shard(shard, weight)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    expert = ShardedTensor.from_rank_offsets(key, weight, (0, 1, 2), (1, 3, 4), prepend_axis_num=2)
    assert described_shard(expert, weight) == (key.replace("layers.", "layers.1."), (4, 4, 3),
                                               (((3, 4), (0, 4), (0, 3)), (0, 0, 0)))
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


def _server(kind: str):
    from transformers import AutoModelForCausalLM

    from megatron_dist_checkpoints import hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(kind))


def _check_against_load_into(server, report, iteration: str, mesh, kind: str, plan) -> None:
    """The server rank's tensors equal load_into's of the torch_dist checkpoint, bit for bit,
    and it received exactly its share of them."""
    import lazyload

    reference = _server(kind)
    lazyload.LazyCheckpoint(iteration).load_into(reference, mesh=mesh, plan=plan, progress=False)
    got, want = server.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(_local(got[name]), _local(tensor)), name
    share = sum(math.prod(_local(t).shape) * t.element_size() for t in want.values())
    assert (report.bytes_received, report.bytes_local) == (share, 0)


def _megatron_into_tp2(case, rank, world):
    """The trainer Megatron TP `tp` x PP `pp` x EP `ep` (stages in order over ranks 0-1; each
    expert over `etp` ranks), the server a transformers model of `kind` at TP 2 on ranks 2-3,
    its experts split by `plan`."""
    import lazyload
    from megatron.core import parallel_state
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_dist_checkpoints import _cpu_only, _gpt_model

    directory, kind, tp, pp, ep, plan, *etp = case
    etp = etp[0] if etp else 1
    _cpu_only()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, order="tp-cp-ep-pp-dp",
                                             expert_tensor_parallel_size=etp if kind != "llama" else None)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = server = None
    if rank < 2:
        trainer = _gpt_model(kind, tp, ep, pp=pp, etp=etp)
        _perturb(trainer, 1)
    else:
        server = _server(kind)
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["x"] if server is not None else None,
                               plan=plan, rank_timeout=60)
    for number in (1, 2):
        if number == 2 and trainer is not None:
            _perturb(trainer, 2)
        report = sync()
        iteration = f"{directory}/iter{number}"
        _save(trainer, iteration, kind)
        if server is not None:
            _check_against_load_into(server, report, iteration, mesh["x"], kind, plan)
    if trainer is not None and pp > 1:  # each stage held its own layer alone, numbered globally
        from lazyload.sync.megatron_source import megatron_tensors

        layers = {n.split(".")[2] for n in megatron_tensors(trainer) if n.startswith("decoder.layers.")}
        assert layers == {str(parallel_state.get_pipeline_model_parallel_rank())}, layers
    elif trainer is not None and (kind == "llama" or ep == 2):  # the dense TP 2 model's, the MoE one's at EP 2
        _described_twice_is_refused(trainer, kind)
        _unsyncable_shards_are_refused()
    elif trainer is not None and etp > 1:
        _experts_split(trainer, etp)
    parallel_state.destroy_model_parallel()


def _experts_split(trainer, etp: int) -> None:
    """At expert TP `etp`, this trainer rank held its part of every expert: fc2 its block of
    input columns, fc1 its block of gate rows and of up rows (two boxes of [all gate; all up])."""
    from megatron.core import parallel_state

    from lazyload.sync.megatron_source import megatron_tensors
    from megatron_dist_checkpoints import EXPERT_FFN, EXPERTS

    part, tensors = parallel_state.get_expert_tensor_parallel_rank(), megatron_tensors(trainer)
    width = EXPERT_FFN // etp
    for layer in range(2):
        fc1, fc2 = (tensors[f"decoder.layers.{layer}.mlp.experts.experts.{n}.weight"]
                    for n in ("linear_fc1", "linear_fc2"))
        assert sorted(box[2] for box, _, _ in fc2.held) == [(part * width, (part + 1) * width)] * EXPERTS
        rows = sorted(box[1] for box, _, _ in fc1.held)
        assert rows == [(part * width, (part + 1) * width)] * EXPERTS + [
            (EXPERT_FFN + part * width, EXPERT_FFN + (part + 1) * width)] * EXPERTS, rows


def _run_case(case, rank, world):
    _megatron_into_tp2(case, rank, world)


def test_sync_from_a_megatron_trainer(tmp_path):
    """Megatron TP 2, and PP 2 (each stage its layers, the embedding on the first, the head on
    the last: layers numbered globally), into a TP-2 Llama; at TP 2 the trainer ranks also
    check that the shards lazyload does not sync are refused. A Qwen3-MoE at TP 2 x EP 2 into
    a TP-2 Qwen3-MoE, its experts cut per expert (TP), and at TP 2 x EP 1 into the default
    plan (whole experts per rank); a Qwen2-MoE (layers unstacked, a shared expert) at EP 2.
    A Qwen3-MoE at TP 2 x expert TP 2 (each expert's rows split over both trainer ranks) into
    both plans: its experts cut per expert, and whole per rank (each expert from both halves)."""
    from checkpoints import EXPERTS_TP

    cases = [(str(tmp_path / "tp2"), "llama", 2, 1, 1, None), (str(tmp_path / "pp2"), "llama", 1, 2, 1, None),
             (str(tmp_path / "moe_ep2"), "qwen3_moe", 2, 1, 2, EXPERTS_TP),
             (str(tmp_path / "moe_ep1"), "qwen3_moe", 2, 1, 1, None),
             (str(tmp_path / "qwen2_moe"), "qwen2_moe", 2, 1, 2, None),
             (str(tmp_path / "moe_etp2"), "qwen3_moe", 2, 1, 1, EXPERTS_TP, 2),
             (str(tmp_path / "moe_etp2_whole"), "qwen3_moe", 2, 1, 1, None, 2)]
    spawn_cases(4, cases, tmp_path, _run_case)

