"""DCP checkpoints written by torch's own `dcp.save`, for the tests: a plain Llama state
dict (with AdamW's state beside it, as a trainer saves it) and an FSDP2 x TP (2 x 2) Llama
saved from a spawned gloo job of 4 CPU ranks (fully_shard over "dp", parallelize_module's
colwise/rowwise styles over "tp" of a 2-D mesh)."""
from __future__ import annotations

import torch

from checkpoints import ATTN, make_config, model_class, randomize_
from gloo import spawn_cases

# transformers' Llama TP styles, written out: q/k/v and gate/up column-parallel, o/down row-parallel.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def llama(dtype=torch.bfloat16, seed: int = 0):
    """The test Llama (random, distinct weights), real, in `dtype`, and its config."""
    config = make_config("llama")
    config._attn_implementation = ATTN
    torch.manual_seed(seed)
    model = model_class("llama", config)(config)
    randomize_(model, seed)
    return model.to(dtype).eval(), config


def save_plain(directory) -> None:
    """`{"model": state dict, "optimizer": AdamW state}` as torch's get_state_dict gives them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, _ = llama(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(8)[None]).logits.sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))


def _save_fsdp_tp(directory, rank, world):
    """DCP's own format into `directory`, and its safetensors flavour (per-rank files under
    `sharded/` and their consolidated copy) into `directory`-hf."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, _ = llama(torch.bfloat16)
    for layer in model.model.layers:
        styles = {name: ColwiseParallel() for name in COLWISE} | {name: RowwiseParallel() for name in ROWWISE}
        parallelize_module(layer, mesh["tp"], styles)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dcp.save(model.state_dict(), checkpoint_id=str(directory))
    writer = HuggingFaceStorageWriter(f"{directory}-hf", save_distributed=True, enable_consolidation=True)
    dcp.save(model.state_dict(), storage_writer=writer)


def save_fsdp_tp(directory, tmp_path) -> None:
    spawn_cases(4, [str(directory)], tmp_path, _save_fsdp_tp)


def dcp_reference(directory, prefix: str = ""):
    """A real Llama filled by torch's own dcp.load (one process) from `directory`."""
    import torch.distributed.checkpoint as dcp

    model, _ = llama(torch.float32 if prefix else torch.bfloat16, seed=99)  # other values, overwritten
    state = {f"{prefix}{k}": v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    model.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()})
    return model


def save_chunked(directory, fqn: str, n: int, values: int = 100) -> None:
    """A DCP checkpoint whose float32 tensor `fqn` of size [1, n] is saved as n chunks of
    [1, 1], laid out as FileSystemWriter lays them (each chunk a torch.save zip in
    `__0_0.distcp`, `.metadata` a pickle of torch's own Metadata classes). Chunk j holds
    j % `values`: `values` distinct zips, each written once by torch.save and repeated."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    zips = []
    for value in range(values):
        buffer = io.BytesIO()
        torch.save(torch.tensor([[float(value)]]), buffer)
        zips.append(buffer.getvalue())
    chunks, storage, offset = [], {}, 0
    with open(directory / "__0_0.distcp", "wb") as f:
        for j in range(n):
            raw = zips[j % values]
            f.write(raw)
            chunks.append(ChunkStorageMetadata(torch.Size([0, j]), torch.Size([1, 1])))
            storage[MetadataIndex(fqn, torch.Size([0, j]))] = _StorageInfo("__0_0.distcp", offset, len(raw))
            offset += len(raw)
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1, n]), chunks)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(Metadata({fqn: tensor}, storage_data=storage), f)
