"""Checkpoint formats: what a path names, and the Index built from that format's metadata.

Each format is a source for the Index, in its own module: safetensors files (`index.py`),
lazyload's pre-sharded layout (`sharded`), PyTorch `.bin`/`.pt` state dicts
(`torch_files`), Megatron-LM per-rank checkpoints (`megatron`), DeepSpeed's checkpoint
description json (`deepspeed`), and training checkpoints: torch DCP directories (`dcp`),
DCP's per-rank safetensors (`dcp_safetensors`), Megatron-Core `torch_dist` (`megatron_dist`).
All give the same `TensorEntry`s, and a tensor stored in pieces across files is one logical
name (`logical`). None reads tensor data to build it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from ..errors import CheckpointError
from ..headers import files_from_index_json, read_json
from ..index import INDEX_JSON, CheckpointIndex, resolve_files
from . import dcp, dcp_safetensors, deepspeed, megatron, megatron_dist, sharded, torch_files

BIN_INDEX_JSON = "pytorch_model.bin.index.json"
DEEPSPEED_JSON = "ds_inference_config.json"  # what DeepSpeed's save_mp_checkpoint_path writes
# Training checkpoints (torch DCP, its safetensors flavour, Megatron-Core torch_dist), in the order asked.
_TRAINING = {"megatron_dist": megatron_dist, "dcp_safetensors": dcp_safetensors, "dcp": dcp}


@dataclass(frozen=True)
class CheckpointSource:
    """What a path names: the format, its files, and the description file (index json,
    layout json, DeepSpeed json, Megatron directory) when there is one."""

    kind: str  # "safetensors" | "sharded" | "torch" | "megatron" | "deepspeed", or one of _TRAINING
    files: list[str]
    description: str | None = None


def resolve(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> CheckpointSource:
    """A directory, a file, a description json, a glob or a list of files -> its format and files."""
    if isinstance(paths, (str, os.PathLike)):
        path = os.fspath(paths)
        for name in (sharded.LAYOUT_JSON, DEEPSPEED_JSON):
            if os.path.isdir(path) and os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
        if os.path.isfile(path) and path.endswith(".json") and not path.endswith(".index.json"):
            return _from_json(path)
        for kind, module in _TRAINING.items():  # asked before Megatron-LM's, whose tracker they share
            hit = module.found(path)
            if hit is not None:
                return CheckpointSource(kind, *hit)
        if os.path.isdir(path) and megatron.is_megatron_dir(path):
            return CheckpointSource("megatron", megatron.rank_files(path), path)
        if os.path.isdir(path):
            torch_dir = _torch_directory(path)
            if torch_dir is not None:
                return torch_dir
    files, index_json = resolve_files(paths)
    if all(torch_files.is_torch_file(f) for f in files):  # e.g. pytorch_model.bin.index.json's shards
        return CheckpointSource("torch", files)
    return CheckpointSource("safetensors", files, index_json)


def _torch_directory(path: str) -> CheckpointSource | None:
    """A directory of `.bin`/`.pt` state dicts (and no safetensors, which are preferred)."""
    names = os.listdir(path)
    if INDEX_JSON in names or any(n.endswith(".safetensors") for n in names):
        return None
    if BIN_INDEX_JSON in names:
        return CheckpointSource("torch", files_from_index_json(os.path.join(path, BIN_INDEX_JSON)))
    files = sorted(os.path.join(path, n) for n in names if n.endswith((".bin", ".pt", ".pth")))
    return CheckpointSource("torch", files) if files else None


def _from_json(path: str) -> CheckpointSource:
    doc = read_json(path, "a checkpoint description json")
    if isinstance(doc, dict) and doc.get("format") == sharded.FORMAT:
        return CheckpointSource("sharded", sharded.files_of(path), path)
    if deepspeed.is_description(doc):
        return CheckpointSource("deepspeed", deepspeed.files_of(path), path)
    raise CheckpointError(f"{path}: a json that lazyload does not know (not a {sharded.LAYOUT_JSON}, a "
                          f"{INDEX_JSON} or a DeepSpeed checkpoint json with 'type' and 'checkpoints'); pass the "
                          "checkpoint's directory or its files.")


def open_index(source: CheckpointSource, trust_pickle: bool = False) -> CheckpointIndex:
    """The Index of a resolved checkpoint, from its metadata alone. `trust_pickle`: let
    pickled files run the code they name (see torch_files)."""
    if source.kind == "sharded":
        return sharded.open_index(source.description)
    if source.kind == "torch":
        return torch_files.open_index(source.files, trust_pickle)
    if source.kind == "megatron":
        return megatron.open_index(source.files, trust_pickle)
    if source.kind in _TRAINING:
        return _TRAINING[source.kind].open_found(source.files, source.description)
    if source.kind == "deepspeed":
        return deepspeed.open_index(source.description, trust_pickle)
    return CheckpointIndex(source.files, source.description)
