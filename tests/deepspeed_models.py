"""DeepSpeed's own workflow for the tests, in a spawned rank (CPU, gloo): a meta model made
tensor parallel by AutoTP (`deepspeed.init_inference` without `checkpoint=`), then filled by
`load_into(model, rank, world)`, checked against a world 1 load of the same checkpoint."""
from __future__ import annotations

import os

import torch

from checkpoints import ATTN, fixed_input
from lazyload import LazyCheckpoint


def autotp_load_matches_world1(rank: int, world: int, directory: str, init_file: str) -> torch.nn.Module:
    """Fill this rank's AutoTP model; every local shard is the part of world 1's tensor that
    DeepSpeed's own shard-size rule cuts for this rank, and the logits are world 1's. Returns
    the model."""
    os.environ.update(DS_ACCELERATOR="cpu", LAZYLOAD_PROGRESS="0", LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), RANK=str(rank), WORLD_SIZE=str(world))
    # DeepSpeed's CPU all-reduce names its shared-memory buffers by MASTER_ADDR and MASTER_PORT
    # alone: unset (a file:// rendezvous), two jobs on one host (two test runs at once) share
    # them and sum each other's partial products. The spawning process's pid names this job.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(os.getppid()))
    torch.set_num_threads(1)
    import deepspeed
    import transformers
    from deepspeed.module_inject.tp_shard import get_shard_size_list

    transformers.logging.set_verbosity_error()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"file://{init_file}",
                               rank=rank, world_size=world, verbose=False)
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        reference, model = (transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=ATTN) for _ in range(2))
    LazyCheckpoint(directory).load_into(reference.eval(), progress=False)  # world 1
    # The DeepSpeed user's lines: init_inference without checkpoint=, then load_into.
    model = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                     replace_with_kernel_inject=False).module
    report = LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
    assert report.ok and not report.missing, report

    full = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        module, want = model.get_submodule(name.rpartition(".")[0]), full[name]
        dim = next((d for d in range(want.dim()) if want.shape[d] != param.shape[d]), None)
        if dim is not None:
            sizes = get_shard_size_list(want.shape[dim], world, module.tp_meta, module.name)
            want = want.narrow(dim, sum(sizes[:rank]), sizes[rank])
        assert torch.equal(param.detach(), want.detach()), f"rank {rank}: {name} is not its share"
    with torch.no_grad():
        got = model(input_ids=fixed_input(config)).logits
        want = reference(input_ids=fixed_input(config)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return model
