"""A new user's first hour: every mistake is a LazyLoadError that names the thing to change,
raised before any tensor byte is read with the model left as it was; nothing loads a model
that silently computes garbage; every public parameter is documented."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import lazyload.executor
from checkpoints import (build_model, copy_checkpoint, fixed_input, meta_tensors, outputs, reference_model,
                         rewrite_tensor_in_checkpoint, shard_files)
from gloo import end_rank, spawn_collecting
from lazyload import (ArgumentError, DtypeError, LazyCheckpoint, LazyLoadError, LoadReport, MissingKeysError,
                      Placement, PlanError)
from lazyload.keywords import keywords_of
from lazyload.errors import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
HEAD = "lm_head.weight"


@pytest.fixture
def no_reading(monkeypatch):
    """Any read fails the test: a load needs a reader to read a byte."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_into went on to read the checkpoint")

    monkeypatch.setattr(lazyload.executor, "choose_reader", refuse)


def snapshot(model: nn.Module) -> dict:
    return {n: t for n, t in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False))}


def assert_untouched(model: nn.Module, before: dict) -> None:
    now = snapshot(model)
    assert now.keys() == before.keys()
    for name, tensor in before.items():
        assert now[name] is tensor, f"{name} was replaced by a failed load"


def refused(directory, model, exc, **kwargs) -> str:
    """load_into raises `exc` before reading (see `no_reading`) and leaves `model` as it was."""
    before = snapshot(model)
    with pytest.raises(exc) as info:
        LazyCheckpoint(directory).load_into(model, progress=False, **kwargs)
    assert isinstance(info.value, LazyLoadError)
    assert_untouched(model, before)
    return str(info.value)


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama")


# ------------------------------------------------------------ errors that escaped

def test_integer_dtype_is_a_dtype_error(llama, no_reading):
    directory, config = llama
    msg = refused(directory, build_model("llama", config, torch.float32), DtypeError, dtype=torch.int8)
    assert "dtype=torch.int8" in msg and "torch.bfloat16" in msg


def test_a_path_as_the_model(llama, no_reading):
    directory, _ = llama
    with pytest.raises(ArgumentError, match=r"LazyCheckpoint\(path\)") as info:
        LazyCheckpoint(directory).load_into(str(directory))
    assert str(directory) in str(info.value)


def test_unknown_plan_string(llama, no_reading):
    directory, config = llama
    msg = refused(directory, build_model("llama", config, torch.float32), PlanError, rank=0, world=2, plan="tensor")
    assert "plan='tensor'" in msg and "'tp'" in msg and "'ep'" in msg and "experts must" not in msg


def test_invalid_key_map_regex_even_when_every_key_matches(llama, no_reading):
    directory, config = llama
    msg = refused(directory, build_model("llama", config, torch.float32), ArgumentError, key_map={"(": "x"})
    assert "'('" in msg and "checkpoint key -> model key" in msg


@pytest.mark.parametrize("kwargs,exc,names", [
    ({"missing": "zeros"}, ArgumentError, "missing='zeros'"),
    ({"reader": "fast"}, ArgumentError, "reader='fast'"),
    ({"device": "gpu0"}, ArgumentError, "device='gpu0'"),
    ({"key_map": ["model."]}, ArgumentError, "key_map="),
])
def test_other_arguments_of_the_wrong_kind(llama, no_reading, kwargs, exc, names):
    directory, config = llama
    assert names in refused(directory, build_model("llama", config, torch.float32), exc, **kwargs)


# ------------------------------------------------------------------------- plan=

def test_plan_glob_that_matches_nothing(llama, no_reading):
    directory, config = llama
    msg = refused(directory, build_model("llama", config, torch.float32), PlanError, rank=0, world=2,
                  plan={"layers.*.mlp.down_proj": "rowwise", "layers.*.mlp.dwn_proj": "rowwise"})
    assert "'layers.*.mlp.dwn_proj'" in msg and "down_proj'" not in msg.split("match no")[1].split(".")[0]


def test_placement_validates_its_fields():
    with pytest.raises(PlanError, match="shard_rows"):
        Placement(kind="shard_rows")
    with pytest.raises(PlanError, match="parts"):
        Placement("shard", 0, parts=3)
    with pytest.raises(PlanError, match="dim"):
        Placement("shard", dim="0")
    with pytest.raises(PlanError, match="spans"):
        Placement("shard", spans=(((0, 1),),))
    assert Placement("packed", 1, parts=3).parts == 3


def test_the_uneven_split_advice_works_and_merges_into_the_model_plan(checkpoint, no_reading, monkeypatch):
    """vocab 250 over 4 ranks: the error names the override; taking it shards the rest."""
    directory, config = checkpoint("llama", vocab_size=250)
    msg = refused(directory, build_model("llama", config, torch.float32), PlanError, rank=1, world=4)
    advice = re.search(r"plan=(\{.*?\})", msg).group(1)
    plan = eval(advice)  # the message's own advice, as a user would paste it
    monkeypatch.undo()
    model = build_model("llama", config, torch.float32)
    for attempt in range(3):  # the advice names one tensor at a time
        try:
            report = LazyCheckpoint(directory).load_into(model, 1, 4, plan=plan, progress=False)
            break
        except PlanError as exc:
            plan |= eval(re.search(r"plan=(\{.*?\})", str(exc)).group(1))
    assert report.ok
    full = reference_model("llama", directory, torch.float32).state_dict()
    assert torch.equal(model.model.embed_tokens.weight, full["model.embed_tokens.weight"])
    q = full["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q.chunk(4, 0)[1]), "the model's plan was dropped"


# ---------------------------------------------------------------- strict=False

@pytest.fixture(scope="module")
def headless(llama, tmp_path_factory):
    """The llama checkpoint without lm_head and one norm weight."""
    directory, config = llama
    out = copy_checkpoint(directory, tmp_path_factory.mktemp("headless") / "ckpt")
    rewrite_tensor_in_checkpoint(out, drop=HEAD)
    rewrite_tensor_in_checkpoint(out, drop="model.layers.1.input_layernorm.weight")
    return out, config


def test_missing_weights_get_the_model_init_as_from_pretrained(headless, caplog):
    directory, config = headless
    torch.manual_seed(5)
    ref = reference_model("llama", directory, torch.float32)
    torch.manual_seed(5)
    model = build_model("llama", config, torch.float32)
    with caplog.at_level(logging.WARNING, logger="lazyload"):
        report = LazyCheckpoint(directory).load_into(model, strict=False, progress=False)
    assert sorted(report.initialized) == sorted([HEAD, "model.layers.1.input_layernorm.weight"])
    assert sorted(report.missing) == sorted(report.initialized) and not report.ok
    assert not meta_tensors(model)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)  # same init, same RNG draws
    assert torch.equal(model.model.layers[1].input_layernorm.weight, torch.ones(config.hidden_size))
    assert torch.equal(outputs(model, config), outputs(ref, config))
    assert "model's own initialisation" in str(report)
    assert any("initialisation" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_missing_keep_and_error(headless, no_reading):
    directory, config = headless
    msg = refused(directory, build_model("llama", config, torch.float32), MissingKeysError, strict=False,
                  missing="error")
    assert HEAD in msg


def test_missing_keep_leaves_meta(headless):
    directory, config = headless
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, strict=False, missing="keep", progress=False)
    assert report.initialized == [] and model.lm_head.weight.is_meta
    assert "left as they were" in str(report)


class Scaled(nn.Module):
    """A module with a parameter that no initialisation knows about."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.empty(4))


def test_missing_weights_the_model_cannot_init_are_refused(tmp_path, no_reading):
    save_file({"proj.weight": torch.randn(4, 4), "proj.bias": torch.randn(4)}, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = Scaled()
    msg = refused(tmp_path, model, MissingKeysError, strict=False)
    assert "scale" in msg and "missing='keep'" in msg


def test_plain_torch_layers_are_initialised_with_reset_parameters(tmp_path):
    save_file({"proj.weight": torch.randn(4, 4)}, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = nn.Sequential()
        model.add_module("proj", nn.Linear(4, 4))
    report = LazyCheckpoint(tmp_path).load_into(model, strict=False, progress=False)
    assert report.initialized == ["proj.bias"]
    assert torch.isfinite(model.proj.bias).all() and model.proj.bias.abs().max() <= 0.5  # U(-1/sqrt(4), 1/sqrt(4))


# ----------------------------------------------------------------- key guidance

@pytest.fixture(scope="module")
def ddp_checkpoint(llama, tmp_path_factory):
    """The llama checkpoint as a DDP-wrapped model saves it: every key under `module.`."""
    directory, config = llama
    out = tmp_path_factory.mktemp("ddp")
    state = {}
    for f in shard_files(directory):
        state.update(load_file(str(f)))
    save_file({f"module.{k}": v for k, v in state.items()}, str(out / "model.safetensors"))
    shutil.copy(Path(directory) / "config.json", out)
    return out, config


def test_ddp_prefix_is_named_first_and_its_key_map_works(ddp_checkpoint, llama, no_reading, monkeypatch):
    directory, config = ddp_checkpoint
    msg = refused(directory, build_model("llama", config, torch.float32), MissingKeysError)
    first = msg.splitlines()[0]
    assert "'module.'" in first and "key_map={r'^module\\.': ''}" in first
    monkeypatch.undo()
    model = build_model("llama", config, torch.float32)
    assert LazyCheckpoint(directory).load_into(model, key_map={r"^module\.": ""}, progress=False).ok
    ref = build_model("llama", config, torch.float32)
    LazyCheckpoint(llama[0]).load_into(ref, progress=False)
    assert torch.equal(outputs(model, config), outputs(ref, config))


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.net = inner


def test_wrapper_prefix_is_named(llama, no_reading):
    directory, config = llama
    msg = refused(directory, Wrapper(build_model("llama", config, torch.float32)), MissingKeysError)
    assert "'net.'" in msg.splitlines()[0] and "key_map={r'^': 'net.'}" in msg.splitlines()[0]


def test_key_map_that_matches_nothing_is_reported(ddp_checkpoint, no_reading, caplog):
    directory, config = ddp_checkpoint
    wrong_way = {r"^model\.": "module.model."}  # model key -> checkpoint key: the wrong direction
    with caplog.at_level(logging.WARNING, logger="lazyload"):
        msg = refused(directory, build_model("llama", config, torch.float32), MissingKeysError, key_map=wrong_way)
    assert "'^model\\\\.'" in msg and "checkpoint key -> model key" in msg
    assert any("match no checkpoint key" in r.getMessage() for r in caplog.records)


def test_readme_says_which_way_key_map_maps():
    assert "checkpoint key -> model key" in (ROOT / "README.md").read_text()


# ----------------------------------------------------------------- repo ids

def _fake_hub_cache(cache: Path, repo: str, directory) -> Path:
    """huggingface_hub's cache layout for `repo` at revision main, holding `directory`'s files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    return copy_checkpoint(directory, root / "snapshots" / ("0" * 40))


def test_repo_id_resolves_through_the_local_hub_cache(llama, tmp_path, monkeypatch):
    from huggingface_hub import constants

    directory, config = llama
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", directory)
    model = build_model("llama", config, torch.float32)
    assert LazyCheckpoint("tiny-org/tiny-llama").load_into(model, progress=False).ok
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache") as info:
        LazyCheckpoint("tiny-org/absent")
    assert "hf download tiny-org/absent" in str(info.value)


# ----------------------------------------------------------------- lazyload plan

@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("lazyload tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _one_line_error(capsys, argv, *needles):
    from lazyload.cli import main

    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("lazyload: error: "), err
    for needle in needles:
        assert needle in err, err


def test_plan_cli_errors(llama, ddp_checkpoint, tmp_path, capsys, monkeypatch, no_network):
    from huggingface_hub import constants

    directory, _ = llama
    _one_line_error(capsys, ["plan", directory, "--world", 3], "3 ranks")  # 4 heads
    _one_line_error(capsys, ["plan", directory, "--world", 2, "--config", tmp_path / "nowhere"], "config.json",
                    "--config")
    bare = copy_checkpoint(directory, tmp_path / "bare")
    (bare / "config.json").unlink()
    _one_line_error(capsys, ["plan", bare, "--world", 2], "no config.json")
    _one_line_error(capsys, ["plan", ddp_checkpoint[0], "--world", 2], "'module.'")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    _one_line_error(capsys, ["plan", "tiny-org/absent", "--world", 2], "not in the local Hugging Face cache")


def test_plan_cli_has_no_traceback_in_a_fresh_process(llama, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")  # a network call would fail
    result = subprocess.run([sys.executable, "-m", "lazyload.cli", "plan", str(llama[0]), "--world", "2",
                             "--config", "some-org/no-such-config"], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("lazyload: error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "some-org/no-such-config" in result.stderr


def test_plan_cli_table_and_warnings_agree(llama, capsys):
    from lazyload.cli import main

    assert main(["plan", str(llama[0]), "--world", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert len(rows) == 2 and all(int(r[1].replace(",", "")) > 0 and int(r[3]) > 0 for r in rows)
    assert "nothing is sharded" not in out


# ----------------------------------------------------------------- output

def test_progress_counts_mapped_bytes_and_the_report_is_logged_once(llama, capsys, caplog):
    directory, config = llama
    model = build_model("llama", config, torch.float32)
    with caplog.at_level(logging.INFO, logger="lazyload"):
        report = LazyCheckpoint(directory).load_into(model, progress=True)
    assert report.bytes_mapped > 0 and report.bytes_read == 0  # fp32 into fp32 on CPU: all views
    bar = capsys.readouterr().err
    total = f"{report.bytes_mapped / 2**20:.1f}/{report.bytes_mapped / 2**20:.1f} MiB"
    assert total in bar, bar
    messages = [r.getMessage() for r in caplog.records]
    assert sum("tensors loaded" in m for m in messages) == 1
    assert not any(re.search(r"\d bytes|\dB\b|GB|MB", m) for m in messages), messages


# ----------------------------------------------------------------- documentation

def _documented(obj) -> str:
    return inspect.getdoc(obj) or ""


def _public_names():
    load, init = keywords_of(LazyCheckpoint.load_into), keywords_of(LazyCheckpoint.__init__)  # not their **unknown
    report = [f.name for f in dataclasses.fields(LoadReport)] + ["ok"]
    placement = [f.name for f in dataclasses.fields(Placement)]
    return [(LazyCheckpoint.load_into, load), (LazyCheckpoint, init), (LoadReport, report), (Placement, placement)]


def test_every_public_parameter_has_a_docstring_and_a_readme_entry():
    readme = (ROOT / "README.md").read_text()
    reference = readme[readme.index("## Reference"):readme.index("## Tensor parallel")]
    for obj, names in _public_names():
        doc = _documented(obj)
        for name in names:
            assert f"`{name}`" in doc, f"{obj.__qualname__}: `{name}` is not in its docstring"
            assert f"`{name}`" in reference, f"README's reference section does not mention `{name}`"


# ----------------------------------------------------------------- paths

def test_benchmarks_and_examples_use_no_fixed_path():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert common.DEFAULT_CKPT_DIR.startswith(tempfile.gettempdir())
    for path in list((ROOT / "benchmarks").glob("*.py")) + list((ROOT / "examples").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"[\"']/(work|tmp|home)/", text), f"{path.name} names a fixed directory"
        assert "mkdtemp(" not in text or "rmtree" in text, f"{path.name} leaves its temporary directory behind"


# ----------------------------------------------------------------- torch.distributed

def _dist_cases(rank, world, tied, llama_dir):
    from transformers import AutoConfig

    for arch, directory in tied:  # tied embeddings: made tensor parallel, world-1 logits
        config = AutoConfig.from_pretrained(directory)
        ref = reference_model(arch, directory, torch.float32)
        model = build_model(arch, config, torch.float32)
        report = LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
        assert report.ok and model.lm_head.weight is model.model.embed_tokens.weight, arch
        logits = model(input_ids=fixed_input(config)).logits
        torch.testing.assert_close(logits, ref(input_ids=fixed_input(config)).logits, rtol=1e-5, atol=1e-5)
        dist.barrier()

    config = AutoConfig.from_pretrained(llama_dir)
    for bad_rank, bad_world in ((rank, 4), ((rank + 1) % world, world)):  # not the process group's
        model = build_model("llama", config, torch.float32)
        before = snapshot(model)
        with pytest.raises(PlanError) as info:
            LazyCheckpoint(llama_dir).load_into(model, bad_rank, bad_world, progress=False)
        msg = str(info.value)
        assert f"rank={bad_rank}, world={bad_world}" in msg and "shards_only=True" in msg
        assert_untouched(model, before)
    model = build_model("llama", config, torch.float32)  # asked for explicitly: plain quarter shards
    assert LazyCheckpoint(llama_dir).load_into(model, rank, 4, shards_only=True, progress=False).ok
    assert model.model.layers[0].mlp.up_proj.weight.shape == (config.intermediate_size // 4, config.hidden_size)


def _dist_worker(rank, world, init_file, args, errors):
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with torch.no_grad():
            _dist_cases(rank, world, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        dist.destroy_process_group()
        raise
    end_rank()


def test_world2_tied_embeddings_and_process_group_checks(checkpoint, llama, tmp_path):
    tied = [(arch, str(checkpoint(arch, tie_word_embeddings=True)[0])) for arch in ("qwen2", "llama")]
    spawn_collecting(_dist_worker, (2, str(tmp_path / "pg"), (tied, str(llama[0]))), 2)
