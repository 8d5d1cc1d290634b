"""Whether a load fits where it goes, decided from its plan before any byte is read. A rank
whose share exceeds its host's memory is otherwise killed by the kernel with no message
(DeepSeek-V3 rank 0 of 16 planned 22.7 GB on a 24 GB host; with plan="ep" it loads 3.48 GB).

What a rank allocates (`need`):
- its destinations: each target's local shape in the dtype it is read into (a quantized
  one: its 8-bit or packed data and its scales, as the placer allocates them), except the
  targets left as views of the file mapping (page cache, no anonymous memory) and the
  model's own real tensors filled in place;
- its staging on the host: the byte budget (what is read but not yet placed);
- on a GPU, the largest conversion's whole sources too (it runs there).

What the device holds now (`capacity`, the one probe): for the CPU, the host's
MemAvailable and every memory cgroup's room (`system.memory_available`), shared by the
ranks of the load on this host (torchrun's LOCAL_WORLD_SIZE), which all plan before any of
them allocates; for a GPU, its free memory (`torch.cuda.mem_get_info`) and what torch's
caching allocator holds unused. Other devices (meta) are not checked.

`load_into` checks its own plan. `lazyload plan` checks every rank against this host, as
if the load ran here: it plans without this host's probes (`preview`), so whether pages
must be released, and with them the views, is decided here as the load would decide it.
WeightSync writes into its target's own tensors and the writer allocates no model: neither
is checked. LAZYLOAD_FIT_CHECK=0 turns the check off (e.g. planning on one host for another).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .errors import LazyLoadError, PlanError
from .placer import allocate_quantized, fills_in_place
from .plan import TargetPlan
from .planner import LoadPlan, plan_load
from .readers.choice import host_ranks, must_release_pages
from .report import size
from .system import memory_available

LARGEST_SHOWN = 4
MAX_WORLD_FACTOR = 64  # larger worlds tried for what fits: 2x, 4x, ... of the planned one


@dataclass(frozen=True)
class Capacity:
    available: int  # bytes
    source: str  # where the number comes from


def capacity(device: torch.device) -> Capacity | None:
    """What `device` can hold now (None: unknown, not checked)."""
    if device.type == "cpu":
        return Capacity(*memory_available())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        cached = f" + {unused:,} cached unused by torch" if unused else ""
        return Capacity(free + unused, f"torch.cuda.mem_get_info({device}) free{cached}")
    return None


@dataclass(frozen=True)
class Need:
    """What one rank allocates: target -> bytes on its device, staging on the host, and
    scratch on a GPU (a conversion's whole sources)."""

    destinations: dict[str, int]
    staging: int
    scratch: int

    @property
    def destination(self) -> int:
        return sum(self.destinations.values())

    @property
    def total(self) -> int:
        return self.destination + self.staging + self.scratch


def need(plan: LoadPlan, preview: bool = False) -> Need:
    """What the plan's load allocates (`preview`: a plan made without this host's probes)."""
    views = kept_views(plan, preview)
    items = Counter(item.target for item in plan.items)
    destinations = {}
    for target in plan.targets:
        grid = plan.quantized.get(target.name)
        if grid is not None:  # allocated on meta: its data and scales, as the load allocates them
            dest = allocate_quantized(target, grid, torch.device("meta"), plan.full_dtypes[target.name],
                                      items[target.name])
            destinations[target.name] = sum(t.nbytes for t in dest.tensors(target.name).values())
        elif target.name not in views and not fills_in_place(target, plan.mapped.slots[target.name], plan.device):
            destinations[target.name] = _local_bytes(target)
    scratch = max(plan.whole.values(), default=0) if plan.device.type != "cpu" else 0  # on the host: in the budget
    return Need(destinations, plan.budget, scratch)


def kept_views(plan: LoadPlan, preview: bool) -> dict:
    """The plan's views of the file mapping, as the load keeps them: a preview is planned
    without this host's probes, so pages that must be released (and with them every view)
    are decided here as the load decides it."""
    if preview and plan.views and not plan.release_pages:
        dest = sum(_local_bytes(t) for t in plan.targets) if plan.device.type == "cpu" else 0
        if must_release_pages(plan.items, dest, plan.world):
            return {}
    return plan.views


def _local_bytes(target: TargetPlan) -> int:
    return math.prod(target.local_shape) * target.dtype.itemsize


@dataclass(frozen=True)
class Shortfall:
    """More bytes needed than are available in one place."""

    where: str
    needed: int
    parts: str  # what the bytes are
    capacity: Capacity
    sharers: int  # ranks of the load sharing it

    @property
    def share(self) -> int:
        return self.capacity.available // self.sharers


def shortfalls(plan: LoadPlan, preview: bool = False) -> tuple[Need, list[Shortfall]]:
    """The rank's need, and where it exceeds what is available (none: it fits)."""
    wanted = need(plan, preview)
    sharers = host_ranks(plan.world)
    found = []
    if plan.device.type == "cpu":
        checks = [("this host", wanted.destination + wanted.staging, plan.device, sharers,
                   f"destinations {size(wanted.destination)} + staging {size(wanted.staging)}")]
    else:
        checks = [(str(plan.device), wanted.destination + wanted.scratch, plan.device, 1,
                   f"destinations {size(wanted.destination)}" + (
                       f" + conversion scratch {size(wanted.scratch)}" if wanted.scratch else "")),
                  ("this host", wanted.staging, torch.device("cpu"), sharers, f"staging {size(wanted.staging)}")]
    for where, needed, device, ranks, parts in checks:
        if needed and (room := capacity(device)) is not None and needed > room.available // ranks:
            found.append(Shortfall(where, needed, parts, room, ranks))
    return wanted, found


def check_fit(plan: LoadPlan, checkpoint: Any, model: nn.Module, preview: bool = False) -> None:
    """A PlanError when this rank's load cannot fit its device (see the module doc)."""
    if os.environ.get("LAZYLOAD_FIT_CHECK", "1").strip() == "0":
        return
    wanted, short = shortfalls(plan, preview)
    if short:
        raise PlanError(message(plan, wanted, short, what_fits(plan, wanted.total, checkpoint, model)))


def message(plan: LoadPlan, wanted: Need, short: list[Shortfall], fits: tuple[list[str], list[str]]) -> str:
    lines = []
    for s in short:
        shared = f", shared by this host's {s.sharers} ranks (LOCAL_WORLD_SIZE): {s.share:,} each" if (
            s.sharers > 1) else ""
        lines.append(f"rank {plan.rank} of {plan.world} cannot load on {s.where}: it needs {s.needed:,} bytes "
                     f"({size(s.needed)}: {s.parts}), {s.capacity.available:,} are available ({s.capacity.source})"
                     f"{shared}.")
    whole = [t for t in plan.targets if t.name in wanted.destinations and t.local_shape == t.full_shape]
    whole.sort(key=lambda t: -wanted.destinations[t.name])
    if whole:
        kind = "replicated on every rank" if plan.world > 1 else "whole"
        lines.append(f"Largest tensors {kind}: " + ", ".join(
            f"{t.name} {size(wanted.destinations[t.name])}" for t in whole[:LARGEST_SHOWN]) + ".")
    fitting, too_large = fits
    lines.append(f"What fits here, planned for rank {plan.rank}: {', '.join(fitting)}." if fitting else
                 "Nothing tried fits here: load on a device with more memory.")
    lines += [f"Planned, and too large: {', '.join(too_large)}."] if too_large else []
    lines.append("Nothing was read and the model is unchanged (LAZYLOAD_FIT_CHECK=0 skips this check).")
    return " ".join(lines)


def what_fits(plan: LoadPlan, current: int, checkpoint: Any, model: nn.Module) -> tuple[list[str], list[str]]:
    """Other loads of this rank, planned here and measured as this one (which needs
    `current` bytes), as (those that fit, those that do not but need less): the other named
    plan (world > 1), quantize="int8" (when not quantizing), and the smallest larger world
    (2x, 4x, ... of this one). Only what was planned is said, with its bytes."""
    options, rank, world = plan.options, plan.rank, plan.world

    def needed(changes: dict, world: int) -> tuple[int, bool] | None:
        try:
            other = plan_load(checkpoint, model, rank, world, replace(options, **changes), preview=True,
                              mapped=plan.mapped)
        except LazyLoadError:  # not a load this model can do (no experts, a split that cuts a group)
            return None
        wanted, short = shortfalls(other, preview=True)
        return wanted.total, not short

    fitting, not_fitting = [], []
    tried = []
    if world > 1:  # the other named plan; both for a plan= dict
        tried += [(f"plan={name!r}", dict(plan=name), world) for name in ("ep", "tp") if name != options.plan]
    if options.quantize is None:
        tried.append(("quantize='int8'", dict(quantize="int8"), world))
    for label, changes, w in tried:
        result = needed(changes, w)
        if result is not None and (result[1] or result[0] < current):  # the same bytes again: no news
            (fitting if result[1] else not_fitting).append(f"{label} ({size(result[0])})")
    larger = world * 2
    while larger <= world * MAX_WORLD_FACTOR:
        result = needed({}, larger)
        if result is not None and result[1]:
            fitting.append(f"world {larger} (rank {rank}: {size(result[0])})")
            break
        larger *= 2
    else:
        not_fitting.append(f"any world up to {world * MAX_WORLD_FACTOR}")
    return fitting, not_fitting
