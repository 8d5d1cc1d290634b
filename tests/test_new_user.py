"""What a new user runs into first (issue 34's walk): a torchrun job that never initialised
torch.distributed, the errors of a first try (a keyword typo, one shard of several, configs
that differ, a world that does not split), and the command line's speed and noise."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model, meta_tensors
from lazyload import LazyCheckpoint, PlanError


def test_torchrun_without_a_process_group_is_refused(checkpoint, monkeypatch):
    """torchrun says WORLD_SIZE=2 and nobody called init_process_group: a load at world 2
    would leave plain shards and a forward computing garbage (half the vocabulary's logits)."""
    directory, config = checkpoint("llama")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    model = build_model("llama", config, torch.float32)
    with pytest.raises(PlanError, match=r"WORLD_SIZE.*torch\.distributed is not initialised.*init_process_group"
                                        r".*shards_only=True"):
        LazyCheckpoint(directory).load_into(model, 0, 2)
    assert len(meta_tensors(model)) == len(list(model.parameters())) + len(list(model.buffers()))
    report = LazyCheckpoint(directory).load_into(model, 0, 2, shards_only=True)  # only the shards: asked for
    assert report.ok and model.lm_head.weight.shape[0] * 2 == config.vocab_size
    whole = build_model("llama", config, torch.float32)
    assert LazyCheckpoint(directory).load_into(whole).ok  # world 1 in each process: the whole model, fine
