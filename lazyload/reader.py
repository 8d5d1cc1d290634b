"""Readers: the bytes of a read item, off disk.

- `MmapReader`: safetensors' `safe_open(...).get_slice(...)` over mmap; casts straight
  from the page cache; its pages count as file-backed RSS.
  safetensors (0.8, framework="pt") maps the whole file once per `safe_open` and returns
  slices as views of that mapping: no anonymous memory is used, but every page touched
  stays in RSS (as RssFile) until unmapped. With `release_pages`, the pages of each item
  are dropped after it is placed (`madvise(MADV_DONTNEED)` on the view's address range,
  then `posix_fadvise(DONTNEED)` for the page cache), so RSS stays about one budget.
  With cold pages, the engine has it `prefetch` each layer's exact ranges a layer ahead.
- `PreadReader`: exact byte runs with `os.preadv` into a staging arena allocated once and
  reused (pinned when the destination is a GPU, its use), or straight into the destination
  when no conversion is needed; keeps readahead off for partial reads, and can drop consumed
  pages from the cache so that RSS stays bounded. Strided (row-parallel) boxes whose runs
  are short read the whole span in a few large reads through a small per-thread bounce
  buffer and gather in memory, when that costs at most SPAN_WASTE times the pages of the
  exact runs (see `_span_is_cheaper`); `bytes_read` counts what was actually read.
- `memory_limit()`: this process's memory cgroup limit (v1 or v2), so that the engine can
  release pages on its own on a host smaller than the checkpoint.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from typing import Callable

import numpy as np
import torch

from .errors import PlanError, ReadError
from .expr import box_shape
from .plan import ReadItem

IOV_MAX = 1024
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
SPAN_CHUNK = 4 << 20  # bounce buffer per read thread for strided boxes read as whole spans
SHORT_RUN = 256 << 10  # runs at least this long are read exactly (few syscalls anyway)
# A span is read instead of its runs only if it costs at most this many times the pages
# the runs touch: the storage reads whole pages anyway, so rows shorter than a page cost
# nothing extra, while a span that is mostly other ranks' rows is not worth it.
SPAN_WASTE = 1.25


def byte_runs(item: ReadItem) -> tuple[np.ndarray, int]:
    """(absolute file offsets of the contiguous runs of the item's source box, run length in
    bytes). The box is row-major: runs are the trailing dims from the last partial one."""
    shape, box = item.entry.shape, item.src_box
    itemsize = item.entry.itemsize
    if not shape:
        return np.array([item.entry.start], dtype=np.int64), itemsize
    partial = [d for d in range(len(shape)) if box[d] != (0, shape[d])]
    last = partial[-1] if partial else 0
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    run = (box[last][1] - box[last][0]) * strides[last] * itemsize
    offsets = np.array([item.entry.start + box[last][0] * strides[last] * itemsize], dtype=np.int64)
    for d in range(last - 1, -1, -1):
        steps = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d] * itemsize
        offsets = (steps[:, None] + offsets[None, :]).reshape(-1)
    return offsets, run


class Arena:
    """One staging buffer, allocated once; first-fit ranges handed out and given back.
    `alloc` blocks until a range is free: that is the back-pressure on reading."""

    def __init__(self, nbytes: int, pin: bool = False):
        self.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self.size = max(nbytes, 1)
        self._used: list[tuple[int, int]] = []  # sorted (start, stop)
        self._cond = threading.Condition()

    def _find(self, n: int) -> int | None:
        cursor = 0
        for start, stop in self._used:
            if start - cursor >= n:
                return cursor
            cursor = stop
        return cursor if self.size - cursor >= n else None

    def alloc(self, n: int) -> torch.Tensor:
        if n > self.size:
            raise ValueError(f"a read of {n} bytes exceeds the staging budget of {self.size} bytes")
        with self._cond:
            while (start := self._find(n)) is None:
                self._cond.wait()
            self._used.append((start, start + n))
            self._used.sort()
        return self.buffer[start:start + n]

    def free(self, view: torch.Tensor) -> None:
        start = view.data_ptr() - self.buffer.data_ptr()
        with self._cond:
            self._used = [r for r in self._used if r[0] != start]
            self._cond.notify_all()


def _as_tensor(raw: torch.Tensor, item: ReadItem) -> torch.Tensor:
    return raw.view(item.entry.dtype).view(box_shape(item.src_box))


class PreadReader:
    name = "pread"
    prefetching = False  # it reads exact ranges itself

    def __init__(self, release_pages: bool = False, partial_files: set[str] = frozenset()):
        self.release_pages = release_pages
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._partial = partial_files  # files this rank reads only part of: no readahead
        self._local = threading.local()
        self.bytes_read = 0

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as exc:
                    raise ReadError(f"{path}: cannot open ({exc.strerror}).") from exc
                if hasattr(os, "posix_fadvise"):
                    advice = os.POSIX_FADV_RANDOM if path in self._partial else os.POSIX_FADV_SEQUENTIAL
                    os.posix_fadvise(fd, 0, 0, advice)
                self._fds[path] = fd
            return fd

    def read_into(self, item: ReadItem, out: torch.Tensor) -> torch.Tensor:
        """Read the item's bytes into `out` (a contiguous uint8 CPU tensor of item.nbytes);
        returns `out` viewed as the source box."""
        fd = self._fd(item.entry.file)
        offsets, run = byte_runs(item)
        memory = memoryview(out.numpy()).cast("B")
        path = item.entry.file
        if len(offsets) == 1 or _adjacent(offsets, run):
            _pread_exact(fd, memory, int(offsets[0]), path)
            read = len(memory)
        elif _span_is_cheaper(offsets, run):
            read = _read_spans(fd, out.numpy(), offsets, run, self._bounce(), path)
        else:
            for i in range(0, len(offsets), IOV_MAX):
                chunk = offsets[i:i + IOV_MAX]
                _preadv_runs(fd, memory[i * run:(i + len(chunk)) * run], chunk, run, path)
            read = len(memory)
        with self._lock:
            self.bytes_read += read
        if self.release_pages and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, int(offsets[0]), int(offsets[-1]) + run - int(offsets[0]), os.POSIX_FADV_DONTNEED)
        return _as_tensor(out, item)

    def _bounce(self) -> np.ndarray:
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = np.empty(SPAN_CHUNK, dtype=np.uint8)
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _adjacent(offsets: np.ndarray, run: int) -> bool:
    return bool(np.all(np.diff(offsets) == run))


def _pread_exact(fd: int, memory: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(memory):
        n = os.preadv(fd, [memory[done:]], offset + done)
        if n <= 0:
            raise ReadError(f"{path}: short read at byte {offset + done} (file truncated or I/O error).")
        done += n


def _preadv_runs(fd: int, memory: memoryview, offsets: np.ndarray, run: int, path: str) -> None:
    # Runs that are not adjacent in the file need a read each (preadv scatters memory, not
    # file offsets); their pages are all this rank needs, so nothing else is fetched.
    # Announce every run first (POSIX_FADV_WILLNEED queues their pages' I/O at once), so
    # that the reads below find them cached instead of waiting on each page in turn.
    if hasattr(os, "posix_fadvise"):
        for offset in offsets.tolist():
            os.posix_fadvise(fd, offset, run, os.POSIX_FADV_WILLNEED)
    for j, offset in enumerate(offsets.tolist()):
        _pread_exact(fd, memory[j * run:(j + 1) * run], offset, path)


def pages_touched(offsets: np.ndarray, run: int) -> int:
    """Distinct pages covered by runs of `run` bytes at sorted `offsets`."""
    first = offsets // PAGE
    last = (offsets + run - 1) // PAGE
    shared = int(np.count_nonzero(first[1:] == last[:-1])) if len(offsets) > 1 else 0
    return int(np.sum(last - first + 1)) - shared


def _span_is_cheaper(offsets: np.ndarray, run: int, sharers: int = 1) -> bool:
    """Read the whole span instead of each run: when runs are short (a syscall each would
    dominate, and the storage reads whole pages anyway) and the span holds at most
    SPAN_WASTE times the pages the exact runs touch. `sharers`: ranks on this host that
    read the same span into the one page cache share its cost (each page still comes from
    storage once), so the span may be that many times larger."""
    if run >= SHORT_RUN:
        return False
    span = int(offsets[-1]) + run - int(offsets[0])
    span_pages = (int(offsets[0]) % PAGE + span + PAGE - 1) // PAGE
    return span_pages <= SPAN_WASTE * sharers * pages_touched(offsets, run)


def _read_spans(fd: int, out: np.ndarray, offsets: np.ndarray, run: int, bounce: np.ndarray, path: str) -> int:
    """Read consecutive runs a bounce buffer at a time (one pread per span), gathering the
    runs into `out`. Returns the bytes read."""
    out = out.reshape(-1)
    cap = len(bounce)
    read, i, n = 0, 0, len(offsets)
    while i < n:
        base = int(offsets[i])
        # Runs that fit in the bounce buffer from offsets[i] on.
        j = i + max(1, int(np.searchsorted(offsets[i:], base + cap - run, side="right")))
        span = int(offsets[j - 1]) + run - base
        if span > cap:  # a single run longer than the bounce buffer: read it exactly
            _pread_exact(fd, memoryview(out[i * run:(i + 1) * run]), base, path)
            read += run
            i += 1
            continue
        _pread_exact(fd, memoryview(bounce[:span]), base, path)
        read += span
        rel = offsets[i:j] - base
        dst = out[i * run:j * run].reshape(j - i, run)
        if j - i > 1 and np.all(np.diff(rel) == rel[1] - rel[0]):
            stride = int(rel[1] - rel[0])
            dst[:] = np.lib.stride_tricks.as_strided(bounce, shape=(j - i, run), strides=(stride, 1))
        else:
            for k, r in enumerate(rel.tolist()):
                dst[k] = bounce[r:r + run]
        i = j
    return read


class MmapReader:
    """safetensors' `get_slice` over its own mmap of each file.

    Cold pages (`prefetch=True`): the engine announces each layer's exact page ranges one
    layer ahead (`prefetch`, POSIX_FADV_WILLNEED: the kernel queues their reads at once), so
    that the storage works while the previous layer is copied and cast, and copies find
    their pages cached. Mappings of files this rank reads only part of are advised
    MADV_RANDOM: a fault then reads its own page, not the 8 MB read-around of the device's
    readahead, most of it other ranks' slices."""

    name = "mmap"

    def __init__(self, release_pages: bool = False, partial_files: set[str] = frozenset(),
                 prefetch: bool = False, host_ranks: int = 1):
        self.release_pages = release_pages
        self.prefetching = prefetch
        # Ranks of this load on this host, which share the page cache: a strided span that
        # they read together costs each of them a share (not when pages are released:
        # then each rank would drop the others' pages and read them again).
        self._sharers = 1 if release_pages else max(1, host_ranks)
        self._partial = partial_files
        self._files: dict[str, object] = {}
        self._fds: dict[str, int] = {}
        self._windows: dict[str, int] = {}  # path -> readahead_window, found with its fd
        self._maps: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _open(self, path: str):
        from safetensors import safe_open

        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                if path in self._partial:
                    self._cache_header(path)
                try:
                    handle = safe_open(path, framework="pt")
                except Exception as exc:  # safetensors raises its own error types
                    raise ReadError(f"{path}: safetensors cannot open it ({exc}).") from exc
                self._files[path] = handle
                if path in self._partial:
                    for lo, hi in self._mappings(path):
                        _madvise(lo, hi - lo, _MADV_RANDOM)
            return handle

    def _fd(self, path: str) -> int:  # callers hold self._lock
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            self._windows[path] = readahead_window(path)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # reads fetch what they ask, no more
        return fd

    def _cache_header(self, path: str) -> None:
        """Bring the header's pages, and only them, into the page cache. safe_open parses the
        header through a mapping, and a fault on an uncached page 0 reads the 8 MB around it
        (the device's readahead): other ranks' tensors, or the whole of a small file."""
        fd = self._fd(path)
        raw = os.pread(fd, 8, 0)
        if len(raw) == 8:  # a shorter file is safe_open's error to report
            os.pread(fd, int.from_bytes(raw, "little"), 8)

    def read(self, item: ReadItem) -> torch.Tensor:
        tensor = self.view(item) if item.src_box else self._open(item.entry.file).get_tensor(item.entry.key)
        with self._lock:
            self.bytes_read += item.nbytes
        return tensor

    def view(self, item: ReadItem) -> torch.Tensor:
        """The item's bytes as a view of the file mapping, nothing read yet: pages are
        faulted in when first used (copy-on-write: writing to it never changes the file)."""
        handle = self._open(item.entry.file)
        return handle.get_slice(item.entry.key)[tuple(slice(a, b) for a, b in item.src_box)]

    def prefetch(self, items: tuple[ReadItem, ...]) -> None:
        """Queue the reads of these items' pages (no waiting): the whole span of an item
        when that costs few extra pages (see `_span_is_cheaper`), else run by run."""
        if not hasattr(os, "posix_fadvise"):
            return
        for item in items:
            with self._lock:
                fd = self._fd(item.entry.file)
                chunk = self._windows[item.entry.file]
            offsets, run = byte_runs(item)
            if len(offsets) == 1 or _adjacent(offsets, run) or _span_is_cheaper(offsets, run, self._sharers):
                ranges = [(int(offsets[0]), int(offsets[-1]) + run - int(offsets[0]))]
            else:
                ranges = [(offset, run) for offset in offsets.tolist()]
            # One WILLNEED reads at most the file's readahead window and silently drops the
            # rest (force_page_cache_ra), so a long range is announced a window at a time.
            for offset, length in ranges:
                for start in range(offset, offset + length, chunk):
                    os.posix_fadvise(fd, start, min(chunk, offset + length - start), os.POSIX_FADV_WILLNEED)

    def populate(self, item: ReadItem, view: torch.Tensor) -> None:
        """Fault a mapped view's pages in now (MADV_POPULATE_READ: read from storage if
        needed, then mapped), so that the loaded model reads nothing from storage later.
        On a kernel without it (< 5.14) the pages were at least announced by `prefetch`."""
        _madvise(view.data_ptr(), view.nbytes, _MADV_POPULATE_READ)

    def release(self, item: ReadItem, tensor: torch.Tensor) -> None:
        """Drop the item's pages: from this process's mapping (RSS), then from the page
        cache. `tensor` is the view `read` returned; the mapping is never written, so a
        page dropped here is read again from the file if another item needs it."""
        if not self.release_pages:
            return
        offsets, run = byte_runs(item)
        span = int(offsets[-1]) + run - int(offsets[0])
        mapping = self._mapping_of(item.entry.file, tensor.data_ptr(), span)
        if mapping is not None:
            # A fault also maps up to fault_around_bytes (64 KiB) of cached neighbours: drop
            # those too, or they stay in RSS. Nothing here is written, so a neighbour that
            # another item still reads is simply faulted in again.
            lo = max(mapping[0], tensor.data_ptr() - FAULT_AROUND)
            hi = min(mapping[1], tensor.data_ptr() + span + FAULT_AROUND)
            _madvise(lo, hi - lo, _MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            with self._lock:
                fd = self._fd(item.entry.file)
            os.posix_fadvise(fd, int(offsets[0]), span, os.POSIX_FADV_DONTNEED)

    def _mappings(self, path: str) -> list[tuple[int, int]]:
        ranges = self._maps.get(path)
        if ranges is None:  # safe_open mapped the file once; it does not move
            ranges = self._maps[path] = file_mappings(path)
        return ranges

    def _mapping_of(self, path: str, address: int, length: int) -> tuple[int, int] | None:
        """The mapping of `path` that holds [address, address + length), if any."""
        with self._lock:
            ranges = self._mappings(path)
        return next(((lo, hi) for lo, hi in ranges if lo <= address and address + length <= hi), None)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._windows.clear()
        self._files.clear()
        self._maps.clear()


_MADV_RANDOM = 1
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux >= 5.14; EINVAL before, which is fine (best effort)
FAULT_AROUND = 64 * 1024  # the kernel's default fault_around_bytes
@functools.lru_cache(maxsize=None)
def libc_function(name: str, *argtypes):
    """A libc function through ctypes, or None where there is none (Python's mmap module has
    no mincore, and madvise only on mappings it made itself)."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    return function


def _madvise(address: int, length: int, advice: int) -> None:
    """madvise(advice) over the pages covering [address, address + length); best effort:
    every advice used here only changes what is cached or mapped, never the data."""
    madvise = libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if madvise is None or length <= 0:
        return
    start = address // PAGE * PAGE
    stop = -(-(address + length) // PAGE) * PAGE
    madvise(start, stop - start, advice)


@functools.lru_cache(maxsize=None)
def _device_readahead(device: int) -> int:
    major, minor = os.major(device), os.minor(device)
    for path in (f"/sys/class/bdi/{major}:{minor}/read_ahead_kb",  # whole disks, NFS, FUSE
                 f"/sys/dev/block/{major}:{minor}/../queue/read_ahead_kb"):  # a partition's disk
        try:
            with open(path) as f:
                kb = int(f.read())
        except (OSError, ValueError):
            continue
        if kb > 0:
            return kb * 1024
    return 128 * 1024  # the kernel's default window; smaller windows are rare


def readahead_window(path: str) -> int:
    """Bytes one POSIX_FADV_WILLNEED on `path` reads at most: its device's readahead window
    (/sys/class/bdi/*/read_ahead_kb), or 128 KiB where that cannot be found."""
    return _device_readahead(os.stat(path).st_dev)


def file_mappings(path: str) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (from /proc/self/maps). Pages are
    dropped (MADV_DONTNEED) only inside them, where nothing is lost: they are read again
    from the file. A tensor that safetensors had copied into anonymous memory would be
    zeroed instead, so it is never advised."""
    real = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == real:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((lo, hi))
    except OSError:
        pass
    return ranges


def _cgroup_paths() -> list[str]:
    """Files holding this process's memory limit, from its cgroup up to the root
    (v1 memory controller, v2 unified hierarchy, or both on hybrid hosts)."""
    paths = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            roots, name = ["/sys/fs/cgroup/memory"], "memory.limit_in_bytes"
        elif controllers == "":
            roots, name = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"], "memory.max"
        else:
            continue
        for root in roots:
            parts = [p for p in group.split("/") if p]
            for depth in range(len(parts), -1, -1):
                paths.append(os.path.join(root, *parts[:depth], name))
    return paths


def memory_limit() -> int | None:
    """The tightest memory cgroup limit over this process (None when unlimited or unknown)."""
    limits = []
    for path in _cgroup_paths():
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):  # v1 writes "unlimited" as ~2**63
            limits.append(int(text))
    return min(limits) if limits else None


def choose_reader(name: str, device: torch.device, release_pages: bool, partial_files: set[str],
                  warm: Callable[[], bool] = lambda: True, host_ranks: int = 1) -> MmapReader | PreadReader:
    """"auto": mmap for a CPU destination, pread (pinned staging) for a GPU. The mmap
    reader casts straight from the page cache, where pread pays one more copy (into its
    staging) and, for same-dtype targets, cannot keep views of the mapping: measured on
    cold storage too (benchmarks/bench_stream.py), mapping with exact prefetch wins. Its
    prefetch is on when this rank's pages are not in the page cache (`warm`, asked only
    for mmap: announcing cached pages costs a page-cache lookup each). `host_ranks`: ranks
    of this load on this host (see `MmapReader`)."""
    if name == "auto":
        name = "mmap" if device.type == "cpu" else "pread"
    if name == "pread":
        return PreadReader(release_pages, partial_files)
    if name == "mmap":
        return MmapReader(release_pages, partial_files, prefetch=not warm(), host_ranks=host_ranks)
    raise PlanError(f"unknown reader {name!r}; use 'auto', 'mmap' or 'pread'.")
