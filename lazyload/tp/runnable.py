"""A runnable tensor-parallel model: `parallelize` makes a model (best on meta, before
loading) tensor parallel over a 1-D DeviceMesh with torch's DTensor (transformers' own
styles where the model has a TP plan, the structural rule otherwise), and
`auto_parallelize` does it inside `load_into` under torch.distributed. Where each tensor's
share comes from is `placements`; this module only changes the model."""
from __future__ import annotations

import os

from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from ..names import KV_NAMES, PACKED_NAMES, Q_NAMES
from ..plan import Placement, local_regions
from ..targets import model_slots
from .heads import HEAD_COUNTS, Heads, attention_checks, model_heads
from .placements import Resolved, owner_of, plain_specs, static_placements
from .structural import is_conv1d
from .styles import STYLES, StylePlan, check_plan, in_whole_module, model_tp_plan, style_placement, whole_modules


def parallelize(model: nn.Module, mesh: Any, plan: Any = None, *, experts: str = "tp") -> nn.Module:
    """Make `model` (best on meta, before loading) a tensor-parallel model over the 1-D
    DeviceMesh `mesh`, so that after `load_into` its forward gives the world=1 result on every rank.

    transformers models with a TP plan get transformers' own DTensor styles
    (`apply_tensor_parallelism`; experts="ep": `apply_expert_parallelism`), `plan=` (glob ->
    style) overriding the model's plan where it matches, except KV projections when world >
    KV heads: those stay plain tensors holding the rank's KV head group. Tied weights keep one
    tensor with the source's split (see `_tied_aliases`). Models
    without a plan (GPT-2, plain modules) get the structural rule: colwise/packed layers keep
    plain local weights (their output stays local), rowwise layers all-reduce their partial
    output through DTensor (`Partial` -> `Replicate`) before adding their bias. Either way,
    attention modules whose projections are split get the rank's head bookkeeping
    (`_localize_attention`)."""
    world, rank = _mesh_and_plan_checked(model, mesh, plan)
    heads = model_heads(model)
    by_plan = bool(model_tp_plan(model, experts)) and hasattr(model, "_expand_parallel_plan")
    if by_plan:
        recorded = _apply_model_plan(model, mesh, plan, experts, heads, rank, world)
    else:
        recorded = _apply_structural_rule(model, mesh, plan, experts, rank, world)
    if world > 1:
        _localize_attention(model, recorded, heads, world, by_plan=by_plan and bool(heads.heads))
    model._lazyload_placements = {**getattr(model, "_lazyload_placements", {}), **recorded}
    return model


def _mesh_and_plan_checked(model: nn.Module, mesh: Any, plan: Any) -> tuple[int, int]:
    """(world, rank) of a 1-D mesh, once `plan=` is one that `parallelize` can run."""
    if mesh.ndim != 1:
        raise PlanError(f"parallelize takes a 1-D DeviceMesh (got {mesh.ndim}-D); for 2-D layouts apply "
                        "torch's parallelize_module / fully_shard yourself: load_into follows any DTensor.")
    world, rank = mesh.size(), mesh.get_local_rank()
    check_plan(model, plan)
    if isinstance(plan, dict) and any(isinstance(v, Placement) for v in plan.values()):
        raise PlanError("parallelize takes transformers style names in plan=; a lazyload.Placement only says which "
                        "shard a rank reads (load_into(..., shards_only=True)), not how the model runs.")
    return world, rank


def _apply_model_plan(model: nn.Module, mesh: Any, plan: Any, experts: str, heads: Heads, rank: int,
                      world: int) -> dict[str, Placement]:
    """transformers' own DTensor styles for the model's plan (`plan=` overriding it), and
    its expert-parallel styles; returns the placements of the tensors kept plain (KV head
    groups, experts without routing)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    expanded = _expanded_plan(model, plan, experts)
    recorded = _kv_groups_kept_plain(model, expanded, heads, rank, world)
    aliases = _tied_aliases(model, expanded)
    if experts == "ep" and not getattr(model, "ep_plan", None):  # experts without routing (Llama-4)
        recorded |= _parallelize_dense_experts(model, expanded, mesh, rank, world)
    ep = {k: v for k, v in expanded.items() if v in ("grouped_gemm", "ep_dispatch_experts")}
    tp = {k: v for k, v in expanded.items() if k not in ep}
    apply_tensor_parallelism(model, mesh, tp)
    for name, style in tp.items():  # what each module runs as, for holders swapped in later (quant.linear)
        if isinstance(_get(model, name), nn.Module):
            _get(model, name)._lazyload_tp_style = style
    _mark_packed(model, tp)
    _local_params_under_all_reduce(model, tp, mesh)
    if ep:
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        apply_expert_parallelism(model, mesh, mesh, ep)
    for alias, source in aliases.items():  # tied weights: the alias holds the source's tensor again
        module, _, attr = owner_of(model, alias)
        module._parameters[attr] = model.get_parameter(source)
    return recorded


def _kv_groups_kept_plain(model: nn.Module, expanded: dict[str, str], heads: Heads, rank: int,
                          world: int) -> dict[str, Placement]:
    """Whole heads per rank under a model's plan. When world > KV heads, the KV projections'
    entries leave `expanded`: they stay plain tensors holding the rank's KV head group
    (DTensor has no placement for a group of ranks holding the same slice)."""
    if heads.heads and heads.heads % world:
        raise PlanError(f"{type(model).__name__}: {heads.heads} attention heads do not split evenly over "
                        f"{world} ranks; choose a world that divides the number of heads.")
    recorded: dict[str, Placement] = {}
    if heads.kv_heads and world > heads.kv_heads:
        for name in [n for n in expanded if _kv_entry(n)]:
            style = expanded.pop(name)
            if name.endswith((".weight", ".bias")) or isinstance(_get(model, name), torch.Tensor):
                shape = tuple(_get(model, name).shape)
                placement = attention_checks(name, _kv_entry(name), style_placement(style, name, len(shape)),
                                              heads, world)
                recorded[name] = _box(name, shape, placement, rank, world)
    elif heads.kv_heads and heads.kv_heads % world:
        raise PlanError(f"{type(model).__name__}: {heads.kv_heads} KV heads do not split evenly over {world} "
                        "ranks; use a world that divides the number of KV heads, or a multiple of it.")
    return recorded


def _parallelize_dense_experts(model: nn.Module, expanded: dict[str, str], mesh: Any, rank: int,
                               world: int) -> dict[str, Placement]:
    """Experts of a derived expert-parallel plan, run by `_install_dense_experts`: each
    holds its own experts (dim 0) as plain tensors."""
    recorded = {}
    for module_name in _dense_experts(model, expanded):
        module = model.get_submodule(module_name)
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}"
            recorded[name] = _box(name, tuple(param.shape), Placement("shard", 0), rank, world)
        _install_dense_experts(module, mesh, rank, world)
    return recorded


def _apply_structural_rule(model: nn.Module, mesh: Any, plan: Any, experts: str, rank: int,
                           world: int) -> dict[str, Placement]:
    """A model without a transformers plan: the structural rule's (or `plan=`'s) split, as
    plain local Linear/Conv1D weights; rowwise layers sum their partial outputs over the mesh."""
    static = {} if plan == {} else static_placements(model, plain_specs(model), plan or experts, world)
    recorded = {}
    for name, placement in static.items():
        module, _, attr = owner_of(model, name)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise PlanError(f"{name}: parallelize can run only Linear/Conv1D layers sharded in a model without "
                            f"a transformers TP plan; leave this tensor replicated: plan={{{name!r}: 'replicate'}}.")
        recorded[name] = _box(name, tuple(_get(model, name).shape), placement, rank, world)
        if attr == "weight":  # the layer's own size bookkeeping (Conv1D reshapes with nf)
            local = [sum(b - a for a, b in runs) for runs in recorded[name].spans]
            if is_conv1d(module):
                module.nf = local[1]
            else:
                module.out_features, module.in_features = local[0], local[1]
    for module_name, module in model.named_modules():
        weight = static.get(f"{module_name}.weight" if module_name else "weight")
        if weight is not None and weight.kind == "shard" and weight.dim == (0 if is_conv1d(module) else 1):
            install_rowwise(module, mesh)
    return recorded


def _mark_packed(model: nn.Module, expanded: dict[str, str]) -> None:
    """DTensors whose style holds packed parts on a rank (a fused gate|up under "colwise":
    `style_placement`) say so: `_StridedShard` (one slice of each part), not `Shard`, so that
    load_into fills them with each part's slice and `full_tensor()` puts the parts back."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for name, param in list(model.named_parameters()):
        style = expanded.get(name, expanded.get(name.rpartition(".")[0]))
        if not isinstance(param, DTensor) or not isinstance(style, str) or style not in STYLES:
            continue
        placement = style_placement(style, name, param.ndim)
        if placement.kind != "packed" or param.placements != (Shard(placement.dim % param.ndim),):
            continue
        strided = DTensor.from_local(param.to_local(), param.device_mesh,
                                     [_StridedShard(placement.dim % param.ndim, split_factor=placement.parts)],
                                     run_check=False, shape=param.shape, stride=param.stride())
        module, _, attr = owner_of(model, name)
        module._parameters[attr] = nn.Parameter(strided, requires_grad=param.requires_grad)


def _local_params_under_all_reduce(model: nn.Module, expanded: dict[str, str], mesh: Any) -> None:
    """transformers' "all_reduce" sums a module's partial output, but runs the module on its
    own split parameters as DTensors, which only works when they sit in Linear children.
    A module holding split tensors itself (Inkling's shared experts: bare 3-D tensors used
    with bmm) runs them as local shards, as transformers' own "local_params" style does."""
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    for module_name, style in expanded.items():
        if style != "all_reduce":
            continue
        module = model.get_submodule(module_name)
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            ALL_PARALLEL_STYLES["local_params"].install_forward(module, mesh)


def _expanded_plan(model: nn.Module, plan: Any, experts: str) -> dict[str, str]:
    """name -> style for each module and parameter: the model's own plan as transformers
    expands it, `plan=` overriding it where it matches (`plan={}`: nothing)."""
    if plan == {}:
        return {}
    own = model_tp_plan(model, experts)
    expanded = model._expand_parallel_plan(own)
    prefix = getattr(model, "base_model_prefix", "") or ""
    whole = whole_modules(model, StylePlan(own, prefix))  # blocks that cannot run split: their entries dropped
    expanded = {k: v for k, v in expanded.items() if not in_whole_module(k, whole)}
    if not isinstance(plan, dict):
        return _scales_follow_weights(model, expanded)
    user = StylePlan(plan, prefix)
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            style = user.style_of_param(name)
            if style is not None:
                expanded[name] = style
        style = user.lookup(module_name) if module_name else None
        if style is not None:
            expanded[module_name] = style
    return _scales_follow_weights(model, expanded)


def _scales_follow_weights(model: nn.Module, expanded: dict[str, str]) -> dict[str, str]:
    """A quantized tensor's scale grid (`X_scale` beside `X`; `X_scale_inv` in transformers'
    FP8 layers) is split as `X` is: a fused expert tensor's scale would otherwise get its
    module's style (`moe_tp_experts`), which leaves it whole."""
    params = dict(model.named_parameters())
    for name, style in list(expanded.items()):
        for scale in (name + "_scale", name + "_scale_inv"):
            if scale in params and name in params:
                expanded[scale] = style
    return expanded


def _tied_aliases(model: nn.Module, expanded: dict[str, str]) -> dict[str, str]:
    """Tied parameters (lm_head.weight -> embed_tokens.weight): one tensor, so one split.
    Their entries leave `expanded`: the tensor keeps the source's split, and a module
    computing with a replicated tied weight gets no TP hook (transformers' from_pretrained
    ties after sharding, with the same result). Returns alias -> source, to re-tie."""
    _, aliases = model_slots(model)
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
    entries taken out of `expanded`: `_install_dense_experts` runs them instead."""
    names = sorted({n.rpartition(".")[0] for n, style in expanded.items() if style == "grouped_gemm"})
    for name in [n for n in expanded if n in names or n.rpartition(".")[0] in names]:
        del expanded[name]
    return names


def _install_dense_experts(module: nn.Module, mesh: Any, rank: int, world: int) -> None:
    """Experts that take every token for every expert, expert-major and pre-scaled by its
    router score (Llama-4's, which transformers gives no expert-parallel plan): the rank
    runs its own experts' rows, the others' rows are zeros, and the ranks' outputs are
    summed (each row comes from one rank, so the sum is exact)."""
    forward = module.forward

    def ep_forward(hidden_states: torch.Tensor) -> torch.Tensor:
        rows = hidden_states.shape[0] // world
        mine = slice(rank * rows, (rank + 1) * rows)
        out = torch.zeros_like(hidden_states)
        out[mine] = forward(hidden_states[mine])
        return _summed_over(mesh, out)

    module.forward = ep_forward



def _kv_entry(name: str) -> str:
    parts = name.split(".")
    for part in reversed(parts[-2:]):
        if part in KV_NAMES:
            return part
    return ""


def _get(model: nn.Module, name: str) -> Any:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_submodule(name)


def _box(name: str, shape: tuple[int, ...], placement: Placement, rank: int, world: int) -> Placement:
    _, regions = local_regions(name, shape, placement, rank, world)
    spans = []
    for d in range(len(shape)):
        seen = []
        for region in regions:
            if region.global_box[d] not in seen:
                seen.append(region.global_box[d])
        spans.append(tuple(seen))
    return Placement("box", spans=tuple(spans))


QUERY_NAMES = (*sorted(Q_NAMES), "q_b_proj", *(n for n, parts in PACKED_NAMES.items() if parts == 3))
KV_COUNTS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_head_kv")
ATTENTION_WIDTHS = ("all_head_size", "embed_dim", "hidden_size", "split_size", "inner_dim")


def _localize_attention(model: nn.Module, recorded: dict[str, Placement], heads: Heads, world: int,
                        by_plan: bool) -> None:
    """Attention modules whose q/k/v (or fused qkv) projections are split: their head
    bookkeeping becomes the rank's, so that a forward that views or reshapes with it sees
    the rank's heads. Derived from each module's own projections, full and local output
    widths: head counts scale with them (q counts with q, KV counts with k), and a width
    attribute equal to the full q width (`all_head_size`, `embed_dim`, GPT-2's `split_size`)
    becomes the local one."""
    kv = heads.kv_heads or heads.heads
    for module_name, module in model.named_modules():
        query = next((n for n in QUERY_NAMES if isinstance(getattr(module, n, None), nn.Module)), None)
        if query in PACKED_NAMES and _child(module_name, query) + ".weight" not in recorded:
            query = None  # a TP plan's own split of a fused q/k/v (CodeGen's blocks of [q v k]): its own layout
        widths = _out_widths(model, _child(module_name, query), recorded) if query else None
        if (query is None and by_plan and getattr(module, "num_key_value_groups", None) == heads.heads // kv
                and _holds_split_tensors(module, module_name, recorded)):
            # a TP plan's q under another name, grouped as the model's attention: the config's local heads
            # (not Inkling2's block-residual attention, whose own groups are 1)
            module.num_key_value_groups = heads.heads // world // max(1, kv // world)
        if widths is None or widths[0] == widths[1]:
            continue
        (q_full, q_local), (kv_full, kv_local) = widths, widths
        key = next((n for n in KV_NAMES if isinstance(getattr(module, n, None), nn.Module)), None)
        if key is not None:
            kv_full, kv_local = _out_widths(model, _child(module_name, key), recorded)
        for attrs, (full, local) in ((HEAD_COUNTS, (q_full, q_local)), (KV_COUNTS, (kv_full, kv_local))):
            for attr in attrs:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value * local % full == 0:
                    setattr(module, attr, value * local // full)
        for attr in ATTENTION_WIDTHS:
            if getattr(module, attr, None) == q_full:
                setattr(module, attr, q_local)
        groups = getattr(module, "num_key_value_groups", None)
        if isinstance(groups, int) and kv_local:
            # scaled by the q and KV shares, not q_local // kv_local: a q projection may carry
            # more than q (Qwen3-Next's is q and an output gate per head, twice as wide)
            module.num_key_value_groups = max(1, groups * q_local * kv_full // (q_full * kv_local))


def _holds_split_tensors(module: nn.Module, module_name: str, recorded: dict[str, Placement]) -> bool:
    """Whether the plan split any tensor of the module (DBRX's plan splits only lm_head: its
    attention, under names the plan does not give, keeps its bookkeeping)."""
    for name, tensor in module.named_parameters():
        full = _child(module_name, name)
        if full in recorded or any(not p.is_replicate() for p in getattr(tensor, "placements", ())):
            return True
    return False


def _child(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


def _out_widths(model: nn.Module, module_name: str, recorded: dict[str, Placement]) -> tuple[int, int] | None:
    """(full, local) output width of a projection's weight (a fused q/k/v: of one part)."""
    module = model.get_submodule(module_name)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return None
    dim = 1 if is_conv1d(module) else 0
    full, local = weight.shape[dim], weight.shape[dim]
    placement = recorded.get(f"{module_name}.weight")
    if placement is not None and placement.kind == "box":
        local = sum(b - a for a, b in placement.spans[dim])
    elif hasattr(weight, "to_local"):  # DTensor
        local = weight.to_local().shape[dim]
    parts = PACKED_NAMES.get(module_name.rpartition(".")[2], 1)
    return full // parts, local // parts


def install_rowwise(module: nn.Module, mesh: Any) -> None:
    """Row-parallel Linear/Conv1D with a plain local weight: partial product, summed over
    the mesh by DTensor (Partial -> Replicate), then the (replicated) bias added once. A
    QuantizedLinear computes with its dequantized local weight, a torchao holder with its
    local Int8Tensor / Float8Tensor (`quant.linear.to_torchao`)."""
    conv1d = is_conv1d(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = module.dequantized_weight(x.dtype) if hasattr(module, "dequantized_weight") else module.weight
        y = _summed_over(mesh, x @ weight if conv1d else nn.functional.linear(x, weight))
        return y if module.bias is None else y + module.bias

    module.forward = forward


def _summed_over(mesh: Any, partial: torch.Tensor) -> torch.Tensor:
    """The sum over the mesh's ranks of each rank's `partial` (DTensor: Partial -> Replicate)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def default_mesh(world: int, device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda" if device.type == "cuda" else "cpu", (world,))


def _process_group() -> tuple[int, int] | None:
    """(rank, world size) of the initialised default process group, else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


def _made_parallel(resolved: Resolved) -> bool:
    """The model holds its own split already (DTensors, `parallelize`, local shapes)."""
    return bool(resolved.local_shaped) or any(p.kind == "box" for p in resolved.placements.values())


def check_process_group(rank: int, world: int, plan: Any, resolved: Resolved, shards_only: bool) -> None:
    """Under torch.distributed a load of a model nobody made parallel is made runnable, so
    (rank, world) must be the process group's: anything else would leave shards of another
    split in plain tensors, and a forward that runs and returns garbage."""
    group = _process_group()
    if shards_only or world == 1 or plan == {}:
        return
    if group is None:
        _check_launched_alone(rank, world)
        return
    if _made_parallel(resolved):
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


def auto_parallelize(model: nn.Module, plan: Any, rank: int, world: int, device: torch.device,
                     resolved: Resolved, shards_only: bool = False, mesh: Any = None) -> bool:
    """With torch.distributed initialised and (rank, world) this process's, make a model
    that nobody made parallel runnable (`parallelize` on a 1-D mesh of all ranks, or on
    `mesh`, the load's tensor-parallel mesh, when given). False
    when nothing was done: no process group, world 1, `shards_only`, plan={} or a name ->
    Placement plan (local shards only), or a model already parallel (DTensors,
    `parallelize`, local shapes)."""
    group = _process_group()
    if group is None or world == 1 or shards_only or (mesh is None and (rank, world) != group):
        return False
    if plan == {} or (isinstance(plan, dict) and any(isinstance(v, Placement) for v in plan.values())):
        return False
    if _made_parallel(resolved):
        return False
    parallelize(model, default_mesh(world, device) if mesh is None else mesh, plan if isinstance(plan, dict) else None,
                experts=plan if isinstance(plan, str) else "tp")
    return True
