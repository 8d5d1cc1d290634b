"""Placements: where each target's tensor-parallel placement comes from, and its checks.

Placements are found, per parameter, in this order:

1. The parameter is a DTensor (torch's `parallelize_module`, FSDP2's `fully_shard`, or
   `lazyload.parallel.parallelize`): this rank's share is read off its mesh and placements,
   on any mesh.
2. The parameter was given a placement by `parallelize` (KV heads replicated over groups of
   ranks, GPT-2's fused Conv1D): a plain local tensor with a recorded share.
3. The parameter already has a local shape (the user's own parallel layers): the sharded dim
   is the one where the checkpoint is `k` times larger (`k == world`: plain shard; `k` a
   divisor of world: KV-style groups); `plan=` may say "packed" for fused ones. Other local
   sizes, and every layer DeepSpeed's AutoTP made, are read by AutoTP's shard-size rule
   (`autotp.py`: KV heads or 64-column grains, so a rank may hold more, or nothing).
4. Only for a model that none of the above made parallel, and only when world > 1: the
   model's own transformers TP plan (or, without one, a structural rule by module name),
   with `plan=` entries (glob -> style in transformers' `base_model_tp_plan` format, or
   name -> Placement) overriding it where they match, as transformers merges a `tp_plan`
   override. `plan={}` shards nothing. A `plan=` glob that matches no module or parameter
   is a PlanError.

Uneven splits: a plan of ours refuses them (PlanError before any byte is read); a DTensor's
layout (torch.chunk: the last ranks hold less or nothing) and AutoTP's are followed as they are.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping as MappingT

import numpy as np
import torch
from torch import nn

from .tp.autotp import autotp_placement, is_autotp_layer
from .errors import PlanError
from .targets import TargetSpec, is_dtensor
from .plan import Placement, REPLICATE, check_rank, local_regions

# transformers' style names -> what the style does to a parameter (see
# transformers/distributed/tensor_parallel.py, expert_parallel.py). Module-level styles
# (hooks only) leave parameters replicated.
_COLWISE = {"colwise", "colwise_gather_output", "colwise_rep", "local_colwise", "gather"}
_SPLIT_OUTPUT = {"colwise", "local_colwise"}  # colwise styles whose output stays split on the rank
_ROWWISE = {"rowwise", "rowwise_split_input", "rowwise_rep", "local_rowwise"}
_SPLIT_INPUT_ROWWISE = {"rowwise", "local_rowwise"}  # fed the rank's split activations
_PACKED_COLWISE = {"packed_colwise", "local_packed_colwise"}
_PACKED_ROWWISE = {"packed_rowwise", "local_packed_rowwise"}
_EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
_EXPERTS = {"grouped_gemm", "ep_experts"}  # whole experts per rank: dim 0 of the 3D tensors
_MODULE_ONLY = {"replicate", "local", "isolated", "sequence_parallel", "replicated_with_grad_allreduce",
                "all_reduce", "mla_kv_a_proj", "moe_tp_experts", "moe_identity_expert", "local_params",
                "ep_dispatch_experts", "ep_router", "ep_router_no_local", "moe_identity", "replicated"}
STYLES = _COLWISE | _ROWWISE | _PACKED_COLWISE | _PACKED_ROWWISE | set(_EMBEDDING) | _EXPERTS | _MODULE_ONLY

# Structural rule (plain nn.Module, and transformers models without a TP plan, e.g. GPT-2):
# by the last name of a Linear / Conv1D module.
COLWISE_NAMES = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "w1", "w3", "wq", "wk", "wv",
                 "query", "key", "value", "fc_in", "dense_h_to_4h", "q_lin", "k_lin", "v_lin", "lin1",
                 "Wq", "Wk", "Wv", "Wi", "w_0", "w_1",  # Wq...: CTRL; Wi: ModernBERT; w_0, w_1: CPM-Ant
                 "proj_up_gate", "proj_up"}  # xLSTM's feed-forward
ROWWISE_NAMES = {"o_proj", "down_proj", "fc2", "c_proj", "w2", "wo", "out_proj", "fc_out", "dense_4h_to_h", "out_lin",
                 "lin2", "Wo", "w_out", "proj_down"}
PACKED_NAMES = {"c_attn": 3, "qkv_proj": 3, "W_pack": 3, "gate_up_proj": 2}
KV_NAMES = {"k_proj", "v_proj", "key", "value", "wk", "wv", "k_lin", "v_lin", "Wk", "Wv"}
Q_NAMES = {"q_proj", "query", "wq", "q_lin", "Wq"}  # q_lin, k_lin, ...: XLM
# `dense` layers by their parent's name: BERT's intermediate/output, CTRL's attention output
BERT_DENSE = {"intermediate": "colwise", "output": "rowwise", "multi_head_attention": "rowwise"}
BERT_BLOCKS = {"self", "intermediate", "output", "w_in"}  # a parent one level below its block (w_in: CPM-Ant)
# Attention whose forward takes its width from outside the module, so it cannot run on a
# rank's heads: the structural rule keeps these whole. BigBird swaps in an attention built
# from the config for inputs too short for block-sparse; TrOCR reshapes its output to its
# input's width.
WHOLE_ATTENTION = {"BigBirdSelfAttention", "BigBirdBlockSparseAttention", "TrOCRAttention"}
# Modules whose forward reads a child embedding's rows off its weight, outside the embedding
# (Gemma 4's pad embedding, `language_model.embed_tokens.weight[pad_token_id]`): a vocab-split
# weight would be a shard there, so that embedding stays whole. Class name -> child.
WEIGHT_READERS = {"Gemma4Model": "language_model.embed_tokens"}
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")  # an attention module's q head count


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")  # transformers' GPT-2 layer: weight [in, out]


# ----------------------------------------------------------------------------- styles


def style_placement(style: str | Placement, name: str, ndim: int, conv1d: bool = False) -> Placement:
    """What a transformers TP style does to the parameter `name` (of `ndim` dims)."""
    if isinstance(style, Placement):
        return style
    if style not in STYLES:
        raise PlanError(f"{name}: unknown tensor-parallel style {style!r}; use one of {sorted(STYLES)} "
                        "or a lazyload.Placement.")
    attr = name.rpartition(".")[2]
    if style in _MODULE_ONLY or ndim == 0:
        return REPLICATE
    out_dim, in_dim = (1, 0) if conv1d else (max(ndim - 2, 0), ndim - 1)
    if style in _COLWISE:
        if style in _SPLIT_OUTPUT and _fused_gate_up(name):
            # The forward chunks a fused gate|up output in two, so each rank must hold its
            # gates and its ups; transformers gets there by splitting the checkpoint's sources
            # before converting them (Inkling's interleaved w13 under "colwise").
            return Placement("packed", 0 if ndim == 1 else out_dim, parts=2)
        return Placement("shard", 0 if ndim == 1 else out_dim)
    if style in _ROWWISE:
        return REPLICATE if attr == "bias" or ndim == 1 else Placement("shard", in_dim)
    if style in _PACKED_COLWISE:
        return Placement("packed", 0 if ndim == 1 else out_dim, parts=2)
    if style in _PACKED_ROWWISE:
        return REPLICATE if ndim == 1 else Placement("packed", in_dim, parts=2)
    if style in _EMBEDDING:
        return Placement("shard", min(_EMBEDDING[style], ndim - 1))
    return Placement("shard", 0)  # experts


def _fused_gate_up(name: str) -> bool:
    """A fused gate|up projection: experts' 3-D `gate_up_proj`, or a `gate_up_proj` layer's tensors."""
    parts = name.split(".")
    return parts[-1] == "gate_up_proj" or (len(parts) > 1 and parts[-2] == "gate_up_proj")


def _glob_regex(pattern: str) -> re.Pattern:
    # transformers' plans write one layer number as "*"; fnmatch's "*" would also span dots.
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


class StylePlan:
    """A glob -> style plan (transformers' format) matched the way transformers does: a
    parameter takes its own entry, else its module's; keys may omit the base model prefix."""

    def __init__(self, plan: MappingT[str, Any], prefix: str = ""):
        self.entries = [(_glob_regex(k), v) for k, v in plan.items()]
        if prefix:
            self.entries += [(_glob_regex(f"{prefix}.{k}"), v) for k, v in plan.items()
                             if not k.startswith(prefix + ".")]

    def lookup(self, name: str) -> Any | None:
        for regex, style in self.entries:
            if regex.match(name):
                return style
        return None

    def matches_any(self, names: list[str]) -> bool:
        return any(regex.match(n) for n in names for regex, _ in self.entries)

    def style_of_param(self, name: str) -> Any | None:
        style = self.lookup(name)
        if style is None and "." in name:
            style = self.lookup(name.rpartition(".")[0])
        return style


def model_tp_plan(model: nn.Module, experts: str = "tp") -> dict[str, str]:
    """The transformers model's own plan (glob -> style, prefixes applied as transformers
    does), {} for models without one. experts="ep": the expert-parallel plan replaces the
    TP one on the experts (whole experts per rank)."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    if not plan and config is not None:
        prefix = getattr(model, "base_model_prefix", "")
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        if prefix and hasattr(model, prefix):
            base = {f"{prefix}.{k}": v for k, v in base.items()}
        plan = base
    plan = {k: v for k, v in plan.items() if not _normed_embedding(model, k, v)}
    if experts == "ep":
        ep = dict(getattr(model, "ep_plan", None) or {}) or fused_experts_plan(model)
        if not ep:
            raise PlanError(f"{type(model).__name__} has no expert-parallel plan (ep_plan) and no fused 3-D "
                            "experts; pass plan= with 'grouped_gemm' on the experts' tensors.")
        is_expert = re.compile(rf"(?:{'|'.join(_glob_regex(k).pattern[1:-1] for k in ep)})(?:\..+)?$").match
        plan = {k: v for k, v in plan.items() if not is_expert(k)} | ep
    elif experts != "tp":
        raise PlanError(f"experts must be 'tp' (tensor parallel inside every expert) or 'ep' (whole experts "
                        f"per rank), got {experts!r}.")
    return plan


def whole_modules(model: nn.Module, auto: StylePlan) -> set[str]:
    """Modules whose forward cannot run on the split a transformers plan gives them, so its
    entries on them and their layers are not applied (the structural rule's kept-whole blocks,
    for a plan): sparse MLPs, blocks with an inner rowwise layer, embeddings read outside."""
    if not auto.entries:
        return set()
    whole = _sparse_mlps(model)
    widths: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and auto.lookup(name) in _SPLIT_INPUT_ROWWISE:
            widths.setdefault(name.rpartition(".")[0], set()).add(module.out_features)
    # Rowwise layers of different widths fed the rank's split activations in one block (Doge's
    # dt_proj, one value per KV head for the dynamic mask, beside o_proj): only one is the
    # block's output; the other's summed full width meets the rank's heads inside the forward.
    # (A rowwise layer that splits a whole input itself, MuseSpark's pre_expert_proj, is not.)
    whole |= {block for block, w in widths.items() if len(w) > 1}
    for name, module in model.named_modules():
        child = WEIGHT_READERS.get(type(module).__name__)
        if child is not None:
            whole.add(f"{name}.{child}" if name else child)
    return whole


def in_whole_module(name: str, whole: set[str]) -> bool:
    """A module or parameter name that is, or sits in (module, or its layer), a whole module."""
    parent = name.rpartition(".")[0]
    return bool(whole) and bool({name, parent, parent.rpartition(".")[0]} & whole)


def _sparse_mlps(model: nn.Module) -> set[str]:
    """MLPs whose forward keeps only their largest activations by statistics over the whole
    intermediate width (Gemma 3n's Gaussian top-k, `activation_sparsity` > 0): a rank holding
    part of that width would keep others."""
    def sparse(m: nn.Module) -> bool:
        value = getattr(m, "activation_sparsity", 0)
        return isinstance(value, (int, float)) and value > 0

    if not any(sparse(m) for m in model.modules()):  # the common case: one cheap pass
        return set()
    return {name for name, m in model.named_modules() if sparse(m)}


def _normed_embedding(model: nn.Module, glob: str, style: Any) -> bool:
    """A vocab-split embedding whose own forward runs a child with weights (Inkling's norm)
    on the looked-up rows: the rows are summed across ranks only after that forward, so
    the child would see partial rows. transformers adds "embedding_rowwise" to any
    `embed_tokens` that is an nn.Embedding; such a one stays replicated."""
    if style not in _EMBEDDING or "*" in glob:
        return False
    try:
        module = model.get_submodule(glob)
    except AttributeError:
        return False
    return isinstance(module, nn.Embedding) and any(True for c in module.children() for _ in c.parameters())


def fused_experts_plan(model: nn.Module) -> dict[str, str]:
    """An expert-parallel plan for a model that has none (Llama-4): whole experts per rank
    on its fused 3-D expert tensors (`...experts.gate_up_proj`, dim 0 the expert)."""
    return {re.sub(r"\.\d+\.", ".*.", name): "grouped_gemm" for name, p in model.named_parameters()
            if p.ndim == 3 and name.rpartition(".")[0].rpartition(".")[2] == "experts"}


def divisor_group(world: int, fits) -> int:
    """The largest divisor g of `world` for which fits(g) (1 always divides)."""
    return max(g for g in range(1, world + 1) if world % g == 0 and (g == 1 or fits(g)))


def _over_groups(placement: Placement, shape: tuple[int, ...], world: int, group: int | None = None) -> Placement:
    """Expert parallel: a tensor-parallel placement that does not split over `world` ranks
    is split over the largest divisor group of ranks it fits (`group` when given: attention
    heads), each group of world // g consecutive ranks holding the same slice; 1: replicated."""
    if placement.kind not in ("shard", "packed") or placement.groups:
        return placement
    size = shape[placement.dim] // placement.parts
    g = group if group is not None else divisor_group(world, lambda g: size % g == 0)
    if g == world:
        return placement
    return REPLICATE if g == 1 else Placement(placement.kind, placement.dim, placement.parts, groups=g)


def attention_group(heads: Heads, world: int) -> int:
    """Expert parallel: the ranks attention is split over, the largest divisor of `world`
    that whole q heads and their KV heads fit (Llama-4-Maverick's 40 heads: 8 at world 64)."""
    kv = heads.kv_heads or heads.heads
    return divisor_group(world, lambda g: heads.heads % g == 0 and (kv % g == 0 or g % kv == 0))


PLAN_CHOICES = ("None (the model's own TP plan, else the structural rule), 'tp' (the same), 'ep' (whole "
                "experts per rank), {} (nothing sharded) or a dict of overrides: glob -> transformers style "
                "(e.g. {'model.embed_tokens': 'replicate'}) or name -> lazyload.Placement")


def check_plan(model: nn.Module, plan: Any) -> None:
    """A `plan=` argument that lazyload can follow: its type, each style, and each glob
    matching at least one module or parameter of `model`."""
    if plan is None or plan in ("tp", "ep"):
        return
    if not isinstance(plan, dict):
        raise PlanError(f"plan={plan!r} is not a plan; pass {PLAN_CHOICES}.")
    for key, style in plan.items():
        if not isinstance(key, str):
            raise PlanError(f"plan= key {key!r} is not a string; keys are module or parameter names (globs).")
        if not isinstance(style, Placement) and style not in STYLES:
            raise PlanError(f"plan[{key!r}] = {style!r} is neither a lazyload.Placement nor a transformers "
                            f"tensor-parallel style; use one of {sorted(STYLES)}.")
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers()]
    known = set(names)

    def matches(key: str) -> bool:
        if "*" not in key:  # an exact name: a set lookup, not a scan (plans may name every tensor)
            return key in known or f"{prefix}.{key}" in known
        return StylePlan({key: None}, prefix).matches_any(names)

    unmatched = [k for k in plan if not matches(k)]
    if unmatched:
        example = next((n for n in names if re.search(r"\.\d+\.", n)), names[0] if names else "")
        raise PlanError(f"plan= entries match no module or parameter of {type(model).__name__}: "
                        f"{', '.join(map(repr, unmatched))}. Keys are names like {example!r} ('*' stands for one "
                        "name part, e.g. a layer number; the base model prefix may be left out).")


def structural_style(module: nn.Module, module_name: str, attr: str) -> tuple[str | None, int]:
    """(style, packed parts) for a parameter by its module's name: input projections
    colwise, output projections rowwise; anything else (routers, norms, embeddings) None."""
    if not (isinstance(module, nn.Linear) or is_conv1d(module)) or attr not in ("weight", "bias"):
        return None, 1
    parent, _, last = module_name.rpartition(".")
    if last in PACKED_NAMES:
        return "packed", PACKED_NAMES[last]
    if last in COLWISE_NAMES:
        return "colwise", 1
    if last in ROWWISE_NAMES:
        return "rowwise", 1
    if last == "dense":  # BERT's layout: intermediate.dense feeds output.dense; attention.self feeds attention.output.dense
        return BERT_DENSE.get(parent.rpartition(".")[2]), 1
    return None, 1


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D layer (Conv1D stores its weight [in, out])."""
    rows, cols = module.weight.shape
    return (rows, cols) if is_conv1d(module) else (cols, rows)


def _block_of(module_name: str) -> str:
    """The module whose colwise layers feed its rowwise ones: a projection's parent, or for
    BERT's layout (`attention.self.query` -> `attention.output.dense`, `intermediate.dense` ->
    `output.dense`) its grandparent."""
    parent = module_name.rpartition(".")[0]
    owner, _, parent_last = parent.rpartition(".")
    return owner if parent_last in BERT_BLOCKS else parent


def paired_structural(model: nn.Module, structural: dict[str, tuple[Placement, str]]) -> dict[str, Placement]:
    """The structural rule's placements that a forward can run: in each block, colwise
    layers must feed a rowwise one (that sums their partial products back) and a rowwise layer
    must be fed by colwise ones; an attention block must split into whole heads on equal q/k/v
    parts (`attention_split`). A block that fails stays replicated, whole: its math is then
    the world=1 math (Mamba's in_proj/out_proj, MPT's unsharded Wqkv, GPTBigCode's
    multi-query c_attn)."""
    blocks: dict[str, dict[str, set]] = {}
    for name, (_, style) in structural.items():
        module_name = name.rpartition(".")[0]
        side = "row" if style == "rowwise" else "col"
        blocks.setdefault(_block_of(module_name), {"col": set(), "row": set()})[side].add(module_name)
    keep, fused = set(), set()
    for block in blocks.values():
        if block["col"] and block["row"] and all(attention_split(model, m) and not _full_width_sibling(model, m)
                                                 and not _in_whole_attention(model, m) for m in block["col"]):
            widths = _mlp_widths(model, block)
            if widths is None:
                keep |= block["col"] | block["row"]
            elif list(widths.values()) == [2]:  # one colwise layer twice as wide: gate|up fused
                keep |= block["col"] | block["row"]
                fused |= set(widths)
    out = {}
    for name, (placement, _) in structural.items():
        module_name = name.rpartition(".")[0]
        if module_name in fused and placement.kind == "shard":
            placement = Placement("packed", placement.dim, parts=2)
        if module_name in keep:
            out[name] = placement
    return out


def _in_whole_attention(model: nn.Module, module_name: str) -> bool:
    return type(model.get_submodule(module_name.rpartition(".")[0])).__name__ in WHOLE_ATTENTION


def _mlp_widths(model: nn.Module, block: dict[str, set]) -> dict[str, int] | None:
    """An MLP block's colwise layers whose output is not as wide as its rowwise layer's
    input, with their width in units of that input (Moshi's fc1: gate and up fused, twice
    fc2's input: 2); None when all match, or for an attention block (q/k/v widths differ
    by design)."""
    attention_names = Q_NAMES | KV_NAMES | PACKED_NAMES.keys()
    if any(m.rpartition(".")[2] in attention_names for m in block["col"]):
        return None
    inputs = {features(model.get_submodule(m))[0] for m in block["row"]}
    if len(inputs) != 1:
        return {m: 0 for m in block["col"]}  # nothing consistent to split: kept whole
    (row_in,) = inputs
    outputs = {m: features(model.get_submodule(m))[1] for m in block["col"]}
    odd = {m: out / row_in for m, out in outputs.items() if out != row_in}
    return odd or None


def _full_width_sibling(model: nn.Module, module_name: str) -> bool:
    """A colwise projection beside a module holding a tensor as wide as its full output
    (BitNet's attn_sub_norm / ffn_sub_norm: a norm over the whole width between the colwise
    and the rowwise layer), which a rank holding part of that width cannot compute. Where the
    output is as wide as the input, a decoder layer's own norms (OPT's fc1/fc2 beside
    final_layer_norm: a parent that also holds a block of projections) are the residual
    stream's, not the colwise output's."""
    parent_name, _, last = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    projection = getattr(parent, last)
    in_width, width = features(projection)
    width //= PACKED_NAMES.get(last, 1)
    others = {name: child for name, child in parent.named_children()
              if structural_style(child, f"{parent_name}.{name}", "weight")[0] is None}
    if width == in_width and any(structural_style(m, n, "weight")[0] for child in others.values()
                                 for n, m in child.named_modules()):
        return False
    return any(width in p.shape for child in others.values() for p in child.parameters())


def attention_shape(module: nn.Module) -> tuple[int | None, int | None]:
    """(q heads, head dim) an attention module says it has, None where it does not say."""
    heads = next((getattr(module, a) for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)), None)
    head_dim = next((getattr(module, a) for a in ("head_dim", "attention_head_size", "head_size")
                     if isinstance(getattr(module, a, None), int)), None)
    return heads, head_dim


def attention_split(model: nn.Module, module_name: str) -> bool:
    """False for a fused q/k/v projection whose parts are not the three equal ones a packed
    split assumes (GPTBigCode's multi-query c_attn: q heads, then one k and one v head)."""
    last = module_name.rpartition(".")[2]
    if PACKED_NAMES.get(last) != 3:
        return True
    module = model.get_submodule(module_name)
    heads, head_dim = attention_shape(model.get_submodule(module_name.rpartition(".")[0]))
    out = features(module)[1]
    return heads is None or head_dim is None or out == 3 * heads * head_dim


# ----------------------------------------------------------------------------- heads


@dataclass(frozen=True)
class Heads:
    heads: int | None
    kv_heads: int | None


def model_heads(model: nn.Module) -> Heads:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = _config_value(config, "num_attention_heads") or _config_value(config, "n_head")
    kv = _config_value(config, "num_key_value_heads") or heads
    return Heads(heads, kv)


def _config_value(config: Any, name: str) -> Any:
    """A config's global value: a heterogeneous config (per-layer overrides, Dots3 Note)
    refuses to read a per-layer field globally; its stored global value is taken instead."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return vars(config).get(name)


def attention_checks(name: str, last: str, placement: Placement, heads: Heads, world: int) -> Placement:
    """Whole heads per rank: q heads must divide; KV heads divide, or are replicated in
    groups when world > KV heads (rank r holds head r // (world // kv))."""
    if placement.kind == "replicate" or world == 1:
        return placement
    if last in Q_NAMES and heads.heads and heads.heads % world:
        raise PlanError(f"{name}: {heads.heads} attention heads do not split evenly over {world} ranks; "
                        "choose a world that divides the number of heads.")
    if last in KV_NAMES and heads.kv_heads:
        kv = heads.kv_heads
        if world > kv:
            if world % kv:
                raise PlanError(f"{name}: {kv} KV heads cannot be replicated evenly over {world} ranks; use a "
                                "world that is a multiple or a divisor of the number of KV heads.")
            return Placement(placement.kind, placement.dim, placement.parts, groups=kv)
        if kv % world:
            raise PlanError(f"{name}: {kv} KV heads do not split evenly over {world} ranks; use a world that "
                            "divides the number of KV heads (or a multiple of it).")
    return placement


# ----------------------------------------------------------------------------- DTensors


def _runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """Consecutive index runs as (start, stop) spans: [0, 1, 2, 5, 6] -> ((0, 3), (5, 7))."""
    ix = np.asarray(indices, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ix) != 1) + 1
    starts = ix[np.concatenate(([0], breaks))]
    stops = ix[np.concatenate((breaks - 1, [len(ix) - 1]))] + 1
    return tuple(zip(starts.tolist(), stops.tolist()))


def dtensor_placement(name: str, tensor: Any) -> Placement:
    """This rank's share of a DTensor as explicit spans: each sharding placement (Shard,
    _StridedShard, on any mesh dim, in mesh order as distribute_tensor applies them) is
    applied to the index range of the dim it splits."""
    from torch.distributed.tensor import Replicate

    mesh, placements, shape = tensor.device_mesh, tensor.placements, tuple(tensor.shape)
    coord = mesh.get_coordinate()
    if coord is None:
        raise PlanError(f"{name}: this rank is not in the parameter's device mesh {mesh}; load on the mesh's ranks.")
    indices: list[list[int] | None] = [None] * len(shape)  # None: the whole dim, unsplit
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not (hasattr(p, "dim") and hasattr(p, "_split_tensor")):  # Shard, _StridedShard
            raise PlanError(f"{name}: DTensor placement {p} on mesh dim {mesh_dim} holds no slice of the checkpoint "
                            "tensor (only Shard and Replicate can be loaded); redistribute it after loading.")
        dim = p.dim % len(shape)
        one_d = type(p)(0, **({"split_factor": p.split_factor} if hasattr(p, "split_factor") else {}))
        current = torch.arange(shape[dim]) if indices[dim] is None else torch.tensor(indices[dim], dtype=torch.long)
        chunks, _ = one_d._split_tensor(current, mesh.size(mesh_dim), with_padding=False, contiguous=True)
        mine = coord[mesh_dim]
        indices[dim] = chunks[mine].tolist() if mine < len(chunks) else []
    return Placement("box", spans=tuple(((0, n),) if ix is None else _runs(ix) if ix else ((0, 0),)
                                        for ix, n in zip(indices, shape)))


# ----------------------------------------------------------------------------- resolution


@dataclass
class Resolved:
    specs: dict            # name -> TargetSpec with full (checkpoint) shapes
    placements: dict[str, Placement]
    local_shaped: list[str]  # parameters whose model shape was already the local one


def owner_of(model: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), module_name, attr


def static_placements(model: nn.Module, specs: MappingT, plan: Any, world: int) -> dict[str, Placement]:
    """Case 4: a plan of ours for a model nobody made parallel: the model's own TP plan (or
    the structural rule where it has none), `plan=` entries overriding it where they match."""
    experts = plan if isinstance(plan, str) else "tp"
    prefix = getattr(model, "base_model_prefix", "") or ""
    user = StylePlan(plan if isinstance(plan, dict) else {}, prefix)
    auto = StylePlan(model_tp_plan(model, experts), prefix)
    heads = model_heads(model)
    # Expert parallel: tensors that do not split over every rank (40 heads at world 64) are
    # split over a divisor group of ranks instead of refused; attention over one group size.
    attn = attention_group(heads, world) if experts == "ep" and heads.heads else world
    whole = whole_modules(model, auto)
    out = {}
    structural: dict[str, tuple[Placement, str]] = {}  # name -> (placement, style), checked in pairs at the end
    for name, spec in specs.items():
        module, module_name, attr = owner_of(model, name)
        conv1d = is_conv1d(module)
        last = module_name.rpartition(".")[2]
        style = user.style_of_param(name)
        by_rule = style is None and not auto.entries
        if style is None and auto.entries:
            style = None if in_whole_module(name, whole) else auto.style_of_param(name)
        elif style is None:
            kind, parts = structural_style(module, module_name, attr)
            if kind == "packed":
                dim = 1 if conv1d and attr == "weight" else 0
                placement = Placement("packed", dim, parts=parts)
                if last == "c_attn" and heads.heads and heads.heads % world:
                    raise PlanError(f"{name}: {heads.heads} attention heads do not split evenly over {world} "
                                    "ranks; choose a world that divides the number of heads.")
                structural[name] = (placement, kind)
                continue
            style = kind
        if style is None:
            continue
        placement = style_placement(style, name, len(spec.shape), conv1d)
        if experts == "ep" and _in_attention(model, module_name):
            placement = _over_groups(attention_checks(name, last, placement, heads, attn), spec.shape, world, attn)
        elif experts == "ep":
            placement = _over_groups(placement, spec.shape, world)
        else:
            placement = attention_checks(name, last, placement, heads, world)
        if by_rule:
            structural[name] = (placement, style)
        else:
            out[name] = placement
    return out | paired_structural(model, structural)


def _in_attention(model: nn.Module, module_name: str) -> bool:
    """A projection of an attention module: its parent has a q projection."""
    parent = module_name.rpartition(".")[0]
    return any(hasattr(model.get_submodule(parent), q) for q in Q_NAMES) if parent else False


def resolve_placements(model: nn.Module, specs: MappingT, mismatched: list, plan: Any, rank: int,
                       world: int) -> Resolved:
    """Every target's placement for this rank (see the module docstring), validated here,
    before any byte is read. `mismatched` are the mapping's (name, checkpoint shape, model
    shape): those that are this rank's share of the checkpoint tensor get their full shape."""
    check_rank(rank, world)
    check_plan(model, plan)
    specs = dict(specs)
    placements: dict[str, Placement] = {}
    tensors = {name: _tensor_of(model, name) for name in specs}
    recorded = getattr(model, "_lazyload_placements", {})
    explicit = plan if isinstance(plan, dict) else {}
    for name, tensor in tensors.items():
        if is_dtensor(tensor):
            placements[name] = dtensor_placement(name, tensor)
        elif name in recorded:
            placements[name] = recorded[name]

    local_shaped = []
    for name, ckpt_shape, model_shape in mismatched:
        placement = _local_shape_placement(model, name, tuple(ckpt_shape), tuple(model_shape), explicit, rank, world)
        if placement is not None:
            placements[name] = placement
            specs[name] = TargetSpec(name, tuple(ckpt_shape), specs[name].dtype)
            local_shaped.append(name)

    parallel_already = bool(placements)
    if not parallel_already and world > 1 and plan != {}:
        placements.update(static_placements(model, specs, plan if plan is not None else "tp", world))
    for name, placement in placements.items():  # fail here, not while reading
        if placement.kind != "replicate":
            local_regions(name, specs[name].shape, placement, rank, world)
    return Resolved(specs, placements, local_shaped)


def _tensor_of(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name), attr)


def _local_shape_placement(model, name, ckpt_shape, model_shape, explicit, rank, world) -> Placement | None:
    """Case 3: a model tensor that is this rank's share of the checkpoint tensor: the even
    split (or KV-style groups, or the `plan=` style), else DeepSpeed AutoTP's uneven one; a
    layer AutoTP made is read by AutoTP's rule alone."""
    if world == 1 or len(ckpt_shape) != len(model_shape):
        return None
    dims = [d for d, (c, m) in enumerate(zip(ckpt_shape, model_shape)) if c != m]
    if len(dims) != 1:
        return None
    module, module_name, _ = owner_of(model, name)
    style = StylePlan(explicit).style_of_param(name) if explicit else None
    if style is None and is_autotp_layer(module):
        return autotp_placement(model, module, module_name, dims[0], ckpt_shape, model_shape, rank, world)
    if style is not None:
        candidate = style_placement(style, name, len(ckpt_shape), is_conv1d(module))
    else:
        candidate = _even_share(ckpt_shape[dims[0]], model_shape[dims[0]], dims[0], world)
    if candidate is None:
        return autotp_placement(model, module, module_name, dims[0], ckpt_shape, model_shape, rank, world)
    try:
        local_shape, _ = local_regions(name, ckpt_shape, candidate, rank, world)
    except PlanError:
        return None
    return candidate if local_shape == model_shape else None


def _even_share(full: int, local: int, dim: int, world: int) -> Placement | None:
    """A plain shard where the checkpoint's dim is `world` times the model's, KV-style groups
    where it is a divisor of world times."""
    if not local or full % local:
        return None
    k = full // local
    if k == world:
        return Placement("shard", dim)
    return Placement("shard", dim, groups=k) if world % k == 0 else None
