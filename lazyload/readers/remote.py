"""The remote reader: a read item's bytes as ranged GETs of its object (S3, HTTP, the Hub),
many in flight, straight into the staging arena or the destination (no local copy).

An item's contiguous runs (`byte_runs`) are coalesced: two runs at most `merge_gap` bytes
apart are fetched by one GET and the gap dropped, since on object storage a request costs
about as much as a megabyte of transfer; a range longer than `part_bytes` is split, so that
one large tensor is fetched over several connections. The engine treats it as it treats
the pread reader: staged under the same byte budget, or written in place when no cast is
needed. A GET's body lands as it arrives (`landing`): straight in its place when its runs
are adjacent, else through a scratch of `CHUNK` bytes; so no GET holds a buffer of its own
size beside the budget. With a cache, each view is also written to the range's entry once
filled, and a cached range is read from its entry into the same views. Every GET is
checked against the object's identity from the index (ETag, version, size); any failure is
a ReadError naming the URL.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import torch

from ..errors import ReadError, RemoteError
from ..expr import box_shape
from ..plan import ReadItem
from ..quant.dequant import QuantizedBox
from ..remote.source import RemoteCheckpoint
from ..report import size
from ..remote.store import ObjectIdentity, Stats
from .base import Reader
from .runs import byte_runs


CHUNK = 256 << 10  # a GET with gaps passes through a scratch buffer of this many bytes


@dataclass(frozen=True)
class Get:
    """One ranged GET [start, end) and where its bytes go: runs `first..last` (exclusive) of
    the item, each clipped to the range."""

    start: int
    end: int
    first: int
    last: int


def plan_gets(offsets: np.ndarray, run: int, merge_gap: int, part_bytes: int) -> list[Get]:
    """The GETs for runs of `run` bytes at sorted `offsets`: neighbours at most `merge_gap`
    apart share one, none longer than `part_bytes` unless a single run is (then split)."""
    ends = offsets + run
    breaks = np.flatnonzero(offsets[1:] - ends[:-1] > merge_gap) + 1
    gets = []
    for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), len(offsets)]):
        start, stop = int(offsets[lo]), int(ends[hi - 1])
        for a in range(start, stop, part_bytes):
            b = min(a + part_bytes, stop)
            first = lo + int(np.searchsorted(ends[lo:hi], a, side="right"))
            last = lo + int(np.searchsorted(offsets[lo:hi], b, side="left"))
            if first < last:  # a part wholly inside a gap carries nothing
                gets.append(Get(max(a, int(offsets[first])), min(b, int(ends[last - 1])), first, last))
    return gets


def scatter(data: memoryview, get: Get, offsets: np.ndarray, run: int, out: np.ndarray) -> None:
    """Copy the runs a GET covers from its bytes into their places in `out` (run k at k * run)."""
    src = np.frombuffer(data, dtype=np.uint8)
    rel = offsets[get.first:get.last] - get.start
    lo, hi = int(np.count_nonzero(rel < 0)), int(np.count_nonzero(rel + run <= len(src)))  # runs wholly inside
    if hi - lo > 1 and np.all(np.diff(rel[lo:hi]) == rel[lo + 1] - rel[lo]):  # evenly strided: one copy
        stride, first = int(rel[lo + 1] - rel[lo]), get.first + lo
        rows = np.lib.stride_tricks.as_strided(src[int(rel[lo]):], shape=(hi - lo, run), strides=(stride, 1))
        out[first * run:(get.first + hi) * run].reshape(hi - lo, run)[:] = rows
        edges = [*range(lo), *range(hi, len(rel))]  # runs cut by the GET's ends
    else:
        edges = range(len(rel))
    for i in edges:
        k, r = get.first + i, int(rel[i])
        a, b = max(r, 0), min(r + run, len(src))  # a run split across parts: its share here
        if a < b:
            out[k * run + a - r:k * run + b - r] = src[a:b]


def landing(get: Get, offsets: np.ndarray, run: int, out: np.ndarray, chunk: int = CHUNK) -> Iterator[memoryview]:
    """Where a GET's bytes go as they arrive: writable views, in order, whose lengths add up
    to the GET's. Runs next to each other in the file are next to each other in `out`, so a
    GET without gaps lands straight in its place; one with gaps is read `chunk` bytes at a
    time into a scratch buffer and scattered from it (each chunk once the caller has filled
    it and asks for the next), so that no GET holds more than `chunk` bytes of its own."""
    first, last = get.first, get.last
    if np.all(offsets[first + 1:last] - offsets[first:last - 1] == run):
        at = first * run + get.start - int(offsets[first])
        yield memoryview(out[at:at + get.end - get.start])
        return
    ends = offsets + run
    scratch = np.empty(min(chunk, get.end - get.start), dtype=np.uint8)
    for start in range(get.start, get.end, chunk):
        end = min(start + chunk, get.end)
        yield memoryview(scratch[:end - start])
        part = Get(start, end, int(np.searchsorted(ends, start, side="right")),
                   int(np.searchsorted(offsets, end, side="left")))
        scatter(memoryview(scratch[:end - start]), part, offsets, run, out)


class RemoteReader(Reader):
    name = "remote"
    prefetching = False  # it fetches exact ranges itself
    release_pages = False  # no page cache: nothing is kept

    def __init__(self, remote: RemoteCheckpoint, identities: Mapping[str, ObjectIdentity]):
        self._remote = remote
        self._options = remote.options
        self._identities = identities
        self.stats = Stats()  # this load's requests, per rank
        self._pool = ThreadPoolExecutor(self._options.concurrency, thread_name_prefix="lazyload-get")
        self._lock = threading.Lock()
        self.bytes_read = 0

    def read_into(self, item: ReadItem, out: torch.Tensor) -> torch.Tensor | QuantizedBox:
        """Fetch the item's bytes into `out` (a contiguous uint8 CPU tensor of item.nbytes);
        returns `out` viewed as the source box (a dequantized item: its parts' views)."""
        if item.scales is not None:
            return QuantizedBox.of(item.scales, [self.read_into(part, view) for part, view in item.staging(out)])
        offsets, run = byte_runs(item)
        memory = out.numpy().reshape(-1)
        gets = plan_gets(offsets, run, self._options.merge_gap, self._options.part_bytes)
        futures = [self._pool.submit(self._fetch, item.entry.file, get, offsets, run, memory) for get in gets]
        errors = [f.exception() for f in futures]  # every GET done: none writes into `out` any more
        failed = next((e for e in errors if e is not None), None)
        if isinstance(failed, RemoteError):
            raise ReadError(str(failed)) from failed
        if failed is not None:
            raise failed
        with self._lock:
            self.bytes_read += item.nbytes
        return out.view(item.entry.dtype).view(box_shape(item.src_box))

    def report_fields(self) -> dict:
        """The counts, and the files read whose changes cannot be detected (no ETag, date or version)."""
        unversioned = sorted(url for url, identity in self._identities.items() if not identity.versioned)
        return {**self.stats.fields(), "unversioned": unversioned}

    def progress_note(self) -> str:
        stats = self.stats
        return f"{stats.requests} GETs, {stats.retries} retries, {size(stats.bytes_served)} served"

    def _fetch(self, url: str, get: Get, offsets: np.ndarray, run: int, out: np.ndarray) -> None:
        identity = self._identities.get(url)
        self._remote.store.get(self._remote.keys[url], get.start, get.end, self.stats, identity,
                               into=lambda: landing(get, offsets, run, out))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)  # after a failure: no GET left to start
        self._remote.store.close()
