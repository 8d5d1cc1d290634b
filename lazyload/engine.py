"""Engine: run the schedule: read items in order, a few in flight, each placed as it lands.

Reads run in a small thread pool (file reads and tensor copies release the GIL). What is
read but not yet placed is bounded by the byte budget: the pread and remote readers stage
into an arena of exactly that size; the mmap reader counts the bytes of its slices in flight.
With a GPU destination (`CudaCopies`), every item is staged; the workers copy their staged
(pinned) bytes to the device on a copy stream, cast there on a second stream, and free a
staging range only once its copy is done (also when the placing failed), so that the copy
of one item overlaps the read of the next; pageable sources (mmap pages) go through a small
pinned bounce buffer per worker. Every worker thread first makes
the destination its current device (`use_device_in_thread`): CUDA's current device is per thread, and
a thread left on device 0 would create a context there (about 500 MB) on leaving a stream.

Cold pages (mmap reader with `prefetching`): a single prefetch thread announces the next
layer's exact page ranges while this one is placed, so that the storage reads ahead of the
copies; targets that are views of the mapping (`mapped`) are paged in rather than copied.

Failures: a read that fails (ReadError from the reader, or any OSError), or a placing that
fails (any exception: a GPU out of memory in a cast), stops the run and becomes a
ReadError naming the file and tensor, with the targets whose every item was
placed (`loaded`), the others (`not_loaded`), and among those the ones some of whose bytes
were already being written (`partly_written`); the pool is drained first, so the lists are
final (see `Progress`). A placing stopped by a checkpoint's bad value (a NaN or zero scale)
ends as that CheckpointError (`CorruptValuesError`), with the same lists.

Page release: when the reader was asked to (`release_pages`, which the loader also turns
on when `readers.choice.must_release_pages`), each item's file pages are dropped once it is placed, so
that RSS (not only anonymous memory) stays bounded.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from .devices import use_device_in_thread  # the read pool's initializer
from .errors import CheckpointError, CorruptValuesError, ReadError, RemoteError
from .expr import apply_ops
from .placer import Destination, assign, copy_into
from .plan import ReadItem
from .quant.dequant import QuantizedBox
from .readers import Arena, Reader, byte_runs
from .schedule import Group
from .targets import Slot, current_tensor, local_tensor


class ByteBudget:
    """Blocks `acquire` while more than `limit` bytes are in flight."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


@dataclass(frozen=True)
class EngineStats:
    """What a run cost beyond its reads: page-locked staging (bytes, held during the run
    only), and its host-to-device copies (bytes; seconds: timed with CUDA events, or for
    copies from pageable memory on the host, from the call until they landed)."""

    pinned_bytes: int = 0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0


BOUNCE_BYTES = 4 << 20  # a slot of a worker's pinned bounce buffer (two slots: fill one while the other copies)


class CudaCopies:
    """Host-to-device copies into CUDA destinations, and the casts there. Two streams of the
    device, shared by the worker threads: `copy_stream` carries only the copies (each between
    its two timing events, enqueued under `_lock`, so `h2d_seconds` times copies alone), and
    `stream` the casts, dequantizing and quantizing, which wait for their copies' events: one
    stream, so that their temporaries come from one pool of torch's caching allocator (it
    keeps a pool per stream). `place` returns once its item is on the device, so a staging
    range is freed only once its bytes have landed, also when the placing failed.

    `pinned_sources`: the sources are page-locked (the staging arena, pinned), so copies from
    them are asynchronous. Pageable sources (mmap pages) are copied by the worker, page
    faults included, into its own pinned bounce buffer first, a chunk at a time and outside
    the lock; copies from pageable memory would block the enqueuing thread (CUDA stages them
    itself), and so every other worker, under the lock. `pinning_refused` (CUDA refused to
    pin the staging; or, found here, a bounce buffer): every copy is from pageable memory,
    made straight from the source (a bounce would only add a memcpy), outside the lock,
    timed on the host until it has landed (staging included: events would time the DMA alone)."""

    def __init__(self, device: torch.device, pinned_sources: bool, pinning_refused: bool = False):
        self.device = device
        self.pinned_sources = pinned_sources
        self.pageable = pinning_refused  # set once: the refusal was logged once, by the first arena refused
        self.copy_stream = torch.cuda.Stream(device)
        self.stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self._spans: list[tuple[float, float, int]] = []  # host-timed pageable copies: (start, end, bytes)
        self._bounce_lock = threading.Lock()
        self._local = threading.local()
        self._bounces: list[Arena] = []
        # Destinations were allocated (or last used) on the current stream: let it finish.
        torch.cuda.current_stream(device).synchronize()

    @property
    def pinned_bytes(self) -> int:
        return sum(bounce.pinned_bytes for bounce in self._bounces)

    def place(self, dest: Destination, item: ReadItem,
              source: torch.Tensor | QuantizedBox) -> None:
        """Copy the item's host bytes into its box of `dest` (or its parts to the device, then
        dequantized, quantized, or kept there); returns once they are there."""
        done = torch.cuda.Event(blocking=True)  # blocking: a waiting thread sleeps instead of spinning
        uploaded: list[torch.Tensor] = []  # device copies the casts read: freed once `done`
        try:
            with torch.cuda.stream(self.stream):
                self._place(dest, item, source, uploaded)
        finally:  # also after a failure: no copy from the staging is in flight once this returns
            done.record(self.stream)
            self.wait(done)

    def _place(self, dest: Destination, item: ReadItem, source: torch.Tensor | QuantizedBox, uploaded: list) -> None:
        if item.scales is not None:  # the plan reads a pre-quantized box: each of its parts to the device
            parts = QuantizedBox(*(self.upload(part, uploaded) if part is not None else None for part in source))
            return copy_into(dest, item, parts)
        box = dest.box(item)  # None: converted on the GPU (quantized, a whole conversion)
        shaped = apply_ops(source, item.ops)
        if box is not None and shaped.dtype == box.dtype and shaped.is_contiguous() and box.is_contiguous():
            self.h2d(box, shaped)  # the bytes land in place: one copy
        else:  # raw bytes over PCIe, then cast / transpose / strided write on the GPU
            copy_into(dest, item, self.upload(source, uploaded))

    def upload(self, source: torch.Tensor, uploaded: list) -> torch.Tensor:
        """A device copy of host `source`, allocated from the copy stream's pool (its only
        writer) and kept in `uploaded` until the casts that read it are done."""
        with torch.cuda.stream(self.copy_stream):
            raw = torch.empty(source.shape, dtype=source.dtype, device=self.device)
        uploaded.append(raw)
        self.h2d(raw, source)
        return raw

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host `src` into device `dst` (same shape, `dst` contiguous); the cast stream
        waits for it."""
        if self.pinned_sources:
            self._copy(dst, src)
            return
        bounce = self._bounce()
        if bounce is None:
            self._copy_pageable(dst, src)
            return
        for part_dst, part_src in host_chunks(dst, src, BOUNCE_BYTES // src.element_size()):
            staged = bounce.take(part_src)  # waits until the slot's previous copy has landed
            staged.copy_(part_src)  # page faults and memcpy here, outside the lock
            bounce.landing(self._copy(part_dst, staged))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True, blocking=True)
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        with self._lock, torch.cuda.stream(self.copy_stream):  # nothing else between the two events
            start.record(self.copy_stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.copy_stream)
            self._timed.append((start, end, src.nbytes))
        self.stream.wait_event(end)
        return end

    def _copy_pageable(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy from pageable memory: the calling thread is held while CUDA stages it."""
        end = torch.cuda.Event(blocking=True)
        start = time.perf_counter()
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            end.record(self.copy_stream)
        end.synchronize()
        with self._lock:
            self._spans.append((start, time.perf_counter(), src.nbytes))
        self.stream.wait_event(end)

    def _bounce(self) -> "Bounce | None":
        """This worker's pinned bounce buffer; None once CUDA refused to pin one (it then
        refuses them all: no other worker tries, so the refusal is logged once)."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is not None:
            return bounce
        with self._bounce_lock:
            if self.pageable:
                return None
            bounce = Bounce(self.wait)
            if not bounce.arena.pinned_bytes:
                self.pageable = True
                return None
            self._local.bounce = bounce
            self._bounces.append(bounce.arena)
        return bounce

    @staticmethod
    def wait(event: torch.cuda.Event) -> None:
        event.synchronize()

    def finish(self) -> tuple[int, float]:
        """Wait for every copy and cast, unpin the bounce buffers; (bytes, seconds) of the
        host-to-device copies."""
        try:
            self.copy_stream.synchronize()
            self.stream.synchronize()
            seconds = sum(start.elapsed_time(end) for start, end, _ in self._timed) / 1e3
            seconds += covered([(start, end) for start, end, _ in self._spans])
            return sum(n for _, _, n in self._timed) + sum(n for _, _, n in self._spans), seconds
        finally:
            for arena in self._bounces:
                arena.close()


def covered(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of the (start, end) spans ran (workers' pageable
    copies overlap: their sum would count the same wall time more than once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Bounce:
    """A worker's pinned bounce buffer: two slots of BOUNCE_BYTES used in turn, each reused
    only once the copy from it has landed (its event waited on)."""

    def __init__(self, wait: Callable[[torch.cuda.Event], None]):
        self.arena = Arena(2 * BOUNCE_BYTES, pin=True)
        self._wait = wait
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """The next slot, as a tensor of `like`'s dtype and shape."""
        self._turn ^= 1
        if self._events[self._turn] is not None:
            self._wait(self._events[self._turn])
        start = self._turn * BOUNCE_BYTES
        return self.arena.buffer[start:start + like.nbytes].view(like.dtype).view(like.shape)

    def landing(self, event: torch.cuda.Event) -> None:
        self._events[self._turn] = event


def host_chunks(dst: torch.Tensor, src: torch.Tensor, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) parts of at most `n` elements each: flat runs of a contiguous `src`, else
    rows (and parts of rows) of a strided one. `dst` is contiguous, of `src`'s shape."""
    if src.numel() <= n:
        yield dst, src
    elif src.is_contiguous():
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        for a in range(0, flat_src.numel(), n):
            yield flat_dst[a:a + n], flat_src[a:a + n]
    elif src[0].numel() > n:  # one row is too long: its own parts
        for i in range(src.shape[0]):
            yield from host_chunks(dst[i], src[i], n)
    else:
        rows = n // src[0].numel()
        for a in range(0, src.shape[0], rows):
            yield dst[a:a + rows], src[a:a + rows]


class Progress:
    """Which targets are fully placed, and which have had bytes written, as items finish
    (worker threads report here); `failure` turns an error into a ReadError saying so."""

    def __init__(self, groups: list[Group], targets: Iterable[str]):
        self._left = dict.fromkeys(targets, 0)  # items not yet placed, by target
        for group in groups:
            for item in group.items:
                self._left[item.target] += 1
        self.done = {t for t, n in self._left.items() if not n}  # e.g. views of warm pages
        self.started: set[str] = set()
        self._lock = threading.Lock()

    def writing(self, item: ReadItem) -> None:
        with self._lock:
            self.started.add(item.target)

    def placed(self, item: ReadItem) -> None:
        with self._lock:
            self._left[item.target] -= 1
            if not self._left[item.target]:
                self.done.add(item.target)

    def failure(self, exc: BaseException, item: ReadItem | None) -> ReadError:
        """A ReadError naming the file and tensor, listing what is loaded; call once no
        worker runs any more."""
        if isinstance(exc, (ReadError, CheckpointError)):  # a bad value read (a NaN scale) says what it is
            reason = str(exc)
        elif isinstance(exc, OSError):
            reason = (f"{getattr(exc, 'filename', None) or (item.entry.file if item else 'a checkpoint file')}: "
                      f"{exc.strerror or exc}")
        else:  # placing it failed (e.g. a GPU out of memory in a cast): the targets are as after a read error
            reason = f"placing it failed with {type(exc).__name__}: {exc}"
        where = f" (reading tensor {item.entry.key!r} of {item.entry.file} for {item.target})" if item else ""
        loaded = [t for t in self._left if t in self.done]
        not_loaded = [t for t in self._left if t not in self.done]
        partly = [t for t in not_loaded if t in self.started]
        return ReadError(f"{reason}{where}; {len(loaded)} of {len(self._left)} targets were loaded before it, "
                         f"{len(not_loaded)} were not (the error's `loaded` / `not_loaded`).",
                         loaded, not_loaded, partly)


class ItemFailed(Exception):
    """A worker's read or placement of `item` failed with `cause` (carried to `Progress`)."""

    def __init__(self, item: ReadItem, cause: BaseException):
        super().__init__(item, cause)
        self.item, self.cause = item, cause


def worker_pool(workers: int, device: torch.device) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="lazyload-read", initializer=use_device_in_thread,
                              initargs=(device,))


def direct_target(dest: Destination, item: ReadItem) -> torch.Tensor | None:
    """A uint8 view of the item's box in `dest` when the file bytes can land there as they
    are: CPU destination, same dtype, no transpose, one contiguous run each side."""
    if dest.device.type != "cpu" or item.scales is not None or any(op[0] == "transpose" for op in item.ops):
        return None
    view = dest.box(item)
    if view is None or view.dtype != item.entry.dtype or not view.is_contiguous():
        return None
    offsets, run = byte_runs(item)
    if len(offsets) != 1:
        return None
    return view.reshape(-1).view(torch.uint8)


def _workers(reader: Reader) -> int:
    return reader.threads


def uses_cuda(device: torch.device) -> bool:
    """Whether the destination is a GPU: its items are staged and copied by `CudaCopies`."""
    return device.type == "cuda"


def run_schedule(groups: list[Group], reader: Reader, dests: dict[str, Destination], budget: int,
                 on_bytes: Callable[[int], None] = lambda n: None, mapped: frozenset[str] = frozenset()) -> EngineStats:
    """Read and place every item. `mapped`: targets whose destination is already a view of
    the file mapping; their items are only paged in (mmap reader), costing no host budget."""
    device = next(iter(dests.values())).device if dests else torch.device("cpu")
    cuda = uses_cuda(device)
    # This thread's CUDA calls (stream, pinning) go to the destination's context, not GPU 0's.
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        progress = Progress(groups, dests)
        arena: Arena | None = None
        copies: CudaCopies | None = None
        try:  # made inside: a failure in either still unpins what the other pinned
            if reader.staged:
                arena = Arena(budget, pin=cuda)
            if cuda:
                pinned = arena is not None and arena.pinned_bytes > 0
                copies = CudaCopies(device, pinned, pinning_refused=arena is not None and not pinned)
            _run(groups, Tasks(reader, dests, ByteBudget(budget), arena, copies, progress, on_bytes, mapped), device)
            if mapped:
                try:
                    reader.check_mapped()
                except ReadError:  # views of a file that shrank during the load: not loaded
                    progress.done -= mapped
                    raise
        except ItemFailed as failed:  # the pool is drained: no worker writes any more
            raise progress.failure(failed.cause, failed.item) from failed.cause
        except (ReadError, OSError) as exc:  # opening or announcing, outside any item
            raise progress.failure(exc, None) from exc
        finally:
            stats = _close(arena, copies)
    return stats


def _close(arena: Arena | None, copies: CudaCopies | None) -> EngineStats:
    """Wait for the copies, then unpin the staging (no copy from it is in flight past here)."""
    pinned = (arena.pinned_bytes if arena is not None else 0) + (copies.pinned_bytes if copies is not None else 0)
    h2d = (0, 0.0)
    try:
        if copies is not None:
            h2d = copies.finish()
    finally:
        if arena is not None:
            arena.close()
    return EngineStats(pinned, *h2d)


@dataclass
class Tasks:
    """What a worker does with one item, by how it is read: into staging (or straight into
    its destination), as a view placed then released, or paged in (a mapped target)."""

    reader: Reader
    dests: dict[str, Destination]
    in_flight: ByteBudget  # bytes of unstaged views not yet placed (staged reads: the arena is the budget)
    arena: Arena | None
    copies: CudaCopies | None
    progress: Progress
    on_bytes: Callable[[int], None]
    mapped: frozenset[str]

    def submit(self, pool: ThreadPoolExecutor, item: ReadItem) -> Future:
        """Start the item's task (waiting first for staging or budget to free up)."""
        if item.target in self.mapped:
            return pool.submit(self.populate, item)
        if self.arena is not None:
            direct = direct_target(self.dests[item.target], item) if self.copies is None else None
            buf = direct if direct is not None else self.arena.alloc(item.nbytes)
            return pool.submit(self.staged, item, buf, direct is None)
        self.in_flight.acquire(item.nbytes)
        return pool.submit(self.unstaged, item)

    def place(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        self.progress.writing(item)
        if self.copies is not None:
            self.copies.place(self.dests[item.target], item, source)
        else:
            copy_into(self.dests[item.target], item, source)

    def done(self, item: ReadItem) -> None:
        self.progress.placed(item)
        self.on_bytes(item.nbytes)

    def staged(self, item: ReadItem, buf: torch.Tensor, staging: bool) -> None:
        try:
            if not staging:
                self.progress.writing(item)  # the file's bytes land in the destination itself
            source = self.reader.read_into(item, buf)
            if staging:
                self.place(item, source)
        except Exception as exc:  # a read, or a placing (a cast out of GPU memory): the run stops
            raise ItemFailed(item, exc) from exc
        finally:
            if staging:
                self.arena.free(buf)
        self.done(item)

    def unstaged(self, item: ReadItem) -> None:
        try:
            source = self.reader.read(item)
            self.place(item, source)
            self.reader.release(item, source)
        except Exception as exc:
            raise ItemFailed(item, exc) from exc
        finally:
            self.in_flight.release(item.nbytes)
        self.done(item)

    def populate(self, item: ReadItem) -> None:
        try:
            self.reader.populate(item, self.dests[item.target].box(item))
        except (ReadError, OSError) as exc:
            raise ItemFailed(item, exc) from exc
        self.done(item)


def _run(groups: list[Group], tasks: Tasks, device: torch.device) -> None:
    """Every group's items through the pool, a bounded number pending; with a prefetching
    reader, each group announced (one thread) before its items start."""
    workers = _workers(tasks.reader)
    pending: deque[Future] = deque()
    announced: dict[int, Future] = {}
    with worker_pool(workers, device) as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="lazyload-prefetch") as prefetcher:
        try:
            for k, group in enumerate(groups):
                if tasks.reader.prefetching:
                    announce(tasks.reader, groups, k, announced, prefetcher)
                for item in group.items:
                    pending.append(tasks.submit(pool, item))
                    while len(pending) > 2 * workers or (pending and pending[0].done()):
                        pending.popleft().result()
            while pending:
                pending.popleft().result()
            for future in announced.values():
                future.result()
        except BaseException:
            for future in (*pending, *announced.values()):
                future.cancel()
            raise


def announce(reader: Reader, groups: list[Group], k: int, announced: dict[int, Future],
              prefetcher: ThreadPoolExecutor) -> None:
    """Announce the next layer while this one is placed; but never let a worker touch a page
    not yet announced: on a partly read file that fault would read its one page alone
    (MADV_RANDOM)."""
    for ahead in range(k, min(k + 2, len(groups))):
        if ahead not in announced:
            announced[ahead] = prefetcher.submit(reader.prefetch, groups[ahead].items)
    announced[k].result()


def settle_failure(error: ReadError, slots: dict[str, Slot], dests: dict[str, Destination],
                   undone: bool = False) -> ReadError | CorruptValuesError:
    """After a failed run: assign the targets that were fully read (they are loaded), leave
    the others as they were (meta, or a real model's previous values), and say so. Only a
    real tensor filled in place can be left half written: it is named (`partly_written`).
    Staging every in-place target into fresh memory instead would double a real model's
    memory for the length of the load. `undone`: the load changed the model's structure and
    its caller puts the model back as it was, so nothing is loaded (a real tensor filled
    in place, fully or not, is named as partly written). A run stopped by a checkpoint's
    bad value (a NaN scale: a CheckpointError while placing) ends in that CheckpointError
    (`CorruptValuesError`), not a ReadError."""
    loaded = [] if undone else error.loaded
    for name in loaded:
        for tensor_name, tensor in dests[name].tensors(name).items():
            assign(slots[tensor_name], tensor)
    not_loaded = [*error.loaded, *error.not_loaded] if undone else error.not_loaded
    written = [name for name in not_loaded if name in error.partly_written or (undone and name in error.loaded)]
    in_place = [name for name in written if _is_own_storage(slots[name], dests[name].tensors(name)[name])]
    message = str(error)
    if undone:
        message += (" None is kept: the load changes the model's modules (quantized layers, tensor parallel), "
                    "and they are left as they were.")
    if in_place:
        message += (f" Partly written (a real model's tensors filled in place, now a mix of old and new values; "
                    f"load again): {_names(in_place)}.")
    message += f" Not loaded, left as they were: {_names(not_loaded)}."
    cause = error.__cause__
    corrupt = isinstance(cause, CheckpointError) and not isinstance(cause, RemoteError)  # a store's failure is a read's
    return (CorruptValuesError if corrupt else ReadError)(message, loaded, not_loaded, in_place)


def _is_own_storage(slot: Slot, dest: torch.Tensor) -> bool:
    own = local_tensor(current_tensor(slot))
    return not own.is_meta and own.data_ptr() == dest.data_ptr()


def _names(names: list[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")
