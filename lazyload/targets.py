"""The model's side of a load: every tensor it holds (a `Slot`: each module attribute that
holds it, so ties survive), and the `TargetSpec`s the checkpoint must fill. Nothing here
reads the checkpoint."""
from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class TargetSpec:
    """A model tensor to fill: its full (unsharded) shape and the dtype the model gives it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Slot:
    """Where a model tensor lives: every (module, attribute) holding it, and its kind."""

    owners: tuple[tuple[nn.Module, str], ...]
    is_parameter: bool
    requires_grad: bool


def model_slots(model: nn.Module) -> tuple[dict[str, Slot], dict[str, str]]:
    """name -> Slot for each distinct parameter and buffer (the first name is canonical),
    and alias name -> canonical name for tensors reachable under several names."""
    by_id: dict[int, list] = {}
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for is_param, named in ((True, model.named_parameters(remove_duplicate=False)),
                            (False, model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            if tensor is None:
                continue
            module_name, _, attr = name.rpartition(".")
            owner = (model.get_submodule(module_name), attr)
            key = id(tensor)
            if key in names:
                aliases[name] = names[key]
                by_id[key][0].append(owner)
            else:
                names[key] = name
                by_id[key] = [[owner], is_param, bool(getattr(tensor, "requires_grad", False))]
    slots = {names[k]: Slot(tuple(o), p, g) for k, (o, p, g) in by_id.items()}
    # Ties the model declares but that are not (or no longer) the same object, e.g. under
    # accelerate's init_empty_weights, which re-creates each registered meta parameter. One
    # that tensor parallelism cut to another shape (AutoTP's lm_head) stays its own target,
    # filled from the same checkpoint tensor (mapping.map_model).
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if (tied in slots and source in slots and tied != source
                and current_tensor(slots[tied]).shape == current_tensor(slots[source]).shape):
            owners = slots[source].owners + slots.pop(tied).owners
            slots[source] = Slot(owners, slots[source].is_parameter, slots[source].requires_grad)
            aliases[tied] = source
    return slots, aliases


def current_tensor(slot: Slot) -> torch.Tensor:
    module, attr = slot.owners[0]
    return getattr(module, attr)


def model_specs(model: nn.Module, slots: dict[str, Slot]) -> dict[str, TargetSpec]:
    """The tensors a checkpoint fills: parameters and persistent buffers, one per tie."""
    state_names = set(model.state_dict().keys())
    return {name: TargetSpec(name, tuple(t.shape), t.dtype)
            for name, t in ((n, current_tensor(s)) for n, s in slots.items()) if name in state_names}


def is_dtensor(tensor: object) -> bool:
    # No import here: a DTensor can exist only once torch.distributed.tensor is imported,
    # and importing it costs memory in every plain load.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank fills); any other tensor as it is."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


class ModuleStates:
    """Every module of a model as it is now: its attributes, its parameter, buffer,
    submodule and hook tables copied (not their tensors). `restore` puts them all back: a
    load that swapped modules, made the model parallel (DTensors, local sizes, replaced
    forwards, hooks) and assigned some tensors leaves it as it was when it fails."""

    def __init__(self, model: nn.Module):
        self._states = [(module, _copied(vars(module))) for module in model.modules()]

    def restore(self) -> None:
        for module, attrs in self._states:
            vars(module).clear()
            vars(module).update(_copied(attrs))


def _copied(attrs: dict) -> dict:
    return {k: copy.copy(v) if isinstance(v, (dict, set, list)) else v for k, v in attrs.items()}


@contextlib.contextmanager
def tensors_swapped(modules: Iterable[nn.Module],
                    stand_in: Callable[[bool, str, torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    """Each parameter or buffer of `modules` for which `stand_in(is_parameter, attr, tensor)`
    gives a tensor is swapped for it meanwhile, and put back afterwards, whatever happened:
    how the model's own init runs on chosen tensors while every other one is a meta stand-in
    (an init computes nothing on meta, so no other tensor changes, and none is copied)."""
    swapped = []
    try:
        for module in modules:
            for table in (module._parameters, module._buffers):
                for attr, tensor in list(table.items()):
                    new = None if tensor is None else stand_in(table is module._parameters, attr, tensor)
                    if new is not None:
                        swapped.append((table, attr, tensor))
                        table[attr] = new
        yield
    finally:
        for table, attr, tensor in swapped:
            table[attr] = tensor
