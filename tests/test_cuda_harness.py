"""The engine's CUDA branch on a machine without a GPU: real loads run through `CudaCopies`
with CUDA's streams, events and runtime replaced by stand-ins (`StandInGPU`), the
destination on the CPU, and come out bit for bit as the CPU load does, for every kind of
item. The stand-ins keep CUDA's semantics where ordering bugs live: a copy from pinned
memory is only queued (it completes when an event recorded after it, or its stream, is
synchronized, and its source must not change or be freed before that); an event never
recorded waits for nothing; `synchronize()` of an event made without `blocking=True` spins;
a refused `cudaHostRegister` leaves the thread's last error set; timing events measure
what ran on their stream between them (1 ns per byte copied)."""
from __future__ import annotations

import contextlib
import threading
from collections import deque

import pytest
import torch

from checkpoints import build_model, copy_checkpoint
from lazyload import LazyCheckpoint, Quantization, ReadError
from lazyload import planner as loader
from lazyload import engine
from lazyload.readers import pread

GROUP = 16
LLAMA = dict(hidden_size=96, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2)


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


class Stream:
    """A stream: work runs in order, and only when something waits for it."""

    def __init__(self, gpu: "StandInGPU"):
        self.gpu, self.ops, self.seq, self.clock = gpu, deque(), 0, 0

    def enqueue(self, op) -> int:
        with self.gpu.lock:
            self.seq += 1
            self.ops.append((self.seq, op))
            return self.seq

    def run_until(self, seq: int) -> None:
        with self.gpu.lock:
            while self.ops and self.ops[0][0] <= seq:
                self.ops.popleft()[1]()

    def synchronize(self) -> None:
        self.run_until(self.seq)

    def wait_event(self, event: "Event") -> None:
        if event.stream is not None:  # an event never recorded: nothing to wait for
            stream, seq = event.stream, event.seq
            self.enqueue(lambda: stream.run_until(seq))


class Event:
    def __init__(self, gpu: "StandInGPU", enable_timing=False, blocking=False, interprocess=False):
        self.gpu, self.timing, self.blocking = gpu, enable_timing, blocking
        self.stream, self.seq, self.clock = None, 0, None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or self.gpu.current()
        self.stream, self.clock = stream, None
        self.seq = stream.enqueue(lambda: setattr(self, "clock", stream.clock))

    def synchronize(self) -> None:
        if not self.blocking:
            self.gpu.problems.append("an event without blocking=True was synchronized (a spinning wait)")
        if self.stream is not None:
            self.stream.run_until(self.seq)

    def elapsed_time(self, end: "Event") -> float:
        if not (self.timing and end.timing) or self.clock is None or end.clock is None:
            raise RuntimeError("elapsed_time of events not made with enable_timing, or not completed")
        return (end.clock - self.clock) / 1e6  # ms: 1 ns per byte


class StandInGPU:
    """torch.cuda's streams, events, cudart and the engine's non-blocking copies, on the CPU."""

    def __init__(self, refuse_pinning: bool = False):
        self.lock = threading.RLock()
        self.local = threading.local()
        self.default = Stream(self)
        self.refuse = refuse_pinning
        self.registered: dict[int, int] = {}
        self.last_error: dict[int, int] = {}  # thread -> cudaGetLastError's value
        self.in_flight: list[tuple[int, int]] = []  # (address, bytes) of sources of copies not completed
        self.problems: list[str] = []
        self.copies: list[tuple[int, bool]] = []  # (bytes, from pinned memory)
        self.staged_ranges = 0

    # torch.cuda
    def current(self) -> Stream:
        stack = getattr(self.local, "streams", None)
        return stack[-1] if stack else self.default

    @contextlib.contextmanager
    def use(self, stream: Stream):
        self.local.streams = getattr(self.local, "streams", []) + [stream]
        try:
            yield
        finally:
            self.local.streams = self.local.streams[:-1]

    # cudart
    def cudaHostRegister(self, ptr, size, flags):
        if self.refuse:
            self.last_error[threading.get_ident()] = 2
            return 2
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        return 0 if self.registered.pop(ptr, None) is not None else 1

    def cudaGetLastError(self):
        return self.last_error.pop(threading.get_ident(), 0)

    def pinned(self, tensor: torch.Tensor) -> bool:
        p = tensor.data_ptr()
        return any(a <= p and p + tensor.nbytes <= a + n for a, n in self.registered.items())

    def copy(self, original, dst, src, non_blocking=False):
        """Tensor.copy_: a non-blocking copy on a side stream is queued; the bytes land at once
        (later work on the stream may read them), but the source is read until completion."""
        stream = self.current()
        if not non_blocking or stream is self.default:
            return original(dst, src, non_blocking)
        pinned = self.pinned(src)
        with self.lock:
            self.copies.append((src.nbytes, pinned))
        original(dst, src)
        if not pinned:  # CUDA stages pageable memory before returning: nothing left to read
            stream.enqueue(lambda: setattr(stream, "clock", stream.clock + src.nbytes))
            return dst
        source, snapshot = (src.data_ptr(), src.nbytes), raw_bytes(src)
        with self.lock:
            self.in_flight.append(source)

        def complete():
            if not torch.equal(raw_bytes(src), snapshot):
                self.problems.append("a source changed before its copy completed")
            self.in_flight.remove(source)
            stream.clock += src.nbytes

        stream.enqueue(complete)
        return dst

    def freeing(self, view: torch.Tensor) -> None:
        lo, hi = view.data_ptr(), view.data_ptr() + view.nbytes
        with self.lock:
            if any(a < hi and lo < a + n for a, n in self.in_flight):
                self.problems.append("a staging range was freed while a copy from it was in flight")


@pytest.fixture
def gpu(monkeypatch):
    """Install a StandInGPU; the engine's CUDA branch then runs for CPU destinations."""
    def install(refuse_pinning=False):
        gpu = StandInGPU(refuse_pinning)
        monkeypatch.setattr(engine, "uses_cuda", lambda device: True)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: Stream(gpu))
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: Event(gpu, **kw))
        monkeypatch.setattr(torch.cuda, "stream", gpu.use)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.current())
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "cudart", lambda: gpu)
        monkeypatch.setattr(pread, "loaded_cudart", lambda: gpu)
        original = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False:
                            gpu.copy(original, dst, src, non_blocking))
        alloc, free = pread.Arena.alloc, pread.Arena.free

        def counted_alloc(arena, n):
            gpu.staged_ranges += 1
            return alloc(arena, n)

        def checked_free(arena, view):
            gpu.freeing(view)
            gpu.staged_ranges -= 1
            free(arena, view)

        monkeypatch.setattr(pread.Arena, "alloc", counted_alloc)
        monkeypatch.setattr(pread.Arena, "free", checked_free)
        return gpu
    return install


def assert_clean(gpu: StandInGPU) -> None:
    assert gpu.problems == []
    assert not gpu.in_flight and gpu.staged_ranges == 0 and gpu.registered == {}
    assert not any(gpu.last_error.values()), "a refused registration left CUDA's last error set"


def state_bytes(model) -> dict[str, tuple]:
    return {n: (t.dtype, tuple(t.shape), raw_bytes(t)) for n, t in model.state_dict().items()}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name][:2] == want[name][:2] and torch.equal(got[name][2], want[name][2]), name


# --------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama", "bf16", **LLAMA)


@pytest.fixture(scope="module")
def fp8(llama, tmp_path_factory):
    from quant_checkpoints import write_fp8_checkpoint

    return str(write_fp8_checkpoint(llama[0], tmp_path_factory.mktemp("fp8"), block=(GROUP, GROUP))), llama[1]


@pytest.fixture(scope="module")
def compressed(llama, tmp_path_factory):
    from quant_checkpoints import write_compressed_checkpoint

    return str(write_compressed_checkpoint(llama[0], tmp_path_factory.mktemp("ct"), "int", "channel")), llama[1]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    from test_sweep import sweep

    directory = tmp_path_factory.mktemp("whole")
    assert sweep.sweep_one("inkling2_text", "Inkling2TextModel", str(directory))["outcome"] == "exact"
    return str(directory / "Inkling2TextModel")


def whole_model(directory):
    import transformers

    config = transformers.Inkling2TextModel.config_class.from_pretrained(directory)
    with torch.device("meta"):
        return transformers.Inkling2TextModel._from_config(config, dtype=torch.float32).eval()


CASES = {  # name: (checkpoint fixture, model dtype, load_into keywords)
    "plain": ("llama", torch.bfloat16, dict(reader="pread")),
    "cast": ("llama", torch.float16, dict(reader="pread", dtype=torch.float16)),
    "mmap": ("llama", torch.bfloat16, dict(reader="mmap", release_pages=True)),
    "mmap cast": ("llama", torch.float16, dict(reader="mmap", dtype=torch.float16)),
    "fp8 dequantized": ("fp8", torch.bfloat16, dict(reader="pread")),
    "fp8 dequantized mmap": ("fp8", torch.bfloat16, dict(reader="mmap")),
    "fp8 kept": ("fp8", torch.bfloat16, dict(reader="pread", quantize=Quantization("fp8", torchao=False))),
    "fp8 requantized int8": ("fp8", torch.bfloat16,
                             dict(reader="pread", quantize=Quantization("int8", GROUP, torchao=False))),
    "compressed-tensors": ("compressed", torch.bfloat16, dict(reader="pread")),
    # lazyload's own holders (int8 / fp8 data and scales), whose bytes the CPU and CUDA loads compare
    "int8 on load": ("llama", torch.float32, dict(reader="pread", quantize=Quantization("int8", GROUP, torchao=False))),
    "fp8 on load": ("llama", torch.float32, dict(reader="mmap", quantize=Quantization("fp8", GROUP, torchao=False))),
    "rank 1 of 2": ("llama", torch.float16, dict(reader="pread", dtype=torch.float16, rank=1, world=2)),
    "rank 1 of 2 fp8": ("fp8", torch.bfloat16, dict(reader="pread", rank=1, world=2)),
}


def load(directory, config, dtype, kw) -> dict:
    kw = dict(kw)
    rank, world = kw.pop("rank", 0), kw.pop("world", 1)
    model = build_model("llama", config, dtype)
    report = LazyCheckpoint(directory).load_into(model, rank, world, progress=False, **kw)
    return state_bytes(model), report


@pytest.mark.parametrize("case", list(CASES))
def test_every_kind_of_item_through_the_cuda_branch_is_the_cpu_load(case, gpu, request):
    fixture, dtype, kw = CASES[case]
    directory, config = request.getfixturevalue(fixture)
    want, _ = load(directory, config, dtype, kw)
    standin = gpu()
    got, report = load(directory, config, dtype, kw)
    assert_same(got, want)
    assert_clean(standin)
    assert report.h2d_bytes == sum(n for n, _ in standin.copies) > 0
    assert all(pinned for _, pinned in standin.copies), "a pageable source was copied to the device"
    # The copies alone were timed (1 ns per byte on the stand-in): no other thread's work.
    assert report.h2d_seconds == pytest.approx(report.h2d_bytes * 1e-9, rel=1e-9)


def test_staging_that_cannot_be_pinned_goes_through_bounce_buffers(llama, gpu):
    directory, config = llama
    want, _ = load(directory, config, torch.float16, dict(reader="pread", dtype=torch.float16))
    standin = gpu(refuse_pinning=True)
    got, report = load(directory, config, torch.float16, dict(reader="pread", dtype=torch.float16))
    assert_same(got, want)
    assert_clean(standin)  # the refused registrations' errors were cleared
    assert report.pinned_bytes == 0 and report.h2d_bytes == sum(n for n, _ in standin.copies)


def test_pinned_bytes_count_the_bounce_buffers(llama, gpu):
    directory, config = llama
    standin = gpu()
    _, report = load(directory, config, torch.bfloat16, dict(reader="mmap", release_pages=True))
    bounce = 2 * engine.BOUNCE_BYTES  # a pinned bounce buffer per worker that copied pageable pages
    assert report.pinned_bytes >= bounce and report.pinned_bytes % bounce == 0
    assert_clean(standin)


def test_a_whole_tensor_conversion_through_the_cuda_branch(whole, gpu):
    want = whole_model(whole)
    LazyCheckpoint(whole).load_into(want, reader="pread", progress=False)
    standin = gpu()
    model = whole_model(whole)
    report = LazyCheckpoint(whole).load_into(model, reader="pread", progress=False)
    assert report.read_whole
    assert_same(state_bytes(model), state_bytes(want))
    assert_clean(standin)


def test_a_remote_checkpoint_through_the_cuda_branch(llama, gpu, tmp_path):
    from remote_servers import RangeServer

    directory, config = llama
    copy_checkpoint(directory, tmp_path / "root" / "ckpt")
    want, _ = load(directory, config, torch.float16, dict(dtype=torch.float16))
    with RangeServer(str(tmp_path / "root")) as server:
        standin = gpu()
        got, report = load(server.url + "/ckpt/", config, torch.float16, dict(dtype=torch.float16))
    assert report.reader == "remote"
    assert_same(got, want)
    assert_clean(standin)


# --------------------------------------------------------------------------- failures

@pytest.mark.parametrize("reader", ["pread", "mmap"])
def test_a_raise_after_the_copy_is_queued_frees_no_staging_in_flight(llama, gpu, monkeypatch, reader):
    """A cast that fails on the GPU (out of memory) after its item's copy was queued: the
    staging is freed only once that copy is done; the load is a ReadError naming the real
    model's tensors it left half written."""
    directory, config = llama
    failing = "model.layers.1.mlp.down_proj.weight"
    place = engine.copy_into

    def copy_into(dest, item, source):
        if item.target == failing:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        place(dest, item, source)

    standin = gpu()
    monkeypatch.setattr(engine, "copy_into", copy_into)
    model = build_model("llama", config, torch.float16, empty=None)  # real: filled in place
    with pytest.raises(ReadError, match=r"RuntimeError: CUDA out of memory.*down_proj") as info:
        LazyCheckpoint(directory).load_into(model, reader=reader, dtype=torch.float16, max_host_bytes=1 << 20,
                                            progress=False)
    assert isinstance(info.value.__cause__.__cause__, RuntimeError)  # the engine's error, then the cast's
    assert failing in info.value.partly_written and failing in info.value.not_loaded
    assert_clean(standin)


def test_a_failure_making_the_copies_unpins_the_staging(llama, gpu, monkeypatch):
    directory, config = llama
    standin = gpu()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: (_ for _ in ()).throw(
        RuntimeError("CUDA error: out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        load(directory, config, torch.float16, dict(reader="pread", dtype=torch.float16))
    assert standin.registered == {}


# --------------------------------------------------------------------------- devices and memory

def test_the_device_is_current_before_anything_is_allocated_on_it(llama, monkeypatch):
    """A first allocation on cuda:1 initialises CUDA and leaves device 0 current; the device
    must be made current before `initial_values` / `meta_buffers_to_recompute` allocate."""
    directory, config = llama
    state = {"current": 0, "initialized": False}
    seen = {}

    def set_device(device):
        state.update(current=torch.device(device).index, initialized=True)

    for name, value in dict(is_available=lambda: True, device_count=lambda: 2, is_initialized=lambda: state[
            "initialized"], current_device=lambda: state["current"], set_device=set_device).items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setenv("LOCAL_RANK", "1")

    class Stop(Exception):
        pass

    def allocating(name, real, stop):
        def call(*args, **kwargs):
            seen[name] = state["current"]
            state["initialized"] = True  # as torch.empty(device="cuda:1") does, restoring device 0
            if stop:
                raise Stop
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(loader, "initial_values", allocating("initial_values", loader.initial_values, False))
    monkeypatch.setattr(loader, "meta_buffers_to_recompute", allocating("buffers", None, True))
    with pytest.raises(Stop):
        LazyCheckpoint(directory).load_into(build_model("llama", config, torch.bfloat16), progress=False)
    assert seen == {"initial_values": 1, "buffers": 1}
    assert torch.cuda.current_device() == 1  # a second load_into(device=None) stays on cuda:1


def test_gpu_destinations_take_no_host_memory_from_the_page_cache_budget(llama, monkeypatch):
    """must_release_pages gets the destination's bytes only when they live in host memory."""
    directory, config = llama
    passed = []

    class Stop(Exception):
        pass

    def recording(items, dest_bytes, world):
        passed.append(dest_bytes)
        raise Stop  # nothing more is needed from the load

    monkeypatch.setattr(loader, "must_release_pages", recording)
    for device in ("cpu", "meta"):  # meta: a device other than the host's memory, as a GPU is
        with pytest.raises(Stop):
            LazyCheckpoint(directory).load_into(build_model("llama", config, torch.bfloat16), device=device,
                                                progress=False)
    assert passed[0] == 2 * sum(p.numel() for p in build_model("llama", config, torch.bfloat16).parameters())
    assert passed[1] == 0


def test_quantize_on_a_gpu_steps_through_the_gpu_chunk():
    """1 MiB chunks would make quantizing on a GPU launch-bound (~12 kernels a MiB)."""
    from lazyload.quant.dequant import CPU_CHUNK, GPU_CHUNK
    from lazyload.quant.onload import chunk_rows

    assert chunk_rows(torch.device("cuda", 1), 1024) == GPU_CHUNK // 1024
    assert chunk_rows(torch.device("cpu"), 1024) == CPU_CHUNK // 1024
    assert chunk_rows(torch.device("cuda", 0), GPU_CHUNK * 2) == 1
