"""strict=True failures are raised before any tensor byte is read and leave the model
untouched; strict=False records them in the report and loads the rest."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (build_model, copy_checkpoint, data_starts, evict, make_config, rchar,
                         reference_model, resident_data_bytes, rewrite_tensor_in_checkpoint,
                         shard_files, assert_same_weights)
from lazyload import LazyCheckpoint
from lazyload.errors import (DtypeError, LazyLoadError, MappingError, MissingKeysError,
                             ShapeMismatchError, UnexpectedKeysError)

DROPPED = "model.layers.1.mlp.up_proj.weight"
EXTRA = "model.layers.1.mlp.extra_proj.weight"
BIG_VOCAB = 131072  # embed_tokens and lm_head 32 MiB each in fp32: bigger than readahead


@pytest.fixture(scope="module")
def big_llama(checkpoint):
    return checkpoint("llama", "fp32", vocab_size=BIG_VOCAB)


@pytest.fixture(scope="module")
def variants(big_llama, tmp_path_factory):
    """Copies of the big llama checkpoint: one shard rewritten without DROPPED, or with EXTRA."""
    directory, _ = big_llama
    base = tmp_path_factory.mktemp("variants")
    missing = copy_checkpoint(directory, base / "missing")
    rewrite_tensor_in_checkpoint(missing, drop=DROPPED)
    unexpected = copy_checkpoint(directory, base / "unexpected")
    rewrite_tensor_in_checkpoint(unexpected, add={EXTRA: torch.randn(16, 64)})
    return {"missing": missing, "unexpected": unexpected}


@pytest.fixture(scope="module", autouse=True)
def warm_imports(checkpoint):
    """One successful load first, so that the byte counting below does not see the
    loader's own lazy imports reading .py files."""
    directory, config = checkpoint("llama", "fp32")
    model = build_model("llama", config, torch.float32)
    LazyCheckpoint(str(directory)).load_into(model, progress=False)


def snapshot(model):
    return {n: (t, None if t.is_meta else t.detach().clone())
            for n, t in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False))}


def assert_untouched(model, snap):
    now = dict(list(model.named_parameters(remove_duplicate=False))
               + list(model.named_buffers(remove_duplicate=False)))
    assert sorted(now) == sorted(snap)
    for n, (obj, values) in snap.items():
        t = now[n]
        if values is None:
            assert t.is_meta, f"{n} left meta before the failed load, is {t.device} after"
        else:
            assert t is obj, f"{n}: replaced by the failed load"
            assert torch.equal(t, values), f"{n}: changed by the failed load"


def fails_before_reading(directory_or_files, model, exc, **kwargs):
    """load_into raises ``exc`` (a LazyLoadError), reads no tensor byte and leaves the model
    as it was. Byte accounting three ways: the index's own counter, read()/pread() bytes
    of this process (/proc/self/io) and, where the page cache can be emptied, which data
    pages are resident afterwards (catches mmap reads too)."""
    ckpt = LazyCheckpoint(directory_or_files)
    total = ckpt.total_bytes
    header_read = ckpt.header_bytes_read
    starts = data_starts(ckpt.files)
    snap = snapshot(model)
    evicted = evict(ckpt.files)
    r0 = rchar()
    with pytest.raises(exc) as e:
        ckpt.load_into(model, progress=False, **kwargs)
    r1 = rchar()
    resident = resident_data_bytes(starts) if evicted else None
    assert isinstance(e.value, LazyLoadError)
    assert ckpt.header_bytes_read == header_read
    if r0 is not None:
        assert r1 - r0 < total // 10, f"read {r1 - r0} of {total} tensor bytes before failing"
    if resident is None:
        warnings.warn("page cache could not be emptied here: mmap reads not checked")
    else:
        assert resident < total // 2, f"{resident} of {total} tensor bytes in the page cache after failing"
    assert_untouched(model, snap)
    return e.value


# ------------------------------------------------------------------------- missing

def test_missing_key_meta_model(variants, big_llama):
    _, config = big_llama
    model = build_model("llama", config, torch.float32)
    err = fails_before_reading(str(variants["missing"]), model, MissingKeysError)
    assert isinstance(err, MappingError)
    msg = str(err)
    assert DROPPED in msg and err.keys == [DROPPED], msg
    # suggestions ("did you mean ..."): real checkpoint keys near the missing name
    assert "did you mean" in msg.lower(), msg
    near = ["model.layers.0.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight",
            "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    after = msg.split(DROPPED, 1)[1].lower().split("did you mean", 1)[1]
    assert sum(k in after for k in near) >= 2, msg


def test_missing_key_real_model_untouched(variants, big_llama):
    _, config = big_llama
    model = build_model("llama", config, torch.float32, empty=None)
    fails_before_reading(str(variants["missing"]), model, MissingKeysError)


def test_missing_key_strict_false_loads_the_rest(variants, big_llama):
    directory, config = big_llama
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(str(variants["missing"])).load_into(model, strict=False, progress=False)
    assert report.missing == [DROPPED]
    assert report.unexpected == [] and report.mismatched == []
    assert DROPPED not in report.loaded
    ref = reference_model("llama", directory, torch.float32).state_dict()
    for name, p in model.named_parameters():
        if name != DROPPED:
            assert torch.equal(p, ref[name]), name


# ---------------------------------------------------------------------- unexpected

def test_unexpected_key(variants, big_llama):
    _, config = big_llama
    model = build_model("llama", config, torch.float32)
    err = fails_before_reading(str(variants["unexpected"]), model, UnexpectedKeysError)
    assert EXTRA in str(err) and err.keys == [EXTRA]
    assert isinstance(err, MappingError)


def test_unexpected_key_strict_false(variants, big_llama):
    directory, config = big_llama
    model = build_model("llama", config, torch.float32)
    report = LazyCheckpoint(str(variants["unexpected"])).load_into(model, strict=False, progress=False)
    assert report.unexpected == [EXTRA]
    assert report.missing == [] and report.mismatched == []
    assert_same_weights(model, reference_model("llama", directory, torch.float32))


def test_keys_to_ignore_on_load_unexpected_respected(checkpoint, tmp_path):
    """GPT2LMHeadModel ignores stray "attn.bias" tensors (old checkpoints carry them)."""
    directory, config = checkpoint("gpt2", "fp32")
    copy = copy_checkpoint(directory, tmp_path / "gpt2")
    rewrite_tensor_in_checkpoint(copy, add={"transformer.h.0.attn.bias": torch.ones(1, 1, 64, 64)})
    model = build_model("gpt2", config, torch.float32)
    assert any(re.search(p, "transformer.h.0.attn.bias") for p in model._keys_to_ignore_on_load_unexpected)
    LazyCheckpoint(str(copy)).load_into(model, progress=False)  # strict, no error
    assert_same_weights(model, reference_model("gpt2", directory, torch.float32))


def test_keys_to_ignore_on_load_missing_respected(checkpoint):
    directory, config = checkpoint("llama", "fp32", base=True)  # no lm_head in the file
    model = build_model("llama", config, torch.float32)
    model._keys_to_ignore_on_load_missing = [r"lm_head\.weight"]
    report = LazyCheckpoint(str(directory)).load_into(model, progress=False)  # strict, no error
    assert "model.embed_tokens.weight" in report.loaded


# -------------------------------------------------------------------------- shapes

def test_shape_mismatch(big_llama):
    directory, config = big_llama
    other = make_config("llama", vocab_size=BIG_VOCAB, intermediate_size=96)
    model = build_model("llama", other, torch.float32)
    err = fails_before_reading(str(directory), model, ShapeMismatchError)
    msg = str(err)
    assert "model.layers.0.mlp.gate_proj.weight" in msg, msg
    assert re.search(r"128,\s*64", msg) and re.search(r"96,\s*64", msg), msg
    found = {name: (tuple(c), tuple(m)) for name, c, m in err.mismatches}
    assert found["model.layers.0.mlp.gate_proj.weight"] == ((128, 64), (96, 64))
    assert found["model.layers.2.mlp.down_proj.weight"] == ((64, 128), (64, 96))
    assert len(found) == 3 * other.num_hidden_layers


def test_shape_mismatch_strict_false_loads_the_rest(checkpoint):
    directory, config = checkpoint("llama", "fp32")
    model = build_model("llama", make_config("llama", intermediate_size=96), torch.float32)
    report = LazyCheckpoint(str(directory)).load_into(model, strict=False, progress=False)
    got = {name: (tuple(c), tuple(m)) for name, c, m in report.mismatched}
    assert got["model.layers.1.mlp.up_proj.weight"] == ((128, 64), (96, 64))
    assert len(got) == 9
    assert report.missing == [] and report.unexpected == []
    tensors = {}
    for f in shard_files(directory):
        tensors.update(load_file(str(f)))
    for name, p in model.named_parameters():
        if name not in got:
            assert torch.equal(p, tensors[name]), name


# -------------------------------------------------------------------------- dtypes

class Counter(torch.nn.Module):
    """A plain module with an integer (and a bool) persistent buffer."""

    def __init__(self, n: int = 1024):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n, n))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(5, dtype=torch.bool))


@pytest.mark.parametrize("bad", ["steps", "mask"])
@pytest.mark.parametrize("where", ["meta", "real"])
def test_float_into_integer_buffer_is_dtype_error(tmp_path, bad, where):
    good = {"w": torch.randn(1024, 1024), "steps": torch.tensor([1, 2, 3]),
            "mask": torch.tensor([True, False, True, True, False])}
    good[bad] = torch.rand(good[bad].shape)  # float32 into int64 / bool
    save_file(good, str(tmp_path / "counter.safetensors"))
    if where == "meta":
        with torch.device("meta"):
            model = Counter()
    else:
        model = Counter()
    err = fails_before_reading(str(tmp_path / "counter.safetensors"), model, DtypeError)
    assert bad in str(err), str(err)


def test_integer_buffers_load_and_survive_float_dtype(tmp_path):
    tensors = {"w": torch.randn(1024, 1024), "steps": torch.tensor([4, 5, 6]),
               "mask": torch.tensor([True, False, True, True, False])}
    save_file(tensors, str(tmp_path / "counter.safetensors"))
    with torch.device("meta"):
        model = Counter()
    LazyCheckpoint(str(tmp_path / "counter.safetensors")).load_into(
        model, dtype=torch.float16, progress=False)
    assert model.w.dtype == torch.float16 and torch.equal(model.w, tensors["w"].half())
    assert model.steps.dtype == torch.int64 and torch.equal(model.steps, tensors["steps"])
    assert model.mask.dtype == torch.bool and torch.equal(model.mask, tensors["mask"])
