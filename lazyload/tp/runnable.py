"""A runnable tensor-parallel model: `make_runnable` carries out a `ParallelPlan`
(`tp/parallel_plan.py`: planned, with its checks, before the model changes) over a 1-D
DeviceMesh with torch's DTensor (transformers' own styles where the model has a TP plan,
plain local shards and summed row-parallel outputs otherwise) and gives attention modules
the rank's head bookkeeping; `parallelize` plans and makes runnable in one call, for a model
made parallel before `load_into`. Nothing here decides a split, and nothing is left on the
model for a later load to read: that load reads the split off the tensors themselves."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import PlanError
from ..names import KV_NAMES, PACKED_NAMES, Q_NAMES
from ..plan import Placement
from .heads import HEAD_COUNTS, Heads
from .parallel_plan import ParallelPlan, local_width, plan_parallel, uses_model_plan
from .placements import owner_of, plain_specs, static_placements
from .structural import is_conv1d
from .styles import STYLES, experts_of, style_placement


def parallelize(model: nn.Module, mesh: Any, plan: Any = None, *, experts: str | None = None) -> nn.Module:
    """Make `model` (best on meta, before loading) a tensor-parallel model over the 1-D
    DeviceMesh `mesh`, so that after `load_into` its forward gives the world=1 result on every rank.

    transformers models with a TP plan get transformers' own DTensor styles
    (`apply_tensor_parallelism`; experts="ep": `apply_expert_parallelism`), `plan=` (glob ->
    style) overriding the model's plan where it matches, except KV projections when world >
    KV heads: those stay plain tensors holding the rank's KV head group. Tied weights keep one
    tensor with the source's split. Models without a plan (GPT-2, plain modules) get the
    structural rule: colwise/packed layers keep plain local weights (their output stays
    local), rowwise layers all-reduce their partial output through DTensor (`Partial` ->
    `Replicate`) before adding their bias. Either way, attention modules whose projections
    are split get the rank's head bookkeeping. `experts`: "tp" (the model's TP plan as it
    is), "ep" (whole experts per rank) or None, as `load_into`'s default plan: "ep" where the
    model's TP plan leaves its experts whole and it has an expert-parallel plan."""
    if mesh.ndim != 1:
        raise PlanError(f"parallelize takes a 1-D DeviceMesh (got {mesh.ndim}-D); for 2-D layouts apply "
                        "torch's parallelize_module / fully_shard yourself: load_into follows any DTensor.")
    world, rank = mesh.size(), mesh.get_local_rank()
    experts = experts or experts_of(model, plan)
    placements = {}
    if not uses_model_plan(model, experts) and plan != {}:
        placements = static_placements(model, plain_specs(model), plan or experts, world)
    make_runnable(model, mesh, plan_parallel(model, plan, experts, rank, world, placements))
    return model


def make_runnable(model: nn.Module, mesh: Any, parallel: ParallelPlan) -> None:
    """Carry out `parallel` on `model` over the 1-D `mesh`: styles applied, plain shards'
    layers given their local sizes, row-parallel outputs summed, head bookkeeping localised."""
    if parallel.by_plan:
        _apply_styles(model, mesh, parallel)
    else:
        _apply_plain_shards(model, mesh, parallel)
    if parallel.world > 1:
        _localize_attention(model, parallel.plain, parallel.heads, parallel.world,
                            by_plan=parallel.by_plan and bool(parallel.heads.heads))
    for name, box in parallel.plain.items():  # the split is held by the tensors themselves, for any later load
        _hold_local(model, name, box)


def _hold_local(model: nn.Module, name: str, box: Placement) -> None:
    """The plain tensor `name` becomes the rank's part of it (`box`): a meta tensor of the
    local shape, or a real one's own values there."""
    module, _, attr = owner_of(model, name)
    tensor = getattr(module, attr)
    local = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    for d, runs in enumerate(box.spans):
        if runs != ((0, local.shape[d]),):
            local = torch.cat([local.narrow(d, a, b - a) for a, b in runs], dim=d)
    if isinstance(tensor, nn.Parameter):
        module._parameters[attr] = nn.Parameter(local, requires_grad=tensor.requires_grad)
    else:
        module._buffers[attr] = local


def _apply_styles(model: nn.Module, mesh: Any, parallel: ParallelPlan) -> None:
    """transformers' own DTensor styles and expert-parallel styles; dense experts run their
    own experts; tied aliases hold their source's tensor again."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    for module_name in parallel.dense_experts:
        _install_dense_experts(model.get_submodule(module_name), mesh, parallel.rank, parallel.world)
    apply_tensor_parallelism(model, mesh, parallel.styles)
    _mark_packed(model, parallel.styles)
    _local_params_under_all_reduce(model, parallel.styles, mesh)
    if parallel.expert_styles:
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        apply_expert_parallelism(model, mesh, mesh, parallel.expert_styles)
    for alias, source in parallel.aliases.items():  # tied weights: the alias holds the source's tensor again
        module, _, attr = owner_of(model, alias)
        module._parameters[attr] = model.get_parameter(source)


def _apply_plain_shards(model: nn.Module, mesh: Any, parallel: ParallelPlan) -> None:
    """The structural rule: each sharded layer's own size bookkeeping becomes the rank's
    (Conv1D reshapes with `nf`); row-parallel layers sum their partial products."""
    for name, box in parallel.plain.items():
        module, _, attr = owner_of(model, name)
        if attr == "weight":
            local = [sum(b - a for a, b in runs) for runs in box.spans]
            if is_conv1d(module):
                module.nf = local[1]
            else:
                module.out_features, module.in_features = local[0], local[1]
    for module_name in parallel.rowwise:
        install_rowwise(model.get_submodule(module_name), mesh)


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
    full, local = weight.shape[dim], local_width(recorded.get(f"{module_name}.weight"), weight, dim)
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
