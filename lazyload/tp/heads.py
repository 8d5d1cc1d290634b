"""Attention heads: the model's q and KV head counts, whole heads per rank (KV heads
replicated in groups when world > KV heads), and the rank groups expert parallel splits
attention over."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import PlanError
from ..names import KV_NAMES, Q_NAMES
from ..plan import Placement

HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "n_head")  # an attention module's q head count


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


def attention_shape(module: nn.Module) -> tuple[int | None, int | None]:
    """(q heads, head dim) an attention module says it has, None where it does not say."""
    heads = next((getattr(module, a) for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)), None)
    head_dim = next((getattr(module, a) for a in ("head_dim", "attention_head_size", "head_size")
                     if isinstance(getattr(module, a, None), int)), None)
    return heads, head_dim


def divisor_group(world: int, fits) -> int:
    """The largest divisor g of `world` for which fits(g) (1 always divides)."""
    return max(g for g in range(1, world + 1) if world % g == 0 and (g == 1 or fits(g)))


def attention_group(heads: Heads, world: int) -> int:
    """Expert parallel: the ranks attention is split over, the largest divisor of `world`
    that whole q heads and their KV heads fit (Llama-4-Maverick's 40 heads: 8 at world 64)."""
    kv = heads.kv_heads or heads.heads
    return divisor_group(world, lambda g: heads.heads % g == 0 and (kv % g == 0 or g % kv == 0))
