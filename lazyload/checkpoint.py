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
from .index import CheckpointIndex, TensorEntry, resolve_files
from .mapping import KeyMap, TargetSpec, build_mapping, check_casts, check_mapping
from .placer import (allocate, assign, current_tensor, fill_meta_buffers, mapped_views, meta_buffers_to_recompute,
                     model_slots)
from .plan import plan_for_rank
from .reader import MmapReader, choose_reader
from .report import LoadReport, MemorySampler
from .residency import resident_fraction
from .rules import BUILTIN_RULES, rules_from
from .schedule import default_budget, schedule
from .tp import auto_parallelize, resolve_placements

logger = logging.getLogger("lazyload")

# Share of this rank's pages that must already be in the page cache for the mmap reader.
WARM_FRACTION = 0.9


def _default_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _conversion_rules(model: nn.Module) -> tuple[list, list]:
    from .hf_rules import hf_rules

    rules = hf_rules(model)
    if rules is not None:
        return rules
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return rules_from(BUILTIN_RULES.get(model_type, []))


def _ignore_patterns(model: nn.Module, attr: str) -> list[str]:
    return list(getattr(model, attr, None) or [])


def model_specs(model: nn.Module, slots: dict) -> dict[str, TargetSpec]:
    """The tensors a checkpoint fills: parameters and persistent buffers, one per tie."""
    state_names = set(model.state_dict().keys())
    return {name: TargetSpec(name, tuple(t.shape), t.dtype)
            for name, t in ((n, current_tensor(s)) for n, s in slots.items()) if name in state_names}


def map_model(index: CheckpointIndex, model: nn.Module, specs: dict[str, TargetSpec], aliases: dict[str, str],
              key_map: KeyMap | None = None):
    """Match checkpoint keys to the model's tensors. The conversion rules are fetched only
    when plain names do not match everything (building transformers' table costs ~0.2 s);
    names that match plainly are never converted, so the result is the same."""
    def with_rules(renames, converts):
        return build_mapping(
            index, specs, aliases={a: c for a, c in aliases.items() if c in specs},
            base_prefix=getattr(model, "base_model_prefix", "") or "", key_map=key_map,
            renames=renames, converts=converts,
            ignore_unexpected=_ignore_patterns(model, "_keys_to_ignore_on_load_unexpected"),
            ignore_missing=_ignore_patterns(model, "_keys_to_ignore_on_load_missing"),
            buffers=[name for name, _ in model.named_buffers(remove_duplicate=False)])

    mapping = with_rules([], [])
    if mapping.missing or mapping.unexpected or mapping.mismatched:
        mapping = with_rules(*_conversion_rules(model))
    return mapping


def _show_progress(progress: bool | None, rank: int) -> bool:
    if progress is not None:
        return bool(progress) and rank == 0
    return rank == 0 and os.environ.get("LAZYLOAD_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


class LazyCheckpoint:
    """A sharded safetensors checkpoint, indexed from its headers alone.

    `paths`: a directory (its `model.safetensors.index.json` when present, else every
    `*.safetensors`), one file, a list of files, or a glob."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        self._paths = paths
        self._index: CheckpointIndex | None = None
        self.files, self._index_json = resolve_files(paths)

    @property
    def index(self) -> CheckpointIndex:
        if self._index is None:
            self._index = CheckpointIndex(self.files, self._index_json)
        return self._index

    def keys(self) -> list[str]:
        return self.index.keys()

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

        Tensor parallel (see lazyload.tp): a DTensor parameter gets its mesh share; a
        parameter of local shape gets its share; for a model nobody made parallel, world > 1
        shards by `plan` (glob -> transformers style, or name -> Placement; "tp" / "ep" / None:
        the model's own plan or the structural rule; {}: nothing sharded). With
        torch.distributed initialised and (rank, world) this process's, such a model is made
        runnable first (`lazyload.tp.parallelize`)."""
        start = time.perf_counter()
        index = self.index
        device = torch.device(device) if device is not None else _default_device(model)

        # Mapping: model tensors as expressions over checkpoint tensors.
        slots, aliases = model_slots(model)
        specs = model_specs(model, slots)
        mapping = map_model(index, model, specs, aliases, key_map)

        # Placements (lazyload.tp): from DTensors, local shapes, plan= or the model's TP plan.
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
        recompute = meta_buffers_to_recompute(model, dtypes, device)
        release_pages = release_pages or must_release_pages(items)
        chosen = choose_reader(reader, device, release_pages, _partially_read_files(items, index),
                               warm=lambda: resident_fraction(items) >= WARM_FRACTION,
                               host_ranks=_host_ranks(world))
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
            recomputed = fill_meta_buffers(recompute)

        report = LoadReport(loaded=[t.name for t in targets], missing=mapping.missing,
                            unexpected=mapping.unexpected, mismatched=mapping.mismatched,
                            recomputed_buffers=recomputed, ignored_buffer_keys=mapping.ignored_buffer_keys,
                            bytes_read=chosen.bytes_read,
                            bytes_mapped=mapped,
                            seconds=time.perf_counter() - start, peak_rss=memory.peak_rss,
                            peak_anon=memory.peak_anon, peak_file=memory.peak_file, rank=rank, world=world,
                            reader=chosen.name, prefetched=chosen.prefetching)
        for name in report.missing:
            logger.warning("missing from checkpoint, left as it was: %s", name)
        logger.info("%s", report)
        return report


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


def _host_ranks(world: int) -> int:
    """Ranks of this load on this host: torchrun's LOCAL_WORLD_SIZE (1 when not set)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return min(max(local, 1), world)


def _partially_read_files(items, index: CheckpointIndex) -> set[str]:
    """Files of which this rank reads less than all the tensor bytes: readahead there would
    fetch other ranks' slices, other experts, or tensors the model does not use."""
    read: dict[str, int] = {}
    for item in items:
        read[item.entry.file] = read.get(item.entry.file, 0) + item.nbytes
    stored: dict[str, int] = {}
    for entry in index.entries():
        stored[entry.file] = stored.get(entry.file, 0) + entry.nbytes
    return {f for f in read if read[f] < stored[f]}
