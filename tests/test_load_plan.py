"""One plan everywhere: `lazyload plan` (the CLI preview), `save_sharded` and `load_into`
plan with the same function (`planner.plan_load`), so the bytes the preview prints for a
rank are the bytes that rank's load reads; a plan is one value, built with each stage run
once, changing nothing."""
from __future__ import annotations

import re

import pytest
import torch

from checkpoints import build_model
from lazyload import LazyCheckpoint
from lazyload import planner

WORLD = 2
WIDE = dict(hidden_size=256, intermediate_size=512)  # column shards of whole quantization groups (128) at world 2


def cli_bytes(capsys, path, *options) -> list[int]:
    """Per rank, the bytes `lazyload plan PATH --world 2 [options]` prints."""
    from lazyload.cli import main

    assert main(["plan", str(path), "--world", str(WORLD), *options]) == 0, capsys.readouterr().err
    rows = [re.match(r"\s*(\d+)\s+([\d,]+)\s", line) for line in capsys.readouterr().out.splitlines()]
    return [int(m.group(2).replace(",", "")) for m in rows if m]


def loaded_bytes(path, arch, config, **load) -> list[int]:
    """Per rank, report.bytes_read + report.bytes_mapped of load_into (on a meta model)."""
    out = []
    for rank in range(WORLD):
        model = build_model(arch, config, torch.float32)
        report = LazyCheckpoint(str(path)).load_into(model, rank, WORLD, progress=False, strict=False, **load)
        out.append(report.bytes_read + report.bytes_mapped)
    return out


@pytest.fixture(scope="module")
def fp8(checkpoint, tmp_path_factory):
    from quant_checkpoints import write_fp8_checkpoint

    directory, config = checkpoint("llama")
    return write_fp8_checkpoint(directory, tmp_path_factory.mktemp("fp8"), block=(16, 16)), config


def test_plan_prints_the_bytes_a_plain_load_reads(checkpoint, capsys):
    directory, config = checkpoint("llama")
    assert cli_bytes(capsys, directory) == loaded_bytes(directory, "llama", config)


def test_plan_prints_the_bytes_an_fp8_block_scaled_load_reads(fp8, capsys):
    directory, config = fp8
    assert cli_bytes(capsys, directory) == loaded_bytes(directory, "llama", config)


def test_plan_prints_the_bytes_an_expert_parallel_load_reads(checkpoint, capsys):
    directory, config = checkpoint("mixtral")
    ep = cli_bytes(capsys, directory, "--plan", "ep")
    assert ep == loaded_bytes(directory, "mixtral", config, plan="ep")
    from lazyload.summary import plan_ranks

    experts = {t.name: t for t in plan_ranks(str(directory), WORLD, plan="ep")[0][0].targets if ".experts." in t.name}
    assert experts and all(t.local_shape[0] == t.full_shape[0] // WORLD and t.local_shape[1:] == t.full_shape[1:]
                           for t in experts.values())  # whole experts per rank


def test_plan_prints_the_bytes_an_int8_load_reads(checkpoint, capsys):
    directory, config = checkpoint("llama", **WIDE)
    assert cli_bytes(capsys, directory, "--quantize", "int8") == loaded_bytes(directory, "llama", config,
                                                                              quantize="int8")


def test_plan_of_a_local_shaped_model_is_the_bytes_its_load_reads(checkpoint):
    """A model holding its own shards (DeepSpeed AutoTP-style local shapes: columns of the MLP
    in uneven shares): the plan maps it with the full shapes, as the load does."""
    directory, config = checkpoint("llama", hidden_size=64, intermediate_size=200)
    for rank in range(WORLD):
        model = build_model("llama", config, torch.float32)
        for layer in model.model.layers:
            sizes = [128, 72]
            for proj in (layer.mlp.gate_proj, layer.mlp.up_proj):
                proj.weight = torch.nn.Parameter(proj.weight[sum(sizes[:rank]):][:sizes[rank]], requires_grad=False)
        plan = planner.plan_load(LazyCheckpoint(str(directory)), model, rank, WORLD, preview=True)
        assert plan.placements.local_shaped and plan.sharded
        report = LazyCheckpoint(str(directory)).load_into(model, rank, WORLD, progress=False)
        assert plan.bytes_to_read == report.bytes_read + report.bytes_mapped


STAGES = ("model_slots", "map_model", "resolve_placements", "quantized_targets", "plan_for_rank", "schedule")


def test_each_stage_runs_once_per_load(checkpoint, monkeypatch):
    directory, config = checkpoint("llama")
    calls = dict.fromkeys(STAGES, 0)
    for name in STAGES:
        def counted(*args, _stage=name, _real=getattr(planner, name), **kwargs):
            calls[_stage] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(planner, name, counted)
    import lazyload.executor

    monkeypatch.setattr(lazyload.executor, "model_slots", lambda model: pytest.fail("slots taken again"))
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(str(directory)).load_into(model, 1, WORLD, progress=False, plan="tp")
    assert report.ok and calls == dict.fromkeys(STAGES, 1), calls
    calls.update(dict.fromkeys(STAGES, 0))
    planner.plan_load(LazyCheckpoint(str(directory)), build_model("llama", config, torch.float32), 0, 1,
                      planner.LoadOptions(quantize="int8"))
    assert calls == dict.fromkeys(STAGES, 1), calls


def test_a_plan_changes_nothing_and_reads_no_tensor_byte(checkpoint, monkeypatch):
    from lazyload.readers import MmapReader, PreadReader

    for reader in (MmapReader, PreadReader):
        for method in ("read", "read_into", "view"):
            monkeypatch.setattr(reader, method, lambda *a, **k: pytest.fail("a plan read a tensor"), raising=False)
    directory, config = checkpoint("llama", **WIDE)
    model = build_model("llama", config, torch.float32)
    before = {n: (t, t.is_meta) for n, t in model.state_dict(keep_vars=True).items()}
    modules = dict(model.named_modules())
    ckpt = LazyCheckpoint(str(directory))
    plans = [planner.plan_load(ckpt, model, rank, WORLD, planner.LoadOptions(quantize="int8"), preview=True)
             for rank in range(WORLD)]
    after = {n: (t, t.is_meta) for n, t in model.state_dict(keep_vars=True).items()}
    assert after.keys() == before.keys() and all(after[n][0] is before[n][0] and after[n][1] for n in before)
    assert dict(model.named_modules()) == modules  # no layer swapped
    assert plans[0].bytes_to_read == plans[1].bytes_to_read and plans[0].items != plans[1].items
    text = plans[1].summary()
    assert f"rank 1 of {WORLD}: {plans[1].bytes_to_read:,} bytes to read in {plans[1].tensors} tensors" in text
    assert f"{plans[1].sharded} sharded, {len(plans[1].quantized)} quantized" in text
    with pytest.raises(Exception):
        plans[0].rank = 1  # frozen
