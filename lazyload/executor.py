"""The executor: carries out a `LoadPlan` (planner.py), the only place where the model
changes, in named steps:

    swap quantized layers -> make parallel -> allocate -> read and place -> agree -> assign -> buffers

Every input check ran in the planner, and every rank agreed on its plan before `execute`
is called (`load_into`); here a read can fail (a ReadError saying what was loaded), or
another rank. A load that changes the model's structure (quantized layers swapped, the
model made parallel) is undone when it fails: the model is left as it was.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import replace

from torch import nn
from tqdm.auto import tqdm

from .agreement import Agreement, NoAgreement
from .buffers import fill_meta_buffers
from .cooperate import Share, exchange
from .mesh import tp_mesh
from .engine import EngineStats, run_schedule, settle_failure
from .errors import PlanError, ReadError
from .tp.runnable import default_mesh, make_runnable
from .placer import Destination, TensorDest, allocate, allocate_quantized, assign, with_whole
from .planner import LoadPlan
from .quant.kept4 import kept_expert_styles
from .quant.linear import to_torchao
from .quant.pack4 import stored_shape
from .quant.packed import quantize_shared
from .quant.targets import saved_bytes, swap_quantized
from .readers import Reader, choose_reader
from .report import LoadReport, MemorySampler, size
from .targets import ModuleStates, Slot, current_tensor, is_dtensor, local_tensor, model_slots

logger = logging.getLogger("lazyload")


def execute(plan: LoadPlan, model: nn.Module, agree: Agreement | NoAgreement = NoAgreement(),
            started: float | None = None) -> LoadReport:
    """Load `model` as `plan` says; returns the LoadReport (`started`: when planning began)."""
    started = time.perf_counter() if started is None else started
    before = ModuleStates(model) if restructures(plan) else None
    try:
        return _execute(plan, model, agree, started)
    except BaseException:
        if before is not None:
            before.restore()  # a failed rank or read leaves no half-transformed model
        raise


def restructures(plan: LoadPlan) -> bool:
    """Whether the load changes the model's modules (not only its tensors' values)."""
    return bool(plan.quantized) or plan.parallel is not None


def _execute(plan: LoadPlan, model: nn.Module, agree: Agreement | NoAgreement, started: float) -> LoadReport:
    slots = swap_quantized_layers(plan, model)
    make_parallel(plan, model, slots)
    reader = choose_reader(plan.reader, plan.device, plan.release_pages, plan.items, plan.index, plan.world,
                           plan.remote)
    logger.info("lazyload: loading %d tensors (%s to copy, %s mapped) with the %s reader, budget %s",
                len(plan.targets), size(plan.bytes_copied), size(plan.bytes_mapped), reader.name, size(plan.budget))
    # The bar counts every byte a target gets: copied, and mapped (paged in by the schedule, or already cached).
    bar = tqdm(total=(plan.bytes_copied + plan.bytes_mapped) / 2**20, unit="MiB", desc="lazyload",
               disable=not _show_progress(plan.options.progress, plan.rank),
               bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} MiB [{elapsed}<{remaining}, {rate_fmt}{postfix}]")
    with MemorySampler() as memory, bar:
        try:
            dests = allocate_destinations(plan, slots, reader)
            if not reader.prefetching:
                bar.update(plan.bytes_mapped / 2**20)
            share = plan.share
            stats = read_and_place(plan, reader, dests, slots, bar, share)
        finally:
            reader.close()
        # every rank read everything: only now is any model made runnable
        agree.reached("read", time.perf_counter() - started)
        shared_amax = any(grid.shared_amax for grid in plan.quantized.values())  # the same on every rank
        with agree.collectives(share is not None or shared_amax):  # bounded, and agreed on at "exchanged"
            received = receive_shared(plan, share, dests, bar)
            quantize_shared(dests)
        assign_loaded(plan, slots, dests)
        recomputed = fill_meta_buffers(plan.recompute)
    held = torchao_holders(plan, model)
    report = _report(plan, reader, dests, stats, memory, recomputed, time.perf_counter() - started, held,
                     received)
    logger.info("%s", report)
    if not report.ok:
        logger.warning("lazyload: rank %d: %s (strict=False); see the report", plan.rank,
                       _problems(report, plan.options.missing))
    return report


def swap_quantized_layers(plan: LoadPlan, model: nn.Module) -> dict[str, Slot]:
    """Linear layers and fused experts quantized on load become their quantized modules
    (on meta); the slots then name the new modules' tensors."""
    if not plan.quantized:
        return plan.mapped.slots
    swap_quantized(model, plan.quantized, plan.quantization)
    return model_slots(model)[0]


def make_parallel(plan: LoadPlan, model: nn.Module, slots: dict[str, Slot]) -> None:
    """The plan's ParallelPlan carried out (under torch.distributed, a model nobody made
    parallel: DTensors of the planned split); each planned local shape must be the one its
    parameter now has."""
    if plan.parallel is None:
        return
    mesh = default_mesh(plan.world, plan.device) if plan.options.mesh is None else tp_mesh(plan.options.mesh)
    styles = kept_expert_styles(plan.parallel.expert_styles, plan.quantized)  # kept experts: blocks and scales
    make_runnable(model, mesh, replace(plan.parallel, expert_styles=styles))
    for target in plan.targets:
        grid = plan.quantized.get(target.name)
        if grid is not None and grid.keep and grid.axis == -2:
            continue  # MXFP4 experts kept as their blocks and scales, cut by expert
        tensor = current_tensor(slots[target.name])
        want = stored_shape(target.local_shape, grid.packed) if grid is not None and grid.packed else target.local_shape
        if is_dtensor(tensor) and tuple(local_tensor(tensor).shape) != want:
            raise PlanError(f"{target.name}: made parallel with a local shape of {list(local_tensor(tensor).shape)}, "
                            f"planned as {list(want)} (a lazyload bug: please report it).")


def allocate_destinations(plan: LoadPlan, slots: dict[str, Slot], reader: Reader) -> dict[str, Destination]:
    """Each target's destination: a view of the file mapping, 8-bit data and scales, the
    model's own tensor (filled in place) or a new one; behind a `WholeDest` when converted."""
    dests: dict[str, Destination] = {}
    items = Counter(item.target for item in plan.items)
    for target in plan.targets:
        if target.name in plan.views:
            dests[target.name] = TensorDest(reader.view(plan.views[target.name]).reshape(target.local_shape))
        elif target.name in plan.quantized:
            dests[target.name] = allocate_quantized(target, plan.quantized[target.name], plan.device,
                                                    plan.full_dtypes[target.name], items[target.name])
        else:
            dests[target.name] = allocate(target, slots[target.name], plan.device)
    return dests


def read_and_place(plan: LoadPlan, reader: Reader, dests: dict[str, Destination], slots: dict[str, Slot],
                   bar: tqdm, share: Share | None = None) -> EngineStats:
    """Run the schedule (of the targets this rank reads, when replicas share reads); after a
    failed read, what was fully read is assigned, the rest left as it was (nothing is
    assigned when the load changes the model's structure: `execute` undoes it)."""
    groups = plan.groups if reader.prefetching else plan.copy_groups
    if share is not None:
        groups = share.own(groups)
        dests = {item.target: dests[item.target] for group in groups for item in group.items}
    placing = with_whole(dests, [t for t in plan.targets if t.name in dests], plan.mapping.exprs, plan.items,
                         plan.index.shape_of)
    try:
        return run_schedule(groups, reader, placing, plan.budget, on_bytes=_progress(bar, reader),
                            mapped=frozenset(plan.views))
    except ReadError as exc:
        raise settle_failure(exc, slots, dests, undone=restructures(plan)) from exc


def receive_shared(plan: LoadPlan, share: Share | None, dests: dict[str, Destination], bar: tqdm) -> int:
    """The targets other replicas read, received from them (every rank having read its part);
    returns the bytes received."""
    if share is None:
        return 0
    received, staged = exchange(plan.groups, share, dests, plan.budget)
    logger.debug("lazyload: exchange staged at most %s of non-contiguous destinations", size(staged))
    bar.update(received / 2**20)
    return received


def assign_loaded(plan: LoadPlan, slots: dict[str, Slot], dests: dict[str, Destination]) -> None:
    """Every target's tensors (a quantized one's scales too), and the initialised ones, into the model."""
    for target in plan.targets:
        for name, tensor in dests[target.name].tensors(target.name).items():
            assign(slots[name], tensor)
    for name, value in plan.initialized.items():
        assign(slots[name], value)


def torchao_holders(plan: LoadPlan, model: nn.Module) -> list[str]:
    """With Quantization(torchao=True) (the default where torchao is installed), the
    quantized Linear layers torchao can hold become its holders; returns their names."""
    if not (plan.quantized and plan.quantization.torchao):
        return []
    styles = plan.parallel.styles if plan.parallel is not None else {}
    return to_torchao(model, [name.rpartition(".")[0] for name in plan.quantized if name.endswith(".weight")], styles)


def _report(plan: LoadPlan, reader: Reader, dests: dict[str, Destination], stats: EngineStats,
            memory: MemorySampler, recomputed: list[str], seconds: float, torchao: list[str],
            received: int = 0) -> LoadReport:
    mapping, quantized = plan.mapping, plan.quantized
    return LoadReport(loaded=[t.name for t in plan.targets], missing=mapping.missing,
                      unexpected=mapping.unexpected, mismatched=mapping.mismatched,
                      initialized=list(plan.initialized), recomputed_buffers=recomputed,
                      ignored_buffer_keys=mapping.ignored_buffer_keys, other_stages=mapping.other_stages,
                      read_whole={n: sum(i.nbytes for i in plan.items if i.target == n) for n in plan.whole},
                      bytes_read=reader.bytes_read, bytes_mapped=plan.bytes_mapped,
                      bytes_received=received, seconds=seconds,
                      peak_rss=memory.peak_rss, peak_anon=memory.peak_anon, peak_file=memory.peak_file,
                      rank=plan.rank, world=plan.world, plan=plan.plan_used, reader=reader.name, prefetched=reader.prefetching,
                      released_pages=plan.release_pages, pinned_bytes=stats.pinned_bytes,
                      quantized=[name.rpartition(".")[0] for name in quantized],
                      quantized_to=plan.quantization.describe(len(torchao)) if quantized else "",
                      bytes_saved=saved_bytes({n: dests[n] for n in quantized}, plan.full_dtypes),
                      h2d_bytes=stats.h2d_bytes, h2d_seconds=stats.h2d_seconds, **reader.report_fields())


def _show_progress(progress: bool | None, rank: int) -> bool:
    if progress is not None:
        return bool(progress) and rank == 0
    return rank == 0 and os.environ.get("LAZYLOAD_PROGRESS", "1").lower() not in ("0", "false", "no", "off")


def _progress(bar: tqdm, reader: Reader):
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
