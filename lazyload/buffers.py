"""Non-persistent buffers left on the meta device (rotary `inv_freq`, `position_ids`,
Gemma 3's `embed_scale`, ...): computed before any byte is read, as `from_pretrained`
computes them, by the model's own `_init_weights` with every other tensor a meta stand-in
(so no loaded weight is ever re-initialised or copied), in the dtype from_pretrained gives
them; put in place after the load."""
from __future__ import annotations

import copy
import logging
from collections import Counter
from typing import Any, Mapping as MappingT

import torch
from torch import nn

from .errors import MetaBufferError
from .report import group_layers
from .targets import Slot, current_tensor, local_tensor, model_slots, tensors_swapped

logger = logging.getLogger("lazyload")


def meta_buffers_to_recompute(model: nn.Module, loaded: MappingT[str, torch.dtype], device: torch.device,
                              also: set[str] = frozenset()) -> dict[str, tuple[Slot, torch.Tensor]]:
    """The buffers on meta that the checkpoint does not fill (`loaded`: name -> dtype of what
    it fills), computed now on `device`, before a byte is read, as `from_pretrained` computes
    them: by the model's own `_init_weights` (`_init_buffers`, which never reads a loaded value, so
    before or after the load is the same), in the dtype from_pretrained gives them. The model is
    left as it was; `fill_meta_buffers` puts them in. A buffer the init does not write, or an
    init that fails, is refused here. `also`: real buffers to recompute the same way (left
    uninitialised by someone else's `to_empty`)."""
    slots, _ = model_slots(model)
    targets = {n: s for n, s in slots.items()
               if not s.is_parameter and n not in loaded and (local_tensor(current_tensor(s)).is_meta or n in also)}
    if not targets:
        return {}
    metas = {n: current_tensor(s) for n, s in targets.items()}
    dtypes = _from_pretrained_dtypes(model, metas, loaded)
    values = {n: torch.empty(t.shape, dtype=dtypes[n], device=device) for n, t in metas.items()}
    hint = "Build the model with these buffers real (outside the meta device), or register them after the load."
    try:
        unwritten = _init_buffers(model, targets, values)
    except Exception as exc:  # the model's own code
        raise MetaBufferError(f"computing the buffers {_names(targets)} with the model's _init_weights failed "
                              f"({type(exc).__name__}: {exc}). {hint}") from exc
    finally:
        for name, meta in metas.items():
            _put_buffer(targets[name], meta)
    if unwritten:
        raise MetaBufferError("buffers on the meta device that the checkpoint does not hold and no _init_weights of "
                              f"the model computes: {_names(unwritten)}. {hint}")
    return {n: (targets[n], values[n]) for n in targets}


def cast_buffers(model: nn.Module, loaded: MappingT[str, torch.dtype]) -> set[str]:
    """Real non-persistent buffers of a model whose parameters are on meta (accelerate's
    `init_empty_weights` computes buffers for real) that a cast (`.to(torch.bfloat16)`) left in
    another dtype than `from_pretrained` gives them (float32 rotary `inv_freq`): to be
    recomputed as if on meta. Buffers in from_pretrained's dtype keep their values."""
    if not any(p.is_meta for p in model.parameters()):
        return set()  # a real model: its buffers are the user's
    real = {f"{prefix}.{attr}" if prefix else attr: module._buffers[attr]
            for prefix, module in model.named_modules() for attr in module._non_persistent_buffers_set
            if module._buffers.get(attr) is not None and not module._buffers[attr].is_meta}
    real = {n: t for n, t in real.items() if n not in loaded and t.is_floating_point()}
    wanted = _from_pretrained_dtypes(model, real, loaded) if real else {}
    return {n for n, t in real.items() if wanted[n] != t.dtype}


def _names(names) -> str:
    return ", ".join(pattern for pattern, _ in group_layers(list(names)))  # one entry per layer pattern


def fill_meta_buffers(computed: dict[str, tuple[Slot, torch.Tensor]]) -> list[str]:
    """Put the buffers computed by `meta_buffers_to_recompute` in place of the meta ones."""
    for slot, value in computed.values():
        _put_buffer(slot, value)
    return list(computed)


def _put_buffer(slot: Slot, tensor: torch.Tensor) -> None:
    for module, attr in slot.owners:
        module._buffers[attr] = tensor


def _init_buffers(model: nn.Module, targets: dict[str, Slot], values: dict[str, torch.Tensor]) -> list[str]:
    """Put `values` in place of the target buffers and run on them what `from_pretrained` runs
    (`initialize_weights`): the `_init_weights` of the nearest (sub)model that has one, on each
    owning module and its ancestors, children first (an ancestor's init may compute a child's buffer, e.g.
    FalconH1Model's mup_vector). Meanwhile every other tensor of the model is swapped for a
    meta stand-in marked initialised, as from_pretrained marks what it loaded: transformers'
    init functions skip it, any other init computes nothing on meta, so no weight (loaded
    or not yet) changes, and none is copied. Returns the targets the init did not write."""
    inits: dict[str, Any] = {}
    for name, module in model.named_modules():
        own = getattr(module, "_init_weights", None)
        inits[name] = own if callable(own) else inits.get(name.rpartition(".")[0])
    names = {id(m): n for n, m in model.named_modules()}
    wanted = set()
    for slot in targets.values():
        for module, _ in slot.owners:
            parts = names[id(module)].split(".") if names[id(module)] else []
            wanted.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    missing = [n for n, s in targets.items() if all(inits[names[id(m)]] is None for m, _ in s.owners)]
    if missing:
        return missing

    target_ids = {id(current_tensor(s)) for s in targets.values()}

    def stand_in(is_parameter: bool, attr: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if id(tensor) in target_ids:
            return None
        meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
        meta._is_hf_initialized = True
        return meta

    with tensors_swapped(model.modules(), stand_in):
        for name, value in values.items():
            _put_buffer(targets[name], value)
        versions = {name: value._version for name, value in values.items()}
        with torch.no_grad():
            for name, module in reversed(list(model.named_modules())):
                if name in wanted and inits[name] is not None:
                    inits[name](module)
    return [n for n, v in values.items() if v._version == versions[n]]


def _from_pretrained_dtypes(model: nn.Module, metas: dict[str, torch.Tensor],
                            loaded: MappingT[str, torch.dtype]) -> dict[str, torch.dtype]:
    """The dtype `from_pretrained(dtype=d)` gives each buffer, d being the loaded weights'
    dtype: the one the model's constructor gives it under the default dtype d (from_pretrained
    builds the model so, then `empty_like` + `_init_weights`): float32 for rotary inv_freq,
    d for Gemma 3's embed_scale. A meta model built in another dtype, or cast with .to(), has
    lost that, and neither the model nor its config (`config.dtype` is the checkpoint's, whatever
    the user built) tells, so it is always built again, on meta (no tensor memory, a fraction of
    a second even at 405B). Models that cannot be rebuilt from their config keep the buffers'
    current dtypes."""
    current = {n: t.dtype for n, t in metas.items()}
    floating = Counter(d for d in loaded.values() if d.is_floating_point)
    config = getattr(model, "config", None)
    if not floating or config is None or not hasattr(type(model), "_from_config"):
        return current
    dtype = floating.most_common(1)[0][0]
    try:
        with torch.device("meta"):
            fresh = type(model)._from_config(copy.deepcopy(config), dtype=dtype)
    except Exception as exc:  # e.g. a constructor that needs more than the config
        logger.debug("could not rebuild %s on meta for its buffer dtypes: %s", type(model).__name__, exc)
        return current
    rebuilt = dict(fresh.named_buffers(remove_duplicate=False))
    return {n: rebuilt[n].dtype if n in rebuilt else d for n, d in current.items()}
