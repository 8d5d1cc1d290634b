"""WeightSync (live weight sync) over real gloo process groups, spawned: a trainer's FSDP2 (or
TP x FSDP2) Llama into a server's tensor-parallel one built on meta, two syncs with an
optimizer step between. Every server rank's tensors are compared bit for bit with the
trainer's full weights (gathered only here, to compare), and every server rank receives
exactly its share."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from checkpoints import make_config, randomize_, write_checkpoint
from gloo import spawn_cases


# Linear layers of whole 128 x 128 blocks, split over 2 ranks into whole blocks: FP8 block targets
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1)


def _config(arch="llama"):
    return make_config("llama", **WIDE) if arch == "llama-wide" else make_config(arch, num_hidden_layers=2)


def _model(arch="llama", config=None):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config or _config(arch), attn_implementation="eager")


def _trainer(dp_mesh, tp_mesh=None, arch="llama"):
    """A model trained by FSDP2 over `dp_mesh` (TP over `tp_mesh` first, when given)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _model(arch)
    randomize_(model)
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                                                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                                "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def _step(model, optimizer):
    ids = torch.arange(16).reshape(2, 8) % 200
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _full(model) -> dict:
    """The trainer's full weights (a collective over its ranks); None elsewhere."""
    if model is None:
        return None
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for n, t in model.state_dict().items()}


def _shared_full(model, group=None) -> dict:
    """The trainer's full weights on every rank of `group` (its first rank is a trainer in every case)."""
    full = [_full(model)]
    dist.broadcast_object_list(full, group=group, group_src=0)
    return full[0]


def _check_exact(sync, server, full: dict) -> None:
    """Each server tensor is bit-equal to its planned slices of the trainer's full weight,
    and the server runs: its logits are those of a plain model holding the full weights."""
    state = server.state_dict()
    for target in sync.load_plan.targets:
        local = _local(state[target.name])
        assert tuple(local.shape) == target.local_shape, target.name
        assert torch.equal(local, _planned_slices(target, local, full[target.name])), target.name
    if next(server.parameters()).dtype != torch.float32:
        return  # cast on arrival: the slices compared above; logits in another precision differ
    plain = _model(config=server.config)
    plain.load_state_dict(full)
    ids = torch.arange(12).reshape(2, 6) % 200
    with torch.no_grad():
        torch.testing.assert_close(server(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def _planned_slices(target, like, full):
    """The target rank's planned slices of `full`, a tensor like its local one."""
    expected = torch.empty_like(like)
    for region in target.regions:
        at = tuple(slice(s, s + b - a) for (a, b), s in zip(region.global_box, region.local_start))
        expected[at] = full[tuple(slice(a, b) for a, b in region.global_box)]
    return expected


def _local(tensor):
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def _share(sync, full) -> int:
    """The bytes of this server rank's share of the trainer's tensors, as the trainer holds them."""
    return sum(math.prod(t.local_shape) * full[t.name].element_size() for t in sync.load_plan.targets)


def _quantized_bytes(sync, server, full) -> tuple[int, int]:
    """The quantized targets' share in the trainer's dtype, and the bytes the server holds of
    them (8-bit data and scales)."""
    state = server.state_dict()
    share = sum(math.prod(t.local_shape) * full[t.name].element_size() for t in sync.load_plan.targets
                if t.name in sync.load_plan.quantized)
    held = sum(_local(state[n]).nbytes + _local(state.get(n + "_scale", state.get(n + "_scale_inv"))).nbytes
               for n in sync.load_plan.quantized)
    return share, held


def _ptrs(server) -> dict:
    return {n: _local(t).data_ptr() for n, t in server.state_dict().items()}


def _meta_server(arch="llama"):
    with torch.device("meta"):
        return _model(arch)


def _two_syncs(trainer, server, server_mesh, group=None, **options):
    """Construct, sync, step, sync: exact after each, the target's storage kept, bytes as planned."""
    import lazyload

    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=server_mesh, group=group, rank_timeout=60,
                               **options)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1) if trainer is not None else None
    first = sync()
    _check_exact_all(sync, trainer, server, first)
    ptrs = _ptrs(server) if server is not None else None
    if trainer is not None:
        _step(trainer, optimizer)
    second = sync()
    _check_exact_all(sync, trainer, server, second)
    assert first.planned and not second.planned and first.plan_digest == second.plan_digest
    if server is not None:
        assert _ptrs(server) == ptrs
    return first, second


def _check_exact_all(sync, trainer, server, report) -> None:
    full = _shared_full(trainer, sync.group)
    if server is not None:
        if not sync.load_plan.quantized:  # quantized: compared with load_into's
            _check_exact(sync, server, full)
        quantized, held = _quantized_bytes(sync, server, full)
        assert report.quantized_on_wire == held  # the source quantized them: the server's 8-bit data and scales
        assert held * 3 < quantized or not quantized  # float32's a quarter, and the scales
        assert report.bytes_received + report.bytes_local == _share(sync, full) - quantized + held
    totals = [None] * len(sync.ranks)
    dist.all_gather_object(totals, (report.bytes_sent, report.bytes_received), group=sync.group)
    assert sum(s for s, _ in totals) == sum(r for _, r in totals)  # every byte sent is received once


def _colocated(rank):
    """FSDP2 and TP 2 over the same ranks: ranks 0-1 and ranks 2-3 each sync over their own
    group, at the same time."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("half", "x"))
    half = mesh["x"]
    _two_syncs(_trainer(half), _meta_server(), half, group=half.get_group())


def _mismatched(rank, world):
    """A source missing a tensor, one of another shape, a target mesh that does not split the
    heads: every rank fails at construction, the server still on meta, no byte moved."""
    import lazyload
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    plain = LlamaForCausalLM(_config()).state_dict()
    missing = {n: t for n, t in plain.items() if n != "model.norm.weight"}
    reshaped = {**plain, "model.norm.weight": torch.ones(32)}
    odd = _config()
    odd.num_attention_heads = odd.num_key_value_heads = 2  # 2 heads over 4 ranks
    for source, config, wanted in ((missing, _config(), lazyload.MissingKeysError),
                                   (reshaped, _config(), lazyload.ShapeMismatchError),
                                   (LlamaForCausalLM(odd).state_dict(), odd, lazyload.PlanError)):
        with torch.device("meta"):
            server = LlamaForCausalLM(config)
        with pytest.raises(lazyload.LazyLoadError) as caught:
            lazyload.WeightSync(source=source if rank == 0 else None, target=server if rank > 0 else None,
                                target_mesh=mesh if rank > 0 else None, rank_timeout=30)
        if rank > 0:
            assert isinstance(caught.value, wanted), caught.value
        else:
            assert isinstance(caught.value, lazyload.RankFailedError) and sorted(caught.value.ranks) == [1, 2, 3]
        assert all(t.is_meta for t in server.state_dict().values())
    _unsupported_holders(rank, mesh)


def _unsupported_holders(rank, mesh):
    """A target holding 4-bit packed or torchao-quantized layers: an ArgumentError at
    construction on the server ranks, naming the layer and what to do; the others a
    RankFailedError."""
    import lazyload
    from lazyload.quant.packed import Packed4Linear
    from torchao.quantization import Int8Tensor

    torchao = torch.nn.Linear(64, 32, bias=False, device="meta")
    torchao.weight = torch.nn.Parameter(Int8Tensor(torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, 2), [1, 32],
                                                   dtype=torch.bfloat16), requires_grad=False)
    packed = Packed4Linear(64, 32, False, "mxfp4", 32, torch.bfloat16, device="meta")
    for layer, held, load in ((packed, "4-bit packed weights (Packed4Linear", "quantize='int8' or 'fp8'"),
                              (torchao, "torchao-quantized weight (Int8Tensor", "torchao=False")):
        with pytest.raises(lazyload.LazyLoadError) as caught:
            lazyload.WeightSync(source={"0.weight": torch.ones(32, 64)} if rank == 0 else None,
                                target=torch.nn.Sequential(layer) if rank > 0 else None,
                                target_mesh=mesh if rank > 0 else None, plan={}, rank_timeout=30)
        message = str(caught.value)
        if rank > 0:
            assert isinstance(caught.value, lazyload.ArgumentError), message
            assert "layer '0' holds" in message and held in message and "not supported" in message, message
            assert load in message and "built on the meta device with quantize=" in message, message
        else:
            assert isinstance(caught.value, lazyload.RankFailedError) and sorted(caught.value.ranks) == [1, 2, 3]


def _fault(rank):
    """Trainer rank 0 raises in the middle of a sync: every rank raises a SyncError, each server
    rank's report names the tensors already new, and the next sync completes it, exact."""
    import lazyload
    import lazyload.sync.transfer as transfer
    from datetime import timedelta
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_store

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = _trainer(mesh["x"]) if rank < 2 else None
    server = _meta_server() if rank >= 2 else None
    # a trainer rank's budget holds both servers' steps: each server's step 0 completes tensors
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["x"] if server else None,
                               rank_timeout=5, max_host_bytes=40_000 if server else 80_000)
    assert sync.routes.steps > 2
    dist.barrier()  # every rank constructed: the construction's keys are gone from the store
    keys = [f"{sync._prefix}/{stage}/{r}" for stage in ("layout", "planned") for r in range(4)]
    assert not any(_get_default_store().check([key]) for key in keys + [f"{sync._prefix}/read"])
    first = sync()
    assert first.version == sync.version == 1 and first.written == first.untouched == ()
    _check_peers(sync, first)
    before = {n: _local(t).clone() for n, t in server.state_dict().items()} if server is not None else None
    if trainer is not None:
        _step(trainer, torch.optim.SGD(trainer.parameters(), lr=0.1))
    pack, calls, wait = transfer._pack, [], transfer.wait_polling
    # rank 0 fails in step 1 only once the servers placed step 0 (told through the store): no race
    store, placed = _get_default_store(), [f"{sync._prefix}/test-step0/{r}" for r in (2, 3)]
    if rank == 0:
        def failing(requests, ends):
            calls.append(1)
            if len(calls) == 3:
                store.wait(placed, timedelta(seconds=30))
                raise RuntimeError("injected: the trainer fails mid-sync")
            return pack(requests, ends)
        transfer._pack = failing
    elif server is not None:
        def telling(works, ends, what):
            wait(works, ends, what)
            if what.startswith("step 0 "):
                store.set(placed[rank - 2], "1")
        transfer.wait_polling = telling
    with pytest.raises(lazyload.SyncError) as caught:
        sync()
    transfer._pack, transfer.wait_polling = pack, wait
    assert sync._failures == 1  # the retry sends under a fresh tag on every rank
    failed = caught.value.report
    assert failed.partial == failed.written and failed.version == sync.version == 1  # not advanced
    assert "its version stays 1" in str(caught.value)
    _check_peers(sync, failed, completed=False)
    _check_torn(sync, server, failed, before, _shared_full(trainer))
    report = sync()
    assert report.partial == report.written == report.untouched == () and report.version == 2
    _check_exact_all(sync, trainer, server, report)
    _fails_waiting(sync, rank, trainer, server)


def _fails_waiting(sync, rank, trainer, server):
    """Trainer rank 0 fails waiting at step 2, its sends of that step posted: its report
    counts only the sends of the steps that completed; the next sync completes, exact."""
    import lazyload
    import lazyload.sync.transfer as transfer
    from lazyload.expr import box_numel

    wait = transfer.wait_polling
    if rank == 0:
        def failing(works, ends, what):
            if what.startswith("step 2 "):
                raise transfer.CollectiveError("injected: the trainer fails waiting")
            return wait(works, ends, what)
        transfer.wait_polling = failing
    with pytest.raises(lazyload.SyncError) as caught:
        sync()
    transfer.wait_polling = wait
    if rank == 0:
        completed = sum(box_numel(r.box) * sync.index[r.key].dtype.itemsize for step in (0, 1)
                        for requests in sync.routes.sends.get(step, {}).values() for r in requests)
        assert sync.routes.sends.get(2) and caught.value.report.bytes_sent == completed > 0
    assert sync._failures == 2 and caught.value.report.version == 2
    report = sync()
    assert report.version == 3
    _check_exact_all(sync, trainer, server, report)


def _check_peers(sync, report, completed=True):
    """The report's traffic per peer: summing to its totals, one message per step with that
    peer (of the steps that completed); and after a sync that completed, every planned
    message, each rank's sends to a peer what that peer received from it."""
    peers = report.peers
    assert sum(t.bytes_sent for t in peers.values()) == report.bytes_sent
    assert sum(t.bytes_received for t in peers.values()) == report.bytes_received
    for peer, traffic in peers.items():
        assert traffic.messages_sent <= sum(peer in by for by in sync.routes.sends.values())
        assert traffic.messages_received <= sum(peer in by for by in sync.routes.receives.values())
        assert (traffic.bytes_sent > 0) == (traffic.messages_sent > 0), (peer, traffic)
    if not completed:
        return  # failed: a peer may have counted a step that this rank gave up waiting for
    assert {p: t.messages_sent for p, t in peers.items() if t.messages_sent} == _per_peer(sync.routes.sends)
    assert {p: t.messages_received for p, t in peers.items() if t.messages_received} == _per_peer(sync.routes.receives)
    every = [None] * len(sync.ranks)
    dist.all_gather_object(every, (sync.rank, peers), group=sync.group)
    by_rank = dict(every)
    for rank, mine in by_rank.items():
        for peer, traffic in mine.items():
            theirs = by_rank[peer][rank]
            assert (traffic.bytes_sent, traffic.messages_sent) == (theirs.bytes_received, theirs.messages_received)


def _per_peer(steps: dict) -> dict:
    """Peer -> the steps that have a message with it."""
    out = {}
    for by_peer in steps.values():
        for peer in by_peer:
            out[peer] = out.get(peer, 0) + 1
    return out


def _check_torn(sync, server, report, before, now):
    """A failed sync's report on a server rank: `written` tensors hold the new weights,
    `untouched` ones the last sync's, both present, and the rest neither of those lists."""
    if server is None:
        assert report.written == report.untouched == ()
        return
    state, targets = server.state_dict(), {t.name: t for t in sync.load_plan.targets}
    assert report.written and report.untouched and not set(report.written) & set(report.untouched)
    for name in report.untouched:
        assert torch.equal(_local(state[name]), before[name]), name
    for name in report.written:
        expected = _planned_slices(targets[name], before[name], now[name])
        assert torch.equal(_local(state[name]), expected) and not torch.equal(expected, before[name]), name


def _nccl_retry(rank, world):
    """Under NCCL (stood in for on gloo, tests/test_cuda_harness.py: tags ignored, a wait
    that does not block the host, completion seen only through CUDA events): trainer rank 0
    fails mid-sync, its peers' sends and receives of that step left posted; every rank raises
    a SyncError saying that the retry runs on a fresh communicator, its own aborted; the
    retry completes on a fresh one, exact, and the stand-in GPU saw no fault."""
    import lazyload
    import lazyload.sync.transfer as transfer
    from test_cuda_harness import StandInGPU, nccl_over_gloo
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = _trainer(mesh["x"]) if rank < 2 else None
    server = _meta_server() if rank >= 2 else None
    gpu = StandInGPU(seed=rank)
    with pytest.MonkeyPatch.context() as patch:
        made = nccl_over_gloo(patch, gpu)
        sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["x"] if server else None,
                                   rank_timeout=60, max_host_bytes=40_000)
        assert sync.routes.steps > 2
        _check_exact_all(sync, trainer, server, sync())
        if trainer is not None:
            _step(trainer, torch.optim.SGD(trainer.parameters(), lr=0.1))  # the retry's bytes differ from the first's
        if rank == 0:
            pack, calls = transfer._pack, []

            def failing(requests, ends):
                calls.append(1)
                if len(calls) == 3:  # once, in step 1: its peers posted theirs
                    raise RuntimeError("injected: the trainer fails mid-sync")
                return pack(requests, ends)
            patch.setattr(transfer, "_pack", failing)
        with pytest.raises(lazyload.SyncError, match="the retry runs on a fresh communicator"):
            sync()
        assert [comm.aborted for comm in made] == [True]
        _check_exact_all(sync, trainer, server, sync())
        assert [comm.aborted for comm in made] == [True, False]
    gpu.synchronize()
    gpu.close()
    assert gpu.problems == []


def _trainer_server(rank, arch="llama", make_server=None, **options):
    """FSDP2 over ranks 0-1, the server (TP 2, or `plan="ep"`) over ranks 2-3: built on meta,
    or by `make_server(arch, mesh)`."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = _trainer(mesh["x"], arch=arch) if rank < 2 else None
    server = (make_server(arch, mesh["x"]) if make_server else _meta_server(arch)) if rank >= 2 else None
    return trainer, server, mesh["x"], _two_syncs(trainer, server, mesh["x"] if server is not None else None,
                                                  **options)


def _quantization(dtype):
    import lazyload

    if dtype == "fp8-block":  # transformers' FP8Linear, a float32 scale per 128 x 128 block
        return lazyload.Quantization("fp8", format="transformers")
    if dtype == "int8-rows":  # a scale per row of what the rank holds
        return lazyload.Quantization("int8", group_size=None, torchao=False)
    return lazyload.Quantization(dtype, group_size=32, torchao=False)


def _loaded_quantized(directory, dtype, quantize, rank, ptrs):
    """A server loaded with load_into(quantize=...) from other weights first (`make_server`);
    its tensors' addresses into `ptrs`."""
    import lazyload
    from safetensors.torch import save_file

    def make(arch, mesh):
        torch.manual_seed(7)
        old = _model(arch)
        randomize_(old)
        save_file(old.state_dict(), f"{directory}/{dtype}-old{rank}.safetensors")
        server = _meta_server(arch)
        lazyload.LazyCheckpoint(f"{directory}/{dtype}-old{rank}.safetensors").load_into(server, mesh=mesh,
                                                                                      quantize=quantize)
        ptrs.update(_ptrs(server))
        return server
    return make


def _quantized(rank, directory, dtype, loaded=False):
    """quantize= on the way: each server rank's 8-bit data and scales equal those of
    load_into(quantize=...) from a checkpoint of the trainer's weights, though the sync cuts
    the items larger than max_host_bytes (on whole scale blocks). `loaded`: into a
    server quantized by load_into already, its layers' data and scales kept in place."""
    import lazyload
    from safetensors.torch import save_file

    block, quantize = dtype == "fp8-block", _quantization(dtype)
    arch = "llama-wide" if block else "llama"
    ptrs = {}
    make = _loaded_quantized(directory, dtype, quantize, rank, ptrs) if loaded else None
    # under max_host_bytes: items cut, FP8 blocks' on whole 128-row blocks (each trainer rank serves both servers)
    budget = 140_000 if block else 6_000
    trainer, server, mesh, (_, second) = _trainer_server(rank, arch, make, quantize=quantize, max_host_bytes=budget)
    full, path = _full(trainer), f"{directory}/{dtype}{'-loaded' if loaded else ''}.safetensors"
    if rank == 0:
        save_file({n: t.contiguous() for n, t in full.items()}, path)
    dist.barrier()
    if loaded:
        assert server is None or _ptrs(server) == ptrs  # the loaded layers' data and scales, filled in place
        _disagreeing(rank, trainer, server, mesh, dtype)
    else:
        _quantized_on_arrival(trainer, server, mesh, arch, quantize, second, budget)
    if server is None:
        return
    reference = _meta_server(arch)
    lazyload.LazyCheckpoint(path).load_into(reference, mesh=mesh, quantize=quantize)
    got, expected = server.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(expected) and any(t.element_size() == 1 for t in got.values())
    assert not block or any(type(m).__name__ == "FP8Linear" for m in server.modules())
    _check_same_bits(got, expected)


def _check_same_bits(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(_local(got[name]).view(torch.uint8) if tensor.element_size() == 1 else _local(got[name]),
                           _local(tensor).view(torch.uint8) if tensor.element_size() == 1 else _local(tensor)), name


def _quantized_on_arrival(trainer, server, mesh, arch, quantize, on_wire, budget):
    """The same weights synced with every box sent in full precision and quantized on arrival
    (`quantize_on_wire` patched out: the sync before trainer-side quantization): the same
    bits, a plan digest of its own, the quantized targets' float32 bytes 3.5x those of the
    quantized wire or more, and the other targets' bytes the same; with the same
    `max_host_bytes`, fewer messages on the quantized wire (its steps count its bytes)."""
    import lazyload
    import lazyload.sync.weight_sync as weight_sync

    quantize_on_wire, weight_sync.quantize_on_wire = weight_sync.quantize_on_wire, lambda plan, items: {}
    try:
        other = _meta_server(arch) if server is not None else None
        sync = lazyload.WeightSync(source=trainer, target=other, target_mesh=mesh if server is not None else None,
                                   quantize=quantize, rank_timeout=60, max_host_bytes=budget)
        arrived = sync()
    finally:
        weight_sync.quantize_on_wire = quantize_on_wire
    assert sync.plan_digest != on_wire.plan_digest and arrived.quantized_on_wire == 0
    if server is not None:
        _check_same_bits(other.state_dict(), server.state_dict())
        plan = sync.load_plan
        quantized = sum(math.prod(t.local_shape) * plan.full_dtypes[t.name].itemsize for t in plan.targets
                        if t.name in plan.quantized)
        assert quantized >= 3.5 * on_wire.quantized_on_wire > 0
        assert arrived.bytes_received - quantized == on_wire.bytes_received - on_wire.quantized_on_wire
        messages = [sum(t.messages_received for t in report.peers.values()) for report in (on_wire, arrived)]
        assert messages[0] < messages[1], messages


def _disagreeing(rank, trainer, server, mesh, dtype):
    """A quantized target and a quantize= that differs (another 8-bit dtype, or none): every
    rank fails at construction, the server ranks naming a layer; the server left as it was."""
    import lazyload

    before = {n: _local(t).clone() for n, t in server.state_dict().items()} if server is not None else None
    for other in ("int8" if dtype != "int8" else "fp8", None):
        with pytest.raises(lazyload.LazyLoadError) as caught:
            lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh if server is not None else None,
                                quantize=other and _quantization(other), rank_timeout=30)
        if server is not None:
            assert isinstance(caught.value, lazyload.ArgumentError) and "'model.layers.0." in str(caught.value)
        else:
            assert isinstance(caught.value, lazyload.RankFailedError) and sorted(caught.value.ranks) == [2, 3]
    if server is not None:
        assert all(torch.equal(_local(t), before[n]) for n, t in server.state_dict().items())


def _blocks_cut(rank, world):
    """FSDP2 shards of 192 rows of a 384 x 256 FP8-block weight (two trainer ranks) cut its
    128 x 128 blocks: its boxes travel in full precision and are quantized on arrival, once
    the server rank holds every block whole; the other layer's whole blocks go quantized on
    the wire. Both syncs (before and after the trainer's weights change) bit-equal to
    load_into(quantize=...) of the same weights."""
    import shutil
    import tempfile

    import lazyload
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))["x"]
    quantize, plan = _quantization("fp8-block"), {"0": "rowwise", "1": "colwise"}  # TP-2 splits whole blocks

    def model():
        return torch.nn.Sequential(torch.nn.Linear(256, 384, bias=False), torch.nn.Linear(384, 256, bias=False))
    torch.manual_seed(0)
    trainer, server = (model(), None) if rank < 2 else (None, None)
    if trainer is not None:
        fully_shard(trainer, mesh=mesh)
    else:
        with torch.device("meta"):
            server = model()
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh if server is not None else None,
                               plan=plan, quantize=quantize, rank_timeout=60)
    directory = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    for turn in range(2):
        report = sync()
        full = _full(trainer)
        if rank == 0:
            save_file(full, f"{directory[0]}/{turn}.safetensors")
        dist.barrier()
        if server is not None:
            with torch.device("meta"):
                reference = model()
            lazyload.LazyCheckpoint(f"{directory[0]}/{turn}.safetensors").load_into(reference, mesh=mesh, plan=plan,
                                                                                   quantize=quantize)
            assert all(type(m).__name__ == "FP8Linear" for m in server)
            _check_same_bits(server.state_dict(), reference.state_dict())
            state = server.state_dict()
            assert report.quantized_on_wire == _local(state["1.weight"]).nbytes + _local(state["1.weight_scale_inv"]).nbytes
            assert report.bytes_received - report.quantized_on_wire == 384 * 128 * 4  # layer 0's share, float32
        if trainer is not None:
            with torch.no_grad():
                for tensor in trainer.parameters():
                    tensor.to_local().mul_(-1.5)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory[0])


def _renamed_state_dict(rank, world):
    """A state dict of plain tensors on rank 0 alone, its keys renamed, mapped back by key_map:
    every rank's TP-4 slices exact (rank 0 copies its own, the others receive theirs)."""
    import lazyload
    from torch.distributed.device_mesh import init_device_mesh

    source = None
    if rank == 0:
        torch.manual_seed(1)
        source = {f"policy.{n}": t for n, t in _model().state_dict().items()}
    server = _meta_server()
    sync = lazyload.WeightSync(source=source, target=server, target_mesh=init_device_mesh("cpu", (world,)),
                               key_map={r"^policy\.": ""})
    report = sync()
    assert report.version == 1
    full = [{n.removeprefix("policy."): t for n, t in source.items()} if rank == 0 else None]
    dist.broadcast_object_list(full, src=0)
    _check_exact(sync, server, full[0])
    assert report.bytes_received + report.bytes_local == _share(sync, full[0])
    assert (report.bytes_local > 0) == (rank == 0) and (report.bytes_received > 0) == (rank > 0)
    # into a target that is real already (the first sync's): filled in place
    ptrs = _ptrs(server)
    if rank == 0:
        with torch.no_grad():
            for tensor in source.values():
                tensor.mul_(-1)
        full[0] = {n.removeprefix("policy."): t for n, t in source.items()}
    again = lazyload.WeightSync(source=source, target=server, target_mesh=init_device_mesh("cpu", (world,)),
                                key_map={r"^policy\.": ""})
    assert again().version == again.version == 2  # the target's count, over both WeightSyncs
    dist.broadcast_object_list(full, src=0)
    _check_exact(again, server, full[0])
    assert _ptrs(server) == ptrs
    _cast_on_send(rank, world, source)


def _cast_on_send(rank, world, source):
    """float32 weights into a bfloat16 server: the source casts each box before sending it
    (the requests and the plan digest say so), half the bytes of a sync that sends float32
    and casts on arrival (`cast_on_wire` patched out), and the server's bits equal to that
    sync's and to load_into(dtype=bfloat16) of the same weights, for values that round to
    even on a tie, subnormals, overflow to inf, a NaN and -0.0."""
    import shutil
    import tempfile

    import lazyload
    import lazyload.sync.weight_sync as weight_sync
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    path = [None]
    if rank == 0:
        hard = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130, -(2 ** -133), 3.0e38,
                             torch.finfo(torch.float32).max, float("nan"), -0.0, 1 / 3])
        with torch.no_grad():
            source["policy.model.norm.weight"][:len(hard)] = hard
            source["policy.model.layers.0.self_attn.q_proj.weight"][-1, :len(hard)] = hard
        path[0] = f"{tempfile.mkdtemp()}/weights.safetensors"
        save_file({n.removeprefix("policy."): t.contiguous() for n, t in source.items()}, path[0])
    dist.broadcast_object_list(path, src=0)
    servers, reports, syncs = [], [], []
    cast_on_wire = weight_sync.cast_on_wire
    try:
        for on_send in (True, False):
            if not on_send:
                weight_sync.cast_on_wire = lambda plan, items: {}
            servers.append(_meta_server())
            syncs.append(lazyload.WeightSync(source=source, target=servers[-1], target_mesh=mesh,
                                             key_map={r"^policy\.": ""}, dtype=torch.bfloat16))
            reports.append(syncs[-1]())
    finally:
        weight_sync.cast_on_wire = cast_on_wire
    loaded = _meta_server()  # whole, in this process (ranks' loads are numbered per process: not in step here)
    lazyload.LazyCheckpoint(path[0]).load_into(loaded, dtype=torch.bfloat16)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0].rpartition("/")[0])
    sent, arrived = reports
    assert syncs[0].plan_digest != syncs[1].plan_digest  # the digest covers the wire dtype
    if rank == 0:
        requests = [r for by in syncs[0].routes.sends.values() for rs in by.values() for r in rs]
        assert requests and all(r.wire == torch.bfloat16 and r.itemsize == 2 for r in requests)
        assert 0 < 2 * sent.bytes_sent == arrived.bytes_sent
    else:
        assert 0 < 2 * sent.bytes_received == arrived.bytes_received
    whole = loaded.state_dict()
    for sync, server in zip(syncs, servers):
        assert next(server.parameters()).dtype == torch.bfloat16
        state = server.state_dict()
        for target in sync.load_plan.targets:
            local = _local(state[target.name])
            expected = _planned_slices(target, local, whole[target.name])
            assert torch.equal(local.view(torch.int16), expected.view(torch.int16)), target.name


def _converted(rank, world, directory):
    """A source in the checkpoint's names (Qwen3-MoE's per-expert tensors, as save_pretrained
    writes them) into transformers' fused experts by its conversion mapping: every rank's
    tensors equal load_into's from that checkpoint, in full precision and quantized (int8):
    the fused experts' sources travel in full precision, quantized on arrival once fused, the
    other Linear layers' boxes quantized on the wire."""
    import glob

    import lazyload
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    source = {k: v for f in sorted(glob.glob(f"{directory}/*.safetensors")) for k, v in load_file(f).items()}
    assert not any("gate_up_proj" in k for k in source)  # per-expert names: the mapping fuses them
    mesh = init_device_mesh("cpu", (world,))
    for quantize in (None, lazyload.Quantization("int8", group_size=8, torchao=False)):  # whole groups at TP 4
        with torch.device("meta"):
            server, loaded = _model(config=config), _model(config=config)
        report = lazyload.WeightSync(source=source if rank < 2 else None, target=server, target_mesh=mesh, plan="ep",
                                     quantize=quantize)()
        lazyload.LazyCheckpoint(directory).load_into(loaded, mesh=mesh, plan="ep", quantize=quantize)
        _check_same_bits(server.state_dict(), loaded.state_dict())
        state = server.state_dict()
        on_wire = sum(_local(state[n]).nbytes + _local(state[n + "_scale"]).nbytes for n in state
                      if n + "_scale" in state and ".experts." not in n)
        assert any(".experts." in n and n + "_scale" in state for n in state) == (quantize is not None)
        assert rank < 2 or report.quantized_on_wire == on_wire  # ranks 2-3 receive every box


def _uneven(rank, world):
    """FSDP2 shards of uneven sizes (3 rows over 4 ranks: one rank holds none) into a plain
    module every rank holds whole (plan={}): every rank gets every byte once."""
    import lazyload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    trainer = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 6))
    full = {n: t.detach().clone() for n, t in trainer.state_dict().items()}
    fully_shard(trainer, mesh=mesh)
    with torch.device("meta"):
        server = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 6))
    report = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh, plan={})()
    assert all(torch.equal(t, full[n]) for n, t in server.state_dict().items())
    assert report.bytes_received + report.bytes_local == sum(t.nbytes for t in full.values())


def _recast(rank, world):
    """A source cast after planning (float32 -> bfloat16, the same shapes): the next sync
    fails on every rank (each message would carry bf16 bytes into float32 slots), naming the
    tensor and both dtypes; the target keeps the last sync's weights, and a source cast back
    syncs again."""
    import lazyload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    fully_shard(trainer, mesh=mesh)
    with torch.device("meta"):
        server = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh, plan={}, rank_timeout=30)
    sync()
    before = {n: t.clone() for n, t in server.state_dict().items()}
    trainer.to(torch.bfloat16)
    with pytest.raises(lazyload.SyncError) as caught:
        sync()
    assert "'0.weight'" in str(caught.value) and "bfloat16" in str(caught.value) and "float32" in str(caught.value)
    assert all(torch.equal(t, before[n]) for n, t in server.state_dict().items())
    trainer.to(torch.float32)  # the values rounded to bfloat16 on the way
    sync()
    now = {n: t.full_tensor() for n, t in trainer.state_dict().items()}
    assert all(torch.equal(t, now[n]) and not torch.equal(t, before[n]) for n, t in server.state_dict().items())


def _replica_groups(rank, world):
    """One WeightSync per replica group: trainer ranks 0-1 (FSDP2) serve replica 2 over the
    group [0, 1, 2] and replica 3 over [0, 1, 3]; the trainers construct both, each server
    its own. Each group's store keys and tags are its own: both replicas exact, twice."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    roles = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    replicas = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replica", "tp"))
    groups = {2: dist.new_group([0, 1, 2]), 3: dist.new_group([0, 1, 3])}
    trainer = _trainer(roles["x"]) if rank < 2 else None
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1) if trainer is not None else None
    import lazyload

    syncs = {r: lazyload.WeightSync(source=trainer, target=_meta_server() if rank == r else None,
                                    target_mesh=replicas["tp"] if rank == r else None, group=groups[r],
                                    rank_timeout=60)
             for r in (2, 3) if rank in (0, 1, r)}
    for _ in range(2):
        for r, sync in syncs.items():
            report = sync()
            _check_exact_all(sync, trainer, sync.target, report)
        if trainer is not None:
            _step(trainer, optimizer)


def _store_size(rank, world):
    """The store holds as many keys after 200 syncs (a failed one among them) as after the
    third: each sync's keys are deleted two syncs later."""
    import lazyload
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_store

    mesh, store = init_device_mesh("cpu", (world,)), _get_default_store()
    with torch.device("meta"):
        target = torch.nn.Linear(4, 8, bias=False)
    sync = lazyload.WeightSync(source={"weight": torch.arange(32.0).reshape(8, 4)} if rank == 0 else None,
                               target=target, target_mesh=mesh, plan={}, rank_timeout=30)
    sizes = []
    for n in range(1, 201):
        if n == 100 and rank == 1:
            with pytest.raises(lazyload.SyncError):  # rank 1's own transfer fails once
                _failing_once(sync)
        elif n == 100:
            with pytest.raises(lazyload.SyncError):
                sync()
        else:
            sync()
        dist.barrier()
        if n in (3, 10, 200):
            sizes.append(store.num_keys())
        dist.barrier()
    assert torch.equal(target.weight, torch.arange(32.0).reshape(8, 4))
    assert sizes[0] == sizes[1] == sizes[2], sizes


def _failing_once(sync):
    import lazyload.sync.transfer as transfer

    def failing(works, ends, what):
        raise RuntimeError("injected: a rank fails its sync")
    transfer.wait_polling, original = failing, transfer.wait_polling
    try:
        sync()
    finally:
        transfer.wait_polling = original


def _digests_differ(rank, world):
    """A rank that derives another sync plan from the exchanged requests (stood in for by a
    patched digest on rank 3): every rank fails at construction naming rank 3, no byte moved."""
    import dataclasses

    import lazyload
    import lazyload.sync.weight_sync as weight_sync
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        target = torch.nn.Linear(4, 8, bias=False)
    routes_for = weight_sync.routes_for
    if rank == 3:
        weight_sync.routes_for = lambda *args: dataclasses.replace(routes_for(*args), digest="0" * 16)
    try:
        with pytest.raises(lazyload.RankFailedError) as caught:
            lazyload.WeightSync(source={"weight": torch.ones(8, 4)} if rank == 0 else None, target=target,
                                target_mesh=mesh, plan={}, rank_timeout=30)
    finally:
        weight_sync.routes_for = routes_for
    assert list(caught.value.ranks) == [3] and "same lazyload version" in str(caught.value)
    assert target.weight.is_meta


def _budgets(rank, world):
    """Rank 0's state dict into a TP-4 server on every rank: rank 0 sends to three target
    ranks (and copies its own slices). Under max_host_bytes, in every step each rank packs
    (summed over the targets it sends to) and receives at most its budget, as routed and as
    allocated. Then a budget under the largest items, smaller on rank 0 than on the others:
    those items are cut to rank 0's, and every sync lands exact. A budget of 0 is refused."""
    import lazyload
    import lazyload.sync.transfer as transfer
    from lazyload.sync.routes import packed_offsets
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    source = _model().state_dict() if rank == 0 else None
    server = _meta_server()
    with pytest.raises(lazyload.LazyLoadError) as caught:  # a budget that is not a positive integer, on rank 1
        lazyload.WeightSync(source=source, target=server, target_mesh=mesh, max_host_bytes=0 if rank == 1 else None,
                            rank_timeout=30)
    assert isinstance(caught.value, lazyload.ArgumentError if rank == 1 else lazyload.RankFailedError), caught.value
    assert rank != 1 or "max_host_bytes must be a positive integer" in str(caught.value)
    assert all(t.is_meta for t in server.state_dict().values())
    at, allocated, step, buffer = [0], {}, transfer._step, transfer.message_buffer

    def stepping(routes, ends, moved, number):
        at[0] = number
        return step(routes, ends, moved, number)

    def allocating(nbytes, ends):
        allocated[at[0]] = allocated.get(at[0], 0) + nbytes
        return buffer(nbytes, ends)
    transfer._step, transfer.message_buffer = stepping, allocating
    try:
        for budget, cut in ((40_000, None), (6_000 if rank == 0 else 10_000, 6_000)):
            sync = lazyload.WeightSync(source=source, target=server, target_mesh=mesh, max_host_bytes=budget,
                                       rank_timeout=60)
            for _ in range(2):
                if rank == 0:
                    with torch.no_grad():
                        for tensor in source.values():
                            tensor.mul_(-1)
                allocated.clear()
                sync()
                full = [source]
                dist.broadcast_object_list(full, src=0)
                _check_exact(sync, server, full[0])
                assert max(allocated.values()) <= budget, (budget, allocated)
            packed = [sum(packed_offsets([(sync.index[r.key].dtype, r.box) for r in requests])[1]
                          for requests in by_target.values()) for by_target in sync.routes.sends.values()]
            assert max(packed, default=0) <= budget, (budget, packed)
            if rank == 0 and cut is None:
                assert max(map(len, sync.routes.sends.values())) == 3  # a step sends to every other rank
            if cut is not None:  # items cut to the sender's budget, from tensors larger than it
                assert max(item.nbytes for item in sync.items) <= cut
                assert max(math.prod(t.local_shape) * 4 for t in sync.load_plan.targets) > 2 * cut
    finally:
        transfer._step, transfer.message_buffer = step, buffer


def _half_rows(full: dict, half: int) -> list:
    """(name, box) of every tensor: matrices' rows split in two (this half's), vectors whole:
    what a TP-2 engine's weight loaders might copy."""
    boxes = []
    for name, tensor in full.items():
        rows = tensor.shape[0] // 2 if tensor.dim() == 2 else 0
        box = [(half * rows, (half + 1) * rows)] if rows else [(0, tensor.shape[0])]
        boxes.append((name, tuple(box + [(0, n) for n in tensor.shape[1:]])))
    return boxes


def _trainer_and_own_group(rank, world, prefix):
    """(trainer, its optimizer, group, store): an FSDP2 trainer on ranks 0-1 (None on 2-3),
    and a `ProcessGroupGloo` of their own over a store of its own (`prefix`), numbered
    otherwise (the engine first), as vLLM's workers and a trainer make it."""
    from datetime import timedelta

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_store

    roles = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = _trainer(roles["x"]) if rank < 2 else None
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1) if trainer is not None else None
    store = dist.PrefixStore(prefix, _get_default_store())
    return trainer, optimizer, dist.ProcessGroupGloo(store, (rank + 2) % world, world, timedelta(seconds=60)), store


def _own_group(rank, world):
    """An engine's workers (ranks 2-3, as BoxTargets) and an FSDP2 trainer (ranks 0-1) meet in
    a process group of their own, as vLLM's workers and a trainer do: `ProcessGroupGloo` over
    a store of its own, numbered otherwise (the engine first). Each worker receives exactly
    its boxes of the trainer's weights, twice, an optimizer step between."""
    import lazyload
    from lazyload.sync.box_target import BoxTarget

    trainer, optimizer, own, store = _trainer_and_own_group(rank, world, "own-group")
    full = _shared_full(trainer)
    boxes = _half_rows(full, rank - 2) if rank >= 2 else None
    sync = lazyload.WeightSync(source=trainer, target=BoxTarget(boxes) if boxes else None, group=own, store=store,
                               rank_timeout=60)
    assert sync.ranks == [0, 1, 2, 3] and sync.rank == (rank + 2) % world
    for _ in range(2):
        report = sync()
        full = _shared_full(trainer)
        if boxes:
            for name, box in boxes:
                assert torch.equal(sync.target.received(name, box), full[name][tuple(slice(a, b) for a, b in box)]), name
            assert report.bytes_received == sum(math.prod(b - a for a, b in box) * 4 for _, box in boxes)
        if trainer is not None:
            _step(trainer, optimizer)


def _own_group_channel(rank, world):
    """`_own_group` into an engine that stores its projections quantized per channel in
    compressed-tensors' FP8 layout (`BoxTarget(quantized=)`): each worker asks for its half
    of each weight (column-parallel rows; row-parallel o_proj and down_proj: columns, every
    row) and the scales of those rows, and receives the FP8 data and scales the library
    writes from the trainer's float32 weights (`quant.channel`, compared with the library
    in test_sync_channel.py), quantized by the trainer from whole rows (a row-parallel half
    gets its row's scale): the 8-bit bytes alone travel, twice, an optimizer step between."""
    import lazyload
    from lazyload.quant.channel import quantize_rows
    from lazyload.sync.box_target import BoxTarget

    trainer, optimizer, own, store = _trainer_and_own_group(rank, world, "own-group-channel")
    full = _shared_full(trainer)
    boxes = _channel_boxes(full, rank - 2) if rank >= 2 else None
    target = BoxTarget(boxes, quantized=torch.float8_e4m3fn) if boxes else None
    sync = lazyload.WeightSync(source=trainer, target=target, group=own, store=store, rank_timeout=60)
    for _ in range(2):
        report = sync()
        full = _shared_full(trainer)
        if boxes:
            quantized, plain = 0, 0
            for name, box in boxes:
                received = target.received(name, box)
                rows, cols = (slice(a, b) for a, b in box) if len(box) == 2 else (slice(*box[0]), None)
                if name.endswith("_proj.weight"):
                    data, _ = quantize_rows(full[name][rows], torch.float8_e4m3fn)
                    assert received.dtype == torch.float8_e4m3fn and torch.equal(received.view(torch.uint8),
                                                                                  data[:, cols].view(torch.uint8)), name
                    quantized += received.numel()
                elif name.endswith("_proj.weight_scale"):
                    _, scale = quantize_rows(full[name[:-len("_scale")]][rows], torch.float8_e4m3fn)
                    assert torch.equal(received, scale), name
                    quantized += received.nbytes
                else:
                    assert torch.equal(received, full[name][tuple(slice(a, b) for a, b in box)]), name
                    plain += received.nbytes
            assert report.quantized_on_wire == quantized and report.bytes_received == quantized + plain
        if trainer is not None:
            _step(trainer, optimizer)


def _channel_boxes(full: dict, half: int) -> list:
    """A TP-2 engine's boxes of a Llama stored quantized per channel: each projection's half
    (rows; columns of o_proj and down_proj) with the scales of its rows, the rest as
    `_half_rows` asks for them."""
    boxes = []
    for name, box in _half_rows(full, half):
        if name.endswith("_proj.weight"):
            rows, cols = full[name].shape
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                box = ((0, rows), (half * cols // 2, (half + 1) * cols // 2))
            boxes += [(name, box), (name + "_scale", (box[0], (0, 1)))]
        else:
            boxes.append((name, box))
    return boxes


def _copies(rank, world):
    """A 2-D trainer (FSDP 2 x TP 2: its norms and embeddings replicated over TP) into servers
    on the same ranks, 2 replicas of TP 2, then 4 of TP 1: at each step each target rank
    receives from the fewest source ranks that hold its boxes, and target ranks asking for
    a replicated box over the wire get it from different holders (where that takes no more
    sources); every sync exact."""
    import lazyload
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    trainer = _trainer(mesh["dp"], mesh["tp"])
    # TP 1 in one step: every holder of a box is a source of that step, free to spread
    for replicas, budget in ((2, None), (4, 1 << 30)):
        servers = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replica", "tp"))
        server = _meta_server()
        sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=servers["tp"], rank_timeout=60,
                                   max_host_bytes=budget)
        _check_fewest_sources(sync)
        _check_spread(sync, world)
        _check_exact_all(sync, trainer, server, sync())


def _holders(sync, key) -> frozenset:
    """The source ranks holding the box of the piece stored as `key` (its copies)."""
    piece = sync.pieces[key]
    return frozenset(p.rank for p in sync.pieces.values() if (p.name, p.held.box) == (piece.name, piece.held.box))


def _check_fewest_sources(sync):
    """At each step this rank receives from as few source ranks as can hold its boxes
    (found by trying every set of the other source ranks)."""
    from itertools import combinations

    others = sorted({p.rank for p in sync.pieces.values()} - {sync.rank})
    for step in range(sync.routes.steps):
        received = sync.routes.receives.get(step, {})
        needed = [_holders(sync, sync.items[p].entry.key) for positions in received.values() for p in positions]
        fewest = min(n for n in range(len(others) + 1) for ranks in combinations(others, n)
                     if all(h & set(ranks) for h in needed))
        assert len(received) == fewest, (sync.rank, step, sorted(received), fewest)


def _check_spread(sync, world):
    """Each replicated box is sent by as many of its holders as there are target ranks that
    receive it over the wire (up to its holders): not all from one copy."""
    rows = []
    for by_source in sync.routes.receives.values():
        for source, positions in by_source.items():
            for key in (sync.items[p].entry.key for p in positions):
                piece = sync.pieces[key]
                rows.append((piece.name, piece.held.box, source, _holders(sync, key), sync.rank))
    every = [None] * world
    dist.all_gather_object(every, rows)
    senders, targets, holders = {}, {}, {}
    for name, box, source, held, target in (row for rows in every for row in rows):
        senders.setdefault((name, box), set()).add(source)
        targets.setdefault((name, box), set()).add(target)
        holders[name, box] = held
    assert any(len(h) > 1 for h in holders.values())  # the case has copies
    for box, held in holders.items():
        assert len(senders[box]) == min(len(held), len(targets[box])), (box, sorted(senders[box]), sorted(held))


def _run_case(case, rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    if isinstance(case, tuple) and case[0] == "converted":
        _converted(rank, world, case[1])
    elif isinstance(case, tuple):
        _quantized(rank, case[2], case[1], loaded=case[0] == "loaded-quantized")
    elif case == "trainer-server":
        _trainer_server(rank)
    elif case == "moe-ep":  # Qwen3-MoE, its experts split whole over the server ranks
        _trainer_server(rank, "qwen3_moe", plan="ep")
    elif case == "colocated":
        _colocated(rank)
    elif case == "2d":  # trainer TP 2 x FSDP 2 into server TP 4, colocated
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _two_syncs(_trainer(mesh["dp"], mesh["tp"]), _meta_server(), init_device_mesh("cpu", (4,)))
    elif case == "fault":
        _fault(rank)
    else:
        _WHOLE_JOB_CASES[case](rank, world)


# cases that take the rank and the job's world, by name
_WHOLE_JOB_CASES = {"uneven": _uneven, "renamed": _renamed_state_dict, "mismatched": _mismatched, "recast": _recast,
                    "replica-groups": _replica_groups, "digests-differ": _digests_differ, "store-size": _store_size,
                    "own-group": _own_group, "own-group-channel": _own_group_channel, "copies": _copies,
                    "budgets": _budgets, "nccl-retry": _nccl_retry, "blocks-cut": _blocks_cut}


def test_sync(tmp_path):
    moe, _ = write_checkpoint("qwen3_moe", torch.float32, tmp_path / "moe", num_hidden_layers=2)
    cases = ["trainer-server", "colocated", "2d", "moe-ep", ("converted", str(moe)),
             *[("quantized", dtype, str(tmp_path)) for dtype in ("int8", "int8-rows", "fp8", "fp8-block")],
             *[("loaded-quantized", dtype, str(tmp_path)) for dtype in ("int8", "fp8-block")],
             "uneven", "renamed", "mismatched", "fault", "nccl-retry", "recast", "replica-groups", "store-size",
             "digests-differ", "own-group", "own-group-channel", "copies", "budgets", "blocks-cut"]
    spawn_cases(4, cases, tmp_path, _run_case)


def _two_d_sources() -> dict:
    """A 2-D trainer's layouts (rank 2 * dp + tp): `w` split over TP and FSDP, every rank a
    quarter; `norm` split over FSDP alone, each half on both TP ranks (copies)."""
    from lazyload.sync.layout import Held, SourceTensor

    def held(*box):
        return (Held(box, (0,) * len(box)),)
    def layout(dp, tp):
        row = 4 * tp + 2 * dp
        return [SourceTensor("w", "torch.float32", (8, 4), held((row, row + 2), (0, 4))),
                SourceTensor("norm", "torch.float32", (4,), held((2 * dp, 2 * dp + 2)))]
    return {2 * dp + tp: layout(dp, tp) for dp in (0, 1) for tp in (0, 1)}


def test_copies_chosen_per_target():
    """The copy of a replicated box each target rank receives: its own; else one of the
    sources its step receives from anyway; else the fewest new ones; target ranks asking
    for the same box spread over its holders. The planner's pick (`Layout.expr`, by
    position) is the starting point: target rank 1 of 2 gets the norm's copies from ranks
    1 and 2, where ranks 1 and 3 (its TP coordinate's, which send its `w` rows) hold both."""
    from lazyload.expr import full_box
    from lazyload.sync.copies import choose_copies
    from lazyload.sync.routes import Request
    from lazyload.sync.source_index import source_index

    index, pieces = source_index(_two_d_sources())

    def wanted(tp, world, names=("w", "norm")):
        """The requests of target `tp` of a TP-`world` server, the copies as the planner picks them."""
        rows = (8 // world * tp, 8 // world * (tp + 1))
        keys = [k for name in names for k in index.for_rank(tp, world).expr(name).keys()]
        return [Request(0, pieces[k].rank, k, full_box([b - a for a, b in pieces[k].held.box]), 4) for k in keys
                if pieces[k].name == "norm" or rows[0] <= pieces[k].held.box[0][0] < rows[1]]

    def sources(requests):
        return sorted({r.source for r in requests})

    def norms(chosen):
        return {t: [r.source for r in requests if pieces[r.key].name == "norm"] for t, requests in chosen.items()}

    planner = wanted(1, 2)
    assert sources(planner) == [1, 2, 3]  # the position's pick: one source more than needed
    # two replicas of TP 2 (ranks 4-5, 6-7); colocated ranks 0 and 3 (a TP-2 server)
    chosen = choose_copies({4: wanted(0, 2), 5: planner, 6: wanted(0, 2), 7: wanted(1, 2), 10: None}, pieces)
    assert chosen[10] is None
    assert all(pieces[r.key].rank == r.source for t in (4, 5, 6, 7) for r in chosen[t])  # each names its copy's key
    assert sources(chosen[4]) == sources(chosen[6]) == [0, 2] and sources(chosen[5]) == sources(chosen[7]) == [1, 3]
    assert norms(choose_copies({0: wanted(0, 2), 3: wanted(1, 2)}, pieces)) == {0: [0, 2], 3: [1, 3]}  # own copy
    # two replicas of TP 1 receive from every rank: they spread over the copies
    assert norms(choose_copies({8: wanted(0, 1), 9: wanted(0, 1)}, pieces)) == {8: [0, 2], 9: [1, 3]}
    # a step of norms alone: the fewest sources (one per half), spread over the replicas
    assert norms(choose_copies({t: wanted(0, 1, ("norm",)) for t in (8, 9)}, pieces)) == {8: [0, 2], 9: [1, 3]}


def test_sync_tags_never_repeat():
    """A WeightSync's tags: the same while syncs complete (nothing left pending), a fresh one
    after each failure, never one a failure used before nor another construction's, all in
    gloo's 31-bit range; past the block, a SyncError asks for a new WeightSync."""
    import lazyload
    from lazyload.sync.weight_sync import _TAGS_EACH, sync_tag

    for construction in (1, 2, 40_000):
        tags = [sync_tag(construction, failures) for failures in range(_TAGS_EACH)]
        assert len(set(tags)) == _TAGS_EACH and 0 <= min(tags) and max(tags) < 2 ** 31
        assert not set(tags) & {sync_tag(construction + 1, f) for f in range(0, _TAGS_EACH, 97)}
    with pytest.raises(lazyload.SyncError, match="construct a new WeightSync"):
        sync_tag(1, _TAGS_EACH)


def _dies(rank):
    """Trainer rank 1 dies in the middle of a sync: every other rank raises a SyncError
    naming it (within about rank_timeout), each server rank's report saying what is new."""
    import os

    import lazyload
    import lazyload.sync.transfer as transfer
    from datetime import timedelta
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _get_default_store

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "x"))
    trainer = _trainer(mesh["x"]) if rank < 2 else None
    server = _meta_server() if rank >= 2 else None
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh["x"] if server else None,
                               rank_timeout=5, max_host_bytes=40_000)
    sync()
    if rank == 1:
        pack, calls = transfer._pack, []

        def dying(requests, ends):
            calls.append(1)
            if len(calls) == 3:
                os._exit(0)  # no error, no goodbye: the process is gone
            return pack(requests, ends)
        transfer._pack = dying
    with pytest.raises(lazyload.SyncError) as caught:
        sync()
    assert 1 in caught.value.ranks, caught.value
    if server is not None:
        assert len(caught.value.report.partial) < len(sync.load_plan.targets)


def _dying_worker(rank, world, init_file, errors):
    """gloo's worker for a job one of whose ranks dies: no barrier after the case."""
    import os
    import traceback

    from gloo import end_rank

    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _dies(rank)
    except Exception:
        errors.put((rank, "dies", traceback.format_exc()))
        raise
    end_rank()


@pytest.mark.slow
def test_sync_rank_dies(tmp_path):
    from gloo import spawn_collecting

    spawn_collecting(_dying_worker, (4, str(tmp_path / "pg")), 4, timeout=300)


def test_cut_items_land_exact():
    """An item larger than the sync's step budget is cut into parts that fill the destination
    exactly as the whole item does: a transposed item (its source's dim 0 lands on the
    quantized input dim) on whole scale groups, a plain one on any row. A budget under one
    group is a PlanError saying how much to allow."""
    import lazyload
    from lazyload.headers import TensorEntry
    from lazyload.placer import TensorDest
    from lazyload.plan import ReadItem
    from lazyload.quant.onload import Grid, QuantizedDest
    from lazyload.sync.split import cut_item

    torch.manual_seed(0)
    source = torch.randn(96, 8)  # stored [in, out], transposed into an [out, in] weight
    item = ReadItem(TensorEntry("rank 0", "w@0.0", torch.float32, (96, 8), 0, source.nbytes), ((0, 96), (0, 8)),
                    (("transpose", 0, 1),), "w", ((0, 8), (0, 96)))

    def placed(dest, items):
        for part in items:
            dest.place(part, source[tuple(slice(a, b) for a, b in part.src_box)])
        return dest

    def quantized():
        return QuantizedDest(torch.zeros(8, 96, dtype=torch.int8), torch.zeros(8, 3), 32)

    parts = cut_item(item, 1100, Grid(32))  # 34 rows of 32 bytes fit: cut at 32, one scale group each
    assert [(p.src_box[0], p.dst_box[1]) for p in parts] == [((0, 32), (0, 32)), ((32, 64), (32, 64)),
                                                               ((64, 96), (64, 96))]
    whole, cut = placed(quantized(), [item]), placed(quantized(), parts)
    assert torch.equal(whole.data, cut.data) and torch.equal(whole.scale, cut.scale)
    plain = cut_item(item, 1100)  # full precision: 34 rows a part
    assert [p.src_box[0] for p in plain] == [(0, 34), (34, 68), (68, 96)]
    assert torch.equal(placed(TensorDest(torch.zeros(8, 96)), plain).tensor, source.T)
    with pytest.raises(lazyload.PlanError, match="at least 1024"):
        cut_item(item, 1000, Grid(32))


def test_quantized_on_the_wire_lands_as_on_arrival():
    """A box quantized by its source (`QuantizedWire.pack`) and copied in by its target
    (`place`) leaves the target's 8-bit data and scales bit-equal to the box quantized on
    arrival (`QuantizedDest.place`), in the bytes `nbytes` says, after a box before it in the
    message: groups of an [out, in] weight (a short last group), FP8 128 x 128 blocks, and
    transposed experts [E, in, out] (input dim -2)."""
    from lazyload.expr import full_box
    from lazyload.headers import TensorEntry
    from lazyload.plan import ReadItem
    from lazyload.quant.onload import QuantizedDest, scale_shape
    from lazyload.sync.routes import packed_offsets
    from lazyload.sync.wire import QuantizedWire

    torch.manual_seed(0)
    cases = [(torch.int8, (6, 80), 32, -1, 1, ((2, 6), (32, 80))),  # columns 32:80, the last group short
             (torch.float8_e4m3fn, (256, 384), 128, -1, 128, ((128, 256), (128, 384))),
             (torch.int8, (3, 64, 10), 32, -2, 1, ((1, 3), (32, 64), (0, 10)))]
    for dtype, shape, group, axis, rows, box in cases:
        values = torch.randn(shape)[tuple(slice(a, b) for a, b in box)] * 3
        item = ReadItem(TensorEntry("rank 0", "w@0.0", torch.float32, shape, 0, 0), full_box(values.shape), (), "w",
                        box)

        def dest():
            return QuantizedDest(torch.zeros(shape, dtype=dtype), torch.zeros(scale_shape(shape, group, axis, rows)),
                                 group, axis, False, rows)
        arrived, received = dest(), dest()
        arrived.place(item, values)
        wire = QuantizedWire(dtype, group, axis, rows)
        (_, at), nbytes = packed_offsets([(torch.bfloat16, ((0, 3),)), (wire, box)])  # after 6 bytes: aligned to 4
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        wire.pack(buffer, at, box, values)
        wire.place(buffer, at, box, received, box)
        assert at == 8 and nbytes == at + wire.nbytes(box)
        assert torch.equal(received.data.view(torch.uint8), arrived.data.view(torch.uint8)), dtype
        assert torch.equal(received.scale, arrived.scale) and received.scale.count_nonzero() > 0


def test_steps_within_every_budget():
    """The sync's steps, process-free: a target rank's requests come in windows of at most
    its budget, as its messages pack them (a bfloat16 box of odd length before a float32 one
    takes 2 bytes of alignment); each target assigns its steps from its own requests and its
    sources' slots alone, its own order kept, a step holding part of one window (so at most
    its budget) and, summed over the targets it serves, at most each source's budget (shared
    by `source_slots`; by default about one layer of what it sends). A request over its
    source's budget is a PlanError."""
    import lazyload
    from lazyload.headers import TensorEntry
    from lazyload.plan import ReadItem
    from lazyload.sync.layout import Held
    from lazyload.sync.routes import (Request, Slot, default_slots, largest_requests, own_steps, packed_offsets,
                                      requests_of, source_slots)
    from lazyload.sync.source_index import Piece

    dtypes = {2: torch.bfloat16, 4: torch.float32}
    pieces = {}

    def item(source, layer, rows, dtype):
        key = f"model.layers.{layer}.w{rows}@{source}.0"
        pieces[key] = Piece(source, key.partition("@")[0], Held(((0, rows), (0, 3)), (0, 0)))
        entry = TensorEntry(f"rank {source}", key, dtype, (rows, 3), 0, rows * 3 * dtype.itemsize)
        return ReadItem(entry, ((0, rows), (0, 3)), (), key, ((0, rows), (0, 3)))

    def packed(requests):  # (source, target) -> the bytes of their message
        out = {}
        for target, r in requests:
            out.setdefault((r.source, target), []).append((dtypes[r.itemsize], r.box))
        return {pair: packed_offsets(specs)[1] for pair, specs in out.items()}

    # ranks 0-1 send to 2-4; rank 2 also copies boxes of its own (colocated)
    budgets = {0: 700, 1: None, 2: 800, 3: 600, 4: 1000}
    wanted = {t: requests_of([item(source, layer, rows + t, dtype) for layer in range(4) for source, rows, dtype in
                              ((0, 33, torch.bfloat16), (1, 40, torch.float32), (0, 10, torch.float32),
                               (t if t == 2 else 1, 7, torch.bfloat16))], pieces, budgets[t]) for t in (2, 3, 4)}
    for target in (2, 3, 4):
        windows = {r.step for r in wanted[target]}
        assert len(windows) > 1
        for window in windows:
            assert sum(packed([(target, r) for r in wanted[target] if r.step == window]).values()) <= budgets[target]
    shared = source_slots({t: largest_requests(t, wanted[t])[0] for t in (2, 3, 4)}, budgets[0])  # rank 0's
    assert all(max(s.each, s.turn) >= largest_requests(t, wanted[t])[0] for t, s in shared.items())
    stepped = {t: own_steps(t, wanted[t], {**default_slots(t, wanted[t]), 0: shared[t]}) for t in (2, 3, 4)}
    window = {(t, r.key): r.step for t in (2, 3, 4) for r in wanted[t]}
    sent_by_1 = {layer: sum(r.nbytes for t in (2, 3, 4) for r in wanted[t] if r.source == 1
                            and r.key.startswith(f"model.layers.{layer}.")) for layer in range(4)}
    steps = max(r.step for t in (2, 3, 4) for r in stepped[t]) + 1
    for step in range(steps):
        now = [(t, r) for t in (2, 3, 4) for r in stepped[t] if r.step == step]
        sizes = packed(now)
        assert sum(n for (s, t), n in sizes.items() if s == 0) <= budgets[0]
        assert sum(n for (s, t), n in sizes.items() if s == 1) <= max(sent_by_1.values())  # rank 1's default
        for target in (2, 3, 4):  # one window a step
            assert len({window[target, r.key] for t, r in now if t == target}) <= 1
    assert len({t for t, r in stepped_at(stepped, 0) if r.source == 0}) == 3  # rank 0 serves all three at once
    for target in (2, 3, 4):
        assert [(r.key, r.box) for r in stepped[target]] == [(r.key, r.box) for r in wanted[target]]
    assert steps > max(r.step for t in (2, 3, 4) for r in wanted[t]) + 1  # rank 0's budget binds
    # 3 bfloat16 then 1 float32: 6 + 4 bytes, but 12 packed in one message (aligned): over a budget of 10
    for needs, budget in (({5: 1, 6: 1}, 100), ({5: 90, 6: 10, 7: 1}, 100), ({5: 30, 6: 30, 7: 30}, 100),
                          ({5: 100, 6: 3}, 100)):  # a source's slots: within its budget in every step
        slots = source_slots(needs, budget)
        assert all(sum(s.budget(step) for s in slots.values()) <= budget for step in range(2 * len(needs)))
        assert all(max(s.budget(step) for step in range(len(needs))) >= needs[t] for t, s in slots.items())
    tight = own_steps(2, [Request(0, 0, "a@0.0", ((0, 3),), 2), Request(0, 0, "b@0.0", ((0, 1),), 4)], {0: Slot(10)})
    assert [r.step for r in tight] == [0, 1]
    with pytest.raises(lazyload.PlanError, match="exceeds rank 0's step budget"):
        own_steps(2, [Request(0, 0, "c@0.0", ((0, 100),), 4)], {0: Slot(200)})


def stepped_at(stepped: dict, step: int) -> list:
    """(target, request) of every target's requests at `step`."""
    return [(t, r) for t, requests in stepped.items() for r in requests if r.step == step]


def test_box_target_over_a_group_of_its_own():
    """A one-process group of its own (no init_process_group): WeightSync needs its store; a
    BoxTarget receives exactly its boxes (copied locally here), a box larger than
    max_host_bytes cut; a box no source holds, or outside the source's shape, is an error
    naming the tensor before any byte moves."""
    from datetime import timedelta

    import lazyload
    from lazyload.sync.box_target import BoxTarget

    def group_of_its_own():
        store = dist.HashStore()
        return dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30)), store

    source = {"w": torch.arange(24.0).reshape(6, 4), "b": torch.arange(6.0)}
    group, store = group_of_its_own()
    with pytest.raises(lazyload.ArgumentError, match="store="):
        lazyload.WeightSync(source=source, target=BoxTarget([("w", ((0, 3), (0, 4)))]), group=group)
    target = BoxTarget([("w", ((2, 5), (1, 3))), ("b", ((0, 6),)), ("w", ((2, 5), (1, 3)))])
    sync = lazyload.WeightSync(source=source, target=target, group=group, store=store, rank_timeout=30)
    report = sync()
    assert torch.equal(target.received("w", ((2, 5), (1, 3))), source["w"][2:5, 1:3])
    assert torch.equal(target.received("w", ((3, 4), (2, 3))), source["w"][3:4, 2:3])  # inside a box asked for
    assert torch.equal(target.received("b", ((0, 6),)), source["b"])
    assert report.bytes_local == (6 + 6) * 4 and report.tensors == 2
    source["w"].add_(1)
    sync()
    assert torch.equal(target.received("w", ((2, 5), (1, 3))), source["w"][2:5, 1:3])
    with pytest.raises(lazyload.ArgumentError, match="'w' box"):
        target.received("w", ((0, 1), (0, 4)))
    group, store = group_of_its_own()  # a box of 24 bytes under max_host_bytes=16: cut into rows of 2 and 1
    cut = BoxTarget([("w", ((2, 5), (1, 3)))])
    sync = lazyload.WeightSync(source=source, target=cut, group=group, store=store, rank_timeout=30,
                               max_host_bytes=16)
    assert [item.src_box[0] for item in sync.items] == [(2, 4), (4, 5)]
    assert sync().bytes_local == 24 and torch.equal(cut.received("w", ((2, 5), (1, 3))), source["w"][2:5, 1:3])
    for boxes, message in (([("nope", ((0, 1),))], "'nope', which no source rank holds"),
                           ([("w", ((0, 7), (0, 4)))], r"box \[\(0, 7\), \(0, 4\)\] of 'w'")):
        group, store = group_of_its_own()
        with pytest.raises(lazyload.ArgumentError, match=message):
            lazyload.WeightSync(source=source, target=BoxTarget(boxes), group=group, store=store, rank_timeout=30)
