"""Tensor parallel under torch.distributed (gloo, CPU, spawned processes): after load_into
every rank's shards equal the full tensors, and the TP forward gives world=1's logits.

One spawned job per world size runs every case on one process group (spawning is the
expensive part on 2 cores); a failing case raises in its rank and fails the job."""
from __future__ import annotations


import pytest
import torch

from checkpoints import EXPERTS_TP, build_model, default_experts, fixed_input
from gloo import spawn_cases

ATOL = RTOL = 1e-5


def _logits(model, config):
    with torch.no_grad():
        return model(input_ids=fixed_input(config)).logits


def _expected_local(name: str, full: torch.Tensor, local: torch.Tensor, rank: int, world: int, kv: int):
    """This rank's share of a plain (non-DTensor) parameter, computed here independently."""
    if local.shape == full.shape:
        return full
    last = name.split(".")[-2]
    if last in ("k_proj", "v_proj"):  # KV heads replicated in groups when world > kv heads
        groups = min(kv, world)
        return full.chunk(groups, 0)[rank // (world // groups)]
    if last == "c_attn":  # GPT-2 fused qkv, Conv1D weight [in, 3 * out]: each part sliced
        dim = full.dim() - 1
        return torch.cat([part.chunk(world, dim)[rank] for part in full.chunk(3, dim)], dim)
    if last == "experts":  # fused experts, expert parallel: whole experts per rank
        return full.chunk(world, 0)[rank]
    if last == "c_fc":
        return full.chunk(world, full.dim() - 1)[rank]
    if last == "c_proj":  # row parallel Conv1D: weight [in, out] split on in
        return full.chunk(world, 0)[rank]
    raise AssertionError(f"{name}: no expectation for local shape {tuple(local.shape)} of {tuple(full.shape)}")


def _check_shards(model, ref, rank, world, kv, label):
    from torch.distributed.tensor import DTensor

    ref_params = dict(ref.named_parameters())
    sharded = 0
    for name, param in model.named_parameters():
        full = ref_params[name].detach()
        if isinstance(param, DTensor):
            gathered = param.full_tensor()
            sharded += tuple(param.to_local().shape) != tuple(full.shape)
            assert torch.equal(gathered, full), f"{label}: {name} gathered differs from the full tensor"
        else:
            local = param.detach()
            sharded += local.shape != full.shape
            expected = _expected_local(name, full, local, rank, world, kv)
            assert torch.equal(local, expected), f"{label}: {name} is not rank {rank}'s share"
    assert sharded, f"{label}: nothing was sharded"


def _case_forward(arch, directory, rank, world, plan=None):
    from lazyload import LazyCheckpoint
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    ref = build_model(arch, config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, progress=False)
    model = build_model(arch, config, torch.float32)
    report = LazyCheckpoint(directory).load_into(model, rank, world, plan=plan, progress=False)
    assert report.ok and report.bytes_read + report.bytes_mapped > 0
    label = f"{arch} world={world} plan={plan}"
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "n_head", 1)
    _check_shards(model, ref, rank, world, kv, label)
    got, want = _logits(model, config), _logits(ref, config)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label}: {m}")
    return model, report


def _case_moe_default(arch, directory, rank, world):
    """A MoE model under the default plan: whole experts per rank where transformers' TP plan
    leaves them whole (5.25; it splits them inside on 5.24): either way each rank holds
    1/world of the experts' bytes, its shards are world 1's and its logits world 1's."""
    from transformers import AutoConfig

    model, report = _case_forward(arch, directory, rank, world)
    assert report.plan == default_experts(AutoConfig.from_pretrained(directory)), (arch, report.plan)
    held = full = 0
    for name, param in model.named_parameters():
        if ".experts." in name:  # routed experts (not DeepSeek's shared_experts)
            held += (param.to_local() if hasattr(param, "to_local") else param).numel()
            full += param.numel() if hasattr(param, "to_local") else param.numel() * world
    assert full and held * world == full, f"{arch} rank {rank}/{world}: holds {held} of {full // world * world}"


def _reference_mesh_and_meta_model(directory, world):
    """The world-1 reference, a 1-D CPU mesh of all ranks, and a fresh meta Llama."""
    from torch.distributed.device_mesh import init_device_mesh
    from lazyload import LazyCheckpoint
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    ref = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(ref, progress=False)
    mesh = init_device_mesh("cpu", (world,))
    return config, ref, mesh, build_model("llama", config, torch.float32)


def _case_torch_styles(directory, rank, world):
    """The user applied torch's own parallelize_module (Colwise/Rowwise) on the meta model."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from lazyload import LazyCheckpoint

    config, ref, mesh, model = _reference_mesh_and_meta_model(directory, world)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                                         "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                         "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                         "mlp.down_proj": RowwiseParallel()})
    LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
    _check_shards(model, ref, rank, world, config.num_key_value_heads, "parallelize_module")


def _case_fsdp2(directory, rank, world, to_empty):
    """FSDP2's fully_shard (parameters: DTensors sharded on dim 0), on meta or after to_empty."""
    from torch.distributed.fsdp import fully_shard
    from lazyload import LazyCheckpoint

    config, ref, mesh, model = _reference_mesh_and_meta_model(directory, world)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if to_empty:
        model.to_empty(device="cpu")
    before = {n: p.to_local().data_ptr() for n, p in model.named_parameters()} if to_empty else {}
    LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
    _check_shards(model, ref, rank, world, config.num_key_value_heads, f"fully_shard to_empty={to_empty}")
    for n, p in model.named_parameters():
        if to_empty:
            assert p.to_local().data_ptr() == before[n], f"{n}: FSDP2 storage was replaced, not filled"
    if to_empty:  # FSDP2's own forward (all-gathers) still works on what was filled in place
        # to_empty left the non-persistent rotary buffer uninitialised (it is real, so not lazyload's to fill)
        for name, buf in ref.named_buffers():
            model.get_buffer(name).copy_(buf)
        torch.testing.assert_close(_logits(model, config), _logits(ref, config), rtol=RTOL, atol=ATOL)


def _case_strict_error_leaves_model_untouched(directory, rank, world):
    """Under a process group a model is made tensor parallel by load_into, but only once the
    input is known good: a missing key fails first, and the model stays plain, on meta."""
    from lazyload import LazyCheckpoint
    from lazyload.errors import MissingKeysError
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    config.num_hidden_layers += 1  # a layer the checkpoint does not have
    model = build_model("llama", config, torch.float32)
    with pytest.raises(MissingKeysError, match=f"model.layers.{config.num_hidden_layers - 1}."):
        LazyCheckpoint(directory).load_into(model, rank, world, progress=False)
    assert all(type(p) is torch.nn.Parameter and p.is_meta for p in model.parameters())


def _run_case(case, rank, world):
    kind, args = case[0], case[1:]
    if kind == "forward":
        _case_forward(*args[:2], rank, world, *args[2:])
    elif kind == "moe_default":
        _case_moe_default(*args, rank, world)
    elif kind == "torch_styles":
        _case_torch_styles(args[0], rank, world)
    elif kind == "fsdp2":
        _case_fsdp2(args[0], rank, world, args[1])
    elif kind == "strict_error":
        _case_strict_error_leaves_model_untouched(args[0], rank, world)


def _spawn(world, cases, tmp_path):
    spawn_cases(world, cases, tmp_path, _run_case)


def test_world2_all_architectures(checkpoint, tmp_path):
    llama1, _ = checkpoint("llama", num_key_value_heads=1)
    llama, _ = checkpoint("llama")
    cases = [
        ("forward", "llama", str(llama1)),  # one KV head at world 2: replicated
        ("forward", "qwen2", str(checkpoint("qwen2")[0])),
        ("forward", "mixtral", str(checkpoint("mixtral")[0]), EXPERTS_TP),  # TP inside every expert
        ("forward", "mixtral", str(checkpoint("mixtral")[0]), "ep"),  # whole experts per rank
        *_moe_defaults(checkpoint),
        ("forward", "llama4_text", str(checkpoint("llama4_text")[0])),
        ("forward", "llama4_text", str(checkpoint("llama4_text")[0]), "ep"),  # derived: whole experts per rank
        ("forward", "gpt2", str(checkpoint("gpt2")[0])),  # no TP plan: structural rule, fused Conv1D
        ("torch_styles", str(llama)),
        ("fsdp2", str(llama), False),
        ("fsdp2", str(llama), True),
        ("strict_error", str(llama)),
    ]
    _spawn(2, cases, tmp_path)


def test_world4_kv_replication_and_experts(checkpoint, tmp_path):
    cases = [
        ("forward", "llama", str(checkpoint("llama")[0])),  # 2 KV heads at world 4
        ("forward", "mixtral", str(checkpoint("mixtral")[0]), "ep"),  # one expert per rank
        ("forward", "gpt2", str(checkpoint("gpt2")[0])),
        *_moe_defaults(checkpoint),
    ]
    _spawn(4, cases, tmp_path)


def _moe_defaults(checkpoint):
    """The default plan on the MoE architectures whose experts transformers 5.25's TP plans
    leave whole (4 experts each: one or two per rank)."""
    return [("moe_default", arch, str(checkpoint(arch)[0])) for arch in ("mixtral", "qwen3_moe", "deepseek_v3",
                                                                          "gpt_oss")]
