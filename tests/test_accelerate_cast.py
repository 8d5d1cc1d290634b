"""A model built under accelerate's init_empty_weights() in float32 (parameters on meta,
buffers computed for real) and cast with .to(bfloat16) gives from_pretrained(dtype=bfloat16)'s
logits: the cast turned the float32 rotary inv_freq bf16, and the load computes it again as
from_pretrained does (issue 34 item 14)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model, fixed_input, reference_model
from lazyload import LazyCheckpoint


@pytest.mark.parametrize("arch", ["llama4_text", "llama"])
def test_init_empty_weights_cast_to_bf16_gives_from_pretrained_logits(checkpoint, arch):
    directory, config = checkpoint(arch, "bf16")
    model = build_model(arch, config, torch.float32, empty="accelerate").to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # what the cast did
    report = LazyCheckpoint(directory).load_into(model)
    ref = reference_model(arch, directory, torch.bfloat16)
    mine = dict(model.named_buffers())
    for name, buf in ref.named_buffers():
        assert mine[name].dtype == buf.dtype and torch.equal(mine[name], buf), name
    assert "model.rotary_emb.inv_freq" in report.recomputed_buffers
    with torch.no_grad():
        assert torch.equal(model(fixed_input(config)).logits, ref(fixed_input(config)).logits)


def test_buffers_already_in_from_pretrained_dtype_keep_their_values(checkpoint):
    """Built under init_empty_weights in bf16, no cast: inv_freq is float32 already and is kept."""
    directory, config = checkpoint("llama", "bf16")
    model = build_model("llama", config, torch.bfloat16, empty="accelerate")
    kept = model.model.rotary_emb.inv_freq
    report = LazyCheckpoint(directory).load_into(model)
    assert model.model.rotary_emb.inv_freq is kept and not report.recomputed_buffers
