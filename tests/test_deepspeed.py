"""DeepSpeed's own workflow: a meta-built model that `deepspeed.init_inference` has made
tensor parallel with AutoTP (its Linear layers hold local shards) is filled by
`load_into(model, rank, world)`, and its forward at world 2 gives world 1's logits.

DeepSpeed is in the test extra (`DS_BUILD_OPS=0 pip install -e '.[test]'`); it runs on CPU
with DS_ACCELERATOR=cpu and gloo, compiling none of DeepSpeed's C++ ops (deepspeed_models.without_op_builds).
Without it installed these tests are skipped, except in CI."""
from __future__ import annotations

import os
import traceback

import pytest

from gloo import end_rank, spawn_collecting

if os.environ.get("CI"):  # CI installs the test extra, DeepSpeed with it: there its absence fails
    import deepspeed  # noqa: F401
else:
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the 'test' extra (DS_BUILD_OPS=0 pip install)")
from deepspeed_models import autotp_load_matches_world1  # noqa: E402

WORLD = 2
# AutoTP cuts in grains of 64 columns: hidden and MLP sizes that split evenly over 2 ranks.
CONFIG = dict(hidden_size=128, intermediate_size=256)


def _worker(rank, world, directory, init_file, errors):
    try:
        model = autotp_load_matches_world1(rank, world, directory, init_file)
        from deepspeed.comm import comm

        assert comm.cdb.shm_comm_op is None, "DeepSpeed built its shared-memory op (a C++ compile) in a test"
        q = model.model.layers[0].self_attn.q_proj
        assert type(q).__module__.startswith("deepspeed.") and q.weight.shape[0] * world == model.config.hidden_size
    except Exception:
        errors.put((rank, traceback.format_exc()))
        raise
    end_rank()


def test_deepspeed_autotp_model_filled_by_load_into_gives_world1_logits(checkpoint, tmp_path):
    directory, _ = checkpoint("llama", **CONFIG)
    spawn_collecting(_worker, (WORLD, str(directory), str(tmp_path / "pg")), WORLD)
