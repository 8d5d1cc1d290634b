"""A load that cannot fit its device fails before any byte is read (lazyload/fit.py): a
PlanError naming the bytes needed and available, where that number comes from, the largest
replicated tensors and what would fit, from `load_into` and from `lazyload plan`. Never the
kernel's OOM killer.

The real probe runs in a real memory cgroup (a spawned process joins one whose limit is
below the load's destination); the CUDA probe runs on the CPU with torch.cuda's device
queries standing in, as tests/test_gpu_path.py does."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch

from checkpoints import build_model
from test_streaming import MiB, _make_memory_cgroup, digests, in_fresh_process

from lazyload import LazyCheckpoint, PlanError
from lazyload import fit
from lazyload.cli import main
from lazyload.planner import LoadOptions, plan_load

# ~6.3M parameters: 12.6 MB of bf16 files, a 25 MB float32 destination
LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4)


@pytest.fixture(scope="module")
def llama(checkpoint):
    directory, config = checkpoint("llama", "bf16", **LLAMA)
    return str(directory), config


def destination_bytes(config) -> int:
    return sum(p.numel() * 4 for p in build_model("llama", config, torch.float32).parameters())


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------- a real memory cgroup

def _load_in_cgroup(directory, config, limit_file, procs, tight, generous, scratch):
    """Runs in a spawned process: join a cgroup of `tight` bytes, where the float32 load is
    refused; then raise it to `generous` and load."""
    from lazyload.system import memory_available

    checkpoint = LazyCheckpoint(directory)
    checkpoint.index  # headers read before joining
    model = build_model("llama", config, torch.float32)
    with open(limit_file, "w") as f:
        f.write(str(tight))
    with open(procs, "w") as f:  # charged from here on: what the plan allocates
        f.write(str(os.getpid()))
    out = {}
    try:
        checkpoint.load_into(model, dtype=torch.float32)
    except PlanError as exc:
        out["error"] = str(exc)
    out["on_meta"] = all(p.is_meta for p in model.parameters())
    with open(limit_file, "w") as f:
        f.write(str(generous))
    report = checkpoint.load_into(model, dtype=torch.float32)
    out.update(ok=report.ok, digests=digests(model))
    # page cache charged to the cgroup is reclaimable: not counted as used
    with open(scratch, "wb") as f:
        f.write(os.urandom(32 * MiB))
        f.flush()
        os.fsync(f.fileno())
    with open(limit_file.replace("limit_in_bytes", "usage_in_bytes").replace("memory.max", "memory.current")) as f:
        out["usage"] = int(f.read())
    out["room"] = memory_available()[0]
    return out


def test_a_load_larger_than_its_memory_cgroup_is_refused_before_any_byte(llama, tmp_path):
    directory, config = llama
    dest = destination_bytes(config)
    tight, generous = dest // 2, 4 * dest + 128 * MiB
    cgroup, procs = _make_memory_cgroup(generous)
    limit_file = os.path.join(cgroup, "memory.max" if os.path.exists(os.path.join(cgroup, "memory.max"))
                              else "memory.limit_in_bytes")
    try:
        r = in_fresh_process(_load_in_cgroup, directory, config, limit_file, procs, tight, generous,
                             str(tmp_path / "scratch"), start_method="spawn")
    finally:
        os.rmdir(cgroup)  # its process has exited
    error = r.get("error")
    assert error is not None, "the load was not refused"
    assert r["on_meta"], "the refused load changed the model"
    assert error.startswith("rank 0 of 1 cannot load on this host: it needs ")
    needed = int(error.split("it needs ")[1].split(" bytes")[0].replace(",", ""))
    assert dest < needed < dest + 16 * MiB  # the destination and about a layer of staging
    source = re.search(rf"the memory cgroup {re.escape(cgroup)}: {os.path.basename(limit_file)} ([\d,]+) less", error)
    assert source is not None and tight - 4096 <= int(source.group(1).replace(",", "")) <= tight  # in pages
    assert "Largest tensors whole: lm_head.weight 4.0 MiB, model.embed_tokens.weight 4.0 MiB" in error
    assert re.search(r"What fits here, planned for rank 0: world \d+ \(rank 0: ", error)
    # with room to spare the same load works, as it does outside the cgroup
    assert r["ok"]
    reference = build_model("llama", config, torch.float32)
    LazyCheckpoint(directory).load_into(reference, dtype=torch.float32)
    assert r["digests"] == digests(reference)
    assert r["usage"] > 32 * MiB and r["room"] > generous - r["usage"] + 16 * MiB


def test_lazyload_plan_refuses_what_load_into_refuses(llama, monkeypatch):
    """`lazyload plan` checks each rank as the load would on this host: the same error, on
    stderr, exit status 2; with room, the plan."""
    directory, config = llama
    monkeypatch.setattr(fit, "capacity", lambda device: fit.Capacity(destination_bytes(config), "the test's host"))
    with pytest.raises(PlanError) as raised:
        LazyCheckpoint(directory).load_into(build_model("llama", config, torch.float32), dtype=torch.float32)
    rc, out, err = cli("plan", directory, "--world", "1", "--dtype", "float32")
    assert (rc, out, err) == (2, "", f"lazyload: error: {raised.value}\n")
    rc, out, err = cli("plan", directory, "--world", "4", "--dtype", "float32")
    assert rc == 0 and out.startswith(f"{directory}: world 4")


# --------------------------------------------------------------------- the message

@pytest.fixture(scope="module")
def mixtral(checkpoint):
    return checkpoint("mixtral", "fp32")


def _available(monkeypatch, available: int, source: str = "the test's host") -> None:
    monkeypatch.setattr(fit, "capacity", lambda device: fit.Capacity(available, source))


def test_the_message_names_the_bytes_the_replicated_experts_and_the_plan_that_fits(mixtral, monkeypatch):
    """At world 2, a plan that leaves a MoE model's experts whole on every rank (transformers
    5.25's TP plan as it is, named in plan= so that 5.24's, which splits them, does too);
    plan="ep" splits them, and fits where it does not: the error says so, with both byte counts."""
    directory, config = mixtral
    checkpoint = LazyCheckpoint(str(directory))
    whole = {"layers.*.mlp.experts.gate_up_proj": "replicate", "layers.*.mlp.experts.down_proj": "replicate"}
    options = LoadOptions(plan=whole, reader="pread", shards_only=True)  # pread: no views, every byte allocated
    tp = plan_load(checkpoint, build_model("mixtral", config, torch.float32), 0, 2, options, preview=True)
    ep = plan_load(checkpoint, build_model("mixtral", config, torch.float32), 0, 2,
                   LoadOptions(plan="ep", reader="pread", shards_only=True), preview=True)
    local = lambda plan: sum(torch.Size(t.local_shape).numel() * 4 for t in plan.targets)  # noqa: E731
    need_tp, need_ep = local(tp) + tp.budget, local(ep) + ep.budget
    assert need_ep < need_tp
    available = (need_ep + need_tp) // 2
    _available(monkeypatch, available)
    model = build_model("mixtral", config, torch.float32)
    with pytest.raises(PlanError) as raised:
        checkpoint.load_into(model, 0, 2, plan=whole, reader="pread", shards_only=True)
    message = str(raised.value)
    assert message.startswith(f"rank 0 of 2 cannot load on this host: it needs {need_tp:,} bytes")
    assert f"{available:,} are available (the test's host)" in message
    experts = sorted(((t.name, torch.Size(t.local_shape).numel() * 4) for t in tp.targets
                      if "experts" in t.name and t.local_shape == t.full_shape), key=lambda e: -e[1])
    assert experts, "the plan shards the experts: nothing to name"
    largest = message.split("Largest tensors replicated on every rank: ")[1].split(".")[0:4]
    assert experts[0][0].split(".")[0] in largest[0]
    from lazyload.report import size

    assert f"{experts[0][0]} {size(experts[0][1])}" in message
    assert f"What fits here, planned for rank 0: plan='ep' ({size(need_ep)})" in message
    assert "Nothing was read and the model is unchanged" in message
    assert all(p.is_meta for p in model.parameters())
    # what it suggests loads
    report = checkpoint.load_into(model, 0, 2, plan="ep", reader="pread", shards_only=True)
    assert report.ok


def test_quantizing_and_a_larger_world_are_offered_when_they_fit(checkpoint, monkeypatch):
    directory, config = checkpoint("llama", "fp32", hidden_size=128, intermediate_size=256)
    ckpt = LazyCheckpoint(str(directory))
    options = dict(reader="pread")
    full = plan_load(ckpt, build_model("llama", config, torch.float32), 0, 1, LoadOptions(**options), preview=True)
    need = sum(torch.Size(t.local_shape).numel() * 4 for t in full.targets) + full.budget
    _available(monkeypatch, need * 3 // 4)
    with pytest.raises(PlanError) as raised:
        ckpt.load_into(build_model("llama", config, torch.float32), **options)
    message = str(raised.value)
    assert "quantize='int8' (" in message.split("What fits here")[1]
    assert "world 2 (rank 0: " in message
    monkeypatch.setenv("LAZYLOAD_FIT_CHECK", "0")  # the user knows better
    assert ckpt.load_into(build_model("llama", config, torch.float32), **options).ok


def test_nothing_that_fits_is_said_so(llama, monkeypatch):
    directory, config = llama
    _available(monkeypatch, 1000)
    with pytest.raises(PlanError, match=r"Nothing tried fits here.*Planned, and too large: quantize='int8' \(14.1 MiB\), any world up to 64\."):
        LazyCheckpoint(directory).load_into(build_model("llama", config, torch.float32), dtype=torch.float32)


def test_views_of_the_file_mapping_and_the_models_own_tensors_take_nothing(llama, monkeypatch):
    """Same-dtype targets left as views of the mapping, and a real model filled in place,
    allocate nothing: a host that holds only the staging loads them."""
    directory, config = llama
    checkpoint = LazyCheckpoint(str(directory))
    planned = plan_load(checkpoint, build_model("llama", config, torch.bfloat16), preview=True)
    assert len(planned.views) == len(planned.targets)
    staged = plan_load(checkpoint, build_model("llama", config, torch.float32), preview=True,
                       options=LoadOptions(reader="pread"))
    assert staged.views == {} and staged.budget > 0
    _available(monkeypatch, staged.budget)
    assert checkpoint.load_into(build_model("llama", config, torch.bfloat16)).ok
    real = build_model("llama", config, torch.float32, empty=None)
    assert checkpoint.load_into(real, reader="pread").ok  # float32 in place: no views, nothing new
    with pytest.raises(PlanError, match="cannot load on this host"):
        checkpoint.load_into(build_model("llama", config, torch.float32), reader="pread")


def test_a_preview_keeps_views_only_where_the_load_would(llama, monkeypatch):
    """`lazyload plan` plans without this host's probes: under a memory cgroup smaller than
    the files the load releases pages and keeps no views, so the preview counts them as
    copies, as the load's own plan does."""
    import lazyload.readers.choice as choice

    directory, config = llama
    checkpoint = LazyCheckpoint(directory)
    plan = lambda preview: plan_load(checkpoint, build_model("llama", config, torch.bfloat16),  # noqa: E731
                                     preview=preview)
    everything = sum(p.numel() * 2 for p in build_model("llama", config, torch.bfloat16).parameters())
    assert fit.need(plan(True), preview=True).destination == fit.need(plan(False)).destination == 0
    monkeypatch.setattr(choice, "memory_limit", lambda: 1 * MiB)
    preview, load = plan(True), plan(False)
    assert preview.views and not load.views  # the preview alone does not know
    assert fit.need(preview, preview=True).destination == fit.need(load).destination == everything


# --------------------------------------------------------------------- a GPU

def test_a_gpu_destination_is_measured_against_its_free_memory(llama, monkeypatch):
    """On a GPU the destinations are checked against `torch.cuda.mem_get_info` (and what
    torch's allocator caches unused), the staging against the host."""
    directory, config = llama
    dest = destination_bytes(config)
    state = {"free": dest}
    for name, value in dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                            is_initialized=lambda: True, set_device=lambda device: None,
                            mem_get_info=lambda device=None: (state["free"], 80 << 30),
                            memory_reserved=lambda device=None: 3000, memory_allocated=lambda device=None: 1000
                            ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    model = build_model("llama", config, torch.float32, empty=None)  # real on the CPU: moved, so allocated
    checkpoint = LazyCheckpoint(directory)
    plan = plan_load(checkpoint, model, options=LoadOptions(device="cuda:0"))
    wanted, short = fit.shortfalls(plan)
    assert wanted.destination == dest and short == []  # dest fits in free + 2000 cached
    state["free"] = dest - 2001
    wanted, short = fit.shortfalls(plan)
    assert [(s.where, s.needed, s.capacity.available) for s in short] == [("cuda:0", dest, dest - 1)]
    assert "torch.cuda.mem_get_info(cuda:0) free + 2,000 cached unused by torch" == short[0].capacity.source
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(PlanError, match=r"rank 0 of 1 cannot load on cuda:0: it needs [\d,]+ bytes .*"
                                        r"destinations .*torch.cuda.mem_get_info\(cuda:0\)"):
        checkpoint.load_into(model, device="cuda:0")
    assert all(torch.equal(before[n], p) and p.device.type == "cpu" for n, p in model.state_dict().items())
    state["free"] = 80 << 30  # the GPU has room; the host is too small for the staging alone
    _available_host = fit.capacity
    monkeypatch.setattr(fit, "capacity", lambda device: fit.Capacity(plan.budget - 1, "host") if device.type == "cpu"
                        else _available_host(device))
    wanted, short = fit.shortfalls(plan)
    assert [(s.where, s.needed) for s in short] == [("this host", plan.budget)]
