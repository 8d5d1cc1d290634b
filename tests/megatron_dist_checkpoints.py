"""Megatron-Core `torch_dist` checkpoints written by Megatron's own `dist_checkpointing.save`
(megatron-core 0.16.1) on CPU, for the tests: a GPTModel (local layer spec, RMSNorm, SwiGLU,
grouped-query attention, RoPE: a Llama) at TP 2 under gloo, and Megatron's own logits on
fixed tokens to check the conversion against. The MoE ones (a Qwen3-MoE: q/k norms, 4
experts, top-2 routing; a Qwen2-MoE: QKV bias, a gated shared expert, its second layer
dense, so that Megatron saves its layers unstacked) are saved at
TP 2 x EP 2 (SequentialMLP, the local spec's experts), then loaded back by Megatron's own
`dist_checkpointing.load` at TP 1 and converted to transformers' names here, independently
of lazyload, as the bit-exact reference (`reference.pt`).

Megatron calls `torch.cuda.current_device()` and `torch.cuda.synchronize()` while saving,
and its RNG tracker's `fork()` in the forward; on a CPU-only machine the writer replaces
those three with CPU no-ops (nothing written changes). Its router's gating also names
`te_general_gemm`, which 0.16.1 only defines when TransformerEngine imports: set to None,
the router takes its own torch.mm path.

`save_megatron_019` writes the Llama by megatron-core 0.19.2, whose saves have no common.pt
(since 0.17 the common state, Megatron's args with it, is a DCP byte item in the .distcp
files): its wheels are for Python >= 3.12, but the code the writer runs imports on 3.11, so
the wheel is downloaded from PyPI and unpacked onto the sys.path of a writer process of its
own (with triton, which 0.19.2 imports unconditionally)."""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import sys
import tempfile
import zipfile

import torch

from gloo import run_job, spawn_cases

HEADS, GROUPS, HIDDEN, FFN, LAYERS, VOCAB, SEQ = 4, 2, 64, 128, 2, 256, 12
EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 4, 2, 32, 48
HEAD_DIM = {"llama": 16, "qwen3_moe": 8, "qwen2_moe": 16}  # Qwen3-MoE's not HIDDEN // HEADS
_MOE = dict(num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=EXPERT_FFN,
            expert_tensor_parallel_size=1, moe_token_dispatcher_type="allgather")  # alltoall makes CUDA streams
_MEGATRON = {"llama": {}, "qwen3_moe": dict(qk_layernorm=True, **_MOE),  # options beside the Llama's
             "qwen2_moe": dict(add_qkv_bias=True, moe_shared_expert_intermediate_size=SHARED_FFN,  # layer 1 dense:
                               moe_shared_expert_gate=True, moe_layer_freq=[1, 0], **_MOE)}  # saved per layer


def hf_config(kind: str = "llama"):
    """The transformers config of the Megatron model of `kind` (Megatron's top-k then softmax
    over the k is the Qwen MoEs' softmax, top-k, renormalised: norm_topk_prob)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=GROUPS, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, max_position_embeddings=128)
    if kind == "llama":
        return tf.LlamaConfig(**common)
    moe = dict(moe_intermediate_size=EXPERT_FFN, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(head_dim=HEAD_DIM[kind], **moe, **common)
    return tf.Qwen2MoeConfig(shared_expert_intermediate_size=SHARED_FFN, qkv_bias=True, **(moe | {"mlp_only_layers": [1]}),
                             **common)


def tokens() -> torch.Tensor:
    return (torch.arange(SEQ)[None] * 7) % VOCAB


def _cpu_only() -> None:
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)


def _gpt_model(kind: str, tp: int, ep: int = 1, pp: int = 1, etp: int = 1):
    """A Megatron GPTModel of `kind` at TP `tp` (a MoE one at EP `ep`: whole experts per rank,
    each split over `etp` ranks, expert tensor parallel), this rank's pipeline stage of `pp`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = dict(_MEGATRON[kind], expert_model_parallel_size=ep, expert_tensor_parallel_size=etp) \
        if kind != "llama" else {}
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=FFN, use_cpu_initialization=True,
                               normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                               activation_func=torch.nn.functional.silu, params_dtype=torch.float32,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               pipeline_dtype=torch.float32,
                               kv_channels=HEAD_DIM[kind], **options)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if options:  # MoE layers, and dense ones where moe_layer_freq says
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128,
                    position_embedding_type="rope", share_embeddings_and_output_weights=False,
                    parallel_output=False, pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage()).eval()


@torch.no_grad()
def _distinct_values(model) -> None:
    """Norms, routers, gates and experts drawn again: a replicated tensor the same on every
    rank (seeded by its name), an expert by its global index (Megatron's CPU init gives every
    EP rank the same local experts, and every norm ones: a swapped expert or norm would go
    unseen)."""
    from megatron.core import parallel_state

    first = parallel_state.get_expert_model_parallel_rank() * (EXPERTS // parallel_state.get_expert_model_parallel_world_size())
    for name, param in model.named_parameters():
        if ".local_experts." in name:
            expert = first + int(name.split(".local_experts.")[1].split(".")[0])
            name = name.replace(f".local_experts.{expert - first}.", f".expert{expert}.")
        elif param.dim() != 1 and not name.endswith(("router.weight", "gate_weight")):
            continue
        tp_split = name.endswith("linear_qkv.bias")  # each TP rank its rows
        torch.manual_seed(sum(i * ord(c) for i, c in enumerate(name)) + tp_split * parallel_state.get_tensor_model_parallel_rank())
        param.normal_(1.0 if param.dim() == 1 and "layernorm" in name else 0.0, 0.2 if param.dim() == 1 else 0.1)


def _save(case, rank, world):
    from megatron.core import dist_checkpointing, parallel_state

    directory, kind = case
    _cpu_only()
    moe = kind != "llama"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, expert_model_parallel_size=world if moe
                                             else 1, expert_tensor_parallel_size=1 if moe else None)
    model = _gpt_model(kind, world, world if moe else 1)
    if moe:
        _distinct_values(model)
    with torch.no_grad():
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
        logits = model(tokens(), torch.arange(SEQ)[None], mask)
    state = model.sharded_state_dict()
    state["args"] = argparse.Namespace(num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True,
                                       hidden_size=HIDDEN, kv_channels=HEAD_DIM[kind])  # as Megatron-LM saves it
    iteration = os.path.join(directory, "iter_0000100")
    os.makedirs(iteration, exist_ok=True)
    dist_checkpointing.save(state, iteration)
    if rank == 0:
        torch.save(logits, os.path.join(directory, "megatron_logits.pt"))
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("100")
    parallel_state.destroy_model_parallel()
    if moe:
        _save_reference(kind, iteration, os.path.join(directory, "reference.pt"), rank)


def _save_reference(kind: str, iteration: str, out: str, rank: int) -> None:
    """Megatron's own load of the checkpoint at TP 1, EP 1 (every rank a data-parallel
    replica), converted to transformers' names by `_as_transformers`."""
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
    model = _gpt_model(kind, 1)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), iteration)
    loaded.pop("args", None)  # common state, not the model's
    model.load_state_dict(loaded)
    if rank == 0:
        torch.save(_as_transformers(model.state_dict(), HEAD_DIM[kind]), out)
    parallel_state.destroy_model_parallel()


_SAME = (("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
         ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
         ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
         ("input_layernorm.weight", "input_layernorm.weight"),
         ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
         ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
         ("mlp.router.weight", "mlp.gate.weight"),
         ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight"),
         ("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"))
_GATE_UP = (("mlp.linear_fc1.weight", "mlp."), ("mlp.shared_experts.linear_fc1.weight", "mlp.shared_expert."))


def _as_transformers(megatron: dict, head_dim: int) -> dict:
    """A Megatron (TP 1) state dict under transformers' names, by hand."""
    out = {"model.embed_tokens.weight": megatron["embedding.word_embeddings.weight"],
           "model.norm.weight": megatron["decoder.final_layernorm.weight"],
           "lm_head.weight": megatron["output_layer.weight"]}
    for i in range(LAYERS):
        out.update(_layer_as_transformers(megatron, f"decoder.layers.{i}.", f"model.layers.{i}.", head_dim))
    return {k: v.clone() for k, v in out.items()}


def _layer_as_transformers(megatron: dict, m: str, h: str, head_dim: int) -> dict:
    """One layer: qkv rows per query group [q heads, k, v] regrouped, fc1 [gate; up] split
    (dense and shared expert), experts' kept as the fused `gate_up_proj`, stacked."""
    per = HEADS // GROUPS
    out = {h + theirs: megatron[m + ours] for ours, theirs in _SAME if m + ours in megatron}
    for param in ("weight", "bias"):
        fused = megatron.get(m + "self_attention.linear_qkv." + param)
        if fused is not None:
            qkv = fused.view(GROUPS, per + 2, head_dim, *fused.shape[1:])
            for proj, rows in (("q", qkv[:, :per]), ("k", qkv[:, per]), ("v", qkv[:, per + 1])):
                out[f"{h}self_attn.{proj}_proj.{param}"] = rows.reshape(-1, *fused.shape[1:])
    for ours, theirs in _GATE_UP:
        if m + ours in megatron:
            gate, up = megatron[m + ours].chunk(2, 0)
            out[h + theirs + "gate_proj.weight"], out[h + theirs + "up_proj.weight"] = gate, up
    experts = [f"{m}mlp.experts.local_experts.{e}." for e in range(EXPERTS)]
    if experts[0] + "linear_fc1.weight" in megatron:
        out[h + "mlp.experts.gate_up_proj"] = torch.stack([megatron[e + "linear_fc1.weight"] for e in experts])
        out[h + "mlp.experts.down_proj"] = torch.stack([megatron[e + "linear_fc2.weight"] for e in experts])
    return out


def save_megatron(tmp_path, checkpoints: list[tuple[str, str]]) -> None:
    """Megatron-LM-style save directories (tracker + iter_0000100/), each with Megatron's
    logits for `tokens()` beside it (and a MoE one's `reference.pt`), for (directory, kind)
    pairs, all in one spawned job."""
    spawn_cases(2, [(str(d), kind) for d, kind in checkpoints], tmp_path, _save)


MEGATRON_019 = "megatron-core==0.19.2"
TRITON = "triton==3.9.0"  # megatron-core 0.19 imports it at import (its MoE paged-stash kernels)
# The GPU toolchain in triton's wheel (CUDA / ROCm libraries and compilers, the profiler's
# library; 0.5 of its 1 GB unpacked): nothing here compiles a kernel, so it is not unpacked.
_GPU_TOOLCHAIN = re.compile(r"^triton/(backends/[^/]+/(lib|bin|include)/|instrumentation/.*\.so$|_C/libproton\.so$|"
                            r"plugins/)")


def _unpacked_019(site: str) -> None:
    """megatron-core 0.19.2 and triton, from PyPI, unpacked in `site` (a sys.path entry)."""
    wheels = os.path.join(site, ".wheels")
    for spec, options in ((MEGATRON_019, ["--python-version", "3.12"]), (TRITON, [])):
        pip = run_job([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", wheels,
                       *options, spec], timeout=600)
        assert pip.returncode == 0, f"pip download {spec} failed (PyPI unreachable?):\n{pip.stdout}\n{pip.stderr}"
    for wheel in glob.glob(os.path.join(wheels, "*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site, [name for name in archive.namelist() if not _GPU_TOOLCHAIN.match(name)])


def save_megatron_019(directory) -> None:
    """The Llama's save directory (as `save_megatron` writes it) written by megatron-core
    0.19.2, in a process whose sys.path starts with 0.19.2 unpacked (removed after)."""
    with tempfile.TemporaryDirectory(prefix="megatron-core-0.19-") as site:
        _unpacked_019(site)
        directory = os.path.abspath(directory)
        code = (f"import sys; sys.path[:0] = [{site!r}, {os.path.dirname(os.path.abspath(__file__))!r}]\n"
                "from pathlib import Path\n"
                "import megatron.core\n"
                "from megatron_dist_checkpoints import save_megatron\n"
                "assert megatron.core.__version__ == '0.19.2', megatron.core.__version__\n"
                f"save_megatron(Path({os.path.dirname(directory)!r}), [(Path({directory!r}), 'llama')])")
        job = run_job([sys.executable, "-c", code])
        assert job.returncode == 0, f"megatron-core 0.19.2's save failed:\n{job.stdout[-4000:]}\n{job.stderr[-8000:]}"
