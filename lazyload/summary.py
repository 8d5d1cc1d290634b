"""Previews for the command line, from headers alone: what a checkpoint holds
(`lazyload inspect`) and what each rank of a tensor-parallel world would read
(`lazyload plan`)."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any


from .digest import plan_data
from .expr import Cat, Expr, Packed4
from .fit import check_fit
from .formats import format_named
from .errors import ArgumentError, MappingError, PlanError
from .hints import one_of_several, worlds_that_plan
from .mapping import prefix_hint
from .tp.heads import model_heads
from .plan import check_rank
from .planner import LoadOptions, LoadPlan, check_values, plan_load
from .report import group_layers, size
from .schedule import layer_of
from .stored import StoredCheckpoint, meta_model, transformers_config


def _check_whole(path: str, single_file: bool) -> None:
    """One shard of a checkpoint of several files plans only its own tensors: refused unless asked."""
    several = None if single_file else one_of_several(path)
    if several is not None:
        raise ArgumentError(f"{path}: one of the {several[1]} files of the checkpoint in {several[0]}; pass the "
                            "directory to plan the whole checkpoint, or --single-file to plan this file alone.")


def inspect_checkpoint(path: str, iteration: int | None = None) -> str:
    stored = StoredCheckpoint(path, iteration=iteration)
    index = stored.index  # local or remote, as LazyCheckpoint reads it
    lines = [f"{path}{_iteration_read(stored, path)}: {len(index)} tensors in {len(index.files)} file(s), "
             f"{size(index.total_bytes)} "
             f"(headers read: {index.header_bytes_read} bytes)", "", "tensors:"]
    names = sorted(index.keys(), key=lambda k: (layer_of(k) != "", k))
    for pattern, count in group_layers(names):
        example = next(k for k in names if _matches(pattern, k))
        entry = index[example]
        tail = f"  x{count}" if count > 1 else ""
        lines.append(f"  {pattern:<60} {str(entry.dtype).removeprefix('torch.'):<9} {str(list(entry.shape)):<18} "
                     f"{size(entry.nbytes)}{tail}")
    lines += _packed_weights(stored)
    lines += ["", "bytes per file:"]
    per_file = defaultdict(int)
    for entry in index.entries():
        per_file[entry.file] += entry.nbytes
    lines += [f"  {os.path.basename(f):<40} {size(per_file[f])}" for f in index.files]
    lines += ["", "bytes per layer:"]
    per_layer = defaultdict(int)
    for entry in index.entries():
        per_layer[layer_of(entry.key) or "(outside layers)"] += entry.nbytes
    lines += [f"  {layer:<40} {size(n)}" for layer, n in per_layer.items()]
    lines += ["", f"total: {size(index.total_bytes)} ({index.total_bytes} bytes)"]
    return "\n".join(lines)


def _iteration_read(stored: StoredCheckpoint, path: str) -> str:
    """' (.../iter_0000200)' where a save directory was given: the iteration that was read."""
    source = stored.source
    return f" ({source.description})" if format_named(source.kind).iterations and source.description != path else ""


def _packed_weights(stored: StoredCheckpoint) -> list[str]:
    """The 4-bit packed weights (NVFP4, INT4): per layer pattern, the packed data and its
    scales (and global scale), the format and its group size."""
    leaves = [leaf for expr in stored.quantization.leaves.values() for leaf in _tiles(expr)
              if isinstance(leaf, Packed4)]
    if not leaves:
        return []
    by_packed = {leaf.packed: leaf for leaf in leaves}
    lines = ["", "4-bit packed weights (packed data + scales [+ global scale]):"]
    names = sorted(by_packed, key=lambda k: (layer_of(k) != "", k))
    at = 0  # patterns come in the order of their first names: one pass finds each one's first
    for pattern, count in group_layers(names):
        while not _matches(pattern, names[at]):
            at += 1
        leaf = by_packed[names[at]]
        common = os.path.commonprefix([leaf.packed, leaf.scales])
        stem = pattern[:len(pattern) - len(leaf.packed) + len(common)]
        pair = " + ".join([pattern] + [stem + k[len(common):] for k in (leaf.scales, leaf.glob) if k])
        lines.append(f"  {pair}  {leaf.codec} (group {leaf.group})" + (f"  x{count}" if count > 1 else ""))
    return lines


def _tiles(expr: Expr) -> list[Expr]:
    """The leaves of a tiling (a weight stored in pieces), or the leaf itself."""
    return [leaf for part in expr.parts for leaf in _tiles(part)] if isinstance(expr, Cat) else [expr]


def _matches(pattern: str, name: str) -> bool:
    if "{" not in pattern:
        return pattern == name
    head, _, rest = pattern.partition("{")
    tail = rest.partition("}")[2]
    return name.startswith(head) and name.endswith(tail)


def plan_ranks(path: str, world: int, config: Any = None, plan: Any = None, *, quantize: Any = None,
               dtype: Any = None, iteration: int | None = None) -> tuple[list[LoadPlan], list[str]]:
    """Every rank's LoadPlan (`bytes_to_read`, `tensors`, `sharded`), as `load_into` plans
    it, from the checkpoint headers and a meta model of `config` (a transformers config, or
    a directory/file holding config.json; default: the one beside the checkpoint, for a URL
    its store's); `iteration`: that one of a Megatron save directory. Returns (plans,
    warnings). A world that cannot be planned is a PlanError naming the worlds that can, a checkpoint none of whose keys fit the model a MappingError,
    meta buffers the model's init cannot compute a MetaBufferError, a rank that cannot fit
    this host's memory a PlanError (as `load_into` says: `fit.check_fit`)."""
    check_rank(0, world)
    stored = StoredCheckpoint(path, iteration=iteration)
    model = meta_model(transformers_config(stored, config, "--config"))
    options = LoadOptions(plan=plan, quantize=quantize, dtype=dtype, strict=False, missing="keep")
    first = plan_load(stored, model, 0, 1, options, preview=True)
    mapping = first.mapping
    hint = prefix_hint(mapping)
    if not mapping.exprs:
        raise MappingError(f"none of the {len(stored.index)} checkpoint tensors fits a model tensor of "
                           f"{type(model).__name__}" + (f": {hint}" if hint else "; check --config."))
    warnings = [hint] if hint else []
    warnings += [f"{len(mapping.missing)} model tensors missing from the checkpoint"] if mapping.missing else []
    warnings += [f"{len(mapping.unexpected)} checkpoint tensors unused"] if mapping.unexpected else []
    rank_plan = lambda rank, w: plan_load(stored, model, rank, w, options, preview=True, mapped=first.mapped)  # noqa: E731
    try:
        ranks = [rank_plan(rank, world) for rank in range(world)]
    except PlanError as exc:
        worlds = worlds_that_plan(rank_plan, world)
        raise PlanError(f"{exc} Worlds that work (of 1 to {max(world, 8)}): "
                        f"{', '.join(map(str, worlds)) or 'none'}.") from exc
    for planned in ranks:  # what each rank's load computes before reading, refused as load_into refuses it
        check_values(planned, model)
    for planned in ranks:  # and a rank that cannot fit this host (fit.py)
        check_fit(planned, stored, model, preview=True)
    heads = model_heads(model)
    if world > 1 and heads.kv_heads and world > heads.kv_heads and any(
            p.groups for p in ranks[-1].placements.placements.values()):
        warnings.append(f"{heads.kv_heads} KV heads replicated over {world} ranks: each KV head is read by "
                        f"{world // heads.kv_heads} ranks")
    if world > 1 and not any(r.sharded for r in ranks):
        warnings.append(f"nothing is sharded: every rank reads all {size(ranks[0].bytes_to_read)} the model "
                        "loads (no TP plan matched)")
    return ranks, warnings


def format_plan(path: str, world: int, config: Any = None, *, single_file: bool = False, plan: Any = None,
                quantize: Any = None, dtype: Any = None, as_json: bool = False, iteration: int | None = None) -> str:
    """Each rank's bytes, tensors and sharded tensors, and the warnings; `as_json`: every
    rank's whole plan and its digest (`digest.plan_data`) as one JSON object instead."""
    _check_whole(path, single_file)
    ranks, warnings = plan_ranks(path, world, config, plan, quantize=quantize, dtype=dtype, iteration=iteration)
    if as_json:
        return json.dumps({"path": path, "world": world, "warnings": warnings, "ranks": [plan_data(r) for r in ranks]},
                          indent=1, ensure_ascii=False)
    split = f" ({ranks[0].plan_used} plan)" if ranks[0].plan_used else ""
    lines = [f"{path}: world {world}{split}", f"{'rank':>4}  {'bytes to read':>15}  {'tensors':>7}  {'sharded':>7}"]
    lines += [f"{r.rank:>4}  {r.bytes_to_read:>15,}  {r.tensors:>7}  {r.sharded:>7}" for r in ranks]
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)
