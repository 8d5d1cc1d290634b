"""Placements: where each target's tensor-parallel placement comes from, and its checks.

Placements are found, per parameter, in this order:

1. The parameter is a DTensor (torch's `parallelize_module`, FSDP2's `fully_shard`, or
   `lazyload.tp.parallelize`): this rank's share is read off its mesh and placements,
   on any mesh.
2. The parameter already has a local shape (`parallelize` kept it a plain local shard: KV
   heads replicated over groups of ranks, the structural rule's layers; or the user's own
   parallel layers): the split case 3's rule gives it, when that gives this local shape (a
   fused layer's "packed" split is told from the structure, not the shape); else the sharded
   dim is the one where the checkpoint is `k` times larger (`k == world`: plain shard; `k` a
   divisor of world: KV-style groups); `plan=` may say "packed" for fused ones. Other local
   sizes, and every layer DeepSpeed's AutoTP made, are read by AutoTP's shard-size rule
   (`tp/autotp.py`: KV heads or 64-column grains, so a rank may hold more, or nothing);
   its fused layers (qkv, gate_up) as a piece of each part (`tp/autotp_fused.py`).
3. Only for a model that none of the above made parallel, and only when world > 1: the
   model's own transformers TP plan (or, without one, a structural rule by module name),
   with `plan=` entries (glob -> style in transformers' `base_model_tp_plan` format, or
   name -> Placement) overriding it where they match, as transformers merges a `tp_plan`
   override. `plan={}` shards nothing. A `plan=` glob that matches no module or parameter
   is a PlanError.

Uneven splits: a plan of ours refuses them (PlanError before any byte is read); a DTensor's
layout (torch.chunk: the last ranks hold less or nothing) and AutoTP's are followed as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping as MappingT

import numpy as np
import torch
from torch import nn

from ..errors import PlanError
from ..names import Q_NAMES
from ..plan import Placement, REPLICATE, check_rank, local_regions
from ..quant.fp8_modules import check_block_splits, scales_follow_weights
from ..targets import TargetSpec, is_dtensor
from .autotp import autotp_placement, is_autotp_layer
from .autotp_fused import fused_kind, fused_placement
from .heads import attention_checks, attention_group, divisor_group, model_heads
from .structural import is_conv1d, paired_structural, structural_style
from .styles import StylePlan, check_plan, in_whole_module, model_tp_plan, style_placement, whole_modules


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


def plain_specs(model: nn.Module) -> dict:
    """Every parameter as a target of its own shape and dtype (a model with nothing mapped yet)."""
    return {n: TargetSpec(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()}


def static_placements(model: nn.Module, specs: MappingT, plan: Any, world: int) -> dict[str, Placement]:
    """Case 3: a plan of ours for a model nobody made parallel: the model's own TP plan (or
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
    explicit = plan if isinstance(plan, dict) else {}
    for name, tensor in tensors.items():
        if is_dtensor(tensor):
            placements[name] = dtensor_placement(name, tensor)

    local_shaped = []
    rule = _rule_for_local_shapes(model, specs, mismatched, plan, world)
    for name, ckpt_shape, model_shape in mismatched:
        placement = _local_shape_placement(model, name, tuple(ckpt_shape), tuple(model_shape), explicit, rank, world,
                                           rule.get(name))
        if placement is not None:
            placements[name] = placement
            specs[name] = TargetSpec(name, tuple(ckpt_shape), specs[name].dtype)
            local_shaped.append(name)

    parallel_already = bool(placements)
    if not parallel_already and world > 1 and plan != {}:
        placements.update(static_placements(model, specs, plan if plan is not None else "tp", world))
        placements.update(scales_follow_weights(model, specs, placements))
    check_block_splits(model, specs, placements, rank, world)  # transformers' FP8 layers: whole scale blocks
    for name, placement in placements.items():  # fail here, not while reading
        if placement.kind != "replicate":
            local_regions(name, specs[name].shape, placement, rank, world)
    return Resolved(specs, placements, local_shaped)


def _tensor_of(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name), attr)


def _rule_for_local_shapes(model: nn.Module, specs: MappingT, mismatched: list, plan: Any,
                           world: int) -> dict[str, Placement]:
    """For a model that holds local shards (`parallelize` made it so, or the user's own
    layers), the split the rule of case 3 gives each such tensor at its full shape: a
    fused layer's "packed" split or a KV head group is told from the model's structure, not
    from its local shape alone (which reads as a plain shard)."""
    if world == 1 or plan == {} or not mismatched:
        return {}
    full = {**specs, **{name: TargetSpec(name, tuple(ckpt), specs[name].dtype) for name, ckpt, _ in mismatched}}
    names = {name for name, _, _ in mismatched}
    try:
        rule = static_placements(model, full, plan if plan is not None else "tp", world)
    except PlanError:  # the rule cannot split this model at this world: the shapes alone decide
        return {}
    return {name: placement for name, placement in rule.items() if name in names}


def _local_shape_placement(model, name, ckpt_shape, model_shape, explicit, rank, world,
                           rule: Placement | None = None) -> Placement | None:
    """Case 2: a model tensor that is this rank's share of the checkpoint tensor: the rule's
    split when it gives this local shape, else the even split (or KV-style groups, or the
    `plan=` style), else DeepSpeed AutoTP's uneven one; a layer AutoTP made is read by
    AutoTP's rule alone."""
    if world == 1 or len(ckpt_shape) != len(model_shape):
        return None
    dims = [d for d, (c, m) in enumerate(zip(ckpt_shape, model_shape)) if c != m]
    if len(dims) != 1:
        return None
    module, module_name, _ = owner_of(model, name)
    style = StylePlan(explicit).style_of_param(name) if explicit else None
    fused = fused_kind(module) if style is None else None
    if fused is not None:  # AutoTP's fused layers: a piece of each part
        return fused_placement(name, module, fused, dims[0], ckpt_shape, model_shape, rank, world)
    if style is None and is_autotp_layer(module):
        return autotp_placement(model, module, module_name, dims[0], ckpt_shape, model_shape, rank, world)
    if style is None and rule is not None and rule.kind != "replicate":
        try:
            if local_regions(name, ckpt_shape, rule, rank, world)[0] == model_shape:
                return rule
        except PlanError:
            pass
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
