"""Megatron-Core `torch_dist` checkpoints (Megatron-LM, NeMo 2's `weights/`): a DCP
directory (`iter_NNNNNNN/` with `metadata.json` saying `"sharded_backend": "torch_dist"`,
`.metadata`, `__R_N.distcp`, `common.pt`) under Megatron's layer-stacked names, read as
transformers' Llama-family names (Llama, Mistral, Qwen2/3, and the MoEs Mixtral, Qwen2/3-MoE).

The chunks are found as for any DCP checkpoint (`dcp`): header-only, checked to tile each
tensor. A stacked tensor (`decoder.layers.self_attention.linear_qkv.weight`, global shape
[layers, rows, hidden]) is unstacked at the entry level: a chunk covering layers
[l0, l1) is one stored entry per layer (row-major, so each layer's bytes are a contiguous
run of the chunk's), and each layer's Megatron tensor is the tiling of those. The
transformers tensors are expressions over them: `linear_qkv` rows interleaved per query
group ([groups, q heads of the group + 2, head size]: its q heads, then its k, then its v)
are de-interleaved with `Chunk`s per head; `linear_fc1` ([all gate rows; all up rows]) is
split in two; norms (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`),
`embedding.word_embeddings`, `output_layer` and `decoder.final_layernorm` are renamed. So a
rank's box pushed down reads only the heads and rows it holds, at any TP.

MoE layers (Mixtral, Qwen2/3-MoE in transformers 5): `mlp.router.weight` is the router
`mlp.gate.weight`; the experts are one tensor with an expert axis,
`mlp.experts.experts.linear_fc1.weight` [layers, experts, 2 x ffn, hidden] (each expert's
gate rows then its up rows) and `...linear_fc2.weight` [layers, experts, hidden, ffn], as
SequentialMLP, GroupedMLP and TEGroupedMLP all save them, which per layer is exactly
transformers' fused `mlp.experts.gate_up_proj` / `down_proj`: renamed, and the model's plan
cuts each expert's gate and up rows (TP) or whole experts (EP). Qwen2-MoE's shared expert is
split as the dense fc1 and its gate renamed. A layer saved unstacked (`decoder.layers.N.`,
as Megatron does for layers of several kinds) is read as that layer's.

A save directory is read at the iteration its tracker names, or at `iteration=` (the
format has iterations: `protocol.resolve_in`); everything is read through the storage, so
its URL loads too (NeMo 2's `weights/` is then named by the URL itself).

The head counts come from Megatron's `args` in its common state: `common.pt`, or (since
megatron-core 0.17, which writes no common.pt) the DCP byte item `common_state/shard_0_1` in
the .distcp files, both read by torch's restricted unpickler, `argparse.Namespace` allowed;
or else from the `config.json` beside the checkpoint. Each count is checked (a positive
integer, the heads a multiple of the groups), and the tracker must hold an iteration number
or `release`, as Megatron writes it. Optimizer state, RNG state and `_extra_state` byte items
are not read.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch

from ..errors import CheckpointError, shown
from ..expr import Cat, Chunk, Expr, Source
from ..headers import TensorEntry
from ..index import CheckpointIndex
from . import dcp, torch_files
from .dcp_metadata import DcpMetadata
from .logical import Layout, Part
from .protocol import CheckpointSource, Format, OpenOptions, Storage

TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION_DIGITS = 20  # an iteration number of more is none (and int() refuses over 4,300 digits)
_LAYER_DIGITS = 9  # a layer number of more is none
MAX_COUNT = 1 << 31  # heads, query groups, head size: a count from 1 below this
MAX_COMMON = 256 << 20  # common.pt: Megatron's args and small state, kilobytes in practice
# megatron-core 0.17+ keeps the common state in the DCP checkpoint, as this byte item (the
# unique key of its ShardedObject "common_state" of one shard); before, in common.pt
COMMON_STATE = "common_state/shard_0_1"
_STACKED = "decoder.layers."
_PREFIXES = ("module.", "model.module.")  # NeMo 2 / DDP wrappers in front of Megatron's names
_LAYER = "model.layers.{i}."
_RENAMES = {  # per-layer Megatron module -> transformers name (the qkv and fc1 are split instead)
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    # MoE (Mixtral, Qwen2/3-MoE): the router; experts ([experts, rows, in], each expert's fc1
    # [gate; up] as transformers' fused 3-D `gate_up_proj`), saved so by SequentialMLP,
    # GroupedMLP and TEGroupedMLP alike (the doubled `experts.experts.` is Megatron's own key);
    # the shared expert and its sigmoid gate (Qwen2-MoE)
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.experts.linear_fc1.weight": "mlp.experts.gate_up_proj",
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.down_proj",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_GLOBAL = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
           "decoder.final_layernorm.weight": "model.norm.weight"}
_GATE_UP = {"mlp.linear_fc1.weight": "mlp.{}_proj.weight",  # [all gate rows; all up rows] -> two Linears
            "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.{}_proj.weight"}
_SPLIT = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", *_GATE_UP)


@dataclass(frozen=True)
class Heads:
    heads: int   # attention heads, all ranks
    groups: int  # query groups (KV heads)
    size: int    # head size


@dataclass(frozen=True)
class Derived:
    """A tensor given as an expression over stored keys (a split of a fused Megatron
    tensor), in the index's layouts beside the tilings."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tree: Expr
    copies: tuple[str, ...] = ()  # stored keys of copies of its pieces the tree does not read (a sync's replicas)

    def keys(self) -> list[str]:
        return list(dict.fromkeys((*self.tree.keys(), *self.copies)))

    def expr(self, rank: int = 0, world: int = 1) -> Expr:
        return self.tree


def checkpoint_dir(storage: Storage, path: str) -> str | None:
    """The torch_dist directory `path` names: itself, its latest iteration (the tracker's),
    or NeMo 2's `weights/` (locally: a URL names its `weights/`); None when it names none."""
    tracker = storage.join(path, TRACKER)
    if storage.exists(tracker):
        tag = storage.read(tracker, "Megatron's latest_checkpointed_iteration.txt", 4096).decode("utf-8", "replace")
        path = storage.join(path, iteration_dir(tag.strip(), tracker))
    if _is_torch_dist(storage, path):
        return path
    weights = storage.join(path, "weights")  # NeMo 2; for a URL a probe more per folder, so not asked
    return weights if not storage.remote and storage.is_dir(weights) and _is_torch_dist(storage, weights) else None


def iteration_dir(tag: str, tracker: str) -> str:
    """The directory of the iteration the tracker names, as Megatron names it (`iter_0000100`,
    `release`): Megatron writes an iteration number or `release` there, nothing else (a path
    would load another directory)."""
    if tag == "release":
        return tag
    if _is_number(tag, _ITERATION_DIGITS):
        return f"iter_{int(tag):07d}"
    raise CheckpointError(f"{tracker}: holds {tag[:60]!r}, not an iteration number (ASCII digits) or 'release', "
                          "which is all Megatron writes there; point lazyload at the iteration's directory, or "
                          "write its number in the file.")


def _is_number(text: str, digits: int) -> bool:
    """ASCII digits, at most `digits` of them (str.isdigit alone takes '²' and other scripts'
    digits, which int() refuses or reads as another number)."""
    return text.isascii() and text.isdigit() and len(text) <= digits


def _is_torch_dist(storage: Storage, path: str) -> bool:
    doc = storage.join(path, "metadata.json")
    if not (dcp.is_dcp_dir(storage, path) and storage.exists(doc)):  # .metadata first: the probe dcp's detect shares
        return False
    try:
        return storage.read_json(doc, "Megatron's metadata.json").get("sharded_backend") == "torch_dist"
    except (CheckpointError, AttributeError):
        return False


def args_heads(args: argparse.Namespace, where: str) -> Heads:
    """Attention heads, query groups and head size from Megatron's `args` (read from `where`)."""
    groups = "num_query_groups" if getattr(args, "group_query_attention", False) else None
    return _heads(lambda name: getattr(args, name, None), "Megatron's args.", groups, "kv_channels", where)


def _heads(value, prefix: str, groups_key: str | None, size_key: str, where: str) -> Heads:
    """Heads, groups (`groups_key`'s value, else one a head) and head size (`size_key`'s,
    else hidden_size over the heads) from `value(name)`, each checked to be a count."""
    def count(name: str) -> int:
        found = value(name)
        if isinstance(found, bool) or not isinstance(found, int) or not 0 < found < MAX_COUNT:
            raise CheckpointError(f"{where}: {prefix}{name} is {shown(found)}, not a count from 1 to {MAX_COUNT - 1}; "
                                  "lazyload needs it to split Megatron's fused QKV rows. The file is damaged: re-save "
                                  "or replace it.")
        return found

    heads = count("num_attention_heads")
    groups = count(groups_key) if groups_key and value(groups_key) is not None else heads
    size = count(size_key) if value(size_key) is not None else count("hidden_size") // heads
    if size == 0 or heads % groups:
        raise CheckpointError(f"{where}: {heads} attention heads in {groups} query groups of head size {size}: no "
                              "such attention (the heads must split evenly into the groups, the head size be at "
                              "least 1). The file is damaged: re-save or replace it.")
    return Heads(heads, groups, size)


def config_heads(config, where: str) -> Heads:
    """Attention heads, query groups and head size from a live model's Megatron-Core
    `TransformerConfig` (`where` names it)."""
    return _heads(lambda name: getattr(config, name, None), "Megatron's config.", "num_query_groups", "kv_channels",
                  where)


def heads_of(storage: Storage, path: str, metadata: DcpMetadata) -> Heads:
    """Attention heads, query groups and head size from Megatron's args (in its common state:
    common.pt, or since megatron-core 0.17 the DCP byte item `common_state/shard_0_1`) or the
    config.json beside the checkpoint (or its parents, up to the save directory)."""
    refused = ""
    common = _common_state(storage, path, metadata)
    if common is not None:
        where, raw, wrapped = common
        try:
            tree = torch_files.load_tree(where, False, [argparse.Namespace], data=raw)
        except CheckpointError as exc:  # args holding classes (enums): the config.json is asked instead
            tree, refused = None, f" ({exc})"
        if wrapped:  # the byte item is a list of the common state (of its one shard)
            tree = tree[0] if isinstance(tree, list) and len(tree) == 1 else None
        args = tree.get("args") if isinstance(tree, dict) else None
        if isinstance(args, argparse.Namespace) and getattr(args, "num_attention_heads", None) is not None:
            return args_heads(args, where)
    for folder in _up_to_save_dir(storage, path):
        config = storage.join(folder, "config.json")
        if storage.exists(config):
            return _config_heads(config, storage.read_json(config, "the model's config.json"))
    raise CheckpointError(f"{path}: no Megatron args in its common state (common.pt, or the byte item "
                          f"{COMMON_STATE!r}){refused} and no config.json beside the checkpoint; lazyload needs the "
                          "attention heads and query groups to split the fused QKV rows. Put the model's config.json "
                          "in the checkpoint directory.")


def _common_state(storage: Storage, path: str, metadata: DcpMetadata) -> tuple[str, bytes, bool] | None:
    """(what names it, its torch.save bytes, whether they are a list around it) of Megatron's
    common state: common.pt, else megatron-core 0.17+'s DCP byte item; None when neither is
    there. The byte item's file is one `data_files` checked to be inside the checkpoint."""
    common = storage.join(path, "common.pt")
    if storage.exists(common):
        return common, storage.read(common, "Megatron's common.pt", MAX_COMMON), False
    info = metadata.storage.get((COMMON_STATE, ()))
    if COMMON_STATE not in metadata.byte_items or info is None:
        return None
    file = storage.join(path, info.relative_path)
    where = f"{file} (Megatron's common state, byte item {COMMON_STATE!r})"
    if info.transforms or info.length > MAX_COMMON:
        raise CheckpointError(f"{where}: " + (f"stored transformed ({', '.join(info.transforms)})" if info.transforms
                                              else f"{info.length} bytes, over the {MAX_COMMON} a common state takes")
                              + "; lazyload reads megatron-core's own torch_dist saves. Re-save the checkpoint, or put "
                              "the model's config.json beside it.")
    ranges = storage.ranges({file: [(info.offset, info.offset + info.length)]})[file]
    try:
        return where, ranges.read(info.offset, info.length, f"byte item {COMMON_STATE!r}"), True
    finally:
        ranges.close()


def _up_to_save_dir(storage: Storage, path: str) -> list[str]:
    """`path` and up to two folders above it (NeMo's `weights/`, the save directory), not
    past the root of a URL's store (`s3://bucket`)."""
    out = [path.rstrip("/") or path]
    for _ in range(2):
        parent = storage.dirname(out[-1])
        if not parent or parent == out[-1] or parent.endswith(":") or parent.endswith(":/"):
            break
        out.append(parent)
    return out


def _config_heads(config: str, doc) -> Heads:
    if not isinstance(doc, dict):
        raise CheckpointError(f"{config}: not a JSON object; lazyload needs the model's num_attention_heads / "
                              "hidden_size from it to split Megatron's fused QKV rows.")
    return _heads(doc.get, "", "num_key_value_heads", "head_dim", config)


def is_model_tensor(fqn: str) -> bool:
    """Megatron's model tensors; anything else (optimizer, RNG and rerun state) is not read."""
    return unwrapped(fqn).split(".", 1)[0] in ("embedding", "decoder", "output_layer")


def unwrapped(fqn: str) -> str:
    for prefix in _PREFIXES:
        if fqn.startswith(prefix):
            return fqn[len(prefix):]
    return fqn


def _per_layer(entries: dict[str, TensorEntry], tiles: dict[str, list[Part]], fqn: str, chunk, key: str) -> None:
    """The chunk's stored entry cut into one entry per layer it covers, each placed in its
    layer's tiling (`tiles`: Megatron per-layer name -> parts)."""
    entry = entries.pop(key, None)
    if entry is None or entry.shape != chunk.sizes:
        raise CheckpointError(f"Megatron tensor {fqn!r}: a chunk is saved transposed; lazyload reads "
                              "Megatron's own row-major layout.")
    step = entry.nbytes // chunk.sizes[0] if chunk.sizes[0] else 0
    name = unwrapped(fqn).removeprefix(_STACKED)
    for j in range(chunk.sizes[0]):
        layer = chunk.offsets[0] + j
        layer_key = f"{fqn}@{layer}:{','.join(map(str, chunk.offsets[1:]))}"
        entries[layer_key] = replace(entry, key=layer_key, shape=chunk.sizes[1:], start=entry.start + j * step,
                                     end=entry.start + (j + 1) * step)
        box = tuple((o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:]))
        tiles.setdefault(f"{layer}:{name}", []).append(Part(Source(layer_key), box))


def _split(name: str, tree: Expr, shape: tuple[int, ...], dtype, heads: Heads, where: str) -> dict[str, Derived]:
    """transformers tensors from a fused Megatron one (one layer's qkv or fc1)."""
    if name in _GATE_UP:
        half = (shape[0] // 2,) + shape[1:]
        targets = [_GATE_UP[name].format(part) for part in ("gate", "up")]
        return {t: Derived(t, half, dtype, Chunk(tree, 0, i, 2)) for i, t in enumerate(targets)}
    per, blocks = heads.heads // heads.groups, heads.groups * (heads.heads // heads.groups + 2)
    if shape[0] != blocks * heads.size:
        raise CheckpointError(f"{where}: {name!r} has {shape[0]} rows, not ({heads.heads} heads + 2 x {heads.groups} "
                              f"query groups) x {heads.size}; the heads lazyload found do not fit this checkpoint.")
    param = name.rpartition(".")[2]
    out = {}
    for comp, picks in (("q", range(per)), ("k", [per]), ("v", [per + 1])):
        rows = [Chunk(tree, 0, g * (per + 2) + t, blocks) for g in range(heads.groups) for t in picks]
        target = f"self_attn.{comp}_proj.{param}"
        out[target] = Derived(target, (len(rows) * heads.size,) + shape[1:], dtype, Cat(tuple(rows), 0))
    return out


def transformers_names(layouts: dict[str, Layout], heads: Heads, where: str) -> dict[str, object]:
    """Megatron (per-layer or global) tilings -> transformers names."""
    out: dict[str, object] = {}
    for key, layout in layouts.items():
        layer, _, name = key.rpartition(":")
        tree, copies = layout.expr(), tuple(layout.keys())  # a sync source's replicated boxes: copies
        if not layer:  # a global tensor
            if name not in _GLOBAL:
                raise CheckpointError(f"{where}: Megatron key {name!r} is not one lazyload knows (expected one of "
                                      f"{sorted(_GLOBAL)} or a decoder.layers.* tensor).")
            out[_GLOBAL[name]] = Derived(_GLOBAL[name], layout.shape, layout.dtype, tree, copies)
            continue
        prefix = _LAYER.format(i=layer)
        if name in _SPLIT:
            derived = _split(name, tree, layout.shape, layout.dtype, heads, where)
        elif name in _RENAMES:
            derived = {_RENAMES[name]: Derived(_RENAMES[name], layout.shape, layout.dtype, tree)}
        else:
            raise CheckpointError(f"{where}: Megatron key 'decoder.layers.{name}' (layer {layer}) is not one lazyload "
                                  f"knows how to name for transformers; expected one of {sorted(_RENAMES) + list(_SPLIT)} "
                                  "(Megatron's default layout: experts as one tensor with an expert axis; per-expert "
                                  "keys, singleton_local_shards, and other layer kinds are not read).")
        for target, d in derived.items():
            out[prefix + target] = replace(d, name=prefix + target, copies=copies)
    return out


def _layer_number(fqn: str, where: str) -> int | None:
    """N of a `decoder.layers.N.` key; None for any other (a stacked `decoder.layers.<module>`
    key, whose module name is an identifier: it starts with no digit)."""
    name = unwrapped(fqn)
    if not name.startswith(_STACKED):
        return None
    layer = name.removeprefix(_STACKED).partition(".")[0]
    if not layer[:1].isnumeric():
        return None
    if not _is_number(layer, _LAYER_DIGITS):
        raise CheckpointError(f"{where}: Megatron key {fqn[:200]!r}: its layer number {layer[:40]!r} is not one "
                              f"(at most {_LAYER_DIGITS} ASCII digits); the checkpoint's metadata is damaged: re-save it.")
    return int(layer)


def layer_key(fqn: str, where: str) -> str:
    """The key `transformers_names` reads an unstacked Megatron tensor by: "N:<module>" for
    layer N's (`decoder.layers.N.<module>`), ":<fqn>" for a global one."""
    layer = _layer_number(fqn, where)
    if layer is None:
        return f":{unwrapped(fqn)}"
    return f"{layer}:{unwrapped(fqn).removeprefix(_STACKED).partition('.')[2]}"


def index_of(storage: Storage, directory: str) -> CheckpointIndex:
    """The index of a torch_dist checkpoint directory under transformers' names."""
    metadata, header = dcp.read_dcp_metadata(storage, directory)
    where = dcp.metadata_path(storage, directory)
    files = dcp.data_files(storage, directory, metadata)
    planned = [p for p in dcp.planned_chunks(where, metadata) if is_model_tensor(p[0])]
    stored, zips, identities = dcp.locate_chunks(storage, directory, metadata, planned)
    entries, _ = dcp.entries_and_layouts(storage, metadata, planned, stored, directory)
    keys = dcp.chunk_keys([(fqn, chunk) for fqn, chunk, _ in planned])
    tiles: dict[str, list[Part]] = {}
    for (fqn, chunk, _), key in zip(planned, keys):
        layer = _layer_number(fqn, where)
        if unwrapped(fqn).startswith(_STACKED) and layer is None:
            _per_layer(entries, tiles, fqn, chunk, key)
        else:  # a global tensor, or one layer's (`decoder.layers.N.`: layers of several kinds)
            box = tuple((o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            tiles.setdefault(layer_key(fqn, where), []).append(Part(Source(key), box))
    layouts = {}
    for key, parts in tiles.items():
        first = entries[parts[0].expr.keys()[0]]
        shape = tuple(max(p.box[d][1] for p in parts) for d in range(len(parts[0].box)))
        layouts[key] = Layout(key, shape, first.dtype, tuple(parts))
    names = transformers_names(layouts, heads_of(storage, directory, metadata), where)
    return CheckpointIndex.of(files, entries.items(), names, header + zips, where, identities)


def detect(storage: Storage, target) -> CheckpointSource | None:
    """(data files, the torch_dist directory) that `target` names, else None."""
    directory = checkpoint_dir(storage, target) if isinstance(target, str) and storage.is_dir(target) else None
    if directory is None:
        return None
    return CheckpointSource("megatron_dist", dcp.data_files(storage, directory,
                                                            dcp.read_dcp_metadata(storage, directory)[0]), directory)


def _open(source: CheckpointSource, storage: Storage, options: OpenOptions) -> CheckpointIndex:
    return index_of(storage, source.description)


FORMAT_MEGATRON_DIST = Format("megatron_dist", detect, _open, remote=True, iterations=True)
