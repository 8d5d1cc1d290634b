"""A Megatron-Core model (a GPTModel, or a Megatron wrapper of one: any of Megatron's modules
with `sharded_state_dict()`) as a sync's source: each tensor as its `sharded_state_dict()`
describes it, under the key its `torch_dist` checkpoint would store it by (one per layer:
`decoder.layers.N.<module>`, N the global layer number, the prepended layer axis dropped),
holding the boxes its ShardedTensors give this rank. A TP-split gated `linear_fc1` (a ShardedTensorFactory) is
built as Megatron saves it: the local [gate; up] rows are two boxes of the global [all gate
rows; all up rows]. The names are read as transformers' by the torch_dist reader's own
mapping (`formats.megatron_dist.transformers_names`, applied in `source_index`): the fused
`linear_qkv` de-interleaved per query group, `linear_fc1` split in gate and up, so that each
target rank asks for only the heads and rows it holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ArgumentError
from ..formats.megatron_dist import Heads, config_heads, unwrapped
from ..expr import Box

_STACKED = "decoder.layers."


@dataclass(frozen=True)
class MegatronTensor:
    """A source tensor as a Megatron-Core model describes it: `local`, this rank's tensor (the
    parameter); `shape`, the global one (one layer's); `held`, (box of the global tensor,
    where it starts in `local`) of each ShardedTensor of it this rank holds; `heads`, the
    model's attention heads (to split the fused QKV)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    held: tuple[tuple[Box, tuple[int, ...]], ...]
    heads: Heads


def is_megatron(source: Any) -> bool:
    """A Megatron-Core module: one that describes its shards by `sharded_state_dict()`."""
    return isinstance(source, nn.Module) and callable(getattr(source, "sharded_state_dict", None)) \
        and type(source).__module__.startswith("megatron.")


def megatron_tensors(model: nn.Module) -> dict[str, MegatronTensor]:
    """name (its torch_dist key, per layer) -> this rank's tensor of a Megatron-Core model."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    heads = config_heads(getattr(model, "config", None), f"WeightSync(source={type(model).__name__})")
    out: dict[str, MegatronTensor] = {}
    for value in model.sharded_state_dict().values():
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            shards = built if isinstance(built, list) else [built]
        elif isinstance(value, ShardedTensor):
            shards = [value]
        else:  # a ShardedObject (`_extra_state`): no weights
            continue
        for shard in shards:
            name, shape, held = described_shard(shard, value.data)
            before = out.get(name)
            if before is not None and (before.local is not value.data or before.shape != shape):
                raise ArgumentError(f"WeightSync(source=...): Megatron tensor {name!r} is described twice, by shards "
                                    "of different tensors; lazyload syncs Megatron's own GPT layouts.")
            out[name] = MegatronTensor(value.data, shape, (before.held if before else ()) + (held,), heads)
    return out


def described_shard(shard: Any, local: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[Box, tuple[int, ...]]]:
    """(per-layer name, global shape, box held) of a ShardedTensor whose data is `local` or a
    block of its rows (a factory's)."""
    axes, key = shard.prepend_axis_num, unwrapped(shard.key)  # a wrapper's `module.` left out, as the reader does
    if axes > 1 or (axes == 1 and not key.startswith(_STACKED)):
        raise ArgumentError(f"WeightSync(source=...): Megatron tensor {shard.key!r} has {axes} axes prepended (MoE "
                            "experts: the layer and expert axes); lazyload syncs a dense GPT model's tensors, one "
                            "layer axis at most.")
    name = key if axes == 0 else f"{_STACKED}{shard.global_offset[0]}.{key.removeprefix(_STACKED)}"
    shape, offsets = tuple(shard.global_shape[axes:]), tuple(shard.global_offset[axes:])
    box = tuple((o, o + n) for o, n in zip(offsets, shard.data.shape))
    return name, shape, (box, _start_in(shard.data, local, name))


def _start_in(view: torch.Tensor, local: torch.Tensor, name: str) -> tuple[int, ...]:
    """Where `view` starts in `local`: it is `local` itself, or a block of its rows (a
    factory's chunk of a contiguous tensor)."""
    if view is local:
        return (0,) * local.dim()
    rows, left = divmod(view.storage_offset() - local.storage_offset(), max(local.stride(0), 1))
    if (view.untyped_storage().data_ptr() != local.untyped_storage().data_ptr() or left or not local.is_contiguous()
            or view.stride() != local.stride() or view.shape[1:] != local.shape[1:]
            or not 0 <= rows <= local.shape[0] - view.shape[0]):
        raise ArgumentError(f"WeightSync(source=...): Megatron tensor {name!r}: a shard that is no block of rows of "
                            "its parameter; lazyload syncs the shards Megatron's own layers describe.")
    return (rows,) + (0,) * (local.dim() - 1)
