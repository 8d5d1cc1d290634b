"""Pipeline stages: a model that holds only its stage's layers (the others set to None in
its ModuleList or left out of a ModuleDict, as torch.distributed.pipelining's manual split
and torchtitan make them; `embed_tokens`, `norm`, `lm_head` set to None where another stage
has them) loads exactly those, strict, and reports the checkpoint's other tensors as the
other stages'. Stages run in sequence give world 1's logits, with TP inside each stage too
(PP 2 x TP 2 on a gloo job of 4)."""
from __future__ import annotations

import pytest
import torch

from checkpoints import build_model, fixed_input, stage_of
from gloo import spawn_cases

LAYERS = 4


@torch.no_grad()
def run_stage(model, x):
    """One stage's forward, as LlamaModel.forward runs its layers: token ids in on the first
    stage, hidden states between stages, logits out of the last."""
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    position_ids = torch.arange(h.shape[1])[None]
    mask = create_causal_mask(config=inner.config, inputs_embeds=h, attention_mask=None, cache=None,
                              position_ids=position_ids)
    rotary = inner.rotary_emb(h, position_ids=position_ids)
    layers = inner.layers.values() if isinstance(inner.layers, torch.nn.ModuleDict) else inner.layers
    for layer in layers:
        if layer is not None:
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids)
    return model.lm_head(inner.norm(h)) if model.lm_head is not None else h


def _whole(directory, config):
    from lazyload import LazyCheckpoint

    ref = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, progress=False)
    return ref


def _layer(key):
    parts = key.split(".")
    return int(parts[2]) if parts[1] == "layers" else None


STAGES = [({0, 1}, True, False), ({2, 3}, False, True)]


@pytest.mark.parametrize("form", ["none", "dict"])
def test_two_stages_load_their_layers_strictly_and_chain_to_the_world1_logits(checkpoint, form):
    from lazyload import LazyCheckpoint

    directory, config = checkpoint("llama", num_hidden_layers=LAYERS)
    ref = _whole(directory, config)
    ref_params = dict(ref.named_parameters())
    keys = set(LazyCheckpoint(directory).keys())
    x = fixed_input(config)
    for layers, first, last in STAGES:
        stage = stage_of(build_model("llama", config, torch.float32), layers, first, last, form)
        report = LazyCheckpoint(directory).load_into(stage, progress=False)  # strict
        assert report.ok and not report.unexpected
        assert set(report.loaded) | set(report.other_stages) == keys and not set(report.loaded) & set(report.other_stages)
        assert {_layer(k) for k in report.loaded} - {None} == layers
        assert not {_layer(k) for k in report.other_stages} & layers
        for name, param in stage.named_parameters():
            assert torch.equal(param, ref_params[name]), name
        x = run_stage(stage, x)
    torch.testing.assert_close(x, ref(input_ids=fixed_input(config)).logits, rtol=0, atol=0)


def test_a_shorter_model_is_no_stage(checkpoint):
    """A ModuleList that is only shorter (its layers renumbered) leaves the checkpoint's
    other layers unexpected: no silent load of layer 0's weights into a layer meant as 2."""
    from lazyload import LazyCheckpoint
    from lazyload.errors import UnexpectedKeysError

    directory, config = checkpoint("llama", num_hidden_layers=LAYERS)
    model = build_model("llama", config, torch.float32)
    model.model.layers = model.model.layers[2:]
    with pytest.raises(UnexpectedKeysError, match="layers.2"):
        LazyCheckpoint(directory).load_into(model, progress=False)


def _case_pp2_tp2(directory, rank, world):
    """Ranks 0, 1: stage 0 (TP 2); ranks 2, 3: stage 1 (TP 2). Stage 0 sends its hidden
    states to the stage-1 rank with the same TP rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig

    from lazyload import LazyCheckpoint
    from lazyload.tp import parallelize

    config = AutoConfig.from_pretrained(directory)
    ref = _whole(directory, config)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp, tp = mesh.get_coordinate()
    layers, first, last = STAGES[pp]
    stage = stage_of(build_model("llama", config, torch.float32), layers, first, last)
    parallelize(stage, mesh["tp"])
    report = LazyCheckpoint(directory).load_into(stage, tp, 2, progress=False)
    assert report.ok and report.other_stages and report.world == 2
    ref_params = dict(ref.named_parameters())
    sharded = 0
    for name, param in stage.named_parameters():
        if isinstance(param, DTensor):
            sharded += tuple(param.to_local().shape) != tuple(param.shape)
            param = param.full_tensor()
        assert torch.equal(param, ref_params[name]), name
    assert sharded
    x = fixed_input(config)
    want = ref(input_ids=x).logits
    if pp == 0:
        dist.send(run_stage(stage, x).contiguous(), dst=rank + 2)
    else:
        hidden = torch.empty(*x.shape, config.hidden_size)
        dist.recv(hidden, src=rank - 2)
        logits = run_stage(stage, hidden)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def _run_case(case, rank, world):
    case[0](*case[1:], rank, world)


def test_pp2_x_tp2_stages_load_their_shards_and_give_world1_logits(checkpoint, tmp_path):
    directory, _ = checkpoint("llama", num_hidden_layers=LAYERS)
    spawn_cases(4, [(_case_pp2_tp2, str(directory))], tmp_path, _run_case)
