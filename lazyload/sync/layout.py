"""The source side of a sync: each tensor a source holds (a module's state dict or a state
dict: plain tensors, DTensor TP, FSDP2 `fully_shard`, both over a 2-D mesh) as its global
shape, dtype and the boxes this rank holds, read off the DTensor placements alone; or a
Megatron-Core model's, as its `sharded_state_dict()` describes them (`megatron_source.py`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ArgumentError
from ..expr import Box, box_numel, full_box
from ..plan import box_regions
from ..targets import is_dtensor, local_tensor
from ..tp.placements import dtensor_placement
from .megatron_source import MegatronTensor, is_megatron, megatron_tensors


@dataclass(frozen=True)
class Held:
    """One box of a source tensor this rank holds: `box` of the global tensor, found at
    `local_start` of the rank's local tensor."""

    box: Box
    local_start: tuple[int, ...]


@dataclass(frozen=True)
class SourceTensor:
    """A source tensor as every rank sees it: name, dtype name, global shape, one rank's boxes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    held: tuple[Held, ...]
    # a Megatron-Core source's tensor (named by Megatron's checkpoint key, read as transformers'
    # tensors by the torch_dist reader's mapping): the model's attention heads; None otherwise
    megatron: Any = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.rpartition(".")[2])


def source_tensors(source: Any) -> dict[str, torch.Tensor | MegatronTensor]:
    """name -> tensor of a source: a module's state dict (FSDP2's holds its sharded DTensors),
    a Megatron-Core model's sharded tensors, or a state dict as given. Asked at every sync: a
    trainer may re-register its parameters."""
    if source is None:
        return {}
    if is_megatron(source):
        return megatron_tensors(source)
    tensors = source.state_dict(keep_vars=True) if isinstance(source, nn.Module) else source
    if not hasattr(tensors, "items"):
        raise ArgumentError(f"WeightSync(source=...) takes an nn.Module or a state dict of tensors, got "
                            f"{type(source).__name__}.")
    wrong = next((name for name, t in tensors.items() if not isinstance(t, torch.Tensor)), None)
    if wrong is not None:
        raise ArgumentError(f"WeightSync(source=...): {wrong!r} is a {type(tensors[wrong]).__name__}, not a tensor; "
                            "pass a state dict of tensors (plain or DTensor).")
    return dict(tensors)


def source_layout(tensors: dict[str, torch.Tensor | MegatronTensor]) -> list[SourceTensor]:
    """This rank's boxes of every source tensor (a plain tensor: the whole of it)."""
    out = []
    for name, tensor in tensors.items():
        if isinstance(tensor, MegatronTensor):
            held = tuple(Held(box, start) for box, start in tensor.held)
            out.append(SourceTensor(name, str(tensor.local.dtype), tensor.shape, held, tensor.heads))
            continue
        shape = tuple(tensor.shape)
        if is_dtensor(tensor):
            local_shape, regions = box_regions(name, shape, dtensor_placement(name, tensor).spans)
            held = tuple(Held(r.global_box, r.local_start) for r in regions)
            if tuple(local_tensor(tensor).shape) != local_shape:
                raise ArgumentError(f"WeightSync(source=...): {name}'s local shard has shape "
                                    f"{list(local_tensor(tensor).shape)}, its placements {tensor.placements} give "
                                    f"{list(local_shape)} (uneven shards padded?); sync from evenly placed tensors.")
        else:
            held = (Held(full_box(shape), (0,) * len(shape)),)
        out.append(SourceTensor(name, str(tensor.dtype), shape, tuple(h for h in held if box_numel(h.box))))
    return out


def local_of(tensor: torch.Tensor | MegatronTensor) -> torch.Tensor:
    """A source tensor's local shard, the tensor this rank holds."""
    return tensor.local if isinstance(tensor, MegatronTensor) else local_tensor(tensor)


def local_piece(tensor: torch.Tensor | MegatronTensor, held: Held, src_box: Box) -> torch.Tensor:
    """The view of `tensor`'s local shard holding `src_box` of the piece `held` (coordinates
    relative to the piece)."""
    local = local_of(tensor).detach()
    return local[tuple(slice(s + a, s + b) for s, (a, b) in zip(held.local_start, src_box))]
