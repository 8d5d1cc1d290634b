"""Megatron-Core `torch_dist` checkpoints (written by megatron-core's own
dist_checkpointing.save at TP 2) load into a meta-built transformers Llama: its logits match
Megatron's forward within 1e-5, at world 2 under gloo each rank's shards equal world 1's
bit for bit while reading less than 0.75x the checkpoint; the save directory, the iteration
directory and a NeMo 2 `weights/` directory are all entry points. A MoE GPTModel (saved at
TP 2 x EP 2) loads into a meta-built Qwen3-MoE bit-exact against Megatron's own load
converted, with Megatron's logits (so its routing), at world 1 and at world 2 (TP, EP). The
dense one written by megatron-core 0.19.2 (its args in a DCP byte item, no common.pt) loads
as the 0.16.1 one. Hostile trackers, args, layer numbers and byte items are CheckpointErrors
naming the file, the model untouched."""
from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core (the test extra) writes the checkpoints")

from gloo import spawn_cases  # noqa: E402
from lazyload import CheckpointError, LazyCheckpoint  # noqa: E402
from megatron_dist_checkpoints import hf_config, save_megatron, save_megatron_019, tokens  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The dense and the Qwen3-MoE Megatron checkpoints, written by one spawned job."""
    root = tmp_path_factory.mktemp("megatron")
    save_megatron(root, [(root / "save", "llama"), (root / "qwen3_moe", "qwen3_moe")])
    return root


@pytest.fixture(scope="module")
def saved(written):
    return written / "save"


@pytest.fixture(scope="module")
def saved_moe(written):
    return written / "qwen3_moe"


@pytest.fixture(scope="module")
def saved_019(tmp_path_factory):
    """The Llama saved by megatron-core 0.19.2 (no common.pt: its args are in the DCP byte
    item `common_state/shard_0_1`), the same weights as the 0.16.1 one (the same seed)."""
    directory = tmp_path_factory.mktemp("megatron_019") / "megatron_0_19"
    save_megatron_019(directory)
    return directory


def _meta_llama():
    import transformers as tf

    with torch.device("meta"):
        return tf.LlamaForCausalLM._from_config(hf_config(), attn_implementation="eager", dtype=torch.float32).eval()


def _meta_model(kind: str):
    import transformers as tf

    classes = {"qwen3_moe": tf.Qwen3MoeForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM}
    with torch.device("meta"):
        return classes[kind]._from_config(hf_config(kind), attn_implementation="eager", dtype=torch.float32).eval()


def _loaded(path, rank=0, world=1, plan=None):
    """The checkpoint at `path` loaded into a meta-built model of its kind (its folder's name)."""
    kind = os.path.basename(path)
    model = _meta_model(kind) if kind.endswith("_moe") else _meta_llama()
    report = LazyCheckpoint(str(path)).load_into(model, rank, world, plan=plan, progress=False)
    assert report.ok
    return model, report


def _megatron_logits_match(model, path):
    with torch.no_grad():
        logits = model(input_ids=tokens()).logits
    torch.testing.assert_close(logits, torch.load(os.path.join(path, "megatron_logits.pt")), rtol=0, atol=1e-5)


def test_megatron_logits_match_megatrons_forward(saved):
    _megatron_logits_match(_loaded(saved)[0], saved)


def test_a_megatron_core_0_19_checkpoint_loads_as_the_0_16_one(saved, saved_019):
    """megatron-core 0.19.2's save (its common state a byte item in the .distcp files, no
    common.pt, metadata.json without common_backend) loads to the tensors of the 0.16.1
    save of the same model, bit for bit, and its logits are Megatron 0.19.2's."""
    import json

    iteration = saved_019 / "iter_0000100"
    assert not (iteration / "common.pt").exists()
    assert "common_backend" not in json.loads((iteration / "metadata.json").read_text())
    model = _loaded(saved_019)[0]
    want = _loaded(saved)[0].state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    _megatron_logits_match(model, saved_019)


@pytest.mark.parametrize("change,match", [
    (dict(length=1 << 40), r"1099511627776 bytes, over the 268435456 a common state takes"),
    (dict(offset=1 << 30), r"the file ends inside byte item 'common_state/shard_0_1'"),
    (dict(transform_descriptors=["zstd"]), r"stored transformed \(zstd\)"),
], ids=["huge", "past-the-end", "compressed"])
def test_a_common_state_byte_item_that_cannot_be_megatrons_is_refused(saved_019, tmp_path, change, match):
    """The byte item holding 0.19's args, said to be a terabyte, past its file's end or
    compressed: a CheckpointError naming it, before anything of it is read."""
    import dataclasses
    import pickle

    directory = tmp_path / "iter"
    shutil.copytree(saved_019 / "iter_0000100", directory)
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    index = next(i for i in metadata.storage_data if i.fqn == "common_state/shard_0_1")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **change)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    _refused(directory, r"\.distcp( \(Megatron's common state, byte item 'common_state/shard_0_1'\))?: .*" + match)


def _equals_megatrons_own_load(path):
    """Every tensor equals Megatron's own load converted, bit for bit; the logits are Megatron's."""
    model, _ = _loaded(path)
    want = torch.load(path / "reference.pt")
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    _megatron_logits_match(model, path)


def test_megatron_moe_equals_megatrons_own_load_and_routes_as_megatron(saved_moe):
    """Qwen3-MoE: router, experts (fused gate_up_proj / down_proj from the expert axis), q/k norms."""
    _equals_megatrons_own_load(saved_moe)


@pytest.mark.slow
def test_megatron_shared_expert_loads_into_qwen2_moe(tmp_path):
    """Qwen2-MoE: QKV bias, the shared expert's fc1 split into gate_proj / up_proj, its
    sigmoid gate, a dense layer after a MoE one (so Megatron saves each layer under its own
    `decoder.layers.N.` keys): a checkpoint of its own, one more spawned job."""
    import pickle

    save_megatron(tmp_path, [(tmp_path / "qwen2_moe", "qwen2_moe")])
    with open(tmp_path / "qwen2_moe" / "iter_0000100" / ".metadata", "rb") as f:
        keys = pickle.load(f).state_dict_metadata
    assert "decoder.layers.1.mlp.linear_fc1.weight" in keys and "decoder.layers.0.mlp.router.weight" in keys
    _equals_megatrons_own_load(tmp_path / "qwen2_moe")


def test_entry_points_give_the_same_tensors(saved, tmp_path):
    """The save directory (its tracker's iteration), the iteration directory, NeMo 2's
    `weights/`: the same index and the same tensors."""
    nemo = tmp_path / "nemo_ckpt"
    shutil.copytree(saved / "iter_0000100", nemo / "weights")
    want = _loaded(saved)[0].state_dict()
    for path in (saved / "iter_0000100", nemo):
        got = _loaded(path)[0].state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[k], want[k]) for k in want), path
    assert LazyCheckpoint(str(saved)).source.kind == "megatron_dist"


def _case_world2(case, rank, world):
    """This rank's shards equal the reference (world 1's, or Megatron's own load converted
    for the MoE model) and, for the MoE model, its forward gives Megatron's logits."""
    path, plan = case
    moe = os.path.basename(path).endswith("_moe")
    want = torch.load(os.path.join(path, "reference.pt")) if moe else _loaded(path)[0].state_dict()
    model, report = _loaded(path, rank, world, plan)
    experts_cut = 0
    for key, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        local = value.to_local() if hasattr(value, "to_local") else value
        experts_cut += key.endswith("experts.gate_up_proj") and local.shape != want[key].shape
        if full.shape != want[key].shape:  # expert parallel: this rank's whole experts
            assert plan == "ep" and key.endswith(("gate_up_proj", "down_proj")), key
            want[key] = want[key].chunk(world, 0)[rank]
        assert torch.equal(full, want[key]), f"rank {rank} plan {plan!r}: {key}"
    if moe:
        assert experts_cut, f"plan {plan}: no rank-local experts"
        _megatron_logits_match(model, path)
    total = LazyCheckpoint(str(path)).index.total_bytes
    assert report.bytes_read + report.bytes_mapped < 0.75 * total, (report.bytes_read, report.bytes_mapped, total)


def test_megatron_loads_at_world_2_under_gloo(saved, saved_019, saved_moe, tmp_path):
    """One spawned job: the dense checkpoint (as megatron-core 0.16.1 and 0.19.2 save it), and
    the MoE one at TP (each expert's gate and up rows cut) and at EP (whole experts per rank)."""
    from checkpoints import EXPERTS_TP

    cases = [(str(saved), None), (str(saved_019), None), (str(saved_moe), EXPERTS_TP), (str(saved_moe), "ep")]
    spawn_cases(2, cases, tmp_path, _case_world2)


def test_heads_that_do_not_fit_are_refused(saved, tmp_path):
    """Without Megatron's args, a config.json whose heads do not fit the fused QKV rows:
    a CheckpointError naming the key, before any tensor byte."""
    import json

    directory = tmp_path / "iter"
    shutil.copytree(saved / "iter_0000100", directory)
    os.remove(directory / "common.pt")
    doc = hf_config().to_dict() | {"num_key_value_heads": 4}
    (directory / "config.json").write_text(json.dumps(doc))
    model = _meta_llama()
    with pytest.raises(CheckpointError, match="linear_qkv.weight"):
        LazyCheckpoint(str(directory)).load_into(model, progress=False)
    assert all(t.is_meta for t in model.state_dict().values())


def test_cli_plans_and_reshards_a_megatron_checkpoint(saved, tmp_path, capsys):
    """`lazyload plan` and `reshard` (with the model's config.json): the pre-sharded copy
    loads at world 2 to the same shards as the training checkpoint itself."""
    from lazyload.cli import main

    hf_config().save_pretrained(tmp_path / "config")
    assert main(["plan", str(saved), "--world", "2", "--config", str(tmp_path / "config")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    total = LazyCheckpoint(str(saved)).index.total_bytes
    assert len(rows) == 2 and all(int(row[1].replace(",", "")) < 0.75 * total for row in rows)
    out = tmp_path / "resharded"
    assert main(["reshard", str(saved), str(out), "--world", "2", "--config", str(tmp_path / "config")]) == 0
    for rank in range(2):
        want = _loaded(saved, rank, 2)[0].state_dict()
        got = _loaded(out, rank, 2)[0].state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)


def _with_key_renamed(saved, directory, old: str, new: str):
    """A copy of the checkpoint's iteration in `directory`, its tensor `old` named `new` in its .metadata."""
    import pickle

    shutil.copytree(saved / "iter_0000100", directory)
    with open(directory / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    for index in list(metadata.storage_data):
        if index.fqn == old:
            info = metadata.storage_data.pop(index)
            metadata.storage_data[type(index)(new, index.offset, index.index)] = info
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return directory


def _refused(path, match):
    """Loading `path` is a CheckpointError matching `match`, the model untouched."""
    model = _meta_llama()
    with pytest.raises(CheckpointError, match=match):
        LazyCheckpoint(str(path)).load_into(model, progress=False)
    assert all(t.is_meta for t in model.state_dict().values())


def test_a_megatron_key_lazyload_does_not_know_is_named(saved, tmp_path):
    """A per-expert key (as Megatron's singleton_local_shards names them; here a renamed fc2)
    is refused naming the key and what lazyload expected, before any tensor byte."""
    directory = _with_key_renamed(saved, tmp_path / "iter", "decoder.layers.mlp.linear_fc2.weight",
                                  "decoder.layers.mlp.experts.experts.0.linear_fc2.weight")
    _refused(directory, r"decoder\.layers\.mlp\.experts\.experts\.0\.linear_fc2\.weight.*expected")


@pytest.mark.parametrize("layer", ["\u00b2", "\u0661", "1" * 5000], ids=["superscript", "arabic-indic", "5000-digits"])
def test_a_layer_number_that_is_not_ascii_digits_is_refused(saved, tmp_path, layer):
    """`decoder.layers.N.` with N not ASCII digits ('²' raised int()'s ValueError, '١' was
    read as layer 1, 5,000 digits over int()'s limit): a CheckpointError naming the key."""
    directory = _with_key_renamed(saved, tmp_path / "iter", "decoder.layers.mlp.linear_fc2.weight",
                                  f"decoder.layers.{layer}.mlp.linear_fc2.weight")
    _refused(directory, r"\.metadata: Megatron key 'decoder\.layers\..*: its layer number .* is not one")


@pytest.mark.parametrize("tag", ["{other}", "../other/iter_0000100", "iter_0000100", "\u00b2", "\u0661\u0660\u0660",
                                 "1" * 30, "+100", ""])
def test_a_tracker_naming_no_iteration_is_refused(saved, tmp_path, tag):
    """Megatron writes an iteration number or `release` in latest_checkpointed_iteration.txt:
    a path there (absolute, or up and into another save directory) loaded that directory, '²'
    raised int()'s ValueError, '١٠٠' was read as 100."""
    save, other = tmp_path / "save", tmp_path / "other"
    for root in (save, other):
        shutil.copytree(saved / "iter_0000100", root / "iter_0000100")
    (save / "latest_checkpointed_iteration.txt").write_text(tag.format(other=other / "iter_0000100"))
    _refused(save, r"latest_checkpointed_iteration\.txt: holds .*, not an iteration number")


_HUGE = 2 ** 2000  # 603 digits: torch's safe unpickler reads no longer integer (pickle's LONG4)


@pytest.mark.parametrize("change,what", [
    (dict(num_attention_heads=0), "Megatron's args.num_attention_heads is 0, not a count"),
    (dict(num_attention_heads="4"), "Megatron's args.num_attention_heads is '4', not a count"),
    (dict(num_attention_heads=True), "Megatron's args.num_attention_heads is True, not a count"),
    (dict(num_query_groups=0), "Megatron's args.num_query_groups is 0, not a count"),
    (dict(num_query_groups="2"), "Megatron's args.num_query_groups is '2', not a count"),
    (dict(num_attention_heads=_HUGE), "Megatron's args.num_attention_heads is <integer of 2001 bits>, not a count"),
    (dict(kv_channels=_HUGE), "Megatron's args.kv_channels is <integer of 2001 bits>, not a count"),
    (dict(kv_channels=[_HUGE]), "Megatron's args.kv_channels is [<integer of 2001 bits>], not a count"),
    (dict(kv_channels=None, hidden_size=_HUGE), "Megatron's args.hidden_size is <integer of 2001 bits>, not a count"),
    (dict(kv_channels=None, hidden_size=2), "4 attention heads in 2 query groups of head size 0: no such attention"),
    (dict(num_query_groups=3), "4 attention heads in 3 query groups of head size 16: no such attention"),
], ids=lambda v: "" if isinstance(v, str) else ",".join(f"{k}={type(x).__name__}" for k, x in v.items()))
def test_megatron_args_that_are_no_heads_are_refused(saved, tmp_path, change, what):
    """Megatron's args in common.pt with heads, groups or head size of 0, a string, a bool or
    a huge integer: a CheckpointError naming common.pt and the value (an integer of over 64
    bits by its size), not ZeroDivisionError, TypeError or a message of 600 digits."""
    import argparse

    directory = tmp_path / "iter"
    shutil.copytree(saved / "iter_0000100", directory)
    common = torch.load(directory / "common.pt", weights_only=False)
    common["args"] = argparse.Namespace(**(vars(common["args"]) | change))
    torch.save(common, directory / "common.pt")
    _refused(directory, r"common\.pt: " + re.escape(what))


# ----------------------------------------------------------------------------- iterations, URLs


@pytest.fixture(scope="module")
def two_iterations(saved, tmp_path_factory):
    """A save directory holding iterations 100 and 200 (its tracker naming 100), the config
    beside them."""
    root = tmp_path_factory.mktemp("iterations") / "save"
    for tag in ("0000100", "0000200"):
        shutil.copytree(saved / "iter_0000100", root / f"iter_{tag}")
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    return root


def test_iteration_picks_one_of_the_save_directory(two_iterations, capsys):
    from lazyload.cli import main

    for iteration, name in ((None, "iter_0000100"), (100, "iter_0000100"), (200, "iter_0000200")):
        checkpoint = LazyCheckpoint(str(two_iterations), iteration=iteration)
        assert checkpoint.source.description == str(two_iterations / name)
    with pytest.raises(CheckpointError, match=r"no iteration 300 .*the iterations present: 100, 200"):
        LazyCheckpoint(str(two_iterations), iteration=300)
    assert main(["inspect", str(two_iterations), "--iteration", "200"]) == 0
    assert "iter_0000200" in capsys.readouterr().out
    assert main(["inspect", str(two_iterations), "--iteration", "300"]) == 2
    assert "the iterations present: 100, 200" in capsys.readouterr().err


def test_iteration_of_a_checkpoint_without_iterations_is_an_argument_error(saved, tmp_path):
    from lazyload import ArgumentError

    dcp_dir = tmp_path / "dcp"
    shutil.copytree(saved / "iter_0000100", dcp_dir)
    os.remove(dcp_dir / "metadata.json")  # a plain DCP directory now
    with pytest.raises(ArgumentError, match=r"iteration=100: .* is a dcp checkpoint, which has no iterations"):
        LazyCheckpoint(str(dcp_dir), iteration=100)


def test_a_megatron_save_directory_over_http(two_iterations):
    """The save directory's URL (its tracker followed, or iteration=) loads as the local
    files do; a missing iteration over HTTP says the store cannot list them."""
    from remote_servers import RangeServer

    want = _loaded(two_iterations)[0].state_dict()
    with RangeServer(str(two_iterations.parent)) as server:
        for iteration in (None, 200):
            url = f"{server.url}/save/"
            model, report = _loaded_url(url, iteration)
            assert report.reader == "remote"
            got = model.state_dict()
            assert all(torch.equal(got[k], want[k]) for k in want), iteration
        with pytest.raises(CheckpointError, match="no iteration 300 .*cannot list"):
            LazyCheckpoint(f"{server.url}/save/", iteration=300)


def _loaded_url(url, iteration):
    model = _meta_llama()
    report = LazyCheckpoint(url, iteration=iteration).load_into(model, progress=False)
    assert report.ok
    return model, report
