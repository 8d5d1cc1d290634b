"""The planner: everything one rank's load will do, as one frozen value (`LoadPlan`), from
the checkpoint's headers, the model and the options alone. It changes nothing and reads no
tensor byte; every check that can fail on input runs here. The executor (`executor.py`)
then carries the plan out; the CLI preview (`summary.py`) and the writer
(`writers/sharded.py`) plan with the same function, so they agree with the load.

    options -> plan_load(checkpoint, model, rank, world) -> LoadPlan -> execute(plan, model)

Stages, each run once per plan: model_slots/model_specs (the model's tensors), map_model
(targets as expressions over checkpoint tensors; a second time only for a model that holds
local shards, with their full shapes), resolve_placements (this rank's share of each),
quantized_targets (grids), plan_for_rank (read items), schedule (layer groups, budget).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import torch
from torch import nn

from .agreement import RANK_TIMEOUT
from .buffers import cast_buffers, meta_buffers_to_recompute
from .devices import target_device, use_device
from .dtypes import dtype_named
from .errors import ArgumentError, DtypeError, PlanError
from .index import CheckpointIndex
from .mapping import KeyMap, Mapping, check_casts, check_mapping, held_by, map_model, prefix_hint
from .missing import check_choice, initial_values, unfilled_on_meta
from .tp.parallel_plan import ParallelPlan, check_process_group, made_parallel, parallel_plan_of_load
from .tp.placements import Resolved, resolve_placements
from .tp.styles import plan_in_use
from .placer import viewable, whole_scratch
from .plan import REPLICATE, ReadItem, TargetPlan, check_rank, local_regions, plan_for_rank
from .quant.formats import Quantization as PreQuantized, detect
from .quant.onload import Grid, Quantization
from .quant.targets import quantized_targets, scale_names
from .cooperate import share_of
from .mesh import cooperating
from .readers import must_release_pages, reader_name
from .remote import RemoteCheckpoint
from .report import size
from .schedule import Group, default_budget, schedule
from .stored import StoredCheckpoint
from .targets import Slot, TargetSpec, model_slots, model_specs

logger = logging.getLogger("lazyload")


@dataclass(frozen=True)
class LoadOptions:
    """`load_into`'s keywords, as one value (see `LazyCheckpoint.load_into` for each)."""

    device: str | torch.device | None = None
    dtype: torch.dtype | str | None = None
    strict: bool = True
    missing: str = "init"
    key_map: KeyMap | None = None
    progress: bool | None = None
    plan: dict[str, Any] | str | None = None
    reader: str = "auto"
    max_host_bytes: int | None = None
    release_pages: bool = False
    shards_only: bool = False
    quantize: str | Quantization | None = None
    rank_timeout: float = RANK_TIMEOUT
    mesh: Any = None  # a torch DeviceMesh, 1-D (tp) or ("dp", "tp"); rank and world are then its tp dim's
    cooperative: bool | None = None  # replicas (a mesh's dp dim) split their reads; default on
    pieces_cut_groups: bool = False  # a weight sync: source pieces may cut a scale group (assembled on arrival)

    @property
    def cooperating(self) -> bool:
        """Replicas split identical reads and exchange them (see cooperate.py)."""
        return cooperating(self.mesh, self.cooperative)

    def checked(self, model: Any, remote: Any = None) -> "LoadOptions":
        """These options with `dtype` as a torch.dtype; arguments of the wrong kind refused."""
        dtype = dtype_named(self.dtype)
        if not isinstance(model, nn.Module):
            hint = " (the checkpoint path goes to LazyCheckpoint(path))" if isinstance(model, (str, os.PathLike)) else ""
            raise ArgumentError(f"load_into takes the model (a torch.nn.Module, e.g. built on the meta device) first; "
                                f"got {type(model).__name__} {model!r}{hint}.")
        if not (dtype is None or dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
            raise DtypeError(f"dtype={dtype!r}: pass None (keep the model's dtypes), 'auto' (the checkpoint's) or a "
                             "floating torch.dtype such as torch.bfloat16; integer tensors keep their own dtype (to "
                             "quantize on load, pass quantize='int8' or 'fp8').")
        check_choice(self.missing)
        if self.reader not in ("auto", "mmap", "pread"):
            raise ArgumentError(f"reader={self.reader!r}: use 'auto' (mmap for CPU, pread for GPU), 'mmap' or 'pread'.")
        if remote is not None and self.reader != "auto":  # `remote`: the paths of a remote checkpoint
            raise ArgumentError(f"reader={self.reader!r} reads local files; a remote checkpoint ({remote}) is read "
                                "with reader='auto'.")
        return replace(self, dtype=dtype)


@dataclass(frozen=True)
class Mapped:
    """The model's tensors matched to the checkpoint (as one rank's index sees it)."""

    index: CheckpointIndex
    slots: dict[str, Slot]
    aliases: dict[str, str]
    specs: dict[str, TargetSpec]
    quant: PreQuantized
    mapping: Mapping


@dataclass(frozen=True)
class LoadPlan:
    """Everything one rank's load does (see the module docstring); `summary()` prints it."""

    rank: int
    world: int
    options: LoadOptions
    device: torch.device
    remote: RemoteCheckpoint | None
    mapped: Mapped
    specs: dict[str, TargetSpec]  # full (checkpoint) shapes
    mapping: Mapping
    placements: Resolved
    quantization: Quantization | None
    quantized: dict[str, Grid]  # target -> scale grid, quantized on load
    dtypes: dict[str, torch.dtype]  # target -> dtype it is read into
    full_dtypes: dict[str, torch.dtype]  # a quantized target's full-precision dtype
    targets: list[TargetPlan]
    items: list[ReadItem]
    whole: dict[str, int]  # targets converted from whole sources -> scratch bytes
    initialized: dict[str, torch.Tensor]  # tensors the checkpoint does not fill: the model's own init
    recompute: dict[str, tuple[Slot, torch.Tensor]]  # meta buffers, computed
    reader: str  # "mmap", "pread" or "remote"
    release_pages: bool
    views: dict[str, ReadItem]  # targets left as views of the file mapping, and their one item
    groups: list[Group]  # every item, by layer
    copy_groups: list[Group]  # those copied (not views)
    budget: int
    share = cached_property(lambda self: share_of(self, self.options.mesh) if self.options.cooperating else None)
    parallel: ParallelPlan | None = None  # how the executor makes the model runnable split; None: it does not

    @property
    def index(self) -> CheckpointIndex:
        return self.mapped.index

    @property
    def bytes_mapped(self) -> int:
        return sum(item.nbytes for item in self.views.values())

    @property
    def bytes_copied(self) -> int:
        return sum(item.nbytes for group in self.copy_groups for item in group.items)

    @property
    def bytes_to_read(self) -> int:
        """The bytes this rank reads (copied or mapped): a load's bytes_read + bytes_mapped."""
        return sum(part.nbytes for item in self.items for part in item.reads())

    @property
    def plan_used(self) -> str:
        """The split this load follows: "tp" (the model's TP plan, else the structural rule),
        "ep" (whole experts per rank), "custom" (a plan= dict over the default), "none"
        (plan={}), "model" (the model holds its split already); "" at world 1."""
        plan = self.options.plan
        if self.world == 1:
            return ""
        if made_parallel(self.placements):
            return "model"
        return plan if isinstance(plan, str) else "custom" if plan else "none"

    @property
    def tensors(self) -> int:
        return len(self.targets)

    @property
    def sharded(self) -> int:
        return sum(1 for t in self.targets if t.local_shape != t.full_shape)

    def summary(self) -> str:
        quantized = f", {len(self.quantized)} quantized" if self.quantized else ""
        return (f"rank {self.rank} of {self.world}: {self.bytes_to_read:,} bytes to read in {self.tensors} tensors "
                f"({self.sharded} sharded{quantized}); {self.bytes_copied:,} copied and {self.bytes_mapped:,} mapped "
                f"with the {self.reader} reader, budget {size(self.budget)}")


def plan_load(checkpoint: StoredCheckpoint, model: nn.Module, rank: int = 0, world: int = 1,
              options: LoadOptions = LoadOptions(), *, preview: bool = False, mapped: Mapped | None = None) -> LoadPlan:
    """This rank's LoadPlan. `preview`: the plan alone, for any rank (the CLI, the writer):
    no initial values or buffers computed (`check_values` runs their checks), no page-cache
    or memory probes of this host.
    `mapped`: an earlier plan's `mapped`, reused when this rank's index is the same."""
    options = options.checked(model, checkpoint.paths if checkpoint.remote else None)
    if world > 1:  # the plan this load follows, named in its report and digest ("tp" or "ep" for None)
        options = replace(options, plan=plan_in_use(model, options.plan))
    qconfig = Quantization.of(options.quantize)
    check_rank(rank, world)
    index = checkpoint.index.for_rank(rank, world)  # copies of a replicated piece: this rank's own file
    device = target_device(options.device, model)  # concrete (cuda:N), checked to exist
    if not preview:
        # Current now, before anything below allocates on it (a first allocation initialises
        # CUDA and leaves device 0 current): DeviceMesh, later loads and `.to("cuda")` agree.
        use_device(device)
    if mapped is None or mapped.index is not index:
        mapped = map_checkpoint(checkpoint, index, model, options.key_map)
    specs, mapping, placements = place(mapped, model, rank, world, options, preview)
    quantized = quantized_targets(model, qconfig, mapping.exprs, specs, placements.placements, index, rank, world,
                                  not options.pieces_cut_groups)
    parallel = parallel_plan_of_load(model, options.plan, rank, world, placements, scale_names(model, quantized),
                                     mapped.aliases, options.shards_only, options.mesh is not None, preview)
    dtypes = {name: target_dtype(specs[name].dtype, values_dtype(expr, index, mapped.quant), options.dtype)
              for name, expr in mapping.exprs.items()}
    full_dtypes = {name: dtypes[name] for name in quantized}
    dtypes.update({name: qconfig.torch_dtype for name in quantized})
    whole = whole_scratch(mapping.exprs, {n: s.shape for n, s in specs.items()}, dtypes, quantized, index.shape_of)
    initialized, recompute = ({}, {}) if preview else values(model, mapped.slots, specs, mapping, placements, dtypes,
                                                             rank, world, device, options)
    targets, items = plan_for_rank(mapping.exprs, index, {n: s.shape for n, s in specs.items()}, dtypes,
                                   placements.placements, rank, world)
    reads = _reads(targets, items, whole, mapped.slots, device, world, options, checkpoint.remote, preview)
    return LoadPlan(rank, world, options, device, checkpoint.remote, mapped, specs, mapping, placements, qconfig,
                    quantized, dtypes, full_dtypes, targets, items, whole, initialized, recompute, **reads,
                    parallel=parallel)


def map_checkpoint(checkpoint: StoredCheckpoint, index: CheckpointIndex, model: nn.Module,
                   key_map: KeyMap | None) -> Mapped:
    """Mapping: the model's tensors as expressions over the checkpoint's (pre-quantized
    weights detected with the config.json beside the files)."""
    slots, aliases = model_slots(model)
    specs = model_specs(model, slots)
    quant = detect(index, checkpoint.quantization_config(), held_by(model, specs))  # pieces: this rank's copies
    return Mapped(index, slots, aliases, specs, quant, map_model(index, model, specs, aliases, key_map, quant))


def place(mapped: Mapped, model: nn.Module, rank: int, world: int, options: LoadOptions,
          preview: bool = False) -> tuple[dict[str, TargetSpec], Mapping, Resolved]:
    """Placements (from DTensors, local shapes, plan= or the model's TP plan) and the
    mapping's checks: keys, shapes, casts, the process group (not for a `preview`, which
    plans any rank of any world: the CLI, the writer inside a process group)."""
    specs, mapping = mapped.specs, mapped.mapping
    placements = resolve_placements(model, specs, mapping.mismatched, options.plan, rank, world)
    if placements.local_shaped:  # the model holds local shards: map with the full shapes
        specs = placements.specs
        mapping = map_model(mapped.index, model, specs, mapped.aliases, options.key_map, mapped.quant)
    if options.mesh is None and not preview:  # a mesh's rank and world are its tp dim's by construction
        check_process_group(rank, world, options.plan, placements, options.shards_only)
    if mapping.unused_key_map:
        logger.warning("lazyload: key_map patterns that match no checkpoint key (key_map maps checkpoint key "
                       "-> model key): %s", ", ".join(mapping.unused_key_map))
    if options.strict or options.missing == "error":
        check_mapping(mapping if options.strict else replace(mapping, unexpected=[]), mapped.index, specs)
    elif (hint := prefix_hint(mapping)) is not None:
        logger.warning("lazyload: %s", hint)
    check_casts(mapping, mapped.index, {n: s.dtype for n, s in specs.items()})
    return specs, mapping, placements


def values(model: nn.Module, slots: dict[str, Slot], specs: dict[str, TargetSpec], mapping: Mapping,
           placements: Resolved, dtypes: dict[str, torch.dtype], rank: int, world: int, device: torch.device,
           options: LoadOptions) -> tuple[dict[str, torch.Tensor], dict[str, tuple[Slot, torch.Tensor]]]:
    """Tensors the checkpoint does not fill, given the model's own init now, and meta
    buffers, computed now: a model whose init cannot is refused before anything changes.
    Those the model expects to be missing (`_keys_to_ignore_on_load_missing`) are no error,
    but from_pretrained inits them too."""
    strict, missing = options.strict, options.missing
    unfilled = [] if strict or missing != "init" else unfilled_on_meta(
        mapping.missing + [name for name, _, _ in mapping.mismatched], slots)
    unfilled += [] if missing == "keep" else unfilled_on_meta(mapping.expected_missing, slots)
    initialized = initial_values(
        model, unfilled, slots,
        {n: local_regions(n, specs[n].shape, placements.placements.get(n, REPLICATE), rank, world)[0]
         for n in unfilled},
        {n: target_dtype(specs[n].dtype, specs[n].dtype, options.dtype) for n in unfilled}, device)
    loaded_dtypes = {**dtypes, **{name: specs[name].dtype for name in initialized}}
    recompute = meta_buffers_to_recompute(model, loaded_dtypes, device, also=emptied_buffers(
        model, set(mapping.exprs)) | cast_buffers(model, loaded_dtypes))
    return initialized, recompute


def check_values(plan: LoadPlan, model: nn.Module) -> None:
    """What `load_into` computes before reading, for a preview planned without it: the
    model's own init of the tensors the checkpoint does not fill and the meta buffers,
    computed on the CPU and dropped, so that a preview refuses what the load refuses, with
    the same error (a MissingKeysError, a MetaBufferError)."""
    values(model, plan.mapped.slots, plan.specs, plan.mapping, plan.placements, plan.dtypes, plan.rank, plan.world,
           torch.device("cpu"), plan.options)


def _reads(targets: list[TargetPlan], items: list[ReadItem], whole: dict[str, int], slots: dict[str, Slot],
           device: torch.device, world: int, options: LoadOptions, remote: RemoteCheckpoint | None,
           preview: bool) -> dict:
    """The reader, the targets left as views of the file mapping, the schedule and the byte
    budget, checked against what must be held at once."""
    whole_host = whole if device.type == "cpu" else {}  # on a GPU the conversions run there
    check_conversions(whole_host, options.max_host_bytes)
    dest_bytes = sum(math.prod(t.local_shape) * t.dtype.itemsize for t in targets)
    release_pages = options.release_pages or (not preview and must_release_pages(
        items, dest_bytes if device.type == "cpu" else 0, world))
    reader = reader_name(options.reader, device, remote)
    views = {}
    # a cooperating rank's destinations are written by its peers too: its own memory, not the file's
    if reader == "mmap" and device.type == "cpu" and not release_pages and not options.cooperating:
        views = viewable([t for t in targets if t.name not in whole], items, slots)
    groups = schedule(items)  # views of warm pages need nothing more; cold ones are paged in by the schedule
    copy_groups = [Group(g.layer, kept) for g in groups if (kept := tuple(i for i in g.items if i.target not in views))]
    budget = byte_budget(copy_groups, options.max_host_bytes, max(whole_host.values(), default=0))
    return dict(reader=reader, release_pages=release_pages, views=views, groups=groups, copy_groups=copy_groups,
                budget=budget)


def check_conversions(whole_host: dict[str, int], max_host_bytes: int | None) -> None:
    """A conversion runs on its whole source tensors, held at once in host memory (`whole_host`:
    target -> those bytes): a `max_host_bytes` smaller than one of them is a PlanError."""
    if whole_host and max_host_bytes is not None and max_host_bytes < max(whole_host.values()):
        name = max(whole_host, key=whole_host.get)
        raise PlanError(f"max_host_bytes={max_host_bytes} is smaller than what {name} needs "
                        f"({whole_host[name]} bytes): its conversion runs on its whole source tensors; raise it to "
                        "at least that.")


def byte_budget(groups: list[Group], max_host_bytes: int | None, floor: int = 0) -> int:
    """The bytes read but not yet placed at once: `max_host_bytes`, refused when smaller
    than the largest single read; by default one layer, never less than the largest read
    (see default_budget) nor than `floor` (a conversion's whole sources)."""
    if max_host_bytes is None:
        return max(default_budget(groups), floor)
    if max_host_bytes < (largest := max((item.nbytes for g in groups for item in g.items), default=0)):
        raise PlanError(f"max_host_bytes={max_host_bytes} is smaller than the largest single read "
                        f"({largest} bytes); raise it to at least that.")
    return max_host_bytes


def emptied_buffers(model: nn.Module, loaded: set[str]) -> set[str]:
    """DeepSpeed's init_inference makes a meta model real with `to_empty` (uninitialised
    memory, buffers included) when it injects its tensor-parallel layers. Non-persistent
    buffers (rotary `inv_freq`: never in a checkpoint) of modules without parameters are
    then recomputed by the model's init, as if they were still on meta."""
    if not hasattr(model, "_init_weights") or not any(
            type(m).__module__.startswith("deepspeed.") for m in model.modules()):
        return set()
    names = set()
    for module_name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            continue
        for attr in module._non_persistent_buffers_set:
            name = f"{module_name}.{attr}" if module_name else attr
            if name not in loaded and module._buffers.get(attr) is not None and not module._buffers[attr].is_meta:
                names.add(name)
    return names


def values_dtype(expr: Any, index: CheckpointIndex, quant: PreQuantized) -> torch.dtype | None:
    """The dtype of the values a target's first source holds (None for a quantized weight)."""
    key = expr.first_key()
    return quant.values_dtype(key, index[key].dtype)


def target_dtype(model_dtype: torch.dtype, ckpt_dtype: torch.dtype | None, requested: Any) -> torch.dtype:
    """None: the model's dtype; "auto": the checkpoint's (the model's for a dequantized
    weight, `ckpt_dtype` None); a dtype: that one, for floating tensors only (integer
    buffers keep theirs)."""
    if requested is None or not model_dtype.is_floating_point:
        return model_dtype
    if requested == "auto":
        return ckpt_dtype if ckpt_dtype is not None and ckpt_dtype.is_floating_point else model_dtype
    if isinstance(requested, torch.dtype):
        return requested
    raise DtypeError(f"dtype must be None, 'auto' or a torch.dtype, got {requested!r}.")
