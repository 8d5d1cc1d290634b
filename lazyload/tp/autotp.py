"""DeepSpeed AutoTP's shard sizes, so that lazyload fills the local shapes DeepSpeed made.

AutoTP (`deepspeed.init_inference(tensor_parallel=...)`) does not always split a dim evenly:
`deepspeed/module_inject/tp_shard.py` (`get_shard_size`, 0.19) splits a dim of a layer whose
name is not an MLP or LM-head one by KV heads when the dim is a multiple of their count (rank
r gets `kv // world` heads' worth, one more for the first `kv % world` ranks); any other dim
in grains of `tp_grain_size` columns (64 by default; the first `grains % world` ranks get one
grain more, the last rank the remainder below a grain; a dim under one grain near evenly).
So a width of 64 at world 2 is 64 columns on rank 0 and none on rank 1. The rule is followed
here as DeepSpeed states it; the name it goes by is the layer's own `name` on a DeepSpeed
layer, else what AutoTP would call it (parent's attribute name + '.' + the layer's, or
`lm_head`)."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..plan import Placement

GRAIN = 64  # DeepSpeed's DeepSpeedTPConfig.tp_grain_size default
_LAST_LINEAR = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# DeepSpeed's probe order for the KV head count (tp_shard._KV_HEAD_ATTRS)
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                  "num_attention_heads", "n_heads", "attention_heads")


def shard_sizes(total: int, world: int, name: str, kv_heads: int | None, grain: int = GRAIN) -> list[int]:
    """Every rank's share of a dim of `total`, as AutoTP's `get_shard_size_list` gives it."""
    by_heads = (kv_heads is not None and total % kv_heads == 0 and "mlp" not in name
                and name not in _LAST_LINEAR and not any(s in name for s in _MLP_NAMES))
    if by_heads:
        return [total * (kv_heads // world + (r < kv_heads % world)) // kv_heads for r in range(world)]
    if total < grain:
        return [total // world + (r < total % world) for r in range(world)]
    grains, remainder = divmod(total, grain)
    sizes = [(grains // world + (r < grains % world)) * grain for r in range(world)]
    sizes[-1] += remainder
    return sizes


def _kv_heads(config: Any) -> int | None:
    config = getattr(config, "text_config", None) or config
    return next((v for v in (getattr(config, a, None) for a in _KV_HEAD_ATTRS) if v is not None), None)


def is_autotp_layer(module: nn.Module) -> bool:
    """A layer DeepSpeed's AutoTP made with a name (it carries its split's metadata)."""
    return isinstance(getattr(module, "name", None), str) and hasattr(getattr(module, "tp_meta", None),
                                                                      "tp_grain_size")


def autotp_rule(model: nn.Module, module: nn.Module, module_name: str) -> tuple[str, int | None, int]:
    """(name, KV heads, grain) AutoTP splits `module` by: read off a DeepSpeed layer, which
    carries them (`name`, `tp_meta`), else what AutoTP would use for it under its defaults."""
    if is_autotp_layer(module):
        return module.name, module.tp_meta.num_kv_heads, module.tp_meta.tp_grain_size
    parts = module_name.split(".")
    name = parts[-1] if parts[-1] in _LAST_LINEAR else ".".join(parts[-2:])
    return name, _kv_heads(getattr(model, "config", None)), GRAIN


def autotp_placement(model: nn.Module, module: nn.Module, module_name: str, dim: int, ckpt_shape: tuple[int, ...],
                     model_shape: tuple[int, ...], rank: int, world: int) -> Placement | None:
    """This rank's box of a tensor cut on `dim` by AutoTP's rule, or None where the rule does
    not give this rank the model's local size (then it is not AutoTP's cut)."""
    name, kv_heads, grain = autotp_rule(model, module, module_name)
    sizes = shard_sizes(ckpt_shape[dim], world, name, kv_heads, grain)
    if sum(sizes) != ckpt_shape[dim] or sizes[rank] != model_shape[dim]:
        return None
    start = sum(sizes[:rank])
    spans = tuple(((start, start + sizes[rank]),) if d == dim else ((0, n),) for d, n in enumerate(ckpt_shape))
    return Placement("box", spans=spans)
