"""transformers' tensor-parallel styles and plans: what each style name does to a parameter
(`style_placement`), a glob -> style plan matched as transformers matches it (`StylePlan`),
a model's own plan (`model_tp_plan`, from `_tp_plan`/`base_model_tp_plan`, or the
expert-parallel one), the blocks whose forward cannot run the split a plan gives them
(`whole_modules`), and the checks on a `plan=` argument (`check_plan`)."""
from __future__ import annotations

import re
from typing import Any, Mapping as MappingT

from torch import nn

from ..errors import PlanError
from ..plan import Placement, REPLICATE

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

# Modules whose forward reads a child embedding's rows off its weight, outside the embedding
# (Gemma 4's pad embedding, `language_model.embed_tokens.weight[pad_token_id]`): a vocab-split
# weight would be a shard there, so that embedding stays whole. Class name -> child.
WEIGHT_READERS = {"Gemma4Model": "language_model.embed_tokens"}


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


def default_experts(model: nn.Module) -> str:
    """How `plan=None` splits a model's MoE experts: "ep" (whole experts per rank, as its
    expert-parallel plan does) when its TP plan leaves every expert tensor whole and it has
    an EP plan; else "tp" (the TP plan as it is). transformers 5.25 took the experts out of
    its MoE models' TP plans (they are only in `ep_plan`): followed as it is, every rank
    would read and hold every expert."""
    ep = dict(getattr(model, "ep_plan", None) or {})
    experts = [k for k, v in ep.items() if v in _EXPERTS]
    if not experts:
        return "tp"
    prefix = getattr(model, "base_model_prefix", "") or ""
    is_expert, tp = StylePlan(dict.fromkeys(experts, True), prefix), StylePlan(model_tp_plan(model, "tp"), prefix)
    for name, param in model.named_parameters():
        if is_expert.lookup(name) and style_placement(tp.style_of_param(name) or "replicate", name,
                                                      param.ndim) != REPLICATE:
            return "tp"
    return "ep"


def plan_in_use(model: nn.Module, plan: Any) -> Any:
    """`plan=` with None resolved to the plan it stands for ("tp" or "ep", `default_experts`)."""
    return default_experts(model) if plan is None else plan


def experts_of(model: nn.Module, plan: Any) -> str:
    """How a `plan=` splits the experts: "tp" or "ep" as named; None, or a dict of overrides
    (entries over the default plan), as `default_experts` says."""
    return plan if isinstance(plan, str) else default_experts(model)


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
