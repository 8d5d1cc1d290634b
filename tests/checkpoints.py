"""Small, real checkpoints written by transformers' ``save_pretrained`` for the tests.

Every checkpoint is a tiny random model (fixed seed, every floating parameter perturbed so
that no two tensors are alike and no norm weight is all ones) saved in several shards.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

# Architecture name -> (config factory, model class name used to write the checkpoint).
ARCHS = ("llama", "qwen2", "mixtral", "llama4_text", "gpt2", "bert")

# Architectures whose buffers sit next to loaded weights or in sub-models (position_ids in
# embeddings, vision towers, Gemma 3's embed_scale), for test_buffers.py; kept out of ARCHS,
# which other tests parametrize over. Name -> transformers auto class.
BUFFER_ARCHS = {"clip": "AutoModel", "siglip": "AutoModel", "groupvit": "AutoModel", "xclip": "AutoModel",
                "chinese_clip": "AutoModel", "llava": "AutoModelForImageTextToText",
                "gemma3": "AutoModelForImageTextToText"}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

ATTN = "eager"  # same attention code on both sides of every comparison

# Tensor parallel inside every fused expert (gate|up halves each cut by rows, down_proj by
# columns): transformers' own TP plan for its MoE models up to 5.24. 5.25 left the experts out
# of the TP plans (they are only in `ep_plan`), so tests of that split name it in plan=.
EXPERTS_TP = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
              "layers.*.mlp.experts": "moe_tp_experts"}


def default_experts(config) -> str:
    """How `plan=None` splits a MoE model's experts, read off transformers' own plans: "tp"
    where its TP plan splits them (transformers <= 5.24), else "ep" (whole experts per rank)."""
    tp = getattr(config, "base_model_tp_plan", None) or {}
    return "tp" if any(".experts." in k for k in tp) else "ep"


_TOWER = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)


def make_config(arch: str, **overrides):
    """A tiny config of the architecture; ``overrides`` are config fields."""
    import transformers as tf

    if arch == "llama":
        kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
        cls = tf.LlamaConfig
    elif arch == "qwen2":
        kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
        cls = tf.Qwen2Config
    elif arch == "mixtral":
        kw = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
        cls = tf.MixtralConfig
    elif arch == "qwen3_moe":  # not in ARCHS: the quantization tests' second fused-experts model
        kw = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                  tie_word_embeddings=False)
        cls = tf.Qwen3MoeConfig
    elif arch == "gpt_oss":  # not in ARCHS: fused experts stored transposed ([E, in, out]), with biases
        kw = dict(vocab_size=256, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=128, layer_types=["full_attention"] * 2, tie_word_embeddings=False)
        cls = tf.GptOssConfig
    elif arch == "deepseek_v3":  # not in ARCHS: MLA attention, shared + routed fused experts, a dense first layer
        kw = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16,
                  kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                  max_position_embeddings=128, tie_word_embeddings=False)
        cls = tf.DeepseekV3Config
    elif arch == "opt":  # not in ARCHS: Linear layers and no transformers TP plan (lazyload's structural rule)
        kw = dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, word_embed_proj_dim=64)
        cls = tf.OPTConfig
    elif arch == "moshi":  # not in ARCHS: no TP plan, a gated MLP fused into one Linear (fc1 -> [gate; up])
        kw = dict(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=128, depth_hidden_size=32,
                  depth_num_hidden_layers=1, depth_ffn_dim=64, depth_num_attention_heads=4, audio_vocab_size=64,
                  num_codebooks=2)
        cls = tf.MoshiConfig
    elif arch == "llama4_text":
        kw = dict(vocab_size=256, hidden_size=32, intermediate_size=64, intermediate_size_mlp=96,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=1,
                  interleave_moe_layer_step=1, attention_chunk_size=64,
                  tie_word_embeddings=False)
        cls = tf.Llama4TextConfig
    elif arch == "gpt2":
        kw = dict(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
        cls = tf.GPT2Config
    elif arch == "bert":
        kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2)
        cls = tf.BertConfig
    elif arch in ("clip", "siglip", "chinese_clip"):
        kw = dict(text_config=dict(vocab_size=99, max_position_embeddings=32, **_TOWER),
                  vision_config=dict(image_size=30, patch_size=6, **_TOWER))
        cls = {"clip": tf.CLIPConfig, "siglip": tf.SiglipConfig, "chinese_clip": tf.ChineseCLIPConfig}[arch]
    elif arch == "groupvit":
        kw = dict(text_config=dict(vocab_size=99, max_position_embeddings=32, **_TOWER),
                  vision_config=dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, image_size=32,
                                     patch_size=8, depths=[1, 1], num_hidden_layers=2, num_group_tokens=[4, 0],
                                     num_output_groups=[4, 2]),
                  projection_dim=16, projection_intermediate_dim=16)
        cls = tf.GroupViTConfig
    elif arch == "xclip":
        kw = dict(text_config=dict(vocab_size=99, max_position_embeddings=32, **_TOWER),
                  vision_config=dict(image_size=32, patch_size=8, num_frames=2, mit_hidden_size=32,
                                     mit_intermediate_size=37, mit_num_hidden_layers=1, mit_num_attention_heads=4,
                                     **_TOWER),
                  projection_dim=16, prompt_layers=1, prompt_attention_heads=4)
        cls = tf.XCLIPConfig
    elif arch == "llava":  # CLIP vision tower, Llama text model
        kw = dict(vision_config=dict(model_type="clip_vision_model", image_size=30, patch_size=6, **_TOWER),
                  text_config=dict(model_type="llama", vocab_size=99, num_key_value_heads=2,
                                   max_position_embeddings=64, **_TOWER),
                  image_token_index=98, image_seq_length=25, vision_feature_layer=-1)
        cls = tf.LlavaConfig
    elif arch == "gemma3":  # SigLIP vision tower, Gemma 3 text model
        kw = dict(text_config=dict(vocab_size=99, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                   sliding_window=16, **_TOWER),
                  vision_config=dict(image_size=28, patch_size=7, **_TOWER), mm_tokens_per_image=4,
                  image_token_index=98, boi_token_index=96, eoi_token_index=97)
        cls = tf.Gemma3Config
    else:
        raise ValueError(f"unknown arch {arch!r}")
    kw.update(overrides)
    return cls(**kw)


def model_class(arch: str, config=None, *, base: bool = False):
    """The transformers class written/loaded for ``arch``: a causal LM, or for bert the
    masked LM (see ``auto_class``); ``base=True`` gives the bare base model (LlamaModel, BertModel, ...)."""
    return auto_class(arch, base=base)._model_mapping[type(config or make_config(arch))]


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Perturb every floating parameter (tied ones once) so each tensor is distinct."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in model.named_parameters():  # named_parameters dedups tied weights
            if p.is_floating_point():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.05
                p.add_(noise.to(p.dtype))


def write_checkpoint(arch: str, dtype, directory, *, base: bool = False, seed: int = 0,
                     min_shards: int = 3, cls=None, **overrides):
    """Build a small random ``arch`` model (fixed seed), cast to ``dtype`` and
    ``save_pretrained`` it into ``directory`` in at least ``min_shards`` shards.

    ``base=True`` writes the bare base model (keys without the ``model.``/``bert.`` prefix);
    ``cls`` forces the model class; ``overrides`` are config fields. Returns (directory, config).
    """
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = make_config(arch, **overrides)
    config._attn_implementation = ATTN
    cls = cls or model_class(arch, config, base=base)
    torch.manual_seed(seed)
    model = cls(config)
    randomize_(model, seed)
    model = model.to(dtype).eval()

    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    max_shard = max(1, total // (min_shards + 2))
    model.save_pretrained(directory, max_shard_size=max_shard)
    n = len(shard_files(directory))
    assert n >= min_shards, f"{directory}: only {n} shards written"
    config = type(config).from_pretrained(directory)
    return directory, config


def shard_files(directory) -> list[Path]:
    return sorted(Path(directory).glob("*.safetensors"))


def index_json(directory) -> Path:
    return Path(directory) / "model.safetensors.index.json"


def weight_map(directory) -> dict[str, str]:
    return json.loads(index_json(directory).read_text())["weight_map"]


def read_header(path) -> tuple[int, dict]:
    """(header length n, header dict) of a safetensors file, read by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def header_bytes(paths) -> int:
    """Sum over files of 8 + header length: all the bytes a header-only index needs."""
    return sum(8 + read_header(p)[0] for p in paths)


def tensor_bytes(paths) -> int:
    total = 0
    for p in paths:
        _, h = read_header(p)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items()
                     if k != "__metadata__")
    return total


def write_raw_safetensors(path, tensors: dict[str, tuple[str, list[int], bytes]],
                          metadata: dict | None = None) -> Path:
    """Write a safetensors file by hand: ``tensors`` maps key -> (dtype string, shape, raw
    bytes). Lets a test write things safetensors itself refuses (an unknown dtype)."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for key, (dt, shape, data) in tensors.items():
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    return Path(path)


def copy_checkpoint(src, dst) -> Path:
    """Copy a checkpoint directory: shards hard-linked (cheap; ``rewrite_tensor_in_checkpoint``
    replaces a shard by a new file, never writes through the link), small files copied."""
    import shutil

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            os.link(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)
    return dst


def rewrite_tensor_in_checkpoint(directory, *, drop: str | None = None,
                                 add: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrite the shard holding ``drop`` without it (or the first shard, for ``add``) and
    fix model.safetensors.index.json to match."""
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    wm = weight_map(directory)
    target = wm[drop] if drop else sorted(set(wm.values()))[0]
    path = directory / target
    tensors = load_file(str(path))
    if drop:
        del tensors[drop]
        del wm[drop]
    for k, v in (add or {}).items():
        tensors[k] = v.contiguous()
        wm[k] = target
    path.unlink()  # the old file may be a hard link into another checkpoint
    save_file(tensors, str(path), metadata={"format": "pt"})
    idx = json.loads(index_json(directory).read_text())
    idx["weight_map"] = wm
    index_json(directory).write_text(json.dumps(idx, indent=2))


def edit_tensor(directory, key: str, edit) -> None:
    """Replace stored tensor ``key`` of the checkpoint at ``directory`` (a ``copy_checkpoint``
    copy) by ``edit(tensor)``: its shard is written as a new file, never through the link."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(directory).glob("*.safetensors")):
        tensors = load_file(str(shard))
        if key in tensors:
            tensors[key] = edit(tensors[key]).contiguous()
            shard.unlink()
            save_file(tensors, str(shard), metadata={"format": "pt"})
            return
    raise KeyError(f"{directory}: no tensor {key!r}")


def rchar() -> int | None:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io);
    None where unavailable. mmap page faults are not counted here."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- models

def auto_class(arch: str, *, base: bool = False):
    import transformers as tf

    if base:
        return tf.AutoModel
    if arch in BUFFER_ARCHS:
        return getattr(tf, BUFFER_ARCHS[arch])
    return tf.AutoModelForMaskedLM if arch == "bert" else tf.AutoModelForCausalLM


def build_model(arch: str, config, dtype, *, base: bool = False, empty: str | None = "meta",
                seed: int = 123, **model_kwargs):
    """A model of ``config`` built without reading the checkpoint: on the meta device
    (``empty="meta"``), under accelerate's ``init_empty_weights`` (``empty="accelerate"``:
    parameters on meta, buffers real) or real with random weights (``empty=None``)."""
    import copy
    import contextlib

    config = copy.deepcopy(config)  # _from_config writes config.dtype
    if empty == "meta":
        ctx = torch.device("meta")
    elif empty == "accelerate":
        from accelerate import init_empty_weights

        ctx = init_empty_weights()
    elif empty is None:
        torch.manual_seed(seed)
        ctx = contextlib.nullcontext()
    else:
        raise ValueError(empty)
    with ctx:
        model = auto_class(arch, base=base).from_config(
            config, dtype=dtype, attn_implementation=ATTN, **model_kwargs)
    return model.eval()


def reference_model(arch: str, directory, dtype, *, base: bool = False, **model_kwargs):
    """What transformers' own loader makes of the checkpoint."""
    model = auto_class(arch, base=base).from_pretrained(
        str(directory), dtype=dtype, attn_implementation=ATTN, **model_kwargs)
    return model.eval()


def model_snapshot(model: torch.nn.Module) -> tuple:
    """Everything a load could change: each module's object, class and attributes (sizes,
    head counts, a replaced forward), each parameter's object, device, shape and dtype."""
    modules = {name: (id(m), type(m), sorted(vars(m)), {k: v for k, v in vars(m).items()
                                                        if isinstance(v, (int, float, str, bool))})
               for name, m in model.named_modules()}
    params = {name: (id(p), p.device.type, tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    return modules, params


def meta_tensors(model: torch.nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    names += [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
    return names


def assert_same_weights(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    """state_dict (parameters and persistent buffers) and every buffer (non-persistent
    ones too, e.g. rotary inv_freq) identical: same names, dtypes, shapes, values."""
    assert not meta_tensors(model), f"left on meta: {meta_tensors(model)}"
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sorted(sd) == sorted(rsd)
    for k in rsd:
        a, b = sd[k], rsd[k]
        assert a.dtype == b.dtype, f"{k}: dtype {a.dtype} != reference {b.dtype}"
        assert a.shape == b.shape, f"{k}: shape {tuple(a.shape)} != reference {tuple(b.shape)}"
        assert a.device == b.device, f"{k}: device {a.device} != reference {b.device}"
        assert torch.equal(a, b), f"{k}: values differ from the reference"
    assert_same_buffers(model, ref)


def assert_same_buffers(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Every buffer, non-persistent ones too, identical: names, dtypes, shapes, values."""
    bufs, rbufs = dict(model.named_buffers()), dict(ref.named_buffers())
    assert sorted(bufs) == sorted(rbufs)
    for k in rbufs:
        a, b = bufs[k], rbufs[k]
        assert a.dtype == b.dtype and a.shape == b.shape, f"buffer {k}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"buffer {k}: values differ from the reference"


def assert_same_ties(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Parameters shared in the reference are the same object in the model too."""
    groups: dict[int, list[str]] = {}
    for n, p in ref.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    for names in groups.values():
        if len(names) > 1:
            first = model.get_parameter(names[0])
            for n in names[1:]:
                assert model.get_parameter(n) is first, f"{n} is no longer tied to {names[0]}"


def fixed_input(config, batch: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=g)


@torch.no_grad()
def outputs(model: torch.nn.Module, config) -> torch.Tensor:
    out = model(input_ids=fixed_input(config))
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


# ----------------------------------------------------------- page-cache residency


def resident_bytes(path, start: int = 0, end: int | None = None) -> int:
    """Bytes of [start, end) of ``path`` present in the page cache (lazyload's own mincore
    probe, which faults nothing in)."""
    from lazyload.system import PAGE, resident_pages

    pages = resident_pages(str(path))
    if pages is None:
        raise OSError("mincore is not available here")
    size = os.path.getsize(path)
    end = size if end is None else min(end, size)
    if end <= start:
        return 0
    return int(pages[start // PAGE:(end + PAGE - 1) // PAGE].sum()) * PAGE


def evict(paths) -> bool:
    """Drop the files' pages from the page cache; True when that visibly worked."""
    ok = True
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        try:
            ok = ok and resident_bytes(p) == 0
        except OSError:
            return False
    return ok


def data_starts(paths) -> dict[str, int]:
    """File -> offset of its first tensor byte. Call before ``evict``: reading a header
    may read ahead into the data."""
    return {str(p): 8 + read_header(p)[0] for p in paths}


def resident_data_bytes(starts: dict[str, int]) -> int:
    """Page-cache bytes of the tensor data regions (``data_starts``) of the files."""
    return sum(resident_bytes(p, start=s) for p, s in starts.items())


# ------------------------------------------------------------ mixed dtypes, odd sizes

MIXED_DTYPES = {"norm": torch.float32, "lm_head": torch.float16}  # the rest bf16


def write_mixed_checkpoint(directory):
    """A tiny Llama whose tensors have odd byte sizes (hidden 35, vocab 61: 2,450-byte bf16
    matrices) in three dtypes (bf16, fp32 norms, fp16 lm_head), written by save_pretrained
    in several shards: staged one after another, a tensor's bytes start at any offset.
    Returns (directory, config)."""
    directory = Path(directory)
    config = make_config("llama", hidden_size=35, intermediate_size=35, num_attention_heads=5,
                         num_key_value_heads=1, head_dim=14, vocab_size=61)
    config._attn_implementation = ATTN
    torch.manual_seed(0)
    model = model_class("llama", config)(config)
    randomize_(model)
    model = model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        param.data = param.data.to(_mixed_dtype(name))
    model.save_pretrained(directory, max_shard_size=20000)
    return directory, type(config).from_pretrained(directory)


def mixed_meta_model(config):
    """The model of `write_mixed_checkpoint` on meta, each parameter in its checkpoint dtype."""
    model = build_model("llama", config, torch.bfloat16)
    for name, param in model.named_parameters():
        param.data = param.data.to(_mixed_dtype(name))
    return model


def _mixed_dtype(name: str) -> torch.dtype:
    return next((dt for part, dt in MIXED_DTYPES.items() if part in name), torch.bfloat16)


def stage_of(model, layers, first, last, form="none"):
    """`model` cut down to one pipeline stage: `layers` (indices) kept, the embedding on the
    first stage, the final norm and head on the last. form "none": other layers set to None
    in the ModuleList; "dict": the layers a ModuleDict keyed by their numbers."""
    inner = model.model
    if form == "none":
        for i in range(len(inner.layers)):
            if i not in layers:
                inner.layers[i] = None
    else:
        inner.layers = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers) if i in layers})
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        model.lm_head = None
    return model
