"""The engine's CUDA branch on a machine without a GPU: real loads run through `CudaCopies`
with CUDA's streams, events, runtime and caching allocator replaced by stand-ins
(`StandInGPU`), the destination on the CPU, and come out bit for bit as the CPU load does,
for every kind of item.

The stand-in is asynchronous as a GPU is: each stream is a worker thread that runs what was
queued on it later, in order, after seeded random delays. A non-blocking copy from pinned
memory reads its source and writes its destination when the copy stream reaches it; the
engine's casts (`copy_into` on the cast stream) run when the cast stream reaches them, with
a scratch taken from that stream's pool when they were queued and given back at once, as
torch's temporaries are; `torch.empty` under a stream takes memory from that stream's pool
(reused as soon as the tensor is dropped, whatever other streams still queue on it); an event
completes when its stream reaches it; `synchronize` waits. A copy from pageable memory holds
the caller while CUDA stages it (after the stream's earlier work) and lands later. Scalar
division in queued work is CUDA's (`a * (1 / b)`, see `cuda_division`). Also kept: an event
never recorded waits for nothing; `synchronize()` of an event made without `blocking=True`
spins; a refused `cudaHostRegister` leaves the thread's last error set; timing events
measure what ran on their stream between them (1 ns per byte copied).

NCCL stands in on a gloo process group (`StandInNCCL`, installed by `nccl_over_gloo`) as
NCCL behaves: its operations run on a stream of their own, in the order posted; tags are
ignored (a peer's messages pair by order); `wait()` makes the caller's current stream wait
and returns at once, so completion is seen only through an event recorded after it; its
set-up blocks the host until every rank joins; `abort()` ends what is stuck on it. The
weight sync's gloo jobs run under it (tests/test_sync.py)."""
from __future__ import annotations

import contextlib
import logging
import math
import queue
import random
import threading
import time
import weakref

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
WAIT = 60  # seconds a stand-in wait may take before it is called a deadlock


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as another tensor object, which does not keep `tensor` alive (a
    queued kernel holds an address, not a reference: dropping the tensor frees the memory)."""
    return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), tensor.storage_offset(),
                                                   tensor.shape, tensor.stride())


class Mark:
    """A point in a stream's work, reached once everything queued before it has run."""

    def __init__(self):
        self.reached, self.clock = threading.Event(), None

    def reach(self, clock: int) -> None:
        self.clock = clock
        self.reached.set()

    def wait(self) -> None:
        if not self.reached.wait(WAIT):
            raise RuntimeError("stand-in GPU: a wait did not complete (deadlock)")


class Stream:
    """A stream: a worker thread runs what is queued, in order, each after a seeded random delay."""

    def __init__(self, gpu: "StandInGPU", index: int):
        self.gpu, self.clock, self.index = gpu, 0, index
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.rng = random.Random(gpu.seed * 1000 + index)
        self.worker = threading.Thread(target=self._run, name=f"stand-in stream {index}", daemon=True)
        self.worker.start()

    def _run(self) -> None:
        self.gpu.local.on_stream = True
        while (op := self.queue.get()) is not None:
            if self.rng.random() < self.gpu.delay_chance:
                time.sleep(self.rng.random() * self.gpu.max_delay)
            try:
                op()
            except BaseException as exc:  # a kernel that failed: the test sees it in `problems`
                self.gpu.problems.append(f"queued work failed on stream {self.index}: {exc!r}")

    def enqueue(self, op) -> None:
        self.queue.put(op)

    def mark(self) -> Mark:
        mark = Mark()
        self.enqueue(lambda: mark.reach(self.clock))
        return mark

    def synchronize(self) -> None:
        self.mark().wait()

    def wait_event(self, event: "Event") -> None:
        mark = event.mark  # the event's last record when this is called; never recorded: nothing
        if mark is not None:
            self.enqueue(mark.wait)


class Event:
    def __init__(self, gpu: "StandInGPU", enable_timing=False, blocking=False, interprocess=False):
        self.gpu, self.timing, self.blocking = gpu, enable_timing, blocking
        self.mark: Mark | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.mark = (stream or self.gpu.current()).mark()

    def query(self) -> bool:
        return self.mark is None or self.mark.reached.is_set()

    def synchronize(self) -> None:
        if not self.blocking:
            self.gpu.problems.append("an event without blocking=True was synchronized (a spinning wait)")
        if self.mark is not None:
            self.mark.wait()

    def elapsed_time(self, end: "Event") -> float:
        if not (self.timing and end.timing) or not (self.query() and end.query()) or self.mark is None:
            raise RuntimeError("elapsed_time of events not made with enable_timing, or not completed")
        return (end.mark.clock - self.mark.clock) / 1e6  # ms: 1 ns per byte


class OwnedLock:
    """threading.Lock that knows its holder (the engine's copy lock, checked by the stand-in)."""

    def __init__(self):
        self._lock, self.owner = threading.Lock(), None

    def acquire(self, *args) -> bool:
        got = self._lock.acquire(*args)
        if got:
            self.owner = threading.get_ident()
        return got

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()


class StandInGPU:
    """torch.cuda's streams, events, cudart, caching allocator and the engine's non-blocking
    copies and casts, on the CPU (see the module doc)."""

    def __init__(self, refuse_pinning: bool = False, seed: int = 0, delay_chance: float = 0.5,
                 max_delay: float = 1e-3, staging_delay: float = 2e-4):
        self.lock = threading.RLock()
        self.local = threading.local()
        self.seed, self.delay_chance, self.max_delay, self.staging_delay = seed, delay_chance, max_delay, staging_delay
        self.streams: list[Stream] = []
        self.default = self.stream()
        self.refuse = refuse_pinning
        self.registered: dict[int, int] = {}
        self.last_error: dict[int, int] = {}  # thread -> cudaGetLastError's value
        self.in_flight: list[tuple[int, int]] = []  # (address, bytes) of sources of copies not completed
        self.problems: list[str] = []
        self.copies: list[tuple[int, bool]] = []  # (bytes, from pinned memory)
        self.staging_spans: list[tuple[float, float]] = []  # host time of pageable copies
        self.pools: dict[int, list[torch.Tensor]] = {}  # stream index -> free blocks
        self.engine_locks: list[OwnedLock] = []
        self.reading: dict[int, int] = {}  # device address -> queued casts that read it
        self.staged_ranges = 0
        self.cast_done = threading.Event()  # a first cast has written its destination

    def stream(self) -> Stream:
        stream = Stream(self, len(self.streams))
        self.streams.append(stream)
        return stream

    def close(self) -> None:
        for stream in self.streams:
            stream.enqueue(None)

    def synchronize(self) -> None:
        for stream in list(self.streams):
            stream.synchronize()

    # torch.cuda
    def current(self) -> Stream:
        stack = getattr(self.local, "streams", None)
        return stack[-1] if stack else self.default

    def queuing(self) -> Stream | None:
        """The side stream the calling host thread queues work on (None: run it now)."""
        stream = self.current()
        return None if stream is self.default or getattr(self.local, "on_stream", False) else stream

    @contextlib.contextmanager
    def use(self, stream: Stream):
        self.local.streams = getattr(self.local, "streams", []) + [stream]
        try:
            yield
        finally:
            self.local.streams = self.local.streams[:-1]

    # the caching allocator: a pool per stream, a block reused once its tensor is dropped
    def alloc(self, stream: Stream, shape, dtype: torch.dtype, real_empty=torch.empty) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        need = max(512, -(-nbytes // 512) * 512)
        with self.lock:
            pool = self.pools.setdefault(stream.index, [])
            fits = [i for i, b in enumerate(pool) if b.numel() >= need]
            block = pool.pop(min(fits, key=lambda i: pool[i].numel())) if fits else None
        if block is None:
            block = real_empty(need, dtype=torch.uint8)
        tensor = block[:nbytes].view(dtype).view(tuple(shape))
        weakref.finalize(tensor, self.release, stream.index, block)
        return tensor

    def release(self, index: int, block: torch.Tensor) -> None:
        with self.lock:
            if self.reading.get(block.data_ptr()):
                self.problems.append("device memory was freed while a queued cast still reads it")
            self.pools[index].append(block)

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
        """Tensor.copy_: a non-blocking copy on a side stream is queued there."""
        stream = self.queuing()
        if not non_blocking or stream is None:
            return original(dst, src, non_blocking)
        pinned = self.pinned(src)
        with self.lock:
            self.copies.append((src.nbytes, pinned))
        if not pinned:
            return self.pageable_copy(original, stream, dst, src)
        source, snapshot, src, dst = (src.data_ptr(), src.nbytes), raw_bytes(src), alias(src), alias(dst)
        with self.lock:
            self.in_flight.append(source)

        def complete():
            if not torch.equal(raw_bytes(src), snapshot):
                self.problems.append("a source changed before its copy completed")
            original(dst, src)  # the source is read now, not when the copy was queued
            with self.lock:
                self.in_flight.remove(source)
            stream.clock += src.nbytes

        stream.enqueue(complete)
        return dst

    def pageable_copy(self, original, stream, dst, src):
        """CUDA waits for the stream's earlier work, then stages the source (the caller held
        meanwhile), and the copy lands later."""
        if any(lock.owner == threading.get_ident() for lock in self.engine_locks):
            self.problems.append("a copy from pageable memory was made under the engine's lock (every worker "
                                 "waits while CUDA stages it)")
        start = time.perf_counter()
        stream.synchronize()
        staged = src.clone()
        time.sleep(self.staging_delay)
        with self.lock:
            self.staging_spans.append((start, time.perf_counter()))
        dst = alias(dst)

        def land():
            original(dst, staged)
            stream.clock += staged.nbytes

        stream.enqueue(land)
        return dst

    def queued_cast(self, copy_into, dest, item, source) -> None:
        """The engine's cast of uploaded parts, queued on the current side stream; its
        scratch comes from that stream's pool now and is given back at once (as torch's
        temporaries are, the kernels using them still queued)."""
        stream = self.queuing()
        if stream is None:
            return copy_into(dest, item, source)
        whole = isinstance(source, torch.Tensor)
        rebuild = None if whole else type(source)
        parts = [source] if whole else list(source)
        scratch = [self.alloc(stream, p.shape, p.dtype) if p is not None else None for p in parts]
        pairs = [(alias(p), alias(s)) if p is not None else None for p, s in zip(parts, scratch)]
        del scratch, parts, source  # back to the pool (the scratch) or the caller's alone (the uploads)
        read = [pair[0].untyped_storage().data_ptr() for pair in pairs if pair is not None]
        with self.lock:
            for address in read:
                self.reading[address] = self.reading.get(address, 0) + 1

        def cast():
            for pair in pairs:
                if pair is not None:
                    pair[1].copy_(pair[0])
            with self.lock:
                for address in read:
                    self.reading[address] -= 1
            held = [pair[1] if pair is not None else None for pair in pairs]
            copy_into(dest, item, held[0] if whole else rebuild(*held))
            self.cast_done.set()

        stream.enqueue(cast)

    def freeing(self, view: torch.Tensor) -> None:
        lo, hi = view.data_ptr(), view.data_ptr() + view.nbytes
        with self.lock:
            if any(a < hi and lo < a + n for a, n in self.in_flight):
                self.problems.append("a staging range was freed while a copy from it was in flight")


class StandInWork:
    """An NCCL work: done when its stream reaches it; `wait()` does not block the host."""

    def __init__(self, gpu: StandInGPU):
        self.gpu, self.mark, self.error = gpu, Mark(), None

    def wait(self, timeout=None) -> bool:
        self.gpu.current().enqueue(self.mark.wait)  # the caller's current stream waits; the host goes on
        return True

    def is_completed(self) -> bool:
        return self.mark.reached.is_set()

    def exception(self):
        return self.error


class StandInNCCL:
    """`ProcessGroupNCCL(store, rank, size, options)` on gloo (see the module doc). Over a
    gloo process group of its own, made at the first operation (NCCL sets up its communicator
    then, blocking the host until every rank joins), or `over` an existing one (a registered
    group's, for `batch_isend_irecv`); peers are ranks in the group."""

    class Options:
        _timeout = None

    def __init__(self, gpu: StandInGPU, store=None, rank: int = 0, size: int = 1, options=None, over=None):
        self.gpu, self.store, self.size, self.gloo = gpu, store, size, over
        self.me = rank if over is None else over.rank()
        self.stream = gpu.stream()
        self.batch: list | None = None
        self.aborted = False

    def _group(self):
        import torch.distributed as dist
        from datetime import timedelta

        if self.aborted:
            raise RuntimeError("NCCL communicator was aborted")
        if self.gloo is None:
            self.gloo = dist.ProcessGroupGloo(self.store, self.me, self.size, timedelta(seconds=WAIT))
        return self.gloo

    def allreduce(self, tensors):
        gloo = self._group()
        return self._run(lambda: [gloo.allreduce(tensors)])

    def _start_coalescing(self) -> None:
        self.batch = []

    def send(self, tensors, peer: int, tag: int) -> None:
        self.batch.append(("send", tensors, peer))

    def recv(self, tensors, peer: int, tag: int) -> None:
        self.batch.append(("recv", tensors, peer))

    def _end_coalescing(self) -> StandInWork:
        gloo, batch, self.batch = self._group(), self.batch, None
        # every message under one tag: a peer's sends and receives pair by order, as NCCL's do
        return self._run(lambda: [getattr(gloo, op)(tensors, peer, 0) for op, tensors, peer in batch])

    def _run(self, post) -> StandInWork:
        """`post()`'s gloo operations, started and waited for on this communicator's stream
        once the caller's current stream reached this point (NCCL's stream waits for it)."""
        work, stream = StandInWork(self.gpu), self.stream
        self.stream.enqueue(self.gpu.current().mark().wait)

        def run():
            try:
                for each in post():
                    each.wait()
            except Exception as exc:  # the work failed (a closed pair, a size that differs)
                work.error = exc
            work.mark.reach(stream.clock)

        self.stream.enqueue(run)
        return work

    def abort(self) -> None:
        """What is pending ends (failed): a gloo wait that expires closes every pair of its
        group, and the waits stuck on them raise; the peers' too (NCCL's abort is local: a
        peer's kernels wait until it aborts its own, as every rank of a failed sync does).
        A receive from a peer that closed its pair already fails at once without closing
        the others, so each peer is tried until one wait expires."""
        from datetime import timedelta

        self.aborted = True
        for peer in range(self.size) if self.gloo is not None else ():
            if peer == self.me:
                continue
            try:
                self.gloo.recv([torch.zeros(1)], peer, 1 << 30).wait(timedelta(milliseconds=1))
            except RuntimeError:
                pass


def nccl_over_gloo(monkeypatch, gpu: StandInGPU) -> list[StandInNCCL]:
    """The weight sync's NCCL path over the gloo groups of this process: every group reports
    the backend "nccl", `ProcessGroupNCCL` and `batch_isend_irecv` are `StandInNCCL`'s (one per
    registered group), CUDA events and streams `gpu`'s, and a message on "the device" is a
    host tensor. Returns the communicators made, in order."""
    import dataclasses

    import torch.distributed as dist
    from lazyload.sync import peers, transfer, weight_sync

    made: list[StandInNCCL] = []
    of = peers.Peers.of
    monkeypatch.setattr(peers.Peers, "of", classmethod(lambda cls, group: dataclasses.replace(of(group),
                                                                                                backend="nccl")))

    def process_group_nccl(store, rank, size, options=None):
        made.append(StandInNCCL(gpu, store, rank, size, options))
        return made[-1]

    process_group_nccl.Options = StandInNCCL.Options
    monkeypatch.setattr(dist, "ProcessGroupNCCL", process_group_nccl, raising=False)
    registered: dict = {}

    def batch_isend_irecv(ops):
        group = ops[0].group
        if group not in registered:
            registered[group] = StandInNCCL(gpu, over=group)
        comm = registered[group]
        comm._start_coalescing()
        for op in ops:
            (comm.send if op.op is dist.isend else comm.recv)([op.tensor], op.group_peer, op.tag)
        return [comm._end_coalescing()]

    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: Event(gpu, **kw))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.current())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def message_buffer(nbytes, ends):  # the device's memory, on the host
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(transfer, "message_buffer", message_buffer)
    monkeypatch.setattr(weight_sync, "message_buffer", message_buffer, raising=False)
    return made


DIVISIONS = ((torch.Tensor, "__truediv__"), (torch.Tensor, "div"), (torch.Tensor, "true_divide"),
             (torch, "div"), (torch, "true_divide"))
IN_PLACE_DIVISIONS = ((torch.Tensor, "__itruediv__"), (torch.Tensor, "div_"), (torch.Tensor, "true_divide_"))


def cuda_division(monkeypatch, active) -> None:
    """Division of a float32/float64 tensor by a CPU scalar (a Python number or a 0-dim
    tensor) as CUDA computes it where `active()`: `a * (1 / b)` (PyTorch's
    BinaryDivTrueKernel, which notes that this may lose a bit); the CPU divides."""
    inverse_of = torch.Tensor.div_  # CUDA's host computes 1 / b itself, in the dtype's math

    def emulating(original, in_place):
        def divide(a, b, *args, **kwargs):
            scalar = isinstance(b, (int, float)) and not isinstance(b, bool) or (
                isinstance(b, torch.Tensor) and b.dim() == 0 and b.device.type == "cpu")
            if args or kwargs or not scalar or not active() or not isinstance(a, torch.Tensor) or \
                    a.dtype not in (torch.float32, torch.float64):
                return original(a, b, *args, **kwargs)
            inverse = inverse_of(torch.ones((), dtype=a.dtype), torch.tensor(float(b), dtype=a.dtype))
            return a.mul_(inverse) if in_place else torch.mul(a, inverse)
        return divide

    for owner, name in DIVISIONS + IN_PLACE_DIVISIONS:
        monkeypatch.setattr(owner, name, emulating(getattr(owner, name), (owner, name) in IN_PLACE_DIVISIONS))


@pytest.fixture
def gpu(monkeypatch):
    """Install a StandInGPU; the engine's CUDA branch then runs for CPU destinations."""
    made: list[StandInGPU] = []

    def install(refuse_pinning=False, **kw):
        gpu = StandInGPU(refuse_pinning, **kw)
        made.append(gpu)
        monkeypatch.setattr(engine, "uses_cuda", lambda device: True)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: gpu.stream())
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: Event(gpu, **kw))
        monkeypatch.setattr(torch.cuda, "stream", gpu.use)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.current())
        monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "cudart", lambda: gpu)
        monkeypatch.setattr(pread, "loaded_cudart", lambda: gpu)
        original = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False:
                            gpu.copy(original, dst, src, non_blocking))
        real_empty = torch.empty

        def empty(*size, device=None, **kwargs):  # under a side stream, on the "device": its pool
            stream = gpu.queuing()
            if device is None or stream is None or set(kwargs) - {"dtype"}:
                return real_empty(*size, device=device, **kwargs)
            shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
            return gpu.alloc(stream, tuple(shape), kwargs.get("dtype") or torch.get_default_dtype(), real_empty)

        monkeypatch.setattr(torch, "empty", empty)
        copy_into = engine.copy_into
        monkeypatch.setattr(engine, "copy_into", lambda dest, item, source: gpu.queued_cast(copy_into, dest, item,
                                                                                              source))
        cuda_division(monkeypatch, lambda: getattr(gpu.local, "on_stream", False))
        init = engine.CudaCopies.__init__

        def owned_lock(copies, *args, **kwargs):
            init(copies, *args, **kwargs)
            copies._lock = OwnedLock()
            gpu.engine_locks.append(copies._lock)

        monkeypatch.setattr(engine.CudaCopies, "__init__", owned_lock)
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
    yield install
    for standin in made:
        standin.close()


def assert_clean(gpu: StandInGPU) -> None:
    gpu.synchronize()  # as a user's next kernel on the device would see it
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
def blocks(checkpoint):
    """Every Linear whole 128x128 blocks: quantized on load into transformers' FP8Linear."""
    return checkpoint("llama", "bf16", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=4, num_hidden_layers=2)


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
    "fp8 blocks on load": ("blocks", torch.bfloat16, dict(reader="mmap", quantize=Quantization("fp8", format="transformers"))),
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


@pytest.mark.parametrize("reader", ["pread", "mmap"])
def test_pinning_refused_copies_from_pageable_memory_outside_the_lock_warned_once_timed_whole(
        llama, gpu, caplog, reader):
    """CUDA refuses to pin (memlock limits, WSL2): the staging (pread) or the first bounce
    buffer (mmap) is refused, and then no worker tries again: one warning; every copy goes
    straight from pageable memory (no bounce: one memcpy less), outside the engine's lock
    (the stand-in flags a copy made under it), and `h2d_seconds` covers CUDA's staging of
    each copy on the host, not only its DMA."""
    directory, config = llama
    kw = dict(reader=reader, dtype=torch.float16)
    want, _ = load(directory, config, torch.float16, kw)
    standin = gpu(refuse_pinning=True)
    with caplog.at_level(logging.WARNING, logger="lazyload"):
        got, report = load(directory, config, torch.float16, kw)
    assert_same(got, want)
    assert_clean(standin)  # the refused registrations' errors were cleared; nothing copied under the lock
    assert sum("could not pin" in r.getMessage() for r in caplog.records) == 1
    assert report.pinned_bytes == 0 and report.h2d_bytes == sum(n for n, _ in standin.copies) > 0
    assert not any(pinned for _, pinned in standin.copies)
    assert report.h2d_seconds >= engine.covered(standin.staging_spans) > report.h2d_bytes * 1e-9


@pytest.mark.parametrize("rank,world,bounce", [(0, 1, 4096), (1, 2, 128)])
def test_tensors_over_the_bounce_size_go_through_both_slots_in_turn(llama, gpu, monkeypatch, rank, world, bounce):
    """mmap pages (pageable) through the pinned bounce buffer, slots far smaller than the
    tensors: every tensor is many chunks (flat runs; for rank 1 of 2, rows of the strided
    column slices, and parts of rows longer than a slot), each slot refilled only once its
    previous copy has landed."""
    directory, config = llama
    kw = dict(reader="mmap", dtype=torch.float16, rank=rank, world=world)
    want, _ = load(directory, config, torch.float16, kw)
    monkeypatch.setattr(engine, "BOUNCE_BYTES", bounce)
    standin = gpu()
    got, report = load(directory, config, torch.float16, kw)
    assert_same(got, want)
    assert_clean(standin)  # no slot rewritten while its copy was queued
    assert max(n for n, _ in standin.copies) == bounce and len(standin.copies) > 2 * len(want)
    assert all(pinned for _, pinned in standin.copies)


def test_work_queued_on_the_current_stream_before_the_load_lands_first(llama, gpu, monkeypatch):
    """A real model whose tensors a kernel still queued on the current stream writes (its
    initialisation, say) when the engine starts: the load's copies land after it."""
    directory, config = llama
    want, _ = load(directory, config, torch.float16, dict(reader="pread", dtype=torch.float16))
    model = build_model("llama", config, torch.float16, empty=None)
    standin = gpu()
    tensors = list(model.state_dict().values())

    def initialise():  # a long kernel: it writes once the load's first cast is done (or after a while)
        standin.cast_done.wait(1.0)
        for tensor in tensors:
            tensor.detach().fill_(float("nan"))

    start = engine.CudaCopies.__init__

    def queued_first(copies, *args, **kwargs):
        standin.default.enqueue(initialise)
        start(copies, *args, **kwargs)

    monkeypatch.setattr(engine.CudaCopies, "__init__", queued_first)
    LazyCheckpoint(directory).load_into(model, reader="pread", dtype=torch.float16, progress=False)
    assert_clean(standin)
    assert_same(state_bytes(model), want)


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
    standin = gpu()
    place = engine.copy_into  # the stand-in's: queued on the cast stream

    def copy_into(dest, item, source):
        if item.target == failing:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        place(dest, item, source)

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


# --------------------------------------------------------------------------- CUDA's division


def test_cuda_division_by_a_cpu_scalar_loses_bits_that_a_device_tensor_keeps(monkeypatch):
    """The emulation is live (a control): `x / 127.0` as CUDA computes it differs from the
    CPU's in some elements; divided by a 1-element tensor (on the device) it does not."""
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) * 10
    true = x / 127.0
    cuda_division(monkeypatch, lambda: True)
    assert not torch.equal(x / 127.0, true)
    assert not torch.equal(x.clone().div_(127.0), true)
    assert torch.equal(x / torch.full((1,), 127.0), true)


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantize_on_load_is_the_same_under_cuda_division(monkeypatch, dtype):
    from lazyload.quant.onload import QDTYPES, QuantizedDest, quantize_into, scale_shape

    values = torch.randn(40, 100, generator=torch.Generator().manual_seed(1)) * 3

    def quantized():
        dest = QuantizedDest(torch.empty(40, 100, dtype=QDTYPES[dtype]), torch.empty(scale_shape((40, 100), GROUP)),
                             GROUP)
        quantize_into(dest, ((0, 40), (0, 100)), values)
        return raw_bytes(dest.data), raw_bytes(dest.scale)

    want = quantized()
    cuda_division(monkeypatch, lambda: True)
    got = quantized()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------- NCCL over gloo


def test_the_nccl_stand_in_pairs_by_order_waits_on_the_stream_and_aborts():
    """Two ranks of `StandInNCCL` (threads of this process, a GPU each): set up by a first
    collective both join; `wait()` returns before the peer has sent anything, and only an
    event recorded after it tells when the messages are in; a peer's messages pair by
    order, whatever their tags; `abort()` ends a receive that nothing will match, failed."""
    import torch.distributed as dist

    gpus = [StandInGPU(seed=rank) for rank in range(2)]
    store = dist.HashStore()
    comms = [StandInNCCL(gpu, store, rank, 2) for rank, gpu in enumerate(gpus)]
    sums = [torch.ones(1), torch.ones(1)]
    setup = [threading.Thread(target=comm.allreduce, args=([total],)) for comm, total in zip(comms, sums)]
    for thread in setup:
        thread.start()
    for thread in setup:
        thread.join(WAIT)

    def posted(rank, ops):
        """rank's (op, tensor, tag) to or from the other, one batch, waited for as NCCL's are."""
        comm = comms[rank]
        comm._start_coalescing()
        for op, tensor, tag in ops:
            getattr(comm, op)([tensor], 1 - rank, tag)
        work = comm._end_coalescing()
        work.wait()  # returns at once
        done = Event(gpus[rank])
        done.record()
        return work, done

    def completed(done) -> bool:
        deadline = time.monotonic() + WAIT
        while not done.query() and time.monotonic() < deadline:
            time.sleep(0.001)
        return done.query()

    first, second = torch.zeros(3), torch.zeros(3)
    _, received = posted(1, [("recv", first, 2), ("recv", second, 1)])
    time.sleep(0.05)
    assert not received.query()  # nothing sent yet: the host went on, the stream waits
    _, sent = posted(0, [("send", torch.full((3,), 1.0), 1), ("send", torch.full((3,), 2.0), 2)])
    assert completed(received) and completed(sent)
    assert sums[0].item() == sums[1].item() == 2  # the set-up collective ran on each stream
    assert first.tolist() == [1.0] * 3 and second.tolist() == [2.0] * 3  # by order: tags ignored

    stuck, waiting = posted(1, [("recv", torch.zeros(3), 0)])
    time.sleep(0.05)
    assert not waiting.query()
    comms[1].abort()
    assert completed(waiting) and stuck.exception() is not None
    for comm in comms:
        comm.abort()
    for gpu in gpus:
        gpu.synchronize()
        gpu.close()
        assert gpu.problems == []


def test_the_nccl_stand_in_abort_ends_what_is_pending_whichever_peer_aborted_first():
    """A communicator's abort ends a receive pending on it, as NCCL's does, even when the peer
    its abort probes first has aborted already (their pair closed from that side; the
    receive waits on another pair): three ranks, rank 0 waiting for rank 2, rank 1 aborts
    first. (The stand-in's abort closed its pairs only when its one timed receive, from the
    next rank, timed out: rank 0's ended at once on the closed pair, and its receive from
    rank 2 waited gloo's whole timeout, holding the caller's stream, and a retry's first
    collective behind it: test_sync's nccl-retry case, when its ranks aborted in that order.)"""
    import torch.distributed as dist

    gpus = [StandInGPU(delay_chance=0) for _ in range(3)]
    store = dist.HashStore()
    comms = [StandInNCCL(gpu, store, rank, 3) for rank, gpu in enumerate(gpus)]
    setup = [threading.Thread(target=comm.allreduce, args=([torch.ones(1)],)) for comm in comms]
    for thread in setup:
        thread.start()
    for thread in setup:
        thread.join(WAIT)
    comms[0]._start_coalescing()
    comms[0].recv([torch.zeros(3)], 2, 0)
    stuck = comms[0]._end_coalescing()
    comms[1].abort()
    time.sleep(0.5)  # rank 0 sees its pair with rank 1 closed
    comms[0].abort()
    assert stuck.mark.reached.wait(10) and stuck.exception() is not None
    comms[2].abort()
    for gpu in gpus:
        gpu.synchronize()
        gpu.close()
        assert gpu.problems == []
