"""Placements: where each target's tensor-parallel placement comes from, and its checks.

A target's placement is the first answer of an ordered tuple of rules, each a small function
`rule(context, target) -> Placement | None` (None: not its case); no answer: replicated.
The order, as data (the tuples `SPLIT_MADE`, then `PLAN_OF_OURS`):

1. The model holds a split someone made. A parameter that already has its local shape
   (`parallelize` kept it a plain local shard: KV heads replicated over groups of ranks, the
   structural rule's layers; or the user's own parallel layers, or DeepSpeed's AutoTP):
   `autotp_fused` (AutoTP's fused qkv/gate_up: a piece of each part, `tp/autotp_fused.py`),
   `autotp_layer` (any other AutoTP layer: its shard-size rule, `tp/autotp.py`: KV heads or
   64-column grains, so a rank may hold more, or nothing), `local_as_planned` (the split a
   plan of ours gives it at full shape, when that gives this local shape: a fused layer's
   "packed" split is told from the structure), `local_plan_style` (a `plan=` style, e.g.
   "packed"), `local_even_share` (the dim where the checkpoint is `k` times larger:
   `k == world` a plain shard, `k` a divisor of world KV-style groups), `local_autotp` (other
   sizes: AutoTP's rule). Then `dtensor` (torch's `parallelize_module`, FSDP2's
   `fully_shard`, `lazyload.tp.parallelize`): this rank's share read off its mesh, any mesh.
2. Only when no rule of 1 answered for any target, world > 1 and `plan != {}`, a plan of
   ours: `user_plan` (`plan=` entries: glob -> style in transformers' `base_model_tp_plan`
   format, or name -> Placement, overriding as transformers merges a `tp_plan` override),
   `model_plan` (the model's own transformers TP plan), `structural` (without one: the
   structural rule by module name, kept only in blocks whose forward can run split). Each
   FP8 scale grid then follows its weight. A `plan=` glob that matches no module or
   parameter is a PlanError.

Uneven splits: a plan of ours refuses them (PlanError before any byte is read); a DTensor's
layout (torch.chunk: the last ranks hold less or nothing) and AutoTP's are followed as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping as MappingT

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
from .styles import (StylePlan, check_plan, experts_of, in_whole_module, model_tp_plan, plan_in_use, style_placement,
                     whole_modules)


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


def dtensor_placement(name: str, tensor: Any, coord: tuple[int, ...] | None = None) -> Placement:
    """This rank's share of a DTensor as explicit spans (or the share of the mesh
    coordinate `coord`): each sharding placement (Shard, _StridedShard, on any mesh dim, in
    mesh order as distribute_tensor applies them) is applied to the index range of the dim
    it splits."""
    from torch.distributed.tensor import Replicate

    mesh, placements, shape = tensor.device_mesh, tensor.placements, tuple(tensor.shape)
    coord = mesh.get_coordinate() if coord is None else coord
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


# ----------------------------------------------------------------------------- the rules
#
# A target's placement is the answer of the first rule that answers (a Placement; None: not
# this rule's case). The rules are data: the two tuples below, in order; a new TP rule is one
# function `rule(context, target) -> Placement | None` and one entry. No rule answers: the
# target is read whole (replicated).


@dataclass(frozen=True)
class Local:
    """A parameter whose model shape is its share of the checkpoint tensor (the mapping's
    mismatched): `full` the checkpoint's shape, `dim` the one dim that differs, `case` the
    rules that read it ("plan": a `plan=` style; "fused" and "autotp": a layer AutoTP made;
    "shape": any other)."""

    full: tuple[int, ...]
    dim: int
    case: str
    style: Any = None


@dataclass(frozen=True)
class Target:
    """A target as the rules see it: its name, its model shape, the module holding it."""

    name: str
    shape: tuple[int, ...]  # the model's (the spec's)
    module: nn.Module
    module_name: str
    attr: str
    local: Local | None = None


@dataclass(frozen=True)
class Rule:
    """`place(context, target) -> Placement | None`; `local_share`: its answers are the
    target's local share (the target then takes the checkpoint's full shape)."""

    name: str
    place: Callable[["Context", Target], Placement | None]
    local_share: bool = False


class Context:
    """What the rules read: the model, the specs, `plan=`, this rank, the world, and what
    several rules share (computed once, when first asked)."""

    def __init__(self, model: nn.Module, specs: MappingT, plan: Any, world: int, rank: int = 0,
                 mismatched: list = ()):
        self.model, self.specs, self.plan, self.world, self.rank = model, specs, plan, world, rank
        self.explicit = plan if isinstance(plan, dict) else {}
        self.mismatched = mismatched
        shapes = {name: (tuple(full), tuple(model_shape)) for name, full, model_shape in mismatched}
        self.targets = [self._target(name, spec, shapes) for name, spec in specs.items()]

    def _target(self, name: str, spec: TargetSpec, mismatched: dict) -> Target:
        module, module_name, attr = owner_of(self.model, name)
        full, model_shape = mismatched.get(name, (None, None))
        if full is None:
            return Target(name, tuple(spec.shape), module, module_name, attr)
        return Target(name, model_shape, module, module_name, attr, _local(self, name, module, full, model_shape))

    @cached_property
    def ours(self) -> "Ours":
        return Ours(self.model, self.plan, self.world)

    @cached_property
    def planned_at_full(self) -> dict[str, Placement]:
        """The split a plan of ours gives each local-shaped tensor at its full shape: a fused
        layer's "packed" split or a KV head group is told from the model's structure, not
        from its local shape alone (which reads as a plain shard)."""
        if self.world == 1 or self.plan == {} or not self.mismatched:
            return {}
        full = {**self.specs, **{n: TargetSpec(n, tuple(c), self.specs[n].dtype) for n, c, _ in self.mismatched}}
        names = {name for name, _, _ in self.mismatched}
        try:
            rule = static_placements(self.model, full, plan_in_use(self.model, self.plan), self.world)
        except PlanError:  # the rule cannot split this model at this world: the shapes alone decide
            return {}
        return {name: placement for name, placement in rule.items() if name in names}


def _local(ctx: Context, name: str, module: nn.Module, full: tuple, model_shape: tuple) -> Local | None:
    if ctx.world == 1 or len(full) != len(model_shape):
        return None
    dims = [d for d, (c, m) in enumerate(zip(full, model_shape)) if c != m]
    if len(dims) != 1:
        return None
    style = StylePlan(ctx.explicit).style_of_param(name) if ctx.explicit else None
    case = ("plan" if style is not None else "fused" if fused_kind(module) is not None
            else "autotp" if is_autotp_layer(module) else "shape")
    return Local(full, dims[0], case, style)


class Ours:
    """What a plan of ours reads off the model once: `plan=` and the model's own TP plan
    (as StylePlans), its heads, the attention group (expert parallel), the blocks whose
    forward cannot run split."""

    def __init__(self, model: nn.Module, plan: Any, world: int):
        self.experts = experts_of(model, plan)
        prefix = getattr(model, "base_model_prefix", "") or ""
        self.user = StylePlan(plan if isinstance(plan, dict) else {}, prefix)
        self.auto = StylePlan(model_tp_plan(model, self.experts), prefix)
        self.heads = model_heads(model)
        # Expert parallel: tensors that do not split over every rank (40 heads at world 64) are
        # split over a divisor group of ranks instead of refused; attention over one group size.
        self.attn = attention_group(self.heads, world) if self.experts == "ep" and self.heads.heads else world
        self.whole = whole_modules(model, self.auto)
        self.structural: dict[str, Placement] | None = None


# --- the model holds a split already made: its local shares, its DTensors


def _autotp_fused(ctx: Context, t: Target) -> Placement | None:
    """AutoTP's fused layers (qkv, gate_up): a piece of each part."""
    if t.local and t.local.case == "fused":
        return fused_placement(t.name, t.module, fused_kind(t.module), t.local.dim, t.local.full, t.shape,
                               ctx.rank, ctx.world)
    return None


def _autotp_layer(ctx: Context, t: Target) -> Placement | None:
    """Any other layer AutoTP made: its shard-size rule alone."""
    if t.local and t.local.case == "autotp":
        return autotp_placement(ctx.model, t.module, t.module_name, t.local.dim, t.local.full, t.shape, ctx.rank,
                                ctx.world)
    return None


def _local_as_planned(ctx: Context, t: Target) -> Placement | None:
    """The split a plan of ours gives it at its full shape, when that gives this local shape."""
    if not (t.local and t.local.case == "shape"):
        return None
    rule = ctx.planned_at_full.get(t.name)
    if rule is not None and rule.kind != "replicate":
        try:
            if local_regions(t.name, t.local.full, rule, ctx.rank, ctx.world)[0] == t.shape:
                return rule
        except PlanError:
            pass
    return None


def _local_plan_style(ctx: Context, t: Target) -> Placement | None:
    """A `plan=` style (e.g. "packed" for a fused layer), when it gives this local shape."""
    if t.local and t.local.case == "plan":
        return _if_local(ctx, t, style_placement(t.local.style, t.name, len(t.local.full), is_conv1d(t.module)))
    return None


def _local_even_share(ctx: Context, t: Target) -> Placement | None:
    """The checkpoint's dim is `world` times the model's (a plain shard) or a divisor of it (KV-style groups)."""
    if t.local and t.local.case == "shape":
        candidate = _even_share(t.local.full[t.local.dim], t.shape[t.local.dim], t.local.dim, ctx.world)
        return None if candidate is None else _if_local(ctx, t, candidate)
    return None


def _local_autotp(ctx: Context, t: Target) -> Placement | None:
    """Other local sizes: AutoTP's uneven shard-size rule (KV heads or 64-column grains)."""
    if t.local and t.local.case == "shape" and _even_share(t.local.full[t.local.dim], t.shape[t.local.dim],
                                                             t.local.dim, ctx.world) is None:
        return autotp_placement(ctx.model, t.module, t.module_name, t.local.dim, t.local.full, t.shape, ctx.rank,
                                ctx.world)
    return None


def _if_local(ctx: Context, t: Target, candidate: Placement) -> Placement | None:
    try:
        local_shape, _ = local_regions(t.name, t.local.full, candidate, ctx.rank, ctx.world)
    except PlanError:
        return None
    return candidate if local_shape == t.shape else None


def _from_mesh(ctx: Context, t: Target) -> Placement | None:
    """A DTensor: this rank's share read off its mesh and placements."""
    tensor = getattr(t.module, t.attr)
    return dtensor_placement(t.name, tensor) if is_dtensor(tensor) else None


# --- a plan of ours, for a model nobody split


def _user_plan(ctx: Context, t: Target) -> Placement | None:
    """A `plan=` entry (glob -> style, or name -> Placement)."""
    style = ctx.ours.user.style_of_param(t.name)
    return None if style is None else _checked(ctx, t, style)


def _model_plan(ctx: Context, t: Target) -> Placement | None:
    """The model's own transformers TP plan, outside the blocks whose forward cannot run split."""
    ours = ctx.ours
    if not ours.auto.entries or in_whole_module(t.name, ours.whole):
        return None
    style = ours.auto.style_of_param(t.name)
    return None if style is None else _checked(ctx, t, style)


def _structural(ctx: Context, t: Target) -> Placement | None:
    """A model without a TP plan: the structural rule by module name, kept only in blocks
    whose forward can run split (`paired_structural`, decided for the whole block over
    the parameters `plan=` does not place)."""
    ours = ctx.ours
    if ours.auto.entries:
        return None
    if ours.structural is None:
        ours.structural = paired_structural(ctx.model, {u.name: p for u in ctx.targets
                                                        if ours.user.style_of_param(u.name) is None
                                                        and (p := _structural_style(ctx, u)) is not None})
    return ours.structural.get(t.name)


def _structural_style(ctx: Context, t: Target) -> tuple[Placement, str] | None:
    kind, parts = structural_style(t.module, t.module_name, t.attr)
    if kind == "packed":
        heads, world = ctx.ours.heads, ctx.world
        if t.module_name.rpartition(".")[2] == "c_attn" and heads.heads and heads.heads % world:
            raise PlanError(f"{t.name}: {heads.heads} attention heads do not split evenly over {world} "
                            "ranks; choose a world that divides the number of heads.")
        return Placement("packed", 1 if is_conv1d(t.module) and t.attr == "weight" else 0, parts=parts), kind
    return None if kind is None else (_checked(ctx, t, kind), kind)


def _checked(ctx: Context, t: Target, style: Any) -> Placement:
    """A style's placement, with the attention-head checks (expert parallel: over divisor groups of ranks)."""
    ours, world = ctx.ours, ctx.world
    placement = style_placement(style, t.name, len(ctx.specs[t.name].shape), is_conv1d(t.module))
    last = t.module_name.rpartition(".")[2]
    if ours.experts == "ep" and _in_attention(ctx.model, t.module_name):
        shape = ctx.specs[t.name].shape
        return _over_groups(attention_checks(t.name, last, placement, ours.heads, ours.attn), shape, world, ours.attn)
    if ours.experts == "ep":
        return _over_groups(placement, ctx.specs[t.name].shape, world)
    return attention_checks(t.name, last, placement, ours.heads, world)


# The order, in one place. First: the model holds a split already made (its local shares, then
# its DTensors: a DTensor's shape is the global one, never a local share of a valid checkpoint).
SPLIT_MADE: tuple[Rule, ...] = (
    Rule("autotp_fused", _autotp_fused, local_share=True),
    Rule("autotp_layer", _autotp_layer, local_share=True),
    Rule("local_as_planned", _local_as_planned, local_share=True),
    Rule("local_plan_style", _local_plan_style, local_share=True),
    Rule("local_even_share", _local_even_share, local_share=True),
    Rule("local_autotp", _local_autotp, local_share=True),
    Rule("dtensor", _from_mesh),
)
# Then, only when no rule above answered for any target, world > 1 and plan != {}: a plan of ours.
PLAN_OF_OURS: tuple[Rule, ...] = (
    Rule("user_plan", _user_plan),
    Rule("model_plan", _model_plan),
    Rule("structural", _structural),
)


def first_answers(rules: tuple[Rule, ...], ctx: Context) -> dict[str, tuple[Rule, Placement]]:
    """Each target's first answer over `rules`, as (rule, placement). Each rule in turn
    answers for the targets no earlier rule answered."""
    answers: dict[str, tuple[Rule, Placement]] = {}
    for rule in rules:
        for t in ctx.targets:
            if t.name not in answers and (placement := rule.place(ctx, t)) is not None:
                answers[t.name] = (rule, placement)
    return answers


# ----------------------------------------------------------------------------- resolution


def static_placements(model: nn.Module, specs: MappingT, plan: Any, world: int) -> dict[str, Placement]:
    """A plan of ours for a model nobody made parallel (`PLAN_OF_OURS`): `plan=` entries, the
    model's own TP plan, the structural rule where it has none."""
    answers = first_answers(PLAN_OF_OURS, Context(model, specs, plan, world))
    return {name: placement for name, (_, placement) in answers.items()}


def _in_attention(model: nn.Module, module_name: str) -> bool:
    """A projection of an attention module: its parent has a q projection."""
    parent = module_name.rpartition(".")[0]
    return any(hasattr(model.get_submodule(parent), q) for q in Q_NAMES) if parent else False


def resolve_placements(model: nn.Module, specs: MappingT, mismatched: list, plan: Any, rank: int,
                       world: int) -> Resolved:
    """Every target's placement for this rank (the rules above), validated here, before any
    byte is read. `mismatched` are the mapping's (name, checkpoint shape, model shape): those
    that are this rank's share of the checkpoint tensor get their full shape."""
    check_rank(rank, world)
    check_plan(model, plan)
    specs = dict(specs)
    ctx = Context(model, specs, plan, world, rank, mismatched)
    answers = first_answers(SPLIT_MADE, ctx)
    placements = {name: placement for name, (_, placement) in answers.items()}
    local_shaped = [name for name, _, _ in mismatched if name in answers and answers[name][0].local_share]
    for name, ckpt_shape, _ in mismatched:
        if name in local_shaped:
            specs[name] = TargetSpec(name, tuple(ckpt_shape), specs[name].dtype)
    if not placements and world > 1 and plan != {}:
        placements.update(static_placements(model, specs, plan_in_use(model, plan), world))
        placements.update(scales_follow_weights(model, specs, placements))
    check_block_splits(model, specs, placements, rank, world)  # transformers' FP8 layers: whole scale blocks
    for name, placement in placements.items():  # fail here, not while reading
        if placement.kind != "replicate":
            local_regions(name, specs[name].shape, placement, rank, world)
    return Resolved(specs, placements, local_shaped)


def _even_share(full: int, local: int, dim: int, world: int) -> Placement | None:
    """A plain shard where the checkpoint's dim is `world` times the model's, KV-style groups
    where it is a divisor of world times."""
    if not local or full % local:
        return None
    k = full // local
    if k == world:
        return Placement("shard", dim)
    return Placement("shard", dim, groups=k) if world % k == 0 else None
