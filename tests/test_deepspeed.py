"""DeepSpeed's own workflow: a meta-built model that `deepspeed.init_inference` has made
tensor parallel with AutoTP (its Linear layers hold local shards) is filled by
`load_into(model, rank, world)`, and its forward at world 2 gives world 1's logits.

DeepSpeed is in the test extra (`DS_BUILD_OPS=0 pip install -e '.[test]'`); it runs on CPU
with DS_ACCELERATOR=cpu and gloo. Without it installed these tests are skipped, except in CI."""
from __future__ import annotations

import os
import traceback

import pytest
import torch

from gloo import end_rank, spawn_collecting

if os.environ.get("CI"):  # CI installs the test extra, DeepSpeed with it: there its absence fails
    import deepspeed  # noqa: F401
else:
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the 'test' extra (DS_BUILD_OPS=0 pip install)")

WORLD = 2
# AutoTP cuts in grains of 64 columns: hidden and MLP sizes that split evenly over 2 ranks.
CONFIG = dict(hidden_size=128, intermediate_size=256)


def _worker(rank, world, directory, init_file, errors):
    os.environ.update(DS_ACCELERATOR="cpu", LAZYLOAD_PROGRESS="0", LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        import deepspeed
        import transformers

        from checkpoints import ATTN, fixed_input
        from lazyload import LazyCheckpoint

        transformers.logging.set_verbosity_error()
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"file://{init_file}",
                                   rank=rank, world_size=world, verbose=False)
        config = transformers.AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                      attn_implementation=ATTN)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                  attn_implementation=ATTN)
        LazyCheckpoint(directory).load_into(reference.eval(), progress=False)  # world 1

        # The DeepSpeed user's lines: init_inference without checkpoint=, then load_into.
        model = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                         replace_with_kernel_inject=False).module
        q = model.model.layers[0].self_attn.q_proj
        assert type(q).__module__.startswith("deepspeed.") and q.weight.shape[0] * world == config.hidden_size
        report = LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
        assert report.ok and not report.missing, report

        full = dict(reference.named_parameters())
        for name, param in model.named_parameters():  # each local shard is this rank's slice of the full one
            want = full[name]
            dim = next((d for d in range(want.dim()) if want.shape[d] != param.shape[d]), None)
            if dim is not None:
                want = want.chunk(world, dim)[rank]
            assert torch.equal(param.detach(), want.detach()), f"rank {rank}: {name} is not its share"
        with torch.no_grad():
            got = model(input_ids=fixed_input(config)).logits
            want = reference(input_ids=fixed_input(config)).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
    end_rank()


def test_deepspeed_autotp_model_filled_by_load_into_gives_world1_logits(checkpoint, tmp_path):
    directory, _ = checkpoint("llama", **CONFIG)
    spawn_collecting(_worker, (WORLD, str(directory), str(tmp_path / "pg")), WORLD)
