"""Engine: run the schedule: read items in order, a few in flight, each placed as it lands.

Reads run in a small thread pool (file reads and tensor copies release the GIL). What is
read but not yet placed is bounded by the byte budget: the pread reader stages into an
arena of exactly that size; the mmap reader counts the bytes of its slices in flight.
With a GPU destination, each worker copies its staged (pinned) bytes to the device on its
own CUDA stream, casts there, and frees the staging range only once that copy is done, so
the copy of one item overlaps the read of the next.

Cold pages (mmap reader with `prefetching`): a single prefetch thread announces the next
layer's exact page ranges while this one is placed, so that the storage reads ahead of the
copies; targets that are views of the mapping (`mapped`) are paged in rather than copied.

Page release: when the reader was asked to (`release_pages`, which the loader also turns
on when `must_release_pages`), each item's file pages are dropped once it is placed, so
that RSS (not only anonymous memory) stays bounded.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from .placer import copy_into
from .plan import ReadItem
from .readers import Arena, MmapReader, PreadReader, byte_runs
from .system import memory_limit
from .schedule import Group


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


def direct_target(dest: torch.Tensor, item: ReadItem) -> torch.Tensor | None:
    """A uint8 view of the item's box in `dest` when the file bytes can land there as they
    are: CPU destination, same dtype, no transpose, one contiguous run each side."""
    if dest.device.type != "cpu" or dest.dtype != item.entry.dtype or item.scales is not None:
        return None
    if any(op[0] == "transpose" for op in item.ops):
        return None
    offsets, run = byte_runs(item)
    if len(offsets) != 1:
        return None
    view = dest[tuple(slice(a, b) for a, b in item.dst_box)]
    if not view.is_contiguous():
        return None
    return view.reshape(-1).view(torch.uint8)


def must_release_pages(items: list[ReadItem]) -> bool:
    """True under a memory cgroup limit smaller than the files this rank reads from: their
    pages would otherwise push out the destination (or the page cache of the other ranks)."""
    limit = memory_limit()
    if limit is None:
        return False
    files = {item.entry.file for item in items}
    return limit < sum(os.path.getsize(f) for f in files)


def _workers(reader: object) -> int:
    # pread threads mostly wait on the storage (the GIL is released): as many as the
    # storage queue likes; mmap threads fault pages and copy: about one per core.
    cores = os.cpu_count() or 2
    return 8 if isinstance(reader, PreadReader) else min(4, cores)


def run_schedule(groups: list[Group], reader: MmapReader | PreadReader, dests: dict[str, torch.Tensor],
                 budget: int, on_bytes: Callable[[int], None] = lambda n: None,
                 mapped: frozenset[str] = frozenset()) -> None:
    """Read and place every item. `mapped`: targets whose destination is already a view of
    the file mapping; their items are only paged in (mmap reader), costing no host budget."""
    device = next(iter(dests.values())).device if dests else torch.device("cpu")
    cuda = device.type == "cuda"
    arena = Arena(budget, pin=cuda) if isinstance(reader, PreadReader) else None
    in_flight = ByteBudget(budget)
    streams: dict[int, torch.cuda.Stream] = {}
    if cuda:  # destinations were allocated on the current stream: let it finish first
        torch.cuda.current_stream(device).synchronize()

    def place(item: ReadItem, source: torch.Tensor) -> None:
        dest = dests[item.target]
        if cuda:
            stream = streams.get(threading.get_ident())
            if stream is None:  # one stream per worker thread, made once
                stream = streams[threading.get_ident()] = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                on_device = source.to(device, non_blocking=True)  # raw bytes over PCIe, cast on the GPU
                copy_into(dest, item, on_device)
            stream.synchronize()
        else:
            copy_into(dest, item, source)

    def pread_task(item: ReadItem, buf: torch.Tensor, staged: bool) -> None:
        try:
            source = reader.read_into(item, buf)
            if staged:
                place(item, source)
        finally:
            if staged:
                arena.free(buf)
        on_bytes(item.nbytes)

    def mmap_task(item: ReadItem) -> None:
        try:
            source = reader.read(item)
            place(item, source)
            reader.release(item, source)
        finally:
            in_flight.release(item.nbytes)
        on_bytes(item.nbytes)

    def populate_task(item: ReadItem) -> None:
        reader.populate(item, dests[item.target])
        on_bytes(item.nbytes)

    workers = _workers(reader)
    pending: deque[Future] = deque()
    announced: dict[int, Future] = {}
    with ThreadPoolExecutor(workers, thread_name_prefix="lazyload-read") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="lazyload-prefetch") as prefetcher:
        try:
            for k, group in enumerate(groups):
                if reader.prefetching:
                    # Announce the next layer while this one is placed; but never let a
                    # worker touch a page not yet announced: on a partly read file that
                    # fault would read its one page alone (MADV_RANDOM).
                    for ahead in range(k, min(k + 2, len(groups))):
                        if ahead not in announced:
                            announced[ahead] = prefetcher.submit(reader.prefetch, groups[ahead].items)
                    announced[k].result()
                for item in group.items:
                    if item.target in mapped:
                        pending.append(pool.submit(populate_task, item))
                    elif arena is not None:
                        direct = direct_target(dests[item.target], item)
                        buf = direct if direct is not None else arena.alloc(item.nbytes)
                        pending.append(pool.submit(pread_task, item, buf, direct is None))
                    else:
                        in_flight.acquire(item.nbytes)
                        pending.append(pool.submit(mmap_task, item))
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
