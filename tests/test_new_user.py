"""What a new user runs into first (issue 34's walk): a torchrun job that never initialised
torch.distributed, the errors of a first try (a keyword typo, one shard of several, configs
that differ, a world that does not split), and the command line's speed and noise."""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from checkpoints import build_model, meta_tensors, shard_files
from lazyload import ArgumentError, LazyCheckpoint, MissingKeysError, PlanError, ShapeMismatchError, load_model
from lazyload.cli import main


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


def test_a_load_into_keyword_typo_names_the_nearest(checkpoint):
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    with pytest.raises(ArgumentError, match=r"load_into got an unknown keyword 'rank_timout'; did you mean "
                                            r"'rank_timeout'\?"):
        LazyCheckpoint(directory).load_into(model, rank_timout=5)
    with pytest.raises(ArgumentError, match=r"LazyCheckpoint got an unknown keyword 'trust_pickles'; did you mean "
                                            r"'trust_pickle'\?") as refused:
        LazyCheckpoint(directory, trust_pickles=True)
    assert "StoredCheckpoint" not in str(refused.value)


def test_one_shard_of_several_says_pass_the_directory(checkpoint):
    directory, _ = checkpoint("llama")
    shard = shard_files(directory)[0]
    with pytest.raises(MissingKeysError) as refused:
        load_model(str(shard))
    first = str(refused.value).splitlines()[0]
    assert f"is one of the {len(shard_files(directory))} files of the checkpoint in" in first, first
    assert f"Pass the directory, LazyCheckpoint({str(directory)!r})" in first, first


def test_a_model_of_another_config_says_the_configs_differ(checkpoint):
    directory, config = checkpoint("llama")
    other = copy.deepcopy(config)
    other.intermediate_size *= 2
    model = build_model("llama", other, torch.float32)
    with pytest.raises(ShapeMismatchError) as refused:
        LazyCheckpoint(directory).load_into(model)
    first = str(refused.value).splitlines()[0]
    assert first.startswith("The model's config differs from the checkpoint's config.json: intermediate_size "
                            f"{other.intermediate_size} (model) vs {config.intermediate_size} (checkpoint)"), first


def test_a_world_that_does_not_split_lists_the_worlds_that_do(checkpoint):
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    with pytest.raises(PlanError, match=r"Worlds that work \(of 1 to 8\): 1, 2, 4\.") as refused:
        LazyCheckpoint(directory).load_into(model, 0, 3)
    assert str(refused.value).count("Worlds that work") == 1
    assert len(meta_tensors(model)) == len(list(model.parameters())) + len(list(model.buffers()))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazyload.cli", *args], capture_output=True, text=True, timeout=600)


def test_version_imports_no_torch():
    code = "import sys; from lazyload.cli import main; code = main(['--version']); print(code, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.splitlines() == ["lazyload 0.1.0", "0 False"], out.stdout + out.stderr


def test_plan_prints_the_plan_and_no_third_party_noise(checkpoint):
    """transformers imports torchao and DeepSpeed where installed, and they print as they
    import (kernels they cannot load, deprecations): none of it reaches the CLI's output."""
    directory, _ = checkpoint("llama")
    out = _cli("plan", str(directory), "--world", "2")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.splitlines()[0] == f"{directory}: world 2 (tp plan)", out.stdout


def test_reshard_quantize_takes_group_size_and_skip(checkpoint, tmp_path):
    """The error for columns that are no whole groups recommends a group size or a skip: both
    are flags."""
    directory, _ = checkpoint("llama")  # hidden 64: less than one group of 128
    refused = main(["reshard", str(directory), str(tmp_path / "g128"), "--world", "1", "--quantize", "int8"])
    assert refused == 2 and not (tmp_path / "g128").exists()
    assert main(["reshard", str(directory), str(tmp_path / "g16"), "--world", "1", "--quantize", "int8",
                 "--group-size", "16", "--skip", r"mlp\.down_proj"]) == 0
    config = json.load(open(tmp_path / "g16" / "config.json"))["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 16
    with safe_open(str(next((tmp_path / "g16").glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.up_proj.weight_scale" in keys and "model.layers.0.mlp.down_proj.weight_scale" not in keys
    assert main(["reshard", str(directory), str(tmp_path / "rows"), "--world", "1", "--quantize", "int8",
                 "--group-size", "none"]) == 0  # one scale per row
    rows = json.load(open(tmp_path / "rows" / "config.json"))["quantization_config"]["config_groups"]["group_0"]
    assert rows["weights"]["strategy"] == "channel"
    for alone in (["--skip", "lm_head"], ["--group-size", "128"]):  # no --quantize: refused, nothing written
        assert main(["reshard", str(directory), str(tmp_path / "x"), "--world", "1", *alone]) == 2
    assert not (tmp_path / "x").exists()


def test_an_error_that_is_no_split_lists_no_worlds(checkpoint):
    """A byte budget below the largest read fails at every world: no list of worlds then."""
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    with pytest.raises(PlanError, match=r"max_host_bytes=1 is smaller") as refused:
        LazyCheckpoint(directory).load_into(model, 0, 2, max_host_bytes=1)
    assert "Worlds that work" not in str(refused.value)
