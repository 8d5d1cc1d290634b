"""LazyCheckpoint: the public entry point. A load is: check the arguments, plan, agree, execute.

    options -> plan_load(checkpoint, model, rank, world) -> LoadPlan -> execute(plan, model) -> LoadReport
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from .agreement import RANK_TIMEOUT, agreement
from .digest import load_facts
from .errors import LazyLoadError
from .executor import execute
from .fit import check_fit
from .hints import explain
from .keywords import check_keywords
from .mapping import KeyMap
from .mesh import ranks_of
from .planner import LoadOptions, plan_load
from .quant.onload import Quantization
from .report import LoadReport
from .remote import RemoteOptions
from .stored import StoredCheckpoint


class LazyCheckpoint(StoredCheckpoint):
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
    gap, retries, timeout).

    `iteration`: with a Megatron save directory (local or a URL), the iteration to load
    (`iter_NNNNNNN/`) instead of the latest one its `latest_checkpointed_iteration.txt`
    names; one that is not there is a CheckpointError listing those present, and a
    checkpoint without iterations an ArgumentError."""

    def __init__(self, paths: str | os.PathLike | list, *, trust_pickle: bool = False,
                 remote: RemoteOptions | None = None, iteration: int | None = None, **unknown: Any):
        check_keywords("LazyCheckpoint", unknown, LazyCheckpoint.__init__)
        super().__init__(paths, trust_pickle=trust_pickle, remote=remote, iteration=iteration)

    def load_into(self, model: nn.Module, rank: int = 0, world: int = 1, *,
                  device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                  strict: bool = True, missing: str = "init", key_map: KeyMap | None = None,
                  progress: bool | None = None, plan: dict[str, Any] | str | None = None, reader: str = "auto",
                  max_host_bytes: int | None = None, release_pages: bool = False,
                  shards_only: bool = False, quantize: str | Quantization | None = None,
                  rank_timeout: float = RANK_TIMEOUT, mesh: Any = None, cooperative: bool | None = None,
                  **unknown: Any) -> LoadReport:
        """Fill `model` with this rank's share of the checkpoint; returns a LoadReport.

        Every input error (arguments, keys, shapes, casts, rank/world, plan) is a
        LazyLoadError raised before any tensor byte is read, leaving the model untouched.
        So is a load that cannot fit: when this rank's destinations and staging budget
        exceed what its device holds now (CPU: MemAvailable and the memory cgroup's room,
        shared by this host's LOCAL_WORLD_SIZE ranks; GPU: `torch.cuda.mem_get_info`), a
        PlanError names the bytes, the largest replicated tensors and what would fit (the
        other plan, quantize="int8", a larger world), instead of the kernel killing the
        process (`lazyload.fit`; LAZYLOAD_FIT_CHECK=0 skips it).

        - `model`: an `nn.Module`, on the meta device (or built under accelerate's
          `init_empty_weights()`), or real (then overwritten in place).
        - `rank`, `world`: this rank and the number of tensor-parallel ranks (world=1: the
          whole model). Under torch.distributed they must be the process group's (a model
          nobody made parallel is then made runnable, see `lazyload.tp.parallelize`),
          unless `shards_only=True`.
        - `device`: where the tensors go; default the device of the model's real tensors;
          for a model on meta, its DTensors' mesh device type, else this process's GPU when
          CUDA is available (as torch's DeviceMesh picks it: the current device once CUDA is
          initialised, else `LOCAL_RANK`'s, the only visible GPU, or rank % GPUs), else CPU.
          A device that does not exist here is a DeviceError.
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
          planning, after reading, after the replicas' exchange) and for each of the
          exchange's collectives; a rank that fails, or does not report in time, makes
          every other one raise RankFailedError naming it and its error. Replicas that
          planned another load (mesh, `cooperative`, checkpoint headers, plan digest)
          fail every rank at the first point, before any byte moves.
        - `mesh`: a torch `DeviceMesh` instead of `rank`/`world`: 1-D (tensor parallel), or
          2-D with dims named ("dp", "tp") (replicas of a tensor-parallel model). This rank's
          share is its `tp` coordinate of the `tp` dim's size; the model is made runnable
          on `mesh["tp"]`; every rank of the mesh agrees at `rank_timeout`'s points.
        - `cooperative` (a mesh with a "dp" dim): True or None (default) splits the reads that
          the replicas of one shard share between them, each reading its part from storage
          and receiving the rest from the others (`report.bytes_received`); False reads all
          of it on every rank.

        A read that fails (I/O error, permission, a file changed since it was indexed) is a
        ReadError listing the targets `loaded` (assigned) and `not_loaded` (kept as they
        were; `partly_written`: real tensors filled in place, their values now mixed). A
        load that quantizes or makes the model parallel is undone when it fails (a read, or
        another rank): the model keeps its modules and tensors, and nothing is `loaded`."""
        started = time.perf_counter()
        check_keywords("load_into", unknown, LazyCheckpoint.load_into)
        options = LoadOptions(device=device, dtype=dtype, strict=strict, missing=missing, key_map=key_map,
                              progress=progress, plan=plan, reader=reader, max_host_bytes=max_host_bytes,
                              release_pages=release_pages, shards_only=shards_only, quantize=quantize,
                              rank_timeout=rank_timeout, mesh=mesh, cooperative=cooperative)
        agree = agreement(rank, world, rank_timeout, mesh)  # a mesh's: every rank of it
        try:
            if mesh is not None:
                rank, world = ranks_of(mesh, rank, world)
            try:
                load_plan = plan_load(self, model, rank, world, options)
            except LazyLoadError as exc:
                explain(exc, self, model, world, options)  # one shard of several, configs that differ, worlds
                raise
            check_fit(load_plan, self, model)  # a load that cannot fit its device: refused, not killed
            # every rank's input is good, and replicas planned the same load: only now may any model change
            agree.reached("planned", facts=load_facts(load_plan))
            return execute(load_plan, model, agree, started)
        except BaseException as exc:
            agree.failed(exc)  # the other ranks hear of it at the next point, instead of waiting forever
            raise
