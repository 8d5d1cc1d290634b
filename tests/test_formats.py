"""Checkpoint formats other than safetensors: PyTorch `.bin`/`.pt` state dicts, Megatron-LM
per-rank checkpoints and DeepSpeed's checkpoint description json, each written here in its
published layout from known tensors and loaded into transformers models exactly, at world 1
and at split and merged worlds."""
from __future__ import annotations

import argparse
import os
import shutil

import pytest
import torch

from checkpoints import assert_same_weights, build_model, rchar, reference_model
from lazyload import CheckpointError, LazyCheckpoint


def _local_equal(path, arch, config, dtype, original, worlds, **kwargs):
    """Every rank's tensors from `path` equal the direct load of the original safetensors."""
    for world in worlds:
        for rank in range(world):
            got = build_model(arch, config, dtype)
            report = LazyCheckpoint(str(path), **kwargs).load_into(got, rank, world, progress=False)
            want = build_model(arch, config, dtype)
            LazyCheckpoint(str(original)).load_into(want, rank, world, progress=False)
            assert report.ok
            a, b = got.state_dict(), want.state_dict()
            assert sorted(a) == sorted(b)
            for k in b:
                assert torch.equal(a[k], b[k]), f"{path.name} rank {rank} of {world}: {k} differs"


# ----------------------------------------------------------------------------- .bin / .pt


def _save_bin(state: dict, directory, parts: int = 2):
    """state split over `parts` files named as transformers named them."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    for p in range(parts):
        chunk = {k: state[k] for k in keys[p::parts]}
        torch.save(chunk, directory / f"pytorch_model-{p + 1:05d}-of-{parts:05d}.bin")
    return directory


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bin_state_dict_loads_exactly(checkpoint, tmp_path, arch):
    original, config = checkpoint(arch, "bf16")
    ref = reference_model(arch, original, torch.bfloat16)
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight" or arch != "gpt2"}  # tied
    name = "model.layers.1.mlp.down_proj.weight" if arch == "llama" else "transformer.h.1.mlp.c_fc.weight"
    state[name] = state[name].t().contiguous().t()  # saved as a transposed view
    directory = _save_bin(state, tmp_path / "bin")
    model = build_model(arch, config, torch.bfloat16)
    LazyCheckpoint(str(directory)).load_into(model, progress=False)
    assert_same_weights(model, ref)
    _local_equal(directory, arch, config, torch.bfloat16, original, [2, 4])


def test_bin_is_mapped_not_held_in_anonymous_memory(tmp_path):
    """A 64 MiB state dict: the index reads only its pickle; the load leaves the tensors as
    views of the file mapping, with no copy of the state dict in anonymous memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    path = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    total = sum(t.nbytes for t in model.state_dict().values())
    before = rchar()
    ckpt = LazyCheckpoint(str(path))
    assert len(ckpt) == 4 and ckpt.total_bytes == total
    if before is not None:
        assert rchar() - before < total / 50, "building the index read tensor data"
    with torch.device("meta"):
        meta = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
    before = _rss_anon()
    report = ckpt.load_into(meta, progress=False)
    assert report.bytes_mapped == total and report.peak_anon - before < total / 4
    for a, b in zip(meta.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class _Payload:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.bin"
    torch.save({"weight": torch.ones(4, 4), "extra": _Payload(marker)}, path)
    with pytest.raises(CheckpointError) as info:
        LazyCheckpoint(str(path)).index
    message = str(info.value)
    assert "mkdir" in message and "trust_pickle=True" in message and str(path) in message
    assert not marker.exists(), "the payload ran"
    # The explicit opt-in names the risk: then the file's code runs, and its tensors load.
    index = LazyCheckpoint(str(path), trust_pickle=True).index
    assert marker.exists() and list(index) == ["weight"]


def test_legacy_pickle_and_strided_views_are_refused_with_a_reason(tmp_path):
    legacy = tmp_path / "legacy.bin"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="zip format"):
        LazyCheckpoint(str(legacy)).index
    strided = tmp_path / "strided.pt"
    torch.save({"w": torch.ones(4, 6)[:, ::2]}, strided)
    with pytest.raises(CheckpointError, match="strided view"):
        LazyCheckpoint(str(strided)).index


# ----------------------------------------------------------------------------- Megatron


def _megatron_qkv(q, k, v, heads, groups, tp, version):
    """Each rank's fused QKV rows in the layout of checkpoint `version`, from transformers'
    q, k, v ([heads * hn, ...]): 0: [3, np, hn]; 1.0: [np, hn, 3]; 2.0+: [ng, np/ng + 2, hn]."""
    hn, rest = q.shape[0] // heads, tuple(q.shape[1:])
    q, k, v = (t.reshape(-1, hn, *rest) for t in (q, k, v))
    np_, ng = heads // tp, groups // tp
    out = []
    for r in range(tp):
        qs, ks, vs = q[r * np_:(r + 1) * np_], k[r * ng:(r + 1) * ng], v[r * ng:(r + 1) * ng]
        if version == 0:
            fused = torch.cat([qs, ks, vs])
        elif version == 1.0:
            fused = torch.stack([qs, ks, vs], dim=2)
        else:
            per = np_ // ng
            fused = torch.cat([torch.cat([qs[g * per:(g + 1) * per], ks[g:g + 1], vs[g:g + 1]]) for g in range(ng)])
        out.append(fused.reshape(-1, *rest).clone())
    return out


def _split(t, tp, dim):
    return [c.clone() for c in t.chunk(tp, dim)]


def _write_megatron(state, config, directory, tp, version, llama):
    """Megatron-LM's per-rank checkpoint layout (release/mp_rank_XX/model_optim_rng.pt), its
    legacy names (version 0: 'transformer' and 'attention.', later 'encoder' and
    'self_attention.'), from a transformers state dict."""
    import argparse
    import random

    import numpy as np

    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    attn = "attention" if version == 0 else "self_attention"
    ranks = [{} for _ in range(tp)]

    def put(name, tensors):
        for r in range(tp):
            ranks[r][name] = tensors[r] if isinstance(tensors, list) else tensors.clone()

    for i in range(layers):
        p = f"layers.{i}."
        if llama:
            h = f"model.layers.{i}."
            put(p + "input_layernorm.weight", state[h + "input_layernorm.weight"])
            put(p + f"{attn}.query_key_value.weight", _megatron_qkv(*(state[h + f"self_attn.{c}_proj.weight"]
                                                                      for c in "qkv"), heads, groups, tp, version))
            put(p + f"{attn}.dense.weight", _split(state[h + "self_attn.o_proj.weight"], tp, 1))
            put(p + "post_attention_layernorm.weight", state[h + "post_attention_layernorm.weight"])
            gate, up = (_split(state[h + f"mlp.{c}_proj.weight"], tp, 0) for c in ("gate", "up"))
            put(p + "mlp.dense_h_to_4h.weight", [torch.cat([g, u]) for g, u in zip(gate, up)])
            put(p + "mlp.dense_4h_to_h.weight", _split(state[h + "mlp.down_proj.weight"], tp, 1))
        else:
            h = f"transformer.h.{i}."
            for ln, mname in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
                for param in ("weight", "bias"):
                    put(p + f"{mname}.{param}", state[h + f"{ln}.{param}"])
            for param, t in (("weight", state[h + "attn.c_attn.weight"].t()), ("bias", state[h + "attn.c_attn.bias"])):
                put(p + f"{attn}.query_key_value.{param}", _megatron_qkv(*t.chunk(3, 0), heads, groups, tp, version))
            put(p + f"{attn}.dense.weight", _split(state[h + "attn.c_proj.weight"].t(), tp, 1))
            put(p + f"{attn}.dense.bias", state[h + "attn.c_proj.bias"])
            put(p + "mlp.dense_h_to_4h.weight", _split(state[h + "mlp.c_fc.weight"].t(), tp, 0))
            put(p + "mlp.dense_h_to_4h.bias", _split(state[h + "mlp.c_fc.bias"], tp, 0))
            put(p + "mlp.dense_4h_to_h.weight", _split(state[h + "mlp.c_proj.weight"].t(), tp, 1))
            put(p + "mlp.dense_4h_to_h.bias", state[h + "mlp.c_proj.bias"])
    if llama:
        put("final_layernorm.weight", state["model.norm.weight"])
        embed, extra = state["model.embed_tokens.weight"], {"output_layer": _split(state["lm_head.weight"], tp, 0)}
    else:
        put("final_layernorm.weight", state["transformer.ln_f.weight"])
        put("final_layernorm.bias", state["transformer.ln_f.bias"])
        embed, extra = state["transformer.wte.weight"], {}
    hidden = config.hidden_size
    args = argparse.Namespace(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, swiglu=llama,
                              group_query_attention=groups != heads, num_query_groups=groups,
                              padded_vocab_size=embed.shape[0], params_dtype=embed.dtype, kv_channels=hidden // heads)
    words = _split(embed, tp, 0)
    for r in range(tp):
        language_model = {"embedding": {"word_embeddings": {"weight": words[r]}},
                          ("transformer" if version == 0 else "encoder"): ranks[r]}
        if not llama:
            language_model["embedding"]["position_embeddings"] = {"weight": state["transformer.wpe.weight"].clone()}
        for name, tensors in extra.items():
            language_model[name] = {"weight": tensors[r]}
        saved = {"args": args, "iteration": 10, "model": {"language_model": language_model},
                 "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}},
                                             "param_groups": [{"lr": 1e-4, "params": [0]}]}},
                 "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state()}]}
        if version:
            saved["checkpoint_version"] = version
        rank_dir = directory / "release" / f"mp_rank_{r:02d}"
        rank_dir.mkdir(parents=True)
        torch.save(saved, rank_dir / "model_optim_rng.pt")
    (directory / "latest_checkpointed_iteration.txt").write_text("release")
    return directory


@pytest.mark.parametrize("arch,version,tp,kv,worlds", [
    ("gpt2", 0, 2, None, [1, 2, 4]), ("gpt2", 1.0, 2, None, [1, 4]), ("gpt2", 2.0, 4, None, [1, 2]),
    ("llama", 0, 4, 4, [1, 2]), ("llama", 1.0, 2, 4, [1, 4]), ("llama", 2.0, 2, 4, [1, 4]),
    ("llama", 3.0, 2, 2, [1, 2, 4]),
])
def test_megatron_checkpoint_loads_exactly(checkpoint, tmp_path, arch, version, tp, kv, worlds):
    """Megatron per-rank files (source TP `tp`) in the QKV layout of `version`: fused q/k/v
    for GPT-2, separate for Llama (grouped-query at version 3.0); world 1 equals
    from_pretrained, other worlds split or merge the source ranks exactly."""
    overrides = {} if kv is None else dict(num_key_value_heads=kv)
    original, config = checkpoint(arch, **overrides)
    ref = reference_model(arch, original, torch.float32)
    directory = _write_megatron(ref.state_dict(), config, tmp_path / "megatron", tp, version, arch == "llama")
    model = build_model(arch, config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, progress=False)
    assert_same_weights(model, ref)
    _local_equal(directory, arch, config, torch.float32, original, [w for w in worlds if w > 1])


def _megatron_llama(checkpoint, directory, change=None):
    """A Megatron-LM Llama (TP 2, grouped-query, layout 3.0) in `directory`, each rank file's
    saved dict passed through `change` (in place) when given."""
    original, config = checkpoint("llama", num_key_value_heads=2)
    _write_megatron(reference_model("llama", original, torch.float32).state_dict(), config, directory, 2, 3.0, True)
    for f in sorted(directory.glob("release/mp_rank_*/model_optim_rng.pt")) if change else []:
        saved = torch.load(f, weights_only=False)
        change(saved)
        torch.save(saved, f)
    return directory, config


def _megatron_refused(path, config, match, **kwargs):
    """Loading `path` is a CheckpointError matching `match`, the model untouched."""
    model = build_model("llama", config, torch.float32)
    with pytest.raises(CheckpointError, match=match):
        LazyCheckpoint(str(path), **kwargs).load_into(model, progress=False)
    assert all(t.is_meta for t in model.state_dict().values())


@pytest.mark.parametrize("tag", ["{other}", "../other/release", "\u00b2", "\u0661\u0660", "1" * 30])
def test_a_megatron_tracker_naming_no_iteration_is_refused(checkpoint, tmp_path, tag):
    """An iteration number or `release` is all Megatron writes in its tracker: a path loaded
    another directory, '²' raised int()'s ValueError, '١٠' was read as 10."""
    save, config = _megatron_llama(checkpoint, tmp_path / "save")
    _megatron_llama(checkpoint, tmp_path / "other")
    shutil.copytree(save / "release", save / "iter_0000010")
    (save / "latest_checkpointed_iteration.txt").write_text(tag.format(other=tmp_path / "other" / "release"))
    _megatron_refused(save, config, r"latest_checkpointed_iteration\.txt: holds .*, not an iteration number")


def _set_args(**values):
    def change(saved):
        saved["args"] = argparse.Namespace(**(vars(saved["args"]) | values))
    return change


def _set(**values):
    return lambda saved: saved.update(values)


def _rename_layer(new: str):
    def change(saved):
        encoder = saved["model"]["language_model"]["encoder"]
        encoder[f"layers.{new}.input_layernorm.weight"] = encoder.pop("layers.1.input_layernorm.weight")
    return change


_HUGE = 10 ** 5000  # str() of it raises ValueError (over 4,300 digits); trust_pickle reads it


@pytest.mark.parametrize("change,match", [
    (_set_args(num_query_groups=0), "args.num_query_groups is 0, not a count"),
    (_set_args(num_query_groups="2"), "args.num_query_groups is '2', not a count"),
    (_set_args(num_attention_heads=_HUGE), "args.num_attention_heads is <integer of 16610 bits>, not a count"),
    (_set_args(kv_channels=None, hidden_size=[_HUGE]), "args.hidden_size is [<integer of 16610 bits>], not a count"),
    (_set_args(tensor_model_parallel_size=_HUGE), "written for tensor-parallel size <integer of 16610 bits>"),
    (_set(checkpoint_version=_HUGE), "checkpoint_version is <integer of 16610 bits>, not a version number"),
    (_set(checkpoint_version="x"), "checkpoint_version is 'x', not a version number"),
    (_rename_layer("\u0661"), "Megatron key 'encoder.layers.\u0661.input_layernorm.weight' is not one lazyload knows"),
    (_rename_layer("1" * 5000), "Megatron key 'encoder.layers.1111"),
], ids=["groups-0", "groups-str", "heads-huge", "hidden-list", "tp-huge", "version-huge", "version-str",
        "layer-arabic-indic", "layer-5000-digits"])
def test_megatron_args_and_keys_that_are_no_model_are_refused(checkpoint, tmp_path, change, match):
    """Heads, groups, sizes and versions that are 0, a string, a list or an integer of 5,000
    digits, and layer numbers that are not ASCII digits: a CheckpointError naming the file
    and the value (an integer too big for str() by its size), not ZeroDivisionError,
    TypeError, OverflowError or ValueError; '١' was read as layer 1."""
    import re

    directory, config = _megatron_llama(checkpoint, tmp_path / "megatron", change)
    _megatron_refused(directory, config, re.escape(match), trust_pickle=True)


# ----------------------------------------------------------------------------- DeepSpeed json

_ROW = ("o_proj", "down_proj")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _write_deepspeed_tp(state, directory, tp, partitions=3):
    """What DeepSpeed's save_mp_checkpoint_path writes after AutoTP: ds_inference_config.json,
    non-tp.pt (tensors outside the layers) and tp_RR_MM.pt (rank RR's local shards of part
    MM of the layers' tensors, listed part by part)."""
    import json

    directory.mkdir(parents=True)
    layer_keys = [k for k in state if ".layers." in k]
    torch.save({k: v.clone() for k, v in state.items() if k not in layer_keys}, directory / "non-tp.pt")
    size = len(layer_keys) // partitions + 1
    for m in range(partitions):
        keys = layer_keys[m * size:(m + 1) * size]
        for r in range(tp):
            shard = {}
            for k in keys:
                module = k.split(".")[-2]
                dim = 1 if module in _ROW and k.endswith("weight") else 0 if module in _COLUMN else None
                shard[k] = (state[k] if dim is None else state[k].chunk(tp, dim)[r]).clone()
            torch.save(shard, directory / f"tp_{r:02d}_{m:02d}.pt")
    doc = {"type": "ds_model", "base_dir": ".", "version": 1.0, "parallelization": "tp", "tp_size": tp,
           "checkpoints": {"non_tp": ["non-tp.pt"],
                           "tp": [f"tp_{r:02d}_{m:02d}.pt" for m in range(partitions) for r in range(tp)]}}
    (directory / "ds_inference_config.json").write_text(json.dumps(doc))
    return directory


def test_deepspeed_json_over_presharded_tp_files(checkpoint, tmp_path):
    original, config = checkpoint("llama")
    ref = reference_model("llama", original, torch.float32)
    directory = _write_deepspeed_tp(ref.state_dict(), tmp_path / "ds", tp=2)
    model = build_model("llama", config, torch.float32)
    LazyCheckpoint(str(directory / "ds_inference_config.json")).load_into(model, progress=False)
    assert_same_weights(model, ref)
    _local_equal(directory, "llama", config, torch.float32, original, [2, 4])


def test_deepspeed_json_lists_state_dicts_and_megatron_files(checkpoint, tmp_path):
    """'ds_model' with a list of whole-tensor .bin files (GPT-2), and 'Megatron' whose json
    version (2.0) says the QKV layout that the files themselves do not record."""
    import json

    original, config = checkpoint("gpt2")
    ref = reference_model("gpt2", original, torch.float32)
    state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    _save_bin(state, tmp_path / "bins")
    names = sorted(p.name for p in (tmp_path / "bins").iterdir())
    (tmp_path / "bins.json").write_text(json.dumps({"type": "ds_model", "base_dir": "bins", "checkpoints": names,
                                                    "version": 1.0}))
    model = build_model("gpt2", config, torch.float32)
    LazyCheckpoint(str(tmp_path / "bins.json")).load_into(model, progress=False)
    assert_same_weights(model, ref)

    megatron = _write_megatron(ref.state_dict(), config, tmp_path / "megatron", 2, 2.0, llama=False)
    files = [str(p) for p in sorted(megatron.glob("release/mp_rank_*/model_optim_rng.pt"))]
    for f in files:  # an old file: no checkpoint_version in it
        saved = torch.load(f, weights_only=False)
        del saved["checkpoint_version"]
        torch.save(saved, f)
    (tmp_path / "megatron.json").write_text(json.dumps({"type": "Megatron", "checkpoints": files, "version": 2.0}))
    model = build_model("gpt2", config, torch.float32)
    LazyCheckpoint(str(tmp_path / "megatron.json")).load_into(model, progress=False)
    assert_same_weights(model, ref)
    with pytest.raises(CheckpointError, match="missing"):
        (tmp_path / "broken.json").write_text(json.dumps({"type": "ds_model", "checkpoints": ["nothing.bin"]}))
        LazyCheckpoint(str(tmp_path / "broken.json"))
