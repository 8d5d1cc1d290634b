"""The plan is the one truth: how a model runs split is planned (with its checks) before
the model changes, the executor carries it out, and nothing travels between loads on the
user's modules.

- A split the model cannot run is refused by `lazyload plan` and by `load_into` with the
  same message, and `load_into` refuses it before any module or parameter changes (a real
  gloo world-2 job: OPT quantized to int8 with a LayerNorm under "colwise").
- Previews (`lazyload plan`, `save_sharded`) plan any rank of any world, also inside a
  process group of another world.
- A model made parallel with `parallelize` before `load_into` holds its split in its own
  tensors (no `_lazyload_*` attribute): the load reads its shares off them, packed GPT-2
  `c_attn` and Llama's KV head groups included, and its forward gives world 1's logits."""
from __future__ import annotations

import json

import torch

from checkpoints import build_model, fixed_input, model_snapshot
from gloo import spawn_cases

LAYER_NORM_COLWISE = {"model.decoder.layers.*.self_attn_layer_norm": "colwise"}
OPT_256 = dict(hidden_size=256, word_embed_proj_dim=256, ffn_dim=512)


def _case(case, rank, world):
    from lazyload import LazyCheckpoint
    from lazyload.errors import PlanError
    from transformers import AutoConfig

    what, directory, expected = case
    config = AutoConfig.from_pretrained(directory)
    model = build_model("opt", config, torch.float32)
    if what == "writer":  # previews plan every rank of another world, inside this process group
        from lazyload import save_sharded
        from lazyload.summary import plan_ranks

        assert len(plan_ranks(directory, 4)[0]) == 4
        if rank == 0:
            save_sharded(directory, expected, 4)
    elif what == "refused":
        before = model_snapshot(model)
        try:
            LazyCheckpoint(directory).load_into(model, rank, world, quantize="int8", plan=LAYER_NORM_COLWISE,
                                                progress=False)
        except PlanError as exc:
            assert expected.startswith(str(exc)), (str(exc), expected)
        else:
            raise AssertionError("load_into accepted a split the model cannot run")
        assert model_snapshot(model) == before, "the refused load changed the model"
        assert not any(k.startswith("_lazyload") for m in model.modules() for k in vars(m))
    else:  # the remedy the message names: the norm replicated, the rest split as planned
        plan = {"model.decoder.layers.*.self_attn_layer_norm": "replicate"}
        report = LazyCheckpoint(directory).load_into(model, rank, world, quantize="int8", plan=plan, progress=False)
        assert report.ok and report.quantized
        norm = model.model.decoder.layers[0].self_attn_layer_norm.weight
        assert tuple(norm.shape) == (config.hidden_size,)


def test_a_split_the_model_cannot_run_is_refused_by_plan_and_load_alike(checkpoint, capsys, tmp_path):
    from lazyload.cli import main

    directory, _ = checkpoint("opt", **OPT_256)
    capsys.readouterr()
    code = main(["plan", str(directory), "--world", "2", "--quantize", "int8", "--plan",
                 json.dumps(LAYER_NORM_COLWISE)])
    err = capsys.readouterr().err
    assert code == 2 and "self_attn_layer_norm.weight: parallelize can run only Linear/Conv1D" in err, err
    message = err.strip().removeprefix("lazyload: error: ")
    spawn_cases(2, [("refused", str(directory), message), ("remedy", str(directory), ""),
                    ("writer", str(directory), str(tmp_path / "tp4"))], tmp_path, _case)
    assert (tmp_path / "tp4" / "lazyload_sharded.json").exists()


def _case_parallelize_first(case, rank, world):
    """`parallelize` on meta, then `load_into`: the load follows the tensors' own split."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from lazyload import LazyCheckpoint
    from lazyload.tp import parallelize
    from transformers import AutoConfig

    arch, directory = case
    config = AutoConfig.from_pretrained(directory)
    ref = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, progress=False)
    model = parallelize(build_model(arch, config, torch.float32), init_device_mesh("cpu", (world,)))
    assert not any(k.startswith("_lazyload") for m in model.modules() for k in vars(m))
    report = LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
    assert report.ok
    ref_params, plain = dict(ref.named_parameters()), 0
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            assert torch.equal(param.full_tensor(), ref_params[name]), name
        elif param.shape != ref_params[name].shape:
            plain += 1
    assert plain, "no tensor was held as a plain local shard"
    with torch.no_grad():
        got = model(input_ids=fixed_input(config)).logits
        want = ref(input_ids=fixed_input(config)).logits
    got = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_model_made_parallel_first_is_loaded_by_its_own_split(checkpoint, tmp_path):
    """GPT-2 (the structural rule: packed c_attn, plain local shards) and Llama at world 4
    (2 KV heads: each held by a group of two ranks, as plain tensors)."""
    gpt2, _ = checkpoint("gpt2")
    llama, _ = checkpoint("llama")
    spawn_cases(4, [("gpt2", str(gpt2)), ("llama", str(llama))], tmp_path, _case_parallelize_first)
