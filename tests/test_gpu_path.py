"""The GPU path, on a machine without one: what can be shown on the CPU. Staging ranges are
aligned for any dtype (every item of a CUDA load is staged); the device a load targets is
concrete and follows this process's GPU (LOCAL_RANK, CUDA_VISIBLE_DEVICES, the current
device; `torch.cuda` patched), warns when CUDA's default device 0 disagrees with LOCAL_RANK,
and an explicit other device never becomes current; worker threads set it; staging is
pinned with CUDA and unpinned after; 128x128 blocks are quantized whole chunks at a time;
benchmarks/gpu_check.py runs its CPU halves without pytest or hypothesis, and says so when
there is no CUDA. The GPU halves are gpu_check.py's, on a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checkpoints import build_model, meta_tensors, mixed_meta_model, shard_files, write_mixed_checkpoint
from lazyload import DeviceError, LazyCheckpoint, LazyLoadError
from lazyload import engine
from lazyload.devices import target_device, use_device
from lazyload.readers import Arena
from lazyload.readers.pread import ALIGN

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_mixed_checkpoint(tmp_path_factory.mktemp("mixed"))


def file_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in shard_files(directory):
        with safe_open(str(path), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def assert_equals_files(model, directory):
    """Each tensor bitwise the checkpoint's (safetensors' own read), cast to the model's dtype."""
    assert not meta_tensors(model)
    files = file_tensors(directory)
    state = model.state_dict()
    assert sorted(state) == sorted(files)
    for name, tensor in state.items():
        want = files[name].to(tensor.dtype)
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


# --------------------------------------------------------------------------- staging


def test_staging_ranges_start_aligned_whatever_came_before():
    arena = Arena(4096)
    odd = arena.alloc(174)  # a bf16 tensor of 87 elements
    after = arena.alloc(8)
    assert after.data_ptr() % ALIGN == 0 and odd.data_ptr() % ALIGN == 0
    after.view(torch.float64)  # "storage_offset() must be divisible by 8" before alignment
    arena.free(odd)
    again = arena.alloc(3)
    assert again.data_ptr() == odd.data_ptr()  # first fit: the freed front range is reused
    assert arena.pinned_bytes == 0


def test_staging_never_overlaps_and_fits_any_read_when_empty():
    import random

    rng = random.Random(0)
    arena = Arena(1000)
    held: list[torch.Tensor] = []
    for _ in range(500):
        if held and (rng.random() < 0.5 or arena._find(1) is None):
            arena.free(held.pop(rng.randrange(len(held))))
            continue
        n = rng.randint(1, 300)
        if arena._find(n) is None:
            continue
        view = arena.alloc(n)
        start = view.data_ptr() - arena.buffer.data_ptr()
        assert start % ALIGN == 0 and start + n <= arena.size
        for other in held:
            lo = other.data_ptr() - arena.buffer.data_ptr()
            assert start + n <= lo or lo + other.numel() <= start, "ranges overlap"
        held.append(view)
    for view in held:
        arena.free(view)
    assert arena.alloc(1000).numel() == 1000


def test_mixed_dtypes_with_odd_sizes_load_when_every_item_is_staged(mixed):
    directory, config = mixed
    model = build_model("llama", config, torch.float16)  # a cast: no item lands directly
    LazyCheckpoint(str(directory)).load_into(model, dtype=torch.float16, reader="pread", max_host_bytes=1 << 20,
                                             progress=False)
    assert_equals_files(model, directory)


def test_a_staged_load_without_cast_is_bitwise_the_files(mixed, monkeypatch):
    """What a CUDA destination does (it stages every item), on the CPU."""
    directory, config = mixed
    threads = {}
    monkeypatch.setattr(engine, "direct_target", lambda dest, item: None)
    monkeypatch.setattr(engine, "use_device_in_thread", lambda device: threads.setdefault(threading.get_ident(), device))
    model = mixed_meta_model(config)
    report = LazyCheckpoint(str(directory)).load_into(model, reader="pread", max_host_bytes=1 << 20, progress=False)
    assert_equals_files(model, directory)
    assert {model.get_parameter("model.norm.weight").dtype, model.get_parameter("lm_head.weight").dtype,
            model.get_parameter("model.embed_tokens.weight").dtype} == {torch.float32, torch.float16, torch.bfloat16}
    assert report.pinned_bytes == 0 and report.h2d_bytes == 0  # nothing pinned for a CPU destination
    # The read pool ran its initializer in every worker thread.
    assert threads and set(threads.values()) == {torch.device("cpu")}


# --------------------------------------------------------------------------- pinning


class FakeCudart:
    """torch.cuda.cudart() on a machine without CUDA: records registrations."""

    def __init__(self, code: int = 0):
        self.code = code
        self.live: dict[int, int] = {}
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        if self.code == 0:
            self.live[ptr] = size
        return self.code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0 if self.live.pop(ptr, None) is not None else 1


def test_pinned_staging_is_exactly_the_budget_and_released_on_close(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    arena = Arena(123_457, pin=True)
    assert arena.pinned_bytes == 123_457
    (_, ptr, size, _), = cudart.calls
    assert (ptr, size) == (arena.buffer.data_ptr(), 123_457) and ptr % os.sysconf("SC_PAGE_SIZE") == 0
    arena.close()
    assert cudart.live == {} and arena.pinned_bytes == 0
    arena.close()  # once only
    assert len(cudart.calls) == 2


def test_staging_that_cannot_be_pinned_stays_pageable(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(code=2))
    arena = Arena(4096, pin=True)
    assert arena.pinned_bytes == 0
    assert "could not pin" in caplog.text
    arena.close()


# --------------------------------------------------------------------------- devices


@pytest.fixture
def fake_cuda(monkeypatch):
    """Patch torch.cuda into a machine with `count` GPUs; returns a setter and the
    devices `set_device` was called with."""
    state = {"count": 0, "current": 0, "initialized": False}
    set_calls: list[torch.device] = []

    def set_device(device):
        set_calls.append(torch.device(device))
        state["initialized"] = True

    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["count"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for name in ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def machine(count, current=0, initialized=False, **env):
        state.update(count=count, current=current, initialized=initialized)
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
    return machine, set_calls


def meta_linear():
    with torch.device("meta"):
        return torch.nn.Linear(4, 4)


def test_cuda_without_index_is_the_current_device(fake_cuda):
    machine, _ = fake_cuda
    machine(2, current=1, initialized=True)
    assert torch.device("cuda") != torch.device("cuda", 1)  # why it must be made concrete
    assert target_device("cuda", meta_linear()) == torch.device("cuda", 1)
    assert target_device("cuda:0", meta_linear()) == torch.device("cuda", 0)
    assert target_device(None, meta_linear()) == torch.device("cuda", 1)
    assert target_device("cpu", meta_linear()) == torch.device("cpu")
    real = torch.nn.Linear(4, 4)
    assert target_device(None, real) == torch.device("cpu")  # a real model's own device


def test_a_device_that_does_not_exist_is_a_device_error(fake_cuda):
    machine, _ = fake_cuda
    machine(2)
    with pytest.raises(DeviceError, match=r"cuda:2 does not exist: 2 CUDA devices visible.*'cuda:1'"):
        target_device("cuda:2", meta_linear())
    with pytest.raises(DeviceError, match="not a device"):
        target_device("gpu", meta_linear())


@pytest.mark.parametrize("count,env,expected", [
    (2, {"LOCAL_RANK": 1}, 1),                                # torchrun, a GPU per local rank
    (1, {"LOCAL_RANK": 3, "CUDA_VISIBLE_DEVICES": "3"}, 0),   # one GPU visible per process
    (4, {}, 0),                                               # a single process
])
def test_a_meta_model_goes_to_the_gpu_of_this_process(fake_cuda, count, env, expected):
    machine, set_calls = fake_cuda
    machine(count, **env)
    device = target_device(None, meta_linear())
    assert device == torch.device("cuda", expected)
    assert set_calls == []  # choosing changes nothing
    use_device(device)  # load_into, before any mesh is made: DeviceMesh then agrees
    assert set_calls == [device]
    use_device(torch.device("cuda", 0))  # chosen once: never overridden
    assert set_calls == [device]


def test_a_chosen_current_device_wins_over_local_rank(fake_cuda):
    machine, set_calls = fake_cuda
    machine(4, current=2, initialized=True, LOCAL_RANK=0)
    assert target_device(None, meta_linear()) == torch.device("cuda", 2)
    use_device(torch.device("cuda", 2))
    assert set_calls == []


def test_a_cuda_call_before_set_device_under_torchrun_is_not_silent(fake_cuda, monkeypatch, caplog):
    """torchrun's rank 1, whose script touched CUDA before set_device: device 0 is current.
    The load goes where DeviceMesh would put the rank (the current device), saying once
    that LOCAL_RANK disagrees and what to do; a current device other than 0 was chosen:
    no warning."""
    from lazyload import devices

    monkeypatch.setattr(devices, "_warned", set())
    machine, set_calls = fake_cuda
    machine(2, current=0, initialized=True, LOCAL_RANK=1)
    with caplog.at_level("WARNING", logger="lazyload"):
        assert target_device(None, meta_linear()) == torch.device("cuda", 0)
        assert target_device("cuda", meta_linear()) == torch.device("cuda", 0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "LOCAL_RANK=1" in warnings[0] and "torch.cuda.set_device(1)" in warnings[0]
    assert "device='cuda:1'" in warnings[0]
    caplog.clear()
    machine(4, current=3, initialized=True, LOCAL_RANK=1)
    assert target_device(None, meta_linear()) == torch.device("cuda", 3)
    machine(2, current=0, initialized=True, LOCAL_RANK=0)
    assert target_device(None, meta_linear()) == torch.device("cuda", 0)
    assert caplog.records == [] and set_calls == []


@pytest.mark.parametrize("env,requested,current", [
    ({}, "cuda:1", None),                     # one process asking for its second GPU: cuda:0 stays current
    ({"LOCAL_RANK": 0}, "cuda:1", None),      # a rank asking for another GPU than its own
    ({"LOCAL_RANK": 1}, "cuda:1", 1),         # the rank's own GPU: current, as DeviceMesh makes it
    ({"LOCAL_RANK": 1}, "cuda", 1),           # no index: the process's GPU
    ({}, None, 0),
])
def test_an_explicit_device_never_changes_the_current_one_behind_the_request(fake_cuda, env, requested, current):
    machine, set_calls = fake_cuda
    machine(2, **env)
    device = target_device(requested, meta_linear())
    use_device(device)
    assert set_calls == ([] if current is None else [torch.device("cuda", current)])


def test_without_local_rank_ranks_share_gpus_as_device_mesh_does(fake_cuda, monkeypatch):
    import torch.distributed as dist

    machine, _ = fake_cuda
    machine(4)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 6)  # srun / mpirun: rank 6, 4 GPUs a host
    assert target_device(None, meta_linear()) == torch.device("cuda", 2)


def test_a_local_rank_beyond_the_gpus_is_a_device_error(fake_cuda):
    machine, _ = fake_cuda
    machine(2, LOCAL_RANK=3, CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(DeviceError, match=r"LOCAL_RANK=3 .*2 CUDA devices visible \(CUDA_VISIBLE_DEVICES='0,1'\)"):
        target_device(None, meta_linear())


def test_cuda_asked_for_without_cuda_fails_before_reading(checkpoint):
    """This machine has no CUDA: device="cuda" is a LazyLoadError saying what to pass,
    raised before anything is read, the model untouched (no patching here)."""
    assert not torch.cuda.is_available()
    directory, config = checkpoint("llama")
    model = build_model("llama", config, torch.float32)
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(LazyLoadError, match="CUDA is not available.*Pass device='cpu'") as info:
            LazyCheckpoint(str(directory)).load_into(model, device=device, progress=False)
        assert isinstance(info.value, DeviceError)
    assert len(meta_tensors(model)) == len(list(model.parameters())) + len(list(model.buffers()))


# --------------------------------------------------------------------------- threads


def test_every_read_thread_sets_the_destination_device_first(monkeypatch):
    """CUDA's current device is per thread; a worker left on device 0 creates a context
    there when it leaves a stream context (a GPU-0 context for every rank)."""
    calls: dict[int, torch.device] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault(threading.get_ident(), d))
    device = torch.device("cuda", 1)
    barrier = threading.Barrier(4)

    def task():
        barrier.wait(timeout=30)  # four tasks on four distinct threads
        return calls.get(threading.get_ident())

    with engine.worker_pool(4, device) as pool:
        seen = [f.result() for f in [pool.submit(task) for _ in range(4)]]
    assert seen == [device] * 4
    calls.clear()
    with engine.worker_pool(2, torch.device("cpu")) as pool:
        pool.submit(lambda: None).result()
    assert calls == {}  # a CPU load leaves CUDA alone


# --------------------------------------------------------------------------- gpu_check


def gpu_check(tmp_path, *args) -> subprocess.CompletedProcess:
    """benchmarks/gpu_check.py in fresh processes (its children too) where pytest and
    hypothesis cannot be imported: the README's install has neither."""
    blocker = tmp_path / "no_test_packages"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules.update(pytest=None, hypothesis=None)\n")
    env = dict(os.environ, PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}", LAZYLOAD_PROGRESS="0")
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--work-dir",
                           str(tmp_path / "work"), *args], capture_output=True, text=True, env=env, timeout=600)


def test_gpu_check_without_cuda_says_so_and_exits_cleanly(tmp_path):
    proc = gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "no CUDA device here" in proc.stdout


def test_gpu_check_cpu_smoke_runs_its_cpu_halves(tmp_path):
    proc = gpu_check(tmp_path, "--cpu-smoke")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")][1:]  # the rows, not the header
    cases = {line.split("|")[1].strip() for line in table}
    assert {"reference", "race", "mixed dtypes", "mmap", "conversions", "in place", "dtensor", "device index",
            "one visible GPU", "pinned", "h2d", "fp8 checkpoint", "quantize", "whole conversion", "remote",
            "second load", "unpinned", "quantize speed", "quantize at size", "host memory", "local rank",
            "fp8 modules", "sync", "sync failures", "sync nccl"} <= cases, cases
    assert all("| FAIL |" not in line for line in table)
    ran = [line for line in table if "| PASS |" in line]
    for case in ("host memory", "local rank", "sync", "sync failures"):  # CPU halves that ran
        assert any(line.startswith(f"| {case} |") for line in ran), case


# --------------------------------------------------------------------------- quantize into 128x128 blocks


def test_blocks_are_quantized_whole_chunks_at_a_time_as_transformers_quantizes(monkeypatch):
    """`quantize_blocks_into` over chunks of several block-rows (and a last, shorter chunk)
    gives transformers' own Fp8Quantize bytes and scales; its operations per chunk do not
    grow with the block-rows in it (one launch each on a GPU, not one per 128 rows)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lazyload.quant import onload
    from test_fp8_quantize import transformers_quantized

    weight = (torch.randn(640, 384, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16)
    weight[128:256, :128] = 0  # an all-zero block: scale 1
    monkeypatch.setattr(onload, "CPU_CHUNK", 2 * 128 * 384)  # two block-rows a chunk: chunks of 2, 2, 1

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def quantize(rows):
        dest = onload.QuantizedDest(torch.empty(rows, 384, dtype=torch.float8_e4m3fn),
                                    torch.empty(rows // 128, 3), 128, rows=128)
        Count.ops = 0
        with Count():
            onload.quantize_blocks_into(dest, ((0, rows), (0, 384)), weight[:rows])
        return dest, Count.ops

    dest, _ = quantize(640)
    want, scale_inv = transformers_quantized(weight)
    assert torch.equal(dest.data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(dest.scale, scale_inv)
    assert quantize(128)[1] == quantize(256)[1]  # one chunk of one block-row, one chunk of two: the same ops
