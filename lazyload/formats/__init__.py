"""Checkpoint formats: what a path names, and the Index built from that format's metadata.

Each format is one module that registers a `Format` (`protocol.py` documents the protocol
and its extension points): lazyload's pre-sharded layout (`sharded`), DeepSpeed's
checkpoint json (`deepspeed`), Megatron-LM per-rank checkpoints (`megatron`), PyTorch
`.bin`/`.pt` state dicts (`torch_files`), training checkpoints (torch DCP directories, `dcp`;
DCP's per-rank safetensors, `dcp_safetensors`; Megatron-Core `torch_dist`, `megatron_dist`),
safetensors files (`safetensors`, the catch-all).
All give the same `TensorEntry`s, and a tensor stored in pieces across files is one
logical name (`logical`). None reads tensor data to build it. This module registers the
built-ins, in the order they are asked, and resolves local paths (`local.py`); URLs are
resolved by `remote.source` through the same registry.
"""
from __future__ import annotations

import glob
import os
from typing import Sequence

from ..index import CheckpointIndex
from . import dcp, dcp_safetensors, deepspeed, megatron, megatron_dist, safetensors, sharded, torch_files
from .local import LocalStorage
from .protocol import (CheckpointSource, Format, OpenOptions, Storage, format_named, formats, open_in, register,
                       resolve_in, unregister)

# Training checkpoints are asked before Megatron-LM's per-rank files, whose tracker file they share.
_TRAINING = (megatron_dist.FORMAT_MEGATRON_DIST, dcp_safetensors.FORMAT_DCP_SAFETENSORS, dcp.FORMAT_DCP)
for _builtin in (sharded.FORMAT_SHARDED, deepspeed.FORMAT_DEEPSPEED, *_TRAINING, megatron.FORMAT_MEGATRON,
                 torch_files.FORMAT_TORCH, safetensors.FORMAT_SAFETENSORS):
    register(_builtin)

LOCAL = LocalStorage()

__all__ = ["CheckpointSource", "Format", "LocalStorage", "OpenOptions", "Storage", "format_named", "formats",
           "open_index", "register", "resolve", "unregister"]


def resolve(paths: str | os.PathLike | Sequence[str | os.PathLike], iteration: int | None = None) -> CheckpointSource:
    """A local directory, a file, a description json, a glob or a list of files -> its
    format and files (the first registered format that claims it); `iteration`: that
    `iter_NNNNNNN/` of a save directory (`protocol.resolve_in`)."""
    if isinstance(paths, (str, os.PathLike)):
        target = os.fspath(paths)
        if not os.path.exists(target):
            target = sorted(glob.glob(target)) or target  # a glob that matches nothing is named as given
    else:
        target = [os.fspath(p) for p in paths]
    return resolve_in(LOCAL, target, iteration)


def open_index(source: CheckpointSource, trust_pickle: bool = False) -> CheckpointIndex:
    """The Index of a resolved local checkpoint, from its metadata alone. `trust_pickle`:
    let pickled files run the code they name (see torch_files)."""
    return open_in(source, LOCAL, OpenOptions(trust_pickle))
