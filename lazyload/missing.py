"""Model tensors a non-strict load does not fill (missing from the checkpoint, or of another
shape there): what happens to them (`missing=`), and their values from the model's own
initialisation, as transformers' `from_pretrained` gives them (`_init_weights` on the owning
module; `reset_parameters` for plain torch modules). Values are computed before any
checkpoint byte is read, on stand-ins, so a model whose init cannot fill them is refused
while it is still untouched."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from .errors import ArgumentError, MissingKeysError
from .targets import Slot, current_tensor, local_tensor, tensors_swapped

CHOICES = ("init", "keep", "error")


def check_choice(missing: str) -> None:
    if missing not in CHOICES:
        raise ArgumentError(f"missing={missing!r} is not one of {', '.join(map(repr, CHOICES))}: 'init' gives "
                            "tensors the checkpoint does not fill the model's own initialisation, 'keep' leaves "
                            "them as they are (on meta for a meta model), 'error' refuses the load.")


def unfilled_on_meta(names: list[str], slots: dict[str, Slot]) -> list[str]:
    """Those of `names` with no values yet (on meta); a real tensor keeps its own."""
    return [n for n in names if local_tensor(current_tensor(slots[n])).is_meta]


def _owner_init(model: nn.Module, module_name: str, inits: list[tuple[str, nn.Module]]) -> Callable | None:
    """The model's own init for one of its modules: `_init_weights` of the innermost
    transformers model holding it (`inits`: composite models have one per part), else the
    module's own `reset_parameters` (torch's layers)."""
    holders = [(name, sub) for name, sub in inits
               if not name or module_name == name or module_name.startswith(name + ".")]
    if holders:
        return max(holders, key=lambda h: len(h[0]))[1]._init_weights
    reset = getattr(model.get_submodule(module_name), "reset_parameters", None)
    return (lambda m: reset()) if callable(reset) else None


def initial_values(model: nn.Module, names: list[str], slots: dict[str, Slot],
                   local_shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """name -> this rank's local tensor, set by the model's own init. The module's other
    tensors are meta stand-ins meanwhile (nothing loaded is touched, nothing is copied),
    and the module gets its own tensors back afterwards."""
    if not names:
        return {}
    by_module: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_module[name.rpartition(".")[0]].append(name)
    inits = [(name, sub) for name, sub in model.named_modules()
             if callable(getattr(sub, "_init_weights", None)) and hasattr(sub, "config")]
    values: dict[str, torch.Tensor] = {}
    for module_name, own in by_module.items():
        init = _owner_init(model, module_name, inits)
        if init is None:
            raise MissingKeysError(
                f"{', '.join(own)}: not in the checkpoint, and {type(model.get_submodule(module_name)).__name__} "
                "has no initialisation lazyload can run (no _init_weights, no reset_parameters). Load them from "
                "another file, or pass missing='keep' to leave them as they are.", own)
        values.update(_init_module_tensors(model.get_submodule(module_name), init, own, slots, local_shapes, dtypes,
                                           device))
    return values


def _init_module_tensors(module: nn.Module, init: Callable[[nn.Module], None], names: list[str],
                         slots: dict[str, Slot], local_shapes: dict, dtypes: dict,
                         device: torch.device) -> dict[str, torch.Tensor]:
    """`init` run on `module` with fresh tensors for `names` (NaN-filled, so what it leaves
    unset shows) and meta stand-ins for its other tensors; the fresh tensors' values."""
    attrs = {name.rpartition(".")[2]: name for name in names}

    def stand_in(is_parameter: bool, attr: str, tensor: torch.Tensor) -> torch.Tensor:
        if attr in attrs:
            name = attrs[attr]
            fresh = torch.empty(local_shapes[name], dtype=dtypes[name], device=device)
            if fresh.is_floating_point():
                fresh.fill_(float("nan"))  # what init leaves unset shows
            else:
                fresh.zero_()
        else:
            fresh = torch.empty_like(local_tensor(tensor), device="meta")
        return nn.Parameter(fresh, requires_grad=slots[attrs[attr]].requires_grad if attr in attrs
                            else tensor.requires_grad) if is_parameter else fresh

    with tensors_swapped([module], stand_in):
        try:
            with torch.no_grad():
                init(module)
        except Exception as exc:
            raise MissingKeysError(f"{', '.join(names)}: the model's own initialisation failed on "
                                   f"{type(module).__name__} ({type(exc).__name__}: {exc}); load these tensors "
                                   "from another file, or pass missing='keep'.", names) from exc
        out = {}
        for attr, name in attrs.items():
            value = getattr(module, attr).detach()
            if value.is_floating_point() and torch.isnan(value).any():
                raise MissingKeysError(f"{name}: not in the checkpoint, and the model's own initialisation of "
                                       f"{type(module).__name__} does not set it; load it from another file, or "
                                       "pass missing='keep'.", [name])
            out[name] = value
        return out
