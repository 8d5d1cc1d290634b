"""save_sharded / `lazyload reshard`: a save_pretrained checkpoint written pre-sharded for a
world, then loaded at the same and at other worlds. Every rank's tensors equal the direct
load from the original, bit for bit, and each rank reads exactly its share's bytes (the
loader's counter); at the world it was written for, a rank reads its own file front to back."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpoints import build_model
from lazyload import CheckpointError, LazyCheckpoint, save_sharded
from lazyload.mapping import map_model
from lazyload.tp.placements import resolve_placements
from lazyload.plan import plan_for_rank
from lazyload.targets import model_slots, model_specs

# 24 heads, hidden 96, vocab 240: every world in 1, 2, 3, 4, 8 splits heads, MLP and vocab evenly.
WIDE = dict(num_attention_heads=24, num_key_value_heads=24, hidden_size=96, intermediate_size=96, vocab_size=240)


def _load(path, arch, config, rank, world):
    model = build_model(arch, config, torch.float32)
    report = LazyCheckpoint(str(path)).load_into(model, rank, world, progress=False)
    return model.state_dict(), report


def _assert_round_trip(arch, original, sharded, config, worlds):
    for world in worlds:
        for rank in range(world):
            want, direct = _load(original, arch, config, rank, world)
            got, report = _load(sharded, arch, config, rank, world)
            label = f"{sharded.name} at rank {rank} of {world}"
            assert report.ok and sorted(got) == sorted(want), label
            for k in want:
                assert got[k].shape == want[k].shape and torch.equal(got[k], want[k]), f"{label}: {k} differs"
            # Exactly the rank's share: every byte of it once, nothing of the other pieces.
            assert report.bytes_read + report.bytes_mapped == direct.bytes_read + direct.bytes_mapped, label


def _rank_items(path, arch, config, rank, world):
    """The read items of a load (the stages load_into runs), without loading."""
    model = build_model(arch, config, torch.float32)
    index = LazyCheckpoint(str(path)).index.for_rank(rank, world)
    slots, aliases = model_slots(model)
    specs = model_specs(model, slots)
    mapping = map_model(index, model, specs, aliases)
    placements = resolve_placements(model, specs, [], None, rank, world).placements
    dtypes = {n: s.dtype for n, s in specs.items()}
    return plan_for_rank(mapping.exprs, index, {n: s.shape for n, s in specs.items()}, dtypes, placements,
                         rank, world)[1]


@pytest.mark.parametrize("written", [2, 4, 8])
def test_round_trip_llama_any_world(checkpoint, tmp_path, written):
    original, config = checkpoint("llama", **WIDE)
    out = tmp_path / f"tp{written}"
    save_sharded(str(original), out, written)
    doc = json.loads((out / "lazyload_sharded.json").read_text())
    assert [f["rank"] for f in doc["files"]] == list(range(written))
    _assert_round_trip("llama", original, out, config, [1, 2, 3, 4, 8])
    # At the world it was written for, each rank reads only its own file, front to back.
    for rank in range(written):
        items = _rank_items(out, "llama", config, rank, written)
        own = out / doc["files"][rank]["name"]
        assert {item.entry.file for item in items} == {str(own)}
        spans = sorted((item.entry.start, item.entry.end) for item in items)
        assert all(item.src_box == tuple((0, n) for n in item.entry.shape) for item in items)  # whole pieces
        header = 8 + int.from_bytes(own.read_bytes()[:8], "little")
        assert spans[0][0] == header and spans[-1][1] == own.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), "gaps or re-reads in the rank's file"


def test_round_trip_kv_groups_and_gpt2_packed(checkpoint, tmp_path):
    """KV heads replicated in groups (2 KV heads at world 4: a copy in two files each) and
    GPT-2's packed c_attn (three boxes per rank) and Conv1D layout."""
    original, config = checkpoint("llama")
    save_sharded(str(original), tmp_path / "llama4", 4)
    _assert_round_trip("llama", original, tmp_path / "llama4", config, [1, 2, 4])
    original, config = checkpoint("gpt2")
    save_sharded(str(original), tmp_path / "gpt2", 2)
    _assert_round_trip("gpt2", original, tmp_path / "gpt2", config, [1, 2, 4])


def test_reshard_a_resharded_checkpoint_by_layer_files_and_cli(checkpoint, tmp_path):
    """From the world-8 layout to world 2 (merging), cut in files of about a layer, by the CLI."""
    original, config = checkpoint("llama", **WIDE)
    save_sharded(str(original), tmp_path / "tp8", 8)
    (tmp_path / "tp8" / "config.json").write_text((original / "config.json").read_text())
    layer = 4 * 96 * 96 * 4 // 2 + 3 * 96 * 96 * 4 // 2  # about one layer of a world-2 rank, in bytes
    subprocess.run([sys.executable, "-m", "lazyload.cli", "reshard", str(tmp_path / "tp8"), str(tmp_path / "tp2"),
                    "--world", "2", "--max-file-bytes", str(layer)], check=True, capture_output=True)
    doc = json.loads((tmp_path / "tp2" / "lazyload_sharded.json").read_text())
    ranks = [f["rank"] for f in doc["files"]]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1} and len(ranks) >= 2 * config.num_hidden_layers
    _assert_round_trip("llama", original, tmp_path / "tp2", config, [1, 2, 3])


def test_layout_json_that_disagrees_with_its_files_is_refused(checkpoint, tmp_path):
    original, config = checkpoint("llama")
    out = tmp_path / "tp2"
    save_sharded(str(original), out, 2)
    layout = out / "lazyload_sharded.json"
    doc = json.loads(layout.read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    good = json.dumps(doc)
    doc["tensors"][name]["pieces"][1]["box"][0] = [16, 64]  # overlaps rank 0's rows
    layout.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="q_proj"):
        LazyCheckpoint(str(out)).index
    doc = json.loads(good)
    doc["tensors"][name]["pieces"][0]["key"] = "nothing"
    layout.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="does not hold"):
        LazyCheckpoint(str(out)).index


class _Int8Mlp(torch.nn.Module):
    """int8 weights with per-output-channel scales (persistent buffers beside them)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64, bias=False, dtype=torch.float16)
        self.down = torch.nn.Linear(64, 32, bias=False, dtype=torch.float16)
        for layer in (self.up, self.down):
            layer.weight = torch.nn.Parameter(torch.empty(layer.weight.shape, dtype=torch.int8), requires_grad=False)
            layer.register_buffer("weight_scale", torch.empty(layer.weight.shape[0], dtype=torch.float16))


def test_scales_follow_their_weights(tmp_path):
    """Column-parallel: each rank's scale rows are its weight rows; row-parallel: the scale
    (per output channel) is whole on every rank. Written for 2 ranks, loaded at 1, 2 and 4."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in (("up", (64, 32)), ("down", (32, 64))):
        state[f"{name}.weight"] = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        state[f"{name}.weight_scale"] = torch.rand(shape[0], generator=g).to(torch.float16)
    (tmp_path / "src").mkdir()
    save_file(state, str(tmp_path / "src" / "model.safetensors"))
    plan = {"up": "colwise", "down": "rowwise"}
    with torch.device("meta"):
        model = _Int8Mlp()
    save_sharded(str(tmp_path / "src"), tmp_path / "tp2", 2, plan, model=model)
    for world in (1, 2, 4):
        for rank in range(world):
            with torch.device("meta"):
                model = _Int8Mlp()
            LazyCheckpoint(str(tmp_path / "tp2")).load_into(model, rank, world, plan=plan, progress=False)
            got = model.state_dict()
            rows = slice(rank * 64 // world, (rank + 1) * 64 // world)
            cols = slice(rank * 64 // world, (rank + 1) * 64 // world)
            assert torch.equal(got["up.weight"], state["up.weight"][rows])
            assert torch.equal(got["up.weight_scale"], state["up.weight_scale"][rows])
            assert torch.equal(got["down.weight"], state["down.weight"][:, cols])
            assert torch.equal(got["down.weight_scale"], state["down.weight_scale"])
