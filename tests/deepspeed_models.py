"""DeepSpeed's own workflow for the tests, in a spawned rank (CPU, gloo): a meta model made
tensor parallel by AutoTP (`deepspeed.init_inference` without `checkpoint=`), then filled by
`load_into(model, rank, world)`, checked against a world 1 load of the same checkpoint."""
from __future__ import annotations

import os

import torch

from checkpoints import ATTN, fixed_input
from lazyload import LazyCheckpoint


def without_op_builds() -> None:
    """Let DeepSpeed compile none of its C++ ops in this process. On CPU, `init_distributed`
    would JIT-compile its shared-memory all-reduce (`deepspeed_shm_comm`: a compiler, minutes,
    and a wait without end on a stale lock in the user's torch extensions cache); marked not
    compatible, DeepSpeed all-reduces through torch.distributed (gloo) instead. Any other op
    that would be compiled fails at once, naming itself, instead of building."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    deepspeed.ops.__compatible_ops__ = {}  # set before first use: DeepSpeed's probe (compilers) never runs

    def refuse(builder, verbose=True):
        raise RuntimeError(f"the tests let DeepSpeed build no op, but it asked to JIT-compile {builder.name}")

    OpBuilder.jit_load = refuse


def init_deepspeed_rank(rank: int, world: int, init_file: str) -> None:
    """This spawned process as rank `rank` of a DeepSpeed job on CPU (gloo), building no op."""
    os.environ.update(DS_ACCELERATOR="cpu", LAZYLOAD_PROGRESS="0", LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(os.getppid()))
    torch.set_num_threads(1)
    import deepspeed
    import transformers

    transformers.logging.set_verbosity_error()
    without_op_builds()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"file://{init_file}",
                               rank=rank, world_size=world, verbose=False)


def autotp_load_matches_world1(rank: int, world: int, directory: str, init_file: str) -> torch.nn.Module:
    """Fill this rank's AutoTP model; every local shard is the part of world 1's tensor that
    DeepSpeed's own shard-size rule cuts for this rank, and the logits are world 1's. Returns
    the model."""
    init_deepspeed_rank(rank, world, init_file)
    import deepspeed
    import transformers
    from deepspeed.module_inject.tp_shard import get_shard_size_list

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
