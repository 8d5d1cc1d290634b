"""Previews for the command line, from headers alone: what a checkpoint holds
(`lazyload inspect`) and what each rank of a tensor-parallel world would read
(`lazyload plan`)."""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ArgumentError, LazyLoadError, MappingError, PlanError
from .formats import open_index, resolve
from .hub import local_path
from .index import CheckpointIndex
from .mapping import map_model, prefix_hint
from .tp.heads import model_heads
from .tp.placements import resolve_placements
from .plan import REPLICATE, check_rank, plan_for_rank
from .remote import RemoteCheckpoint, is_remote
from .report import group_layers, size
from .schedule import layer_of
from .targets import model_slots, model_specs


def _index(path: str) -> CheckpointIndex:
    """Local or remote (s3://, https://, hf://), as LazyCheckpoint reads it."""
    return RemoteCheckpoint(path).index() if is_remote(path) else open_index(resolve(local_path(path)))


def _check_whole(path: str, single_file: bool) -> None:
    """One shard of a checkpoint of several files plans only its own tensors: refused unless asked."""
    if single_file or is_remote(path) or not os.path.isfile(path) or not path.endswith(".safetensors"):
        return
    siblings = resolve(os.path.dirname(os.path.abspath(path))).files
    if len(siblings) > 1:
        raise ArgumentError(f"{path}: one of the {len(siblings)} files of the checkpoint in "
                            f"{os.path.dirname(os.path.abspath(path))}; pass the directory to plan the whole "
                            "checkpoint, or --single-file to plan this file alone.")


def inspect_checkpoint(path: str) -> str:
    index = _index(path)
    lines = [f"{path}: {len(index)} tensors in {len(index.files)} file(s), {size(index.total_bytes)} "
             f"(headers read: {index.header_bytes_read} bytes)", "", "tensors:"]
    names = sorted(index.keys(), key=lambda k: (layer_of(k) != "", k))
    for pattern, count in group_layers(names):
        example = next(k for k in names if _matches(pattern, k))
        entry = index[example]
        tail = f"  x{count}" if count > 1 else ""
        lines.append(f"  {pattern:<60} {str(entry.dtype).removeprefix('torch.'):<9} {str(list(entry.shape)):<18} "
                     f"{size(entry.nbytes)}{tail}")
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


def _matches(pattern: str, name: str) -> bool:
    if "{" not in pattern:
        return pattern == name
    head, _, rest = pattern.partition("{")
    tail = rest.partition("}")[2]
    return name.startswith(head) and name.endswith(tail)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    bytes_to_read: int
    tensors: int
    sharded: int


def _config(path: str, config: Any) -> Any:
    """A transformers config: given, or read from a local config.json (never the network)."""
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return config
    from transformers import AutoConfig

    if config is None and is_remote(path):
        raise ArgumentError(f"{path}: a remote checkpoint's config.json is not fetched; pass --config with the "
                            "model's config.json (or the directory holding it).")
    path = local_path(path)
    source = os.fspath(local_path(config)) if config is not None else (
        path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))
    file = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.isfile(file):
        where = f"--config {config}" if config is not None else f"the checkpoint's directory {source}"
        raise ArgumentError(f"{file}: no such file ({where} has no config.json); pass --config with the model's "
                            "config.json or the directory holding it.")
    try:
        return AutoConfig.from_pretrained(file)
    except (OSError, ValueError, KeyError) as exc:
        raise ArgumentError(f"{file}: not a config transformers can read ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}).") from exc


def plan_ranks(path: str, world: int, config: Any = None, plan: Any = None) -> tuple[list[RankPlan], list[str]]:
    """Per rank: bytes to read and tensors, from the checkpoint headers and a meta model of
    `config` (a transformers config, or a directory/file holding config.json; default: the
    checkpoint's directory). Returns (ranks, warnings). A world that cannot be planned is
    a PlanError naming the worlds that can, a checkpoint none of whose keys fit the model a
    MappingError."""
    from transformers import AutoModel, AutoModelForCausalLM

    check_rank(0, world)
    config = _config(path, config)
    index = _index(path)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = AutoModel.from_config(config)
    slots, aliases = model_slots(model)
    specs = model_specs(model, slots)
    mapping = map_model(index, model, specs, aliases)
    hint = prefix_hint(mapping)
    if not mapping.exprs:
        raise MappingError(f"none of the {len(index)} checkpoint tensors fits a model tensor of "
                           f"{type(model).__name__}" + (f": {hint}" if hint else "; check --config."))
    warnings = [hint] if hint else []
    warnings += [f"{len(mapping.missing)} model tensors missing from the checkpoint"] if mapping.missing else []
    warnings += [f"{len(mapping.unexpected)} checkpoint tensors unused"] if mapping.unexpected else []
    rank_plan = lambda rank, w: _rank_plan(model, specs, mapping, index, plan, rank, w)  # noqa: E731
    try:
        ranks = [rank_plan(rank, world)[0] for rank in range(world)]
    except PlanError as exc:
        worlds = [w for w in range(1, max(world, 8) + 1) if w != world and _plans(rank_plan, w)]
        raise PlanError(f"{exc} Worlds that work (of 1 to {max(world, 8)}): "
                        f"{', '.join(map(str, worlds)) or 'none'}.") from exc
    placements = rank_plan(world - 1, world)[1]
    heads = model_heads(model)
    if world > 1 and heads.kv_heads and world > heads.kv_heads and any(p.groups for p in placements.values()):
        warnings.append(f"{heads.kv_heads} KV heads replicated over {world} ranks: each KV head is read by "
                        f"{world // heads.kv_heads} ranks")
    if world > 1 and not any(r.sharded for r in ranks):
        warnings.append(f"nothing is sharded: every rank reads all {size(ranks[0].bytes_to_read)} the model "
                        "loads (no TP plan matched)")
    return ranks, warnings


def _rank_plan(model, specs, mapping, index, plan, rank: int, world: int) -> tuple[RankPlan, dict]:
    """One rank's RankPlan, and its placements."""
    placements = resolve_placements(model, specs, [], plan, rank, world).placements
    dtypes = {n: index[e.keys()[0]].dtype for n, e in mapping.exprs.items()}
    _, items = plan_for_rank(mapping.exprs, index, {n: s.shape for n, s in specs.items()}, dtypes, placements,
                             rank, world)
    sharded = sum(1 for n in mapping.exprs if placements.get(n, REPLICATE).kind != "replicate")
    return RankPlan(rank, sum(i.nbytes for i in items), len(mapping.exprs), sharded), placements


def _plans(rank_plan, world: int) -> bool:
    """Whether `world` can be planned (its first and last ranks: where uneven splits show)."""
    try:
        rank_plan(0, world)
        rank_plan(world - 1, world)
    except LazyLoadError:
        return False
    return True


def format_plan(path: str, world: int, config: Any = None, *, single_file: bool = False) -> str:
    _check_whole(path, single_file)
    ranks, warnings = plan_ranks(path, world, config)
    lines = [f"{path}: world {world}", f"{'rank':>4}  {'bytes to read':>15}  {'tensors':>7}  {'sharded':>7}"]
    lines += [f"{r.rank:>4}  {r.bytes_to_read:>15,}  {r.tensors:>7}  {r.sharded:>7}" for r in ranks]
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)
