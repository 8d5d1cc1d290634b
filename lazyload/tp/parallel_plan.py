"""How a model will run split, planned with every check before it changes: the
`ParallelPlan` is data (styles per name, tensors kept as plain local shards, row-parallel
modules, tied aliases); `runnable.make_runnable` carries it out and decides nothing.

A load plans it in the planner (`parallel_plan_of_load`, a field of the LoadPlan), so that a
split the model cannot run (a sharded LayerNorm in a model without a transformers plan, heads
that do not divide, tied weights split two ways) is a PlanError before any byte is read and
before any module changes, and `lazyload plan` refuses what `load_into` refuses. The
placements come from the planner's own (`resolve_placements`); the transformers styles from
the model's plan, expanded here once, as transformers expands it."""
from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from ..names import KV_NAMES
from ..plan import Placement, local_regions
from ..targets import model_slots
from .heads import Heads, attention_checks, model_heads
from .placements import Resolved
from .structural import is_conv1d
from .styles import (StylePlan, check_plan, experts_of, in_whole_module, model_tp_plan, style_placement,
                     whole_modules)

EXPERT_STYLES = ("grouped_gemm", "ep_dispatch_experts")


@dataclass(frozen=True)
class ParallelPlan:
    """How the model runs split over a 1-D mesh of `world` ranks (this one `rank`).

    - `by_plan`: transformers' own styles (`styles`, `expert_styles`); else the structural
      rule (plain local Linear/Conv1D shards, `rowwise` modules summing their outputs).
    - `styles`: parameter or module name -> transformers TP style (`apply_tensor_parallelism`).
    - `expert_styles`: name -> expert-parallel style (`apply_expert_parallelism`).
    - `dense_experts`: experts modules without routing, each rank running its own experts.
    - `aliases`: tied alias -> source: the alias holds the source's tensor again afterwards.
    - `plain`: tensors held as plain local shards -> the box the rank holds.
    - `rowwise`: modules (structural rule) whose partial outputs are summed over the mesh.
    - `heads`: the model's q and KV head counts (the attention bookkeeping)."""

    rank: int
    world: int
    by_plan: bool
    styles: dict[str, str]
    expert_styles: dict[str, str]
    dense_experts: tuple[str, ...]
    aliases: dict[str, str]
    plain: dict[str, Placement]
    rowwise: tuple[str, ...]
    heads: Heads


def uses_model_plan(model: nn.Module, experts: str) -> bool:
    """Whether transformers' own styles make `model` parallel (it has a TP plan), else the structural rule."""
    return bool(model_tp_plan(model, experts)) and hasattr(model, "_expand_parallel_plan")


def plan_parallel(model: nn.Module, plan: Any, experts: str, rank: int, world: int,
                  placements: dict[str, Placement], scales: dict[str, str] | None = None,
                  aliases: dict[str, str] | None = None) -> ParallelPlan:
    """The ParallelPlan of `model` (before any module changes). `plan`: `plan=`'s glob ->
    style overrides (None: the model's own); `placements`: the planned placements (the
    structural rule's split); `scales`: quantized tensor -> the scale parameter the load's
    swap puts beside it (split as its tensor is); `aliases`: the model's tied alias -> source
    names (`targets.model_slots`), when the caller has them."""
    check_plan(model, plan)
    if isinstance(plan, dict) and any(isinstance(v, Placement) for v in plan.values()):
        raise PlanError("parallelize takes transformers style names in plan=; a lazyload.Placement only says which "
                        "shard a rank reads (load_into(..., shards_only=True)), not how the model runs.")
    heads = model_heads(model)
    if uses_model_plan(model, experts):
        aliases = model_slots(model)[1] if aliases is None else aliases
        return _by_model_plan(model, plan, experts, rank, world, heads, scales or {}, aliases)
    plain, rowwise = _structural(model, placements, rank, world)
    return ParallelPlan(rank, world, False, {}, {}, (), {}, plain, rowwise, heads)


def _by_model_plan(model: nn.Module, plan: Any, experts: str, rank: int, world: int, heads: Heads,
                   scales: dict[str, str], aliases: dict[str, str]) -> ParallelPlan:
    """transformers' own styles for the model's plan (`plan=` overriding it), its
    expert-parallel styles, and the tensors kept plain (KV head groups, experts without routing)."""
    expanded = _expanded_plan(model, plan if isinstance(plan, dict) else None, experts, scales)
    plain = _kv_groups_kept_plain(model, expanded, heads, rank, world, experts)
    aliases = _tied_aliases(model, expanded, aliases)
    dense: list[str] = []
    if experts == "ep" and not getattr(model, "ep_plan", None):  # experts without routing (Llama-4)
        dense = _dense_experts(model, expanded)
        for module_name in dense:
            for attr, param in model.get_submodule(module_name).named_parameters(recurse=False):
                name = f"{module_name}.{attr}"
                plain[name] = box_of(name, tuple(param.shape), Placement("shard", 0), rank, world)
    ep = {k: v for k, v in expanded.items() if v in EXPERT_STYLES}
    tp = {k: v for k, v in expanded.items() if k not in ep}
    return ParallelPlan(rank, world, True, tp, ep, tuple(dense), aliases, plain, (), heads)


def _structural(model: nn.Module, placements: dict[str, Placement], rank: int,
                world: int) -> tuple[dict[str, Placement], tuple[str, ...]]:
    """A model without a transformers plan: the planned split as plain local Linear/Conv1D
    shards (their boxes), and the modules whose row-parallel products are summed."""
    plain, rowwise = {}, []
    for name, placement in placements.items():
        if placement.kind == "replicate":
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise PlanError(f"{name}: parallelize can run only Linear/Conv1D layers sharded in a model without "
                            f"a transformers TP plan; leave this tensor replicated: plan={{{name!r}: 'replicate'}}.")
        plain[name] = box_of(name, tuple(getattr(module, attr).shape), placement, rank, world)
        if attr == "weight" and placement.kind == "shard" and placement.dim == (0 if is_conv1d(module) else 1):
            rowwise.append(module_name)
    return plain, tuple(rowwise)


def _kv_groups_kept_plain(model: nn.Module, expanded: dict[str, str], heads: Heads, rank: int,
                          world: int, experts: str = "tp") -> dict[str, Placement]:
    """Whole heads per rank under a model's plan. When world > KV heads, the KV projections'
    entries leave `expanded`: they stay plain tensors holding the rank's KV head group
    (DTensor has no placement for a group of ranks holding the same slice)."""
    if heads.heads and heads.heads % world:
        hint = ("; under plan='ep' attention split over groups of ranks is planned, but lazyload makes no such "
                "model runnable: load with shards_only=True and build the runnable layout yourself, or choose a "
                "world that divides the number of heads." if experts == "ep" else
                "; choose a world that divides the number of heads.")
        raise PlanError(f"{type(model).__name__}: {heads.heads} attention heads do not split evenly over "
                        f"{world} ranks{hint}")
    kept: dict[str, Placement] = {}
    if heads.kv_heads and world > heads.kv_heads:
        params = dict(model.named_parameters())
        for name in [n for n in expanded if kv_entry(n)]:
            style = expanded.pop(name)
            if name in params:  # a module's entry, or a scale the load's swap adds, has no tensor to record
                shape = tuple(params[name].shape)
                placement = attention_checks(name, kv_entry(name), style_placement(style, name, len(shape)),
                                             heads, world)
                kept[name] = box_of(name, shape, placement, rank, world)
    elif heads.kv_heads and heads.kv_heads % world:
        raise PlanError(f"{type(model).__name__}: {heads.kv_heads} KV heads do not split evenly over {world} "
                        "ranks; use a world that divides the number of KV heads, or a multiple of it.")
    return kept


def _expanded_plan(model: nn.Module, plan: dict | None, experts: str, scales: dict[str, str]) -> dict[str, str]:
    """name -> style for each module and parameter: the model's own plan as transformers
    expands it, `plan=` overriding it where it matches (`plan={}`: nothing)."""
    if plan == {}:
        return {}
    own = model_tp_plan(model, experts)
    expanded = model._expand_parallel_plan(own)
    prefix = getattr(model, "base_model_prefix", "") or ""
    whole = whole_modules(model, StylePlan(own, prefix))  # blocks that cannot run split: their entries dropped
    expanded = {k: v for k, v in expanded.items() if not in_whole_module(k, whole)}
    if plan is not None:
        user = StylePlan(plan, prefix)
        for module_name, module in model.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                if (style := user.style_of_param(name)) is not None:
                    expanded[name] = style
            if module_name and (style := user.lookup(module_name)) is not None:
                expanded[module_name] = style
    return _scales_follow_weights(model, expanded, scales)


def _scales_follow_weights(model: nn.Module, expanded: dict[str, str], scales: dict[str, str]) -> dict[str, str]:
    """A quantized tensor's scale grid (`X_scale` beside `X`; `X_scale_inv` in transformers'
    FP8 layers, held by the model or swapped in by the load: `scales`) is split as `X` is: a
    fused expert tensor's scale would otherwise get its module's style (`moe_tp_experts`),
    which leaves it whole."""
    params = dict(model.named_parameters())
    for name, style in list(expanded.items()):
        if name not in params:
            continue
        for scale in (name + "_scale", name + "_scale_inv"):
            if scale in params or scales.get(name) == scale:
                expanded[scale] = style
    return expanded


def _tied_aliases(model: nn.Module, expanded: dict[str, str], aliases: dict[str, str]) -> dict[str, str]:
    """Tied parameters (lm_head.weight -> embed_tokens.weight): one tensor, so one split.
    Their entries leave `expanded`: the tensor keeps the source's split, and a module
    computing with a replicated tied weight gets no TP hook (transformers' from_pretrained
    ties after sharding, with the same result). Returns alias -> source, to re-tie."""
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = {a: s for a, s in aliases.items() if a in params and s in params}
    for alias, source in aliases.items():
        style, source_style = expanded.pop(alias, None), expanded.get(source)
        if source_style is None:
            module_name = alias.rpartition(".")[0]
            if module_name in expanded and expanded[module_name] not in ("replicate", "replicated"):
                del expanded[module_name]
        elif style is not None:
            ndim = params[source].ndim
            if style_placement(style, alias, ndim) != style_placement(source_style, source, ndim):
                raise PlanError(f"{alias} is tied to {source}, but the plan splits them differently ({style!r} vs "
                                f"{source_style!r}); give both the same split in plan=, or untie them "
                                "(tie_word_embeddings=False).")
    return aliases


def _dense_experts(model: nn.Module, expanded: dict[str, str]) -> list[str]:
    """The expert modules of a derived expert-parallel plan (`fused_experts_plan`), their
    entries taken out of `expanded`: they run as dense experts instead."""
    names = sorted({n.rpartition(".")[0] for n, style in expanded.items() if style == "grouped_gemm"})
    for name in [n for n in expanded if n in names or n.rpartition(".")[0] in names]:
        del expanded[name]
    return names


def kv_entry(name: str) -> str:
    """The KV projection (`k_proj`, `v_proj`, ...) a module or parameter name is, or sits in; "" if none."""
    parts = name.split(".")
    for part in reversed(parts[-2:]):
        if part in KV_NAMES:
            return part
    return ""


def box_of(name: str, shape: tuple[int, ...], placement: Placement, rank: int, world: int) -> Placement:
    """`placement` resolved for `rank` as an explicit box (per dim, the global runs held)."""
    _, regions = local_regions(name, shape, placement, rank, world)
    spans = []
    for d in range(len(shape)):
        seen = []
        for region in regions:
            if region.global_box[d] not in seen:
                seen.append(region.global_box[d])
        spans.append(tuple(seen))
    return Placement("box", spans=tuple(spans))


def process_group() -> tuple[int, int] | None:
    """(rank, world size) of the initialised default process group, else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def made_parallel(resolved: Resolved) -> bool:
    """The model holds its own split already (DTensors, `parallelize`, local shapes)."""
    return bool(resolved.local_shaped) or any(p.kind == "box" for p in resolved.placements.values())


def check_process_group(rank: int, world: int, plan: Any, resolved: Resolved, shards_only: bool) -> None:
    """Under torch.distributed a load of a model nobody made parallel is made runnable, so
    (rank, world) must be the process group's: anything else would leave shards of another
    split in plain tensors, and a forward that runs and returns garbage."""
    group = process_group()
    if shards_only or world == 1 or plan == {}:
        return
    if group is None:
        _check_launched_alone(rank, world)
        return
    if made_parallel(resolved):
        return
    if (rank, world) != group:
        raise PlanError(
            f"load_into(model, rank={rank}, world={world}) under a process group of {group[1]} processes (this is "
            f"rank {group[0]}): the model would hold shards of another split, in plain tensors that no forward can "
            "run. Pass rank=dist.get_rank(), world=dist.get_world_size() for a runnable tensor-parallel model, or "
            "shards_only=True to load only this rank's shards (e.g. a TP group inside a larger world).")


def _check_launched_alone(rank: int, world: int) -> None:
    """A launcher (torchrun) that started several processes, none of which initialised
    torch.distributed: each would hold plain shards and run a forward over them alone,
    computing garbage (logits of its share of the vocabulary) with no error."""
    launched = os.environ.get("WORLD_SIZE", "")
    if launched.isdigit() and int(launched) > 1:
        raise PlanError(
            f"load_into(model, rank={rank}, world={world}) in one of {launched} processes a launcher started "
            "(WORLD_SIZE), but torch.distributed is not initialised: the model would hold this rank's shards in "
            "plain tensors and its forward would compute garbage. Call torch.distributed.init_process_group() "
            "before load_into for a runnable tensor-parallel model, or pass shards_only=True to load only this "
            "rank's shards.")


def parallel_plan_of_load(model: nn.Module, plan: Any, rank: int, world: int, resolved: Resolved,
                          scales: dict[str, str], aliases: dict[str, str], shards_only: bool, on_mesh: bool,
                          preview: bool) -> ParallelPlan | None:
    """The ParallelPlan a load carries out: with torch.distributed initialised and (rank,
    world) this process's (or `on_mesh`: the load's tensor-parallel mesh), a model nobody made
    parallel is made runnable. `preview` (`lazyload plan`, the writer) plans it as such a
    load would. None when nothing is to be done: world 1, `shards_only`, plan={} or a name ->
    Placement plan (local shards only), or a model already parallel (DTensors, local shapes)."""
    if world == 1 or shards_only or made_parallel(resolved):
        return None
    if not (preview or on_mesh or process_group() == (rank, world)):
        return None
    if plan == {} or (isinstance(plan, dict) and any(isinstance(v, Placement) for v in plan.values())):
        return None
    return plan_parallel(model, plan if isinstance(plan, dict) else None, experts_of(model, plan),
                         rank, world, resolved.placements, scales, aliases)


def local_width(placement: Placement | None, tensor: torch.Tensor, dim: int) -> int:
    """The rank's width of `tensor` along `dim`: its planned box, a DTensor's local shard, or whole."""
    if placement is not None and placement.kind == "box":
        return sum(b - a for a, b in placement.spans[dim])
    if hasattr(tensor, "to_local"):  # DTensor
        return tensor.to_local().shape[dim]
    return tensor.shape[dim]
