"""Quantize on load (`load_into(..., quantize=...)`): tiny Llama and Mixtral checkpoints from
save_pretrained, loaded int8 and fp8: the model runs and agrees with full precision, every
quantized weight is within one quantization step of the checkpoint's, the skipped modules
stay full precision, a TP split that cuts a scale group is refused before anything
changes, the tensor-parallel quantized model (gloo, world 2 and 4) equals world 1's, and a
quantized load's peak anonymous memory stays within destination + one layer."""
from __future__ import annotations


import pytest
import torch

from checkpoints import EXPERTS_TP, build_model, fixed_input, reference_model
from quant_checkpoints import needs_torchao
from gloo import spawn_cases

import lazyload
from lazyload import LazyCheckpoint, PlanError, Quantization
from lazyload.quant.experts import QuantizedExperts
from lazyload.quant.linear import QuantizedLinear

GROUP = 16  # tiny models: hidden 32/64, so that groups are smaller than a row


def own_holder(qdtype: str, **kw) -> Quantization:
    """Quantization held by lazyload's QuantizedLinear / QuantizedExperts, which these tests
    examine (where torchao is installed, its holders are the default: tests/test_torchao_tp.py)."""
    return Quantization(qdtype, torchao=False, **kw)


def _logits(model, config, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (4, 16), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _step(module: QuantizedLinear) -> torch.Tensor:
    return _step_of(module.weight, module.weight_scale, module.group)


def _step_of(weight: torch.Tensor, scale: torch.Tensor, group: int, axis: int = -1) -> torch.Tensor:
    """One quantization step at each weight element: the scale for int8; for fp8 the
    spacing of float8_e4m3fn values around the stored value (3 mantissa bits, subnormal
    spacing 2**-9), times the scale. `group` elements of dim `axis` share a scale."""
    q = weight.float()
    scale = scale.repeat_interleave(group, axis).narrow(axis, 0, q.shape[axis])
    if weight.dtype == torch.int8:
        return scale
    exponent = torch.floor(torch.log2(q.abs().clamp(min=2.0 ** -6)))
    return scale * torch.exp2(exponent - 3)


def _load(checkpoint, arch, quantize, **kw):
    directory, config = checkpoint(arch)
    model = build_model(arch, config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, quantize=quantize, progress=False, **kw)
    return model, config, report


# Measured on these random tiny models (3 layers): int8 ~1-2 % logits error, top-1 ~96-100 %.
# float8_e4m3fn keeps 3 mantissa bits: ~2.2 % RMS error per weight, which these random
# models (near-tied logits) amplify to ~7-8 % and 80-85 % top-1; the fp8 bounds say so. The
# issue's bound (< 5 %, >= 95 % for both) is asserted on trained models, whose logits are
# peaked as a published model's (test_quantized_trained_model_meets_the_accuracy_bound).
BOUNDS = {"int8": (0.05, 0.95), "fp8": (0.12, 0.75)}


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_quantized_load_runs_and_agrees_with_full_precision(checkpoint, arch, qdtype):
    model, config, report = _load(checkpoint, arch, own_holder(qdtype, group_size=GROUP))
    ref = reference_model(arch, checkpoint(arch)[0], torch.float32)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) >= 4 * config.num_hidden_layers
    ref_params = dict(ref.named_parameters())
    for name, module in quantized.items():
        assert module.weight.dtype == lazyload.quant.onload.QDTYPES[qdtype]
        assert module.weight_scale.shape == (module.out_features, -(-module.in_features // GROUP))
        full = ref_params[f"{name}.weight"].detach()
        error = (module.dequantized_weight(torch.float32) - full).abs()
        assert (error <= _step(module) * (1 + 1e-6)).all(), f"{name}: more than one quantization step off"
        assert f"{name}.weight" in report.loaded
    max_err, min_top1 = BOUNDS[qdtype]
    for seed in range(2):
        a, b = _logits(model, config, seed), _logits(ref, config, seed)
        rel = ((a - b).norm() / b.norm()).item()
        top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        assert rel < max_err and top1 >= min_top1, f"{qdtype}: logits error {rel:.3f}, top-1 agreement {top1:.2f}"


# --------------------------------------------------------------- accuracy on a trained model


def markov_corpus(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    """Token sequences of a small synthetic language: each token is followed by its own
    successor 80 % of the time, a second one 15 %, any token 5 % (fixed tables), so that a
    model trained on it predicts the next token as peakedly as a published LM does on text
    (top-1 probability ~0.8), unlike a random model's near-tied logits."""
    first = torch.randperm(vocab, generator=torch.Generator().manual_seed(1234))
    second = torch.randperm(vocab, generator=torch.Generator().manual_seed(4321))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(rows, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (rows,), generator=g)
    for t in range(1, length):
        r = torch.rand(rows, generator=g)
        nxt = torch.where(r < 0.8, first[tokens[:, t - 1]], second[tokens[:, t - 1]])
        tokens[:, t] = torch.where(r >= 0.95, torch.randint(0, vocab, (rows,), generator=g), nxt)
    return tokens


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(arch) -> (directory, config): the tiny model trained for 80 AdamW steps on
    `markov_corpus` (about a second each on one thread), saved by save_pretrained in shards."""
    from checkpoints import ATTN, make_config, model_class

    cache = {}

    def get(arch):
        if arch not in cache:
            config = make_config(arch)
            config._attn_implementation = ATTN
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # tiny matmuls: threads only contend
            try:
                torch.manual_seed(0)
                model = model_class(arch, config)(config)
                data = markov_corpus(config.vocab_size, 1024, 16, seed=0)
                optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
                g = torch.Generator().manual_seed(0)
                for _ in range(80):
                    batch = data[torch.randint(0, len(data), (16,), generator=g)]
                    loss = model(input_ids=batch, labels=batch).loss
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            finally:
                torch.set_num_threads(threads)
            assert loss.item() < 1.5, f"{arch}: training did not converge (loss {loss.item():.2f})"
            directory = tmp_path_factory.mktemp(f"trained-{arch}")
            model.eval().save_pretrained(directory, max_shard_size=200_000)
            cache[arch] = directory, type(config).from_pretrained(directory)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_quantized_trained_model_meets_the_accuracy_bound(trained, arch):
    """The issue's bound, on models whose logits are peaked as a published model's: int8
    and fp8 loads (default groups of 128) agree with full precision on the top-1 token for
    >= 95 % of the positions of held-out prompts, with relative logits error < 5 %
    (measured: int8 0.1-0.4 %, fp8 0.5-1.7 %, top-1 100 %)."""
    directory, config = trained(arch)
    full = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(full, progress=False)
    prompts = markov_corpus(config.vocab_size, 8, 32, seed=99)
    with torch.no_grad():
        want = full(input_ids=prompts).logits
    assert want.softmax(-1).amax(-1).mean() > 0.6  # peaked, as intended
    for qdtype in ("int8", "fp8"):
        model = build_model(arch, config, torch.float32)
        LazyCheckpoint(directory).load_into(model, quantize=own_holder(qdtype), progress=False)
        assert all(p.dtype == lazyload.quant.onload.QDTYPES[qdtype]
                   for n, p in model.named_parameters() if n.endswith(("proj.weight", "experts.down_proj")))
        with torch.no_grad():
            got = model(input_ids=prompts).logits
        rel = ((got - want).norm() / want.norm()).item()
        top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert rel < 0.05 and top1 >= 0.95, f"{arch} {qdtype}: logits error {rel:.4f}, top-1 agreement {top1:.3f}"


def _experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_fused_experts_quantized_on_load(checkpoint, arch, qdtype):
    """transformers' fused 3-D experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]; GPT-OSS
    transposed, [E, in, out]) are quantized per (expert, output row, group of the contracted
    input dim); routers stay full precision; every implementation of the model's own experts
    forward (eager, batched_mm, grouped_mm) runs on the dequantized tensors: the
    full-precision model given those values gives the same logits."""
    model, config, _ = _load(checkpoint, arch, own_holder(qdtype, group_size=GROUP))
    ref = reference_model(arch, checkpoint(arch)[0], torch.float32)
    experts = _experts(model)
    assert len(experts) == config.num_hidden_layers
    for name, module in experts.items():
        assert set(module._lazyload_quantized) == {"gate_up_proj", "down_proj"}
        for attr in module._lazyload_quantized:
            weight, scale = getattr(module, attr), getattr(module, attr + "_scale")
            axis = -2 if arch == "gpt_oss" else -1  # the dim the experts forward contracts
            assert module._lazyload_quantized[attr][:2] == (GROUP, axis)
            assert weight.dtype == lazyload.quant.onload.QDTYPES[qdtype] and scale.dtype == torch.float32
            want = list(weight.shape)
            want[axis] = -(-want[axis] // GROUP)
            assert list(scale.shape) == want
            full = ref.get_parameter(f"{name}.{attr}").detach()
            error = (module.dequantized(attr, torch.float32) - full).abs()
            assert (error <= _step_of(weight, scale, GROUP, axis) * (1 + 1e-6)).all(), f"{name}.{attr}: > a step off"
        mlp = model.get_submodule(name.rpartition(".")[0])
        router = mlp.router if arch == "gpt_oss" else mlp.gate
        assert all(p.dtype == torch.float32 for p in router.parameters())
    with torch.no_grad():  # the reference given the dequantized values of every quantized tensor
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear):
                ref.get_submodule(name).weight.copy_(module.dequantized_weight(torch.float32))
            elif isinstance(module, QuantizedExperts):
                for attr in module._lazyload_quantized:
                    ref.get_parameter(f"{name}.{attr}").copy_(module.dequantized(attr, torch.float32))
    want = _logits(ref, config)
    for implementation in ("eager", "batched_mm", "grouped_mm"):
        model.config._experts_implementation = ref.config._experts_implementation = implementation
        torch.testing.assert_close(_logits(model, config), want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{implementation}: {m}")
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == lazyload.quant.onload.QDTYPES[qdtype]  # restored


@pytest.mark.parametrize("world", [1, 2])
def test_fp8_per_expert_checkpoint_kept_quantized_in_fused_experts(checkpoint, tmp_path, world):
    """Per-expert FP8 weights (Mixtral's w1/w2/w3, 128x128 blocks over 32/64-wide tensors:
    tail blocks) that transformers fuses into 3-D experts, loaded with quantize="fp8": the
    stored bytes are kept, stacked and concatenated, and every rank's experts dequantize
    exactly to the dequantized load's slice (at world 2 the down_proj slices start inside a
    block: scales re-gridded to groups of 32)."""
    from quant_checkpoints import QUANTIZED, write_fp8_checkpoint

    src, config = checkpoint("mixtral", "bf16")
    directory = str(write_fp8_checkpoint(src, tmp_path / "fp8", names=QUANTIZED + ("w1", "w2", "w3")))
    full = build_model("mixtral", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)
    inter = config.intermediate_size
    for rank in range(world):
        model = build_model("mixtral", config, torch.bfloat16)
        LazyCheckpoint(directory).load_into(model, rank, world, quantize=own_holder("fp8"), plan=EXPERTS_TP,
                                            progress=False)
        for name, module in _experts(model).items():
            want = full.get_submodule(name)
            rows = [r for part in (0, inter) for r in range(part + rank * inter // world,
                                                           part + (rank + 1) * inter // world)]
            cols = slice(rank * inter // world, (rank + 1) * inter // world)
            assert module._lazyload_quantized["down_proj"][0] == inter // world  # whole rows, or each half
            assert torch.equal(module.dequantized("gate_up_proj", torch.bfloat16), want.gate_up_proj[:, rows])
            assert torch.equal(module.dequantized("down_proj", torch.bfloat16), want.down_proj[:, :, cols])
            layer = name.split(".")[2]
            stored = read_file_key(directory, f"model.layers.{layer}.block_sparse_moe.experts.1.w2.weight")
            assert torch.equal(module.down_proj[1].view(torch.int8), stored.view(torch.int8)[:, cols])


def read_file_key(directory, key):
    from test_dequant import read_all

    return read_all(directory)[key]


def test_skipped_modules_stay_full_precision(checkpoint):
    model, config, _ = _load(checkpoint, "mixtral", own_holder("int8", group_size=GROUP, skip=[r"\.v_proj$"]))
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert kinds["lm_head"] == "Linear" and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert kinds["model.layers.0.self_attn.v_proj"] == "Linear"  # skip=
    assert kinds["model.layers.0.self_attn.q_proj"] == "QuantizedLinear"
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.int8  # fused experts: quantized
    for name, param in model.named_parameters():  # routers, norms
        if not name.endswith(("proj.weight", "proj.weight_scale", "proj", "proj_scale")) or ".v_proj." in name:
            assert param.dtype == torch.float32, name


def test_modules_to_not_convert_from_the_config(checkpoint):
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    model.config.quantization_config = {"modules_to_not_convert": ["mlp.down_proj"]}
    LazyCheckpoint(directory).load_into(model, quantize=own_holder("int8"), progress=False)
    layer = model.model.layers[0]
    assert type(layer.mlp.down_proj) is torch.nn.Linear and isinstance(layer.mlp.up_proj, QuantizedLinear)


def test_a_split_that_cuts_a_group_is_refused_before_anything_changes(checkpoint):
    directory, config = checkpoint("llama")  # down_proj: 128 input columns, 64 per rank at world 2
    model = build_model("llama", config, torch.float32)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(PlanError, match=r"down_proj.*cuts the quantization groups of 48.*\[1\]|whole groups"):
        LazyCheckpoint(directory).load_into(model, 1, 2, quantize=Quantization("int8", group_size=48),
                                            progress=False)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(p.is_meta for p in model.parameters())


def test_quantize_argument_errors(checkpoint):
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    with pytest.raises(lazyload.ArgumentError, match="quantize='int2'"):
        LazyCheckpoint(directory).load_into(model, quantize="int2")
    with pytest.raises(lazyload.ArgumentError, match="group_size"):
        Quantization("int8", group_size=0)


# --------------------------------------------------------------- tensor parallel (gloo)

TP_GROUP = 8  # row-parallel shards of the tiny models: 32 / 4 columns


ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "fc2")


def _plain_share(name, full, rank, world):
    """This rank's share of a plain parameter of a model without a TP plan (OPT), by the
    structural rule: row-parallel weights and scales split on columns, their bias replicated,
    the other Linear layers split on rows."""
    module, attr = name.split(".")[-2:]
    if module in ROW_PARALLEL:
        return full if attr == "bias" else full.chunk(world, 1)[rank]
    return full.chunk(world, 0)[rank]


def _quantized_pair(arch, directory, rank, world, quantize, plan=None):
    """(the world-1 quantized model, this rank's quantized model) and the config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    ref = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, quantize=quantize, progress=False)
    model = build_model(arch, config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, rank, world, quantize=quantize, plan=plan, progress=False)
    assert report.ok
    return ref, model, config


def _case_tp(arch, directory, qdtype, rank, world, plan=None):
    from test_tp_dist import RTOL, ATOL, _check_shards

    ref, model, config = _quantized_pair(arch, directory, rank, world, own_holder(qdtype, group_size=TP_GROUP),
                                         plan)
    label = f"{arch} {qdtype} world={world} plan={'experts tp' if isinstance(plan, dict) else plan}"
    assert any(isinstance(m, QuantizedLinear) for m in model.modules()), label
    if arch in ("mixtral", "qwen3_moe"):  # fused experts quantized too, weight and scale split alike
        experts, dim = model.model.layers[0].mlp.experts, (0 if plan == "ep" else -1)  # by expert, or columns
        assert isinstance(experts, QuantizedExperts) and experts.down_proj_scale.to_local().shape[dim] == \
            ref.model.layers[0].mlp.experts.down_proj_scale.shape[dim] // world, label
    if arch == "opt":  # no TP plan: plain local shards, row-parallel layers all-reduced by lazyload
        params = dict(_BitView(ref).named_parameters())
        for name, param in _BitView(model).named_parameters():
            want = params[name] if param.shape == params[name].shape else _plain_share(name, params[name], rank, world)
            assert torch.equal(param, want), f"{label}: {name} is not world 1's share"
    else:  # weights and scales (DTensors gathered, plain KV shards as their share) equal world 1's
        _check_shards(_BitView(model), _BitView(ref), rank, world, config.num_key_value_heads, label)
    ids = fixed_input(config)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label}: {m}")


class _BitView:
    """A model's named parameters with float8 seen as int8 bits (torch.equal compares bits)."""

    def __init__(self, model):
        self.model = model

    def named_parameters(self):
        for name, p in self.model.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p = p.view(torch.int8) if not hasattr(p, "to_local") else _dtensor_bits(p)
            yield name, p


def _dtensor_bits(p):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(p.to_local().view(torch.int8), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _case_per_row(arch, directory, qdtype, rank, world):
    """group_size=None at world 2: one scale per row of what each rank holds, so a
    row-parallel rank's scales cover its own columns (not world 1's rows): each rank's
    weights are within one step of the checkpoint's share, and the model runs and agrees
    with full precision."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    full = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(full, progress=False)
    model = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(model, rank, world, quantize=own_holder(qdtype, group_size=None),
                                        progress=False)
    label = f"{arch} {qdtype} per-row world={world}"
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert layers, label
    for name, module in layers.items():
        weight, scale = module.weight, module.weight_scale
        weight, scale = (weight.to_local(), scale.to_local()) if hasattr(weight, "to_local") else (weight, scale)
        want = full.get_parameter(f"{name}.weight").detach()
        if name.rpartition(".")[2] in ROW_PARALLEL:
            want = want.chunk(world, 1)[rank]
        elif weight.shape != want.shape:
            want = want.chunk(world, 0)[rank]
        assert scale.shape == (weight.shape[0], 1) and module.group == weight.shape[1], f"{label}: {name}"
        error = (module.dequantized_weight(torch.float32) - want).abs()
        assert (error <= _step_of(weight, scale, module.group) * (1 + 1e-6)).all(), f"{label}: {name}"
    ids = fixed_input(config)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, full(input_ids=ids).logits
    assert ((got - want).norm() / want.norm()).item() < BOUNDS[qdtype][0], label


def _run_case(case, rank, world):
    kind, *args = case
    if kind == "per_row":
        _case_per_row(*args, rank, world)
    else:
        moe = args[0] in ("mixtral", "qwen3_moe")  # "tp": inside every expert, as transformers <= 5.24 planned it
        _case_tp(*args, rank, world, plan="ep" if kind == "ep" else EXPERTS_TP if moe else None)


@pytest.mark.parametrize("world,cases", [
    (2, [("tp", "mixtral", "fp8"), ("ep", "mixtral", "int8"), ("tp", "qwen3_moe", "int8"), ("tp", "opt", "int8"),
         ("per_row", "opt", "int8"), ("per_row", "llama", "int8")]),
    (4, [("tp", "llama", "int8")])])
def test_tensor_parallel_quantized_model_equals_world1(checkpoint, tmp_path, world, cases):
    """One spawn per world (spawning is the cost on 2 cores): at world 2 Mixtral fp8 and
    Qwen3-MoE int8 (fused experts: gate_up_proj packed, down_proj row-parallel, with their
    scales), Mixtral int8 expert-parallel (plan="ep": experts and scales split by expert),
    OPT int8 (no transformers TP plan: lazyload's row-parallel layers all-reduce their
    dequantized partial products), and per-row scales (group_size=None) on OPT and Llama;
    Llama int8 at world 4 (KV heads replicated over pairs of ranks, row shards of 16
    columns)."""
    spawn_cases(world, [(kind, arch, str(checkpoint(arch)[0]), qdtype) for kind, arch, qdtype in cases], tmp_path,
                _run_case)


# --------------------------------------------------------------- memory


def _quantized_load_memory(directory, config, qdtype):
    """In a fresh process: a warm-up load of one layer, then the measured quantized load."""
    import copy
    import gc

    from test_streaming import model_bytes, status

    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    LazyCheckpoint(directory).load_into(build_model("llama", small, torch.bfloat16), quantize=own_holder(qdtype),
                                        strict=False, progress=False)
    model = build_model("llama", config, torch.bfloat16)
    ckpt = LazyCheckpoint(directory)
    ckpt.index
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    before = status()["RssAnon"]
    report = ckpt.load_into(model, quantize=own_holder(qdtype), progress=False)
    return dict(over=report.peak_anon - before - model_bytes(model), dest=model_bytes(model),
                linear=sum(m.weight.nbytes + m.weight_scale.nbytes for m in model.modules()
                           if isinstance(m, QuantizedLinear)),
                full=sum(2 * m.weight.numel() for m in model.modules() if isinstance(m, QuantizedLinear)))


@pytest.mark.parametrize("qdtype", ["int8"])  # fp8 takes the same path (one cast differs)
def test_quantized_load_peak_memory_is_destination_plus_one_layer(checkpoint, qdtype):
    from test_streaming import SHAPE, MiB, in_fresh_process, layer_bytes

    directory, config = checkpoint("llama", "bf16", **SHAPE)
    r = in_fresh_process(_quantized_load_memory, str(directory), config, qdtype)
    budget = layer_bytes(str(directory))
    assert r["linear"] <= 0.55 * r["full"], f"quantized Linear weights + scales are {r['linear'] / r['full']:.2f}x bf16"
    assert r["over"] < budget + 64 * MiB, (
        f"{qdtype}: peak anonymous memory exceeds destination by {r['over'] / MiB:.1f} MiB; "
        f"one layer is {budget / MiB:.1f} MiB")


# --------------------------------------------------------------- kept quantized


@pytest.fixture(scope="module")
def fp8_llama(checkpoint, tmp_path_factory):
    from quant_checkpoints import write_fp8_checkpoint
    from test_dequant import LLAMA

    src, config = checkpoint("llama", "bf16", **LLAMA)
    return str(write_fp8_checkpoint(src, tmp_path_factory.mktemp("llama-fp8-kept"))), config


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp8_block_checkpoint_kept_quantized_dequantizes_to_the_dequantized_load(fp8_llama, world):
    """Dims not multiples of 128 (384, 1000): at world 4 the down_proj slices (250 columns)
    start inside blocks; the kept scales are re-gridded, and dequantizing every rank's local
    weights gives exactly the dequantized load's slice. The stored bytes are kept."""
    from test_dequant import read_all
    from test_tp import shard_of

    directory, config = fp8_llama
    full = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)
    raw = read_all(directory)
    for rank in range(world):
        model = build_model("llama", config, torch.bfloat16)
        LazyCheckpoint(directory).load_into(model, rank, world, quantize=own_holder("fp8"), progress=False)
        quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        assert len(quantized) == 7 * config.num_hidden_layers
        for name, module in quantized.items():
            kv = config.num_key_value_heads
            want = shard_of(f"{name}.weight", full.get_parameter(f"{name}.weight").detach(), rank, world, kv)
            assert torch.equal(module.dequantized_weight(torch.bfloat16), want), f"rank {rank}/{world}: {name}"
            stored = shard_of(f"{name}.weight", raw[f"{name}.weight"].view(torch.int8), rank, world, kv)
            assert torch.equal(module.weight.view(torch.int8), stored), f"{name}: not the stored bytes"


def test_int8_channel_checkpoint_kept_and_fp8_requantized(checkpoint, tmp_path):
    from quant_checkpoints import write_compressed_checkpoint

    src, config = checkpoint("llama", "bf16")
    directory = str(write_compressed_checkpoint(src, tmp_path / "int8", "int", "channel"))
    full = build_model("llama", config, torch.bfloat16)
    LazyCheckpoint(directory).load_into(full, progress=False)
    for rank in range(2):
        kept = build_model("llama", config, torch.bfloat16)
        LazyCheckpoint(directory).load_into(kept, rank, 2, quantize=own_holder("int8"), progress=False)
        module = kept.model.layers[0].mlp.down_proj  # row parallel: half of each row's channel
        from test_tp import shard_of

        want = shard_of("model.layers.0.mlp.down_proj.weight", full.model.layers[0].mlp.down_proj.weight.detach(),
                        rank, 2, config.num_key_value_heads)
        assert torch.equal(module.dequantized_weight(torch.bfloat16), want)
    fp8 = build_model("llama", config, torch.bfloat16)  # int8 stored, fp8 asked: dequantized, quantized again
    LazyCheckpoint(directory).load_into(fp8, quantize=own_holder("fp8", group_size=GROUP), progress=False)
    module = fp8.model.layers[0].mlp.down_proj
    assert module.weight.dtype == torch.float8_e4m3fn
    error = (module.dequantized_weight(torch.float32) - full.model.layers[0].mlp.down_proj.weight.float()).abs()
    assert (error <= _step(module) * (1 + 1e-6)).all()


# --------------------------------------------------------------- torchao (optional extra)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_torchao_tensors_hold_the_same_weights_and_give_the_same_logits(checkpoint, qdtype):
    needs_torchao()
    from torchao.quantization import Float8Tensor, Int8Tensor

    ours, config, _ = _load(checkpoint, "llama", own_holder(qdtype, group_size=GROUP))
    theirs, _, _ = _load(checkpoint, "llama", Quantization(qdtype, group_size=GROUP, torchao=True))
    kind = Int8Tensor if qdtype == "int8" else Float8Tensor
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, QuantizedLinear)}
    for name, module in layers.items():
        held = theirs.get_submodule(name)
        assert type(held) is torch.nn.Linear and isinstance(held.weight, kind), name
        assert torch.equal(held.weight.dequantize(torch.float32), module.dequantized_weight(torch.float32)), name
    torch.testing.assert_close(_logits(theirs, config), _logits(ours, config), rtol=1e-5, atol=1e-5)
    # A short last group (64 columns, groups of 48) is no grid torchao takes: QuantizedLinear.
    tails, _, _ = _load(checkpoint, "llama", Quantization(qdtype, group_size=48, torchao=True))
    assert isinstance(tails.model.layers[0].self_attn.q_proj, QuantizedLinear)
