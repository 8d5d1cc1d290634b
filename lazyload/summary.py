"""Previews for the command line, from headers alone: what a checkpoint holds
(`lazyload inspect`) and what each rank of a tensor-parallel world would read
(`lazyload plan`)."""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from .errors import PlanError
from .formats import open_index, resolve
from .index import CheckpointIndex
from .mapping import map_model
from .placements import model_heads, resolve_placements
from .plan import REPLICATE, check_rank, plan_for_rank
from .report import group_layers
from .schedule import layer_of
from .targets import model_slots, model_specs


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def _index(path: str) -> CheckpointIndex:
    return open_index(resolve(path))


def inspect_checkpoint(path: str) -> str:
    index = _index(path)
    lines = [f"{path}: {len(index)} tensors in {len(index.files)} file(s), {_size(index.total_bytes)} "
             f"(headers read: {index.header_bytes_read} bytes)", "", "tensors:"]
    names = sorted(index.keys(), key=lambda k: (layer_of(k) != "", k))
    for pattern, count in group_layers(names):
        example = next(k for k in names if _matches(pattern, k))
        entry = index[example]
        tail = f"  x{count}" if count > 1 else ""
        lines.append(f"  {pattern:<60} {str(entry.dtype).removeprefix('torch.'):<9} {str(list(entry.shape)):<18} "
                     f"{_size(entry.nbytes)}{tail}")
    lines += ["", "bytes per file:"]
    per_file = defaultdict(int)
    for entry in index.entries():
        per_file[entry.file] += entry.nbytes
    lines += [f"  {os.path.basename(f):<40} {_size(per_file[f])}" for f in index.files]
    lines += ["", "bytes per layer:"]
    per_layer = defaultdict(int)
    for entry in index.entries():
        per_layer[layer_of(entry.key) or "(outside layers)"] += entry.nbytes
    lines += [f"  {layer:<40} {_size(n)}" for layer, n in per_layer.items()]
    lines += ["", f"total: {_size(index.total_bytes)} ({index.total_bytes} bytes)"]
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


def plan_ranks(path: str, world: int, config: Any = None, plan: Any = None) -> tuple[list[RankPlan], list[str]]:
    """Per rank: bytes to read and tensors, from the checkpoint headers and a meta model of
    `config` (a transformers config, or a directory/file holding config.json; default: the
    checkpoint's directory). Returns (ranks, warnings); a plan that cannot be made is a warning."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    check_rank(0, world)
    index = _index(path)
    if config is None or isinstance(config, (str, os.PathLike)):
        source = config or (path if os.path.isdir(path) else os.path.dirname(path))
        config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = AutoModel.from_config(config)
    slots, aliases = model_slots(model)
    specs = model_specs(model, slots)
    mapping = map_model(index, model, specs, aliases)
    warnings = [f"{len(mapping.missing)} model tensors missing from the checkpoint"] if mapping.missing else []
    warnings += [f"{len(mapping.unexpected)} checkpoint tensors unused"] if mapping.unexpected else []
    dtypes = {n: index[e.keys()[0]].dtype for n, e in mapping.exprs.items()}
    ranks = []
    for rank in range(world):
        try:
            resolved = resolve_placements(model, specs, [], plan, rank, world)
            _, items = plan_for_rank(mapping.exprs, index, {n: s.shape for n, s in specs.items()}, dtypes,
                                     resolved.placements, rank, world)
        except PlanError as exc:
            warnings.append(f"world {world} cannot be planned: {exc}")
            return [], warnings
        sharded = sum(1 for n in mapping.exprs if resolved.placements.get(n, REPLICATE).kind != "replicate")
        ranks.append(RankPlan(rank, sum(i.nbytes for i in items), len(mapping.exprs), sharded))
    heads = model_heads(model)
    if world > 1 and heads.kv_heads and world > heads.kv_heads and any(
            p.groups for p in resolved.placements.values()):
        warnings.append(f"{heads.kv_heads} KV heads replicated over {world} ranks: each KV head is read by "
                        f"{world // heads.kv_heads} ranks")
    if world > 1 and not any(r.sharded for r in ranks):
        warnings.append("nothing is sharded: every rank reads the whole checkpoint (no TP plan matched)")
    return ranks, warnings


def format_plan(path: str, world: int, config: Any = None) -> str:
    ranks, warnings = plan_ranks(path, world, config)
    lines = [f"{path}: world {world}", f"{'rank':>4}  {'bytes to read':>15}  {'tensors':>7}  {'sharded':>7}"]
    lines += [f"{r.rank:>4}  {r.bytes_to_read:>15,}  {r.tensors:>7}  {r.sharded:>7}" for r in ranks]
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)
