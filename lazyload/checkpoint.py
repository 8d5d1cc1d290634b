"""LazyCheckpoint: the public entry point, wiring the stages together.

    paths -> Index -> Mapping -> Plan -> Schedule -> Reader -> Placer -> LoadReport
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .buffers import fill_meta_buffers, meta_buffers_to_recompute
from .devices import target_device, use_device
from .dtypes import dtype_named
from .agreement import Agreement, NoAgreement, agreement
from .engine import run_schedule, settle_failure
from .errors import ArgumentError, DtypeError, PlanError, ReadError
from .hub import local_path
from .formats import CheckpointSource, open_index, resolve
from .index import CheckpointIndex, TensorEntry
from .mapping import KeyMap, check_casts, check_mapping, held_by, map_model, prefix_hint
from .missing import check_choice, initial_values, unfilled_on_meta
from .parallel import auto_parallelize, check_process_group
from .placements import resolve_placements
from .placer import TensorDest, allocate, allocate_quantized, assign, mapped_views, whole_scratch, with_whole
from .plan import REPLICATE, check_rank, local_regions, plan_for_rank
from .quant.formats import Quantization as PreQuantized, detect, quantization_config_of, read_quantization_config
from .quant.linear import to_torchao
from .quant.onload import Quantization
from .quant.targets import quantized_targets, saved_bytes, swap_quantized
from .readers import choose_reader, must_release_pages
from .remote import RemoteCheckpoint, RemoteOptions, is_remote
from .report import LoadReport, MemorySampler, size
from .schedule import default_budget, schedule
from .targets import model_slots, model_specs

logger = logging.getLogger("lazyload")

def _show_progress(progress: bool | None, rank: int) -> bool:
    if progress is not None:
        return bool(progress) and rank == 0
    return rank == 0 and os.environ.get("LAZYLOAD_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


class LazyCheckpoint:
    """A checkpoint, indexed from its headers (or other metadata) alone: no tensor byte is
    read until `load_into`.

    `paths`: a directory (its `model.safetensors.index.json` when present, else every
    `*.safetensors` in it; a pre-sharded layout written by `save_sharded`), one file, a list
    of files, a glob, a description json (`lazyload_sharded.json`, DeepSpeed's checkpoint
    json), `.bin`/`.pt` state dicts, Megatron-LM per-rank checkpoints, or a Hugging Face repo
    id (`"Qwen/Qwen2-0.5B"`) already in huggingface_hub's local cache (never downloaded). A
    path that leads to no checkpoint is a CheckpointError here.

    `trust_pickle`: True lets a pickled file (`.bin`, `.pt`) run the code it names (classes,
    functions): only for files from a trusted source; without it such a file is refused.

    A URL reads the checkpoint from where it is stored, each rank fetching only its byte
    ranges (`lazyload.remote`): `s3://bucket/prefix/`, `https://host/path/`,
    `hf://org/repo[@revision]`; `remote`: a `RemoteOptions` (requests in flight, merge
    gap, retries, timeout)."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], *, trust_pickle: bool = False,
                 remote: RemoteOptions | None = None):
        _check_paths(paths)
        self._paths = paths
        self.trust_pickle = trust_pickle
        self._index: CheckpointIndex | None = None
        self._quantization: PreQuantized | None = None
        self.remote = RemoteCheckpoint(paths, remote) if is_remote(paths) else None
        self.source: CheckpointSource = (CheckpointSource("safetensors", self.remote.files, self.remote.index_json)
                                         if self.remote else resolve(local_path(paths)))
        self.files = self.source.files

    @property
    def index(self) -> CheckpointIndex:
        if self._index is None:
            self._index = self.remote.index() if self.remote else open_index(self.source, self.trust_pickle)
        return self._index

    @property
    def quantization(self) -> PreQuantized:
        """The checkpoint's pre-quantized weights and their scales (from the tensors and the
        `quantization_config` of the config.json beside its files); loads dequantize them."""
        if self._quantization is None:
            self._quantization = self._detect()
        return self._quantization

    def _detect(self, held=lambda key: False) -> PreQuantized:
        return detect(self.index, self._quantization_config(), held)

    def _quantization_config(self) -> dict | None:
        """The `quantization_config` of the config.json beside the files (from the store, for a URL)."""
        if self.remote is None:
            return read_quantization_config(self.files)
        self.index  # indexing fetches config.json, beside the headers
        return None if self.remote.config_json is None else quantization_config_of(*self.remote.config_json)

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

    def _values_dtype(self, key: str, quant: PreQuantized) -> torch.dtype | None:
        """The dtype of the values a key holds: None for a quantized weight (8-bit storage)."""
        return None if key in quant.leaves else self.index[key].dtype

    def __repr__(self) -> str:
        return f"LazyCheckpoint({len(self.files)} files, {len(self.index)} tensors, {self.total_bytes} bytes)"

    def load_into(self, model: nn.Module, rank: int = 0, world: int = 1, *,
                  device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                  strict: bool = True, missing: str = "init", key_map: KeyMap | None = None,
                  progress: bool | None = None, plan: dict[str, Any] | str | None = None, reader: str = "auto",
                  max_host_bytes: int | None = None, release_pages: bool = False,
                  shards_only: bool = False, quantize: str | Quantization | None = None,
                  rank_timeout: float = 60.0) -> LoadReport:
        """Fill `model` with this rank's share of the checkpoint; returns a LoadReport.

        Every input error (arguments, keys, shapes, casts, rank/world, plan) is a
        LazyLoadError raised before any tensor byte is read, leaving the model untouched.

        - `model`: an `nn.Module`, on the meta device (or built under accelerate's
          `init_empty_weights()`), or real (then overwritten in place).
        - `rank`, `world`: this rank and the number of tensor-parallel ranks (world=1: the
          whole model). Under torch.distributed they must be the process group's (a model
          nobody made parallel is then made runnable, see `lazyload.parallel.parallelize`),
          unless `shards_only=True`.
        - `device`: where the tensors go; default the model's device, for a meta model
          `cuda:$LOCAL_RANK` when CUDA is available, else CPU.
        - `dtype`: None keeps each model tensor's dtype (casting from the checkpoint); "auto"
          keeps the checkpoint's; a floating `torch.dtype` (or its name: "bfloat16", "bf16",
          "float16") for every floating tensor (integer tensors keep theirs).
        - `strict`: True refuses missing, unexpected and mismatched tensors. False ignores
          unexpected checkpoint tensors and treats missing and mismatched model tensors as
          `missing` says.
        - `missing` (strict=False only): "init" (default) gives model tensors the checkpoint
          does not fill, and that have no values yet (on meta), the model's own
          initialisation, as `from_pretrained` does (`report.initialized`; real tensors keep
          their values); "keep" leaves them as they are (on meta: the forward fails or
          computes NaN); "error" refuses them as strict=True does. Tensors the model expects
          to be missing (`_keys_to_ignore_on_load_missing`) are no error, and get its init
          unless "keep".
        - `key_map`: renames checkpoint keys to model names (checkpoint key -> model key),
          tried when the exact and base-prefixed names do not match: {regex: replacement}
          (`re.sub`, the first matching pattern wins) or a callable.
        - `progress`: a tqdm bar (MiB) on rank 0; default on unless `LAZYLOAD_PROGRESS=0`.
        - `plan` (world > 1, a model nobody made parallel): None or "tp" uses the model's
          transformers TP plan (else the structural rule); "ep" whole experts per rank; a
          dict overrides entries of it, glob -> transformers style or name ->
          `lazyload.Placement`; {} shards nothing. A glob that matches nothing is a PlanError.
        - `reader`: "auto" (mmap for CPU, pread for GPU; a remote checkpoint's GETs), "mmap" or
          "pread" (local files only).
        - `max_host_bytes`: bytes read but not yet placed (default about one layer).
        - `release_pages`: drop consumed file pages (on by itself under a tight cgroup).
        - `shards_only`: fill this rank's shards into plain tensors and leave the model's
          structure alone, even under torch.distributed with another (rank, world).
        - `quantize`: None (default) loads full precision; "int8", "fp8" or a
          `lazyload.Quantization(dtype, group_size=128, skip=())` quantizes the Linear layers
          and fused 3-D MoE experts on load (weight-only: `lazyload.quant.linear.QuantizedLinear`,
          `lazyload.quant.experts.QuantizedExperts`, 8-bit weights and float32 scales per output
          row and group of 128 input columns), each rank quantizing
          the slice it reads; `lm_head`, MoE routers and the config's
          `modules_to_not_convert` stay in full precision. A TP split that cuts a group is a
          PlanError.
        - `rank_timeout`: seconds a rank of a torch.distributed load (the process group's
          rank and world > 1) waits for the others at each point where they agree (after
          planning, after reading); a rank that fails, or does not report in time, makes
          every other one raise RankFailedError naming it and its error.

        A read that fails (I/O error, permission, a file changed since it was indexed) is a
        ReadError listing the targets `loaded` (assigned) and `not_loaded` (kept as they
        were; `partly_written`: real tensors filled in place, their values now mixed)."""
        agree = agreement(rank, world, rank_timeout)
        try:
            return self._load(agree, model, rank, world, device=device, dtype=dtype, strict=strict, missing=missing,
                              key_map=key_map, progress=progress, plan=plan, reader=reader,
                              max_host_bytes=max_host_bytes, release_pages=release_pages, shards_only=shards_only,
                              quantize=quantize)
        except BaseException as exc:
            agree.failed(exc)  # the other ranks hear of it at the next point, instead of waiting forever
            raise

    def _load(self, agree: Agreement | NoAgreement, model: nn.Module, rank: int, world: int, *,
              device: str | torch.device | None, dtype: torch.dtype | str | None, strict: bool, missing: str,
              key_map: KeyMap | None, progress: bool | None, plan: dict[str, Any] | str | None, reader: str,
              max_host_bytes: int | None, release_pages: bool, shards_only: bool,
              quantize: str | Quantization | None) -> LoadReport:
        start = time.perf_counter()
        dtype = dtype_named(dtype)
        _check_arguments(model, dtype, missing, reader)
        if self.remote is not None and reader != "auto":
            raise ArgumentError(f"reader={reader!r} reads local files; a remote checkpoint ({self._paths}) is read "
                                "with reader='auto'.")
        qconfig = Quantization.of(quantize)
        check_rank(rank, world)
        index = self.index.for_rank(rank, world)  # copies of a replicated piece: this rank's own file
        device = target_device(device, model)  # concrete (cuda:N), checked to exist
        # Current now, before anything below allocates on it (a first allocation initialises
        # CUDA and leaves device 0 current): DeviceMesh, later loads and `.to("cuda")` agree.
        use_device(device)

        # Mapping: model tensors as expressions over checkpoint tensors.
        slots, aliases = model_slots(model)
        specs = model_specs(model, slots)
        quant = self._detect(held=held_by(model, specs))
        mapping = map_model(index, model, specs, aliases, key_map, quant)

        # Placements: from DTensors, local shapes, plan= or the model's TP plan.
        placements = resolve_placements(model, specs, mapping.mismatched, plan, rank, world)
        if placements.local_shaped:  # the model holds local shards: map with the full shapes
            specs = placements.specs
            mapping = map_model(index, model, specs, aliases, key_map, quant)
        check_process_group(rank, world, plan, placements, shards_only)
        if mapping.unused_key_map:
            logger.warning("lazyload: key_map patterns that match no checkpoint key (key_map maps checkpoint key "
                           "-> model key): %s", ", ".join(mapping.unused_key_map))
        if strict or missing == "error":
            check_mapping(mapping if strict else replace(mapping, unexpected=[]), index, specs)
        elif (hint := prefix_hint(mapping)) is not None:
            logger.warning("lazyload: %s", hint)
        check_casts(mapping, index, {n: s.dtype for n, s in specs.items()})
        # Tensors the checkpoint does not fill, given the model's own init now: a model
        # whose init cannot is refused before anything changes. Those the model expects to be
        # missing (`_keys_to_ignore_on_load_missing`) are no error, but from_pretrained inits them too.
        unfilled = [] if strict or missing != "init" else unfilled_on_meta(
            mapping.missing + [name for name, _, _ in mapping.mismatched], slots)
        unfilled += [] if missing == "keep" else unfilled_on_meta(mapping.expected_missing, slots)
        initialized = initial_values(
            model, unfilled, slots,
            {n: local_regions(n, specs[n].shape, placements.placements.get(n, REPLICATE), rank, world)[0]
             for n in unfilled},
            {n: _target_dtype(specs[n].dtype, specs[n].dtype, dtype) for n in unfilled}, device)
        quantized = quantized_targets(model, qconfig, mapping.exprs, specs, placements.placements, index, rank, world)
        dtypes = {name: _target_dtype(specs[name].dtype, self._values_dtype(expr.keys()[0], quant), dtype)
                  for name, expr in mapping.exprs.items()}
        full_dtypes = {name: dtypes[name] for name in quantized}
        dtypes.update({name: qconfig.torch_dtype for name in quantized})
        shape_of = lambda key: index[key].shape  # noqa: E731
        whole = whole_scratch(mapping.exprs, {n: s.shape for n, s in specs.items()}, dtypes, quantized, shape_of)
        whole_host = whole if device.type == "cpu" else {}  # on a GPU the conversions run there
        if whole_host and max_host_bytes is not None and max_host_bytes < max(whole_host.values()):
            name = max(whole_host, key=whole_host.get)  # conversions run on whole sources: they hold them all
            raise PlanError(f"max_host_bytes={max_host_bytes} is smaller than what {name} needs ({whole_host[name]} "
                            "bytes): its conversion runs on its whole source tensors; raise it to at least that.")
        # Buffers left on meta, computed now: one that cannot be is refused while the model is untouched.
        loaded_dtypes = {**dtypes, **{name: specs[name].dtype for name in initialized}}
        recompute = meta_buffers_to_recompute(model, loaded_dtypes, device,
                                              also=_emptied_buffers(model, set(mapping.exprs)))
        agree.reached("planned")  # every rank's input is good: only now may any model change
        # Only now, with the input checked, may the model change: Linear layers quantized,
        # made tensor parallel.
        if quantized:
            swap_quantized(model, quantized, qconfig)
            slots, _ = model_slots(model)
        if auto_parallelize(model, plan, rank, world, device, placements, shards_only):
            slots, _ = model_slots(model)  # parameters became DTensors: placements from them
            placements = resolve_placements(model, specs, mapping.mismatched, plan, rank, world)

        # Plan: this rank's boxes, pushed down to read items.
        targets, items = plan_for_rank(mapping.exprs, index, {n: s.shape for n, s in specs.items()}, dtypes,
                                       placements.placements, rank, world)
        dest_bytes = sum(math.prod(t.local_shape) * t.dtype.itemsize for t in targets)
        release_pages = release_pages or must_release_pages(items, dest_bytes if device.type == "cpu" else 0, world)
        chosen = choose_reader(reader, device, release_pages, items, index, world, self.remote)
        views: dict[str, torch.Tensor] = {}
        copies = items
        if chosen.maps_views and device.type == "cpu" and not release_pages:
            views, copies = mapped_views([t for t in targets if t.name not in whole], items, chosen, slots)
        # Views of warm pages need nothing more; cold ones are paged in by the schedule.
        copy_groups = schedule(copies)
        groups = schedule(items) if chosen.prefetching else copy_groups
        budget = max_host_bytes if max_host_bytes is not None else max([default_budget(copy_groups), *whole_host.values()])
        largest = max((item.nbytes for item in copies), default=0)
        if budget < largest:
            raise PlanError(f"max_host_bytes={budget} is smaller than the largest single read "
                            f"({largest} bytes); raise it to at least that.")
        copied = sum(item.nbytes for item in copies)
        mapped = sum(v.nbytes for v in views.values())
        logger.info("lazyload: loading %d tensors (%s to copy, %s mapped) with the %s reader, budget %s",
                    len(targets), size(copied), size(mapped), chosen.name, size(budget))

        # Read and place; from here on the model changes. The bar counts every byte a
        # target gets: copied, and mapped (paged in by the schedule, or already cached).
        bar = tqdm(total=(copied + mapped) / 2**20, unit="MiB", desc="lazyload", disable=not _show_progress(progress, rank),
                   bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} MiB [{elapsed}<{remaining}, {rate_fmt}{postfix}]")
        with MemorySampler() as memory, bar:
            if not chosen.prefetching:
                bar.update(mapped / 2**20)
            dests = {t.name: TensorDest(views[t.name]) if t.name in views else
                     allocate_quantized(t, quantized[t.name], device) if t.name in quantized else
                     allocate(t, slots[t.name], device) for t in targets}
            try:
                engine = run_schedule(groups, chosen, with_whole(dests, targets, mapping.exprs, items, shape_of),
                                      budget, on_bytes=_progress(bar, chosen), mapped=frozenset(views))
            except ReadError as exc:  # what was fully read is assigned; the rest left as it was
                raise settle_failure(exc, slots, dests) from exc
            finally:
                chosen.close()
            agree.reached("read")  # every rank read everything: only now is any model made runnable
            for target in targets:
                for name, tensor in dests[target.name].tensors(target.name).items():
                    assign(slots[name], tensor)
            for name, value in initialized.items():
                assign(slots[name], value)
            recomputed = fill_meta_buffers(recompute)
        if quantized and qconfig.torchao and world == 1:
            to_torchao(model, [name.rpartition(".")[0] for name in quantized if name.endswith(".weight")])

        report = LoadReport(loaded=[t.name for t in targets], missing=mapping.missing,
                            unexpected=mapping.unexpected, mismatched=mapping.mismatched,
                            initialized=list(initialized), recomputed_buffers=recomputed,
                            ignored_buffer_keys=mapping.ignored_buffer_keys, other_stages=mapping.other_stages,
                            read_whole={n: sum(i.nbytes for i in items if i.target == n) for n in whole},
                            bytes_read=chosen.bytes_read, bytes_mapped=mapped,
                            seconds=time.perf_counter() - start, peak_rss=memory.peak_rss,
                            peak_anon=memory.peak_anon, peak_file=memory.peak_file, rank=rank, world=world,
                            reader=chosen.name, prefetched=chosen.prefetching, released_pages=release_pages,
                            pinned_bytes=engine.pinned_bytes,
                            quantized=[name.rpartition(".")[0] for name in quantized],
                            quantized_to=qconfig.describe() if quantized else "",
                            bytes_saved=saved_bytes({n: dests[n] for n in quantized}, full_dtypes),
                            h2d_bytes=engine.h2d_bytes, h2d_seconds=engine.h2d_seconds,
                            **chosen.report_fields())
        logger.info("%s", report)
        if not report.ok:
            logger.warning("lazyload: rank %d: %s (strict=False); see the report", rank, _problems(report, missing))
        return report


def _progress(bar: tqdm, reader: Any) -> Any:
    """The bar's update per placed item; a remote reader's requests and retries beside it."""
    def update(n: int) -> None:
        note = reader.progress_note()
        if note:
            bar.set_postfix_str(note, refresh=False)
        bar.update(n / 2**20)

    return update


def _problems(report: LoadReport, missing: str) -> str:
    unfilled = len(report.missing) + len(report.mismatched)
    fate = ("given the model's own initialisation" if report.initialized else
            "left as they were" if missing == "keep" else "kept their values")
    parts = [f"{unfilled} model tensors not filled from the checkpoint ({fate})"] if unfilled else []
    parts += [f"{len(report.unexpected)} checkpoint tensors not used"] if report.unexpected else []
    return ", ".join(parts)


def _check_paths(paths: Any) -> None:
    """Something other than paths (the model, with the arguments swapped) is refused with what goes where."""
    items = paths if isinstance(paths, (list, tuple)) else [paths]
    wrong = next((p for p in items if not isinstance(p, (str, os.PathLike))), None)
    if wrong is not None or not items:
        got = f"a {type(wrong).__name__}" if items else "an empty list"
        model = " (a model: it goes to load_into)" if isinstance(wrong, nn.Module) else ""
        raise ArgumentError(f"LazyCheckpoint takes the checkpoint: a directory, file, list of files, glob, repo id "
                            f"or URL; got {got}{model}. Use LazyCheckpoint(path).load_into(model, rank, world).")


def _check_arguments(model: Any, dtype: Any, missing: str, reader: str) -> None:
    """Arguments of the wrong kind, refused before anything is read."""
    if not isinstance(model, nn.Module):
        hint = " (the checkpoint path goes to LazyCheckpoint(path))" if isinstance(model, (str, os.PathLike)) else ""
        raise ArgumentError(f"load_into takes the model (a torch.nn.Module, e.g. built on the meta device) first; "
                            f"got {type(model).__name__} {model!r}{hint}.")
    if not (dtype is None or dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
        raise DtypeError(f"dtype={dtype!r}: pass None (keep the model's dtypes), 'auto' (the checkpoint's) or a "
                         "floating torch.dtype such as torch.bfloat16; integer tensors keep their own dtype (to "
                         "quantize on load, pass quantize='int8' or 'fp8').")
    check_choice(missing)
    if reader not in ("auto", "mmap", "pread"):
        raise ArgumentError(f"reader={reader!r}: use 'auto' (mmap for CPU, pread for GPU), 'mmap' or 'pread'.")


def _emptied_buffers(model: nn.Module, loaded: set[str]) -> set[str]:
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


def _target_dtype(model_dtype: torch.dtype, ckpt_dtype: torch.dtype | None, requested: Any) -> torch.dtype:
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
