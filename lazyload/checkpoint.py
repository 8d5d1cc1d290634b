"""LazyCheckpoint: the public entry point, wiring the stages together.

    paths -> Index -> Mapping -> Plan -> Schedule -> Reader -> Placer -> LoadReport
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .engine import must_release_pages, run_schedule
from .errors import DtypeError, PlanError
from .formats import CheckpointSource, open_index, resolve
from .index import CheckpointIndex, TensorEntry
from .mapping import KeyMap, check_casts, check_mapping, map_model
from .parallel import auto_parallelize
from .placements import resolve_placements
from .placer import allocate, assign, fill_meta_buffers, mapped_views, meta_buffers_to_recompute
from .plan import check_rank, plan_for_rank
from .readers import MmapReader, choose_reader
from .report import LoadReport, MemorySampler
from .schedule import default_budget, schedule
from .targets import model_slots, model_specs

logger = logging.getLogger("lazyload")

def _default_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _show_progress(progress: bool | None, rank: int) -> bool:
    if progress is not None:
        return bool(progress) and rank == 0
    return rank == 0 and os.environ.get("LAZYLOAD_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


class LazyCheckpoint:
    """A checkpoint, indexed from its headers (or other metadata) alone.

    `paths`: a directory (its `model.safetensors.index.json` when present, else every
    `*.safetensors`; a pre-sharded layout written by `save_sharded`), one file, a list of
    files, a glob, or a description json (`lazyload_sharded.json`); `.bin`/`.pt` state
    dicts too. `trust_pickle=True` lets a pickled file run the code it names (classes,
    functions): only for files from a trusted source; without it such a file is refused."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, trust_pickle: bool = False):
        self._paths = paths
        self.trust_pickle = trust_pickle
        self._index: CheckpointIndex | None = None
        self.source: CheckpointSource = resolve(paths)
        self.files = self.source.files

    @property
    def index(self) -> CheckpointIndex:
        if self._index is None:
            self._index = open_index(self.source, self.trust_pickle)
        return self._index

    def keys(self) -> list[str]:
        return list(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def entry(self, key: str) -> TensorEntry:
        return self.index[key]

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    @property
    def header_bytes_read(self) -> int:
        return self.index.header_bytes_read

    def __repr__(self) -> str:
        return f"LazyCheckpoint({len(self.files)} files, {len(self.index)} tensors, {self.total_bytes} bytes)"

    def load_into(self, model: nn.Module, rank: int = 0, world: int = 1, *,
                  device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                  strict: bool = True, key_map: KeyMap | None = None, progress: bool | None = None,
                  plan: dict[str, Any] | str | None = None, reader: str = "auto",
                  max_host_bytes: int | None = None, release_pages: bool = False) -> LoadReport:
        """Fill `model` (on meta or real) with this rank's share of the checkpoint.

        Every input error (keys, shapes, casts, rank/world) is raised before any tensor
        byte is read, leaving the model untouched.

        Tensor parallel (see lazyload.placements): a DTensor parameter gets its mesh share; a
        parameter of local shape gets its share; for a model nobody made parallel, world > 1
        shards by `plan` (glob -> transformers style, or name -> Placement; "tp" / "ep" / None:
        the model's own plan or the structural rule; {}: nothing sharded). With
        torch.distributed initialised and (rank, world) this process's, such a model is made
        runnable first (`lazyload.parallel.parallelize`)."""
        start = time.perf_counter()
        check_rank(rank, world)
        index = self.index.for_rank(rank, world)  # copies of a replicated piece: this rank's own file
        device = torch.device(device) if device is not None else _default_device(model)

        # Mapping: model tensors as expressions over checkpoint tensors.
        slots, aliases = model_slots(model)
        specs = model_specs(model, slots)
        mapping = map_model(index, model, specs, aliases, key_map)

        # Placements: from DTensors, local shapes, plan= or the model's TP plan.
        placements = resolve_placements(model, specs, mapping.mismatched, plan, rank, world)
        if placements.local_shaped:  # the model holds local shards: map with the full shapes
            specs = placements.specs
            mapping = map_model(index, model, specs, aliases, key_map)
        if strict:
            check_mapping(mapping, index, specs)
        check_casts(mapping, index, {n: s.dtype for n, s in specs.items()})
        # Only now, with the input checked, may the model change: made tensor parallel.
        if auto_parallelize(model, plan, rank, world, device, placements):
            slots, _ = model_slots(model)  # parameters became DTensors: placements from them
            placements = resolve_placements(model, specs, mapping.mismatched, plan, rank, world)
        dtypes = {name: _target_dtype(specs[name].dtype, index[expr.keys()[0]].dtype, dtype)
                  for name, expr in mapping.exprs.items()}

        # Plan: this rank's boxes, pushed down to read items.
        targets, items = plan_for_rank(mapping.exprs, index, {n: s.shape for n, s in specs.items()}, dtypes,
                                       placements.placements, rank, world)
        recompute = meta_buffers_to_recompute(model, set(mapping.exprs)) | _emptied_buffers(model, set(mapping.exprs))
        release_pages = release_pages or must_release_pages(items)
        chosen = choose_reader(reader, device, release_pages, items, index, world)
        views: dict[str, torch.Tensor] = {}
        copies = items
        if isinstance(chosen, MmapReader) and device.type == "cpu" and not release_pages:
            views, copies = mapped_views(targets, items, chosen, slots)
        # Views of warm pages need nothing more; cold ones are paged in by the schedule.
        copy_groups = schedule(copies)
        groups = schedule(items) if chosen.prefetching else copy_groups
        budget = max_host_bytes if max_host_bytes is not None else default_budget(copy_groups)
        largest = max((item.nbytes for item in copies), default=0)
        if budget < largest:
            raise PlanError(f"max_host_bytes={budget} is smaller than the largest single read "
                            f"({largest} bytes); raise it to at least that.")
        total = sum(group.nbytes for group in groups)
        mapped = sum(v.nbytes for v in views.values())
        logger.info("loading %d tensors (%d bytes to read, %d mapped) with the %s reader, budget %d bytes",
                    len(targets), total, mapped, chosen.name, budget)

        # Read and place; from here on the model changes.
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="lazyload", disable=not _show_progress(progress, rank))
        with MemorySampler() as memory, bar:
            dests = {t.name: views.get(t.name) if t.name in views else allocate(t, slots[t.name], device)
                     for t in targets}
            try:
                run_schedule(groups, chosen, dests, budget, on_bytes=bar.update, mapped=frozenset(views))
            finally:
                chosen.close()
            for target in targets:
                assign(slots[target.name], dests[target.name])
            recomputed = fill_meta_buffers(model, recompute, device)

        report = LoadReport(loaded=[t.name for t in targets], missing=mapping.missing,
                            unexpected=mapping.unexpected, mismatched=mapping.mismatched,
                            recomputed_buffers=recomputed, bytes_read=chosen.bytes_read,
                            bytes_mapped=mapped,
                            seconds=time.perf_counter() - start, peak_rss=memory.peak_rss,
                            peak_anon=memory.peak_anon, peak_file=memory.peak_file, rank=rank, world=world,
                            reader=chosen.name, prefetched=chosen.prefetching)
        for name in report.missing:
            logger.warning("missing from checkpoint, left as it was: %s", name)
        logger.info("%s", report)
        return report


def _emptied_buffers(model: nn.Module, loaded: set[str]) -> dict[str, list[str]]:
    """DeepSpeed's init_inference makes a meta model real with `to_empty` (uninitialised
    memory, buffers included) when it injects its tensor-parallel layers. Non-persistent
    buffers (rotary `inv_freq`: never in a checkpoint) of modules without parameters are
    then recomputed by the model's init, as if they were still on meta."""
    if not hasattr(model, "_init_weights") or not any(
            type(m).__module__.startswith("deepspeed.") for m in model.modules()):
        return {}
    owners: dict[str, list[str]] = {}
    for module_name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            continue
        for attr in module._non_persistent_buffers_set:
            name = f"{module_name}.{attr}" if module_name else attr
            if name not in loaded and module._buffers.get(attr) is not None and not module._buffers[attr].is_meta:
                owners.setdefault(module_name, []).append(name)
    return owners


def _target_dtype(model_dtype: torch.dtype, ckpt_dtype: torch.dtype, requested: Any) -> torch.dtype:
    """None: the model's dtype; "auto": the checkpoint's; a dtype: that one, for floating
    tensors only (integer buffers keep theirs)."""
    if requested is None or not model_dtype.is_floating_point:
        return model_dtype
    if requested == "auto":
        return ckpt_dtype if ckpt_dtype.is_floating_point else model_dtype
    if isinstance(requested, torch.dtype):
        return requested
    raise DtypeError(f"dtype must be None, 'auto' or a torch.dtype, got {requested!r}.")
