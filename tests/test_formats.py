"""Checkpoint formats other than safetensors: PyTorch `.bin`/`.pt` state dicts, Megatron-LM
per-rank checkpoints and DeepSpeed's checkpoint description json, each written here in its
published layout from known tensors and loaded into transformers models exactly, at world 1
and at split and merged worlds."""
from __future__ import annotations

import os

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
