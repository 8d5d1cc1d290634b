"""Operating-system facts the readers and the engine rely on: page size, libc calls
Python has no binding for (madvise on any address, mincore), where a file is mapped,
the readahead window of a file's device, and this process's memory cgroup limit.

Everything here is Linux behaviour with a best-effort fallback elsewhere; the measurements
behind each use are in docs/architecture.md ("Kernel behaviours").
"""
from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os

import numpy as np
import psutil

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_RANDOM = 1
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux >= 5.14; EINVAL before, which is fine (best effort)
FAULT_AROUND = 64 * 1024  # the kernel's default fault_around_bytes
DEFAULT_READAHEAD = 128 * 1024  # the kernel's default window; smaller windows are rare


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


def madvise(address: int, length: int, advice: int) -> None:
    """madvise(advice) over the pages covering [address, address + length); best effort:
    every advice used here only changes what is cached or mapped, never the data."""
    madvise_checked(address, length, advice)


def madvise_checked(address: int, length: int, advice: int) -> int:
    """madvise(advice) over the pages covering [address, address + length); returns 0 or
    the errno. With MADV_POPULATE_READ, EFAULT means pages beyond the end of the file (it
    shrank since it was mapped: touching them would be SIGBUS) and EINVAL a kernel older
    than 5.14 (or no libc madvise at all: also EINVAL)."""
    function = libc_function("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if function is None:
        return errno.EINVAL
    if length <= 0:
        return 0
    start = address // PAGE * PAGE
    stop = -(-(address + length) // PAGE) * PAGE
    return ctypes.get_errno() if function(start, stop - start, advice) != 0 else 0


def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
    """posix_fadvise where the platform has it (a hint only: nothing is lost without it)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, advice)


def resident_pages(path: str, first: int = 0, last: int | None = None) -> np.ndarray | None:
    """One bool per page of `path` in pages [first, last) (the whole file by default,
    clipped to it): in the page cache or not (None where mincore is not available). Only
    the pages asked about are looked up, one page-cache lookup each. The private mapping
    made for the question is never touched, so asking faults nothing in."""
    mincore = libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    size = os.path.getsize(path)
    if mincore is None or size == 0:
        return None
    pages = -(-size // PAGE)
    first, last = min(first, pages), pages if last is None else min(last, pages)
    vec = np.zeros(max(last - first, 0), dtype=np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        try:
            if len(vec) and mincore(ctypes.c_void_p(address + first * PAGE), len(vec) * PAGE,
                                    vec.ctypes.data_as(ctypes.c_void_p)) != 0:
                return None
        finally:
            del address  # no buffer export may outlive the mapping
    np.bitwise_and(vec, 1, out=vec)  # the low bit says resident; the others are reserved
    return vec.view(bool)


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
    return DEFAULT_READAHEAD


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


# A memory cgroup's files, by version: its limit, its usage, and the memory.stat entries of
# its page cache (counted in its usage, but reclaimed before the limit kills anything).
_CGROUP_FILES = {"v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "total_active_file")),
                 "v2": ("memory.max", "memory.current", ("inactive_file", "active_file"))}


def _memory_cgroups() -> list[tuple[str, str]]:
    """(directory, version) of this process's memory cgroups, from its own up to the root
    (v1 memory controller, v2 unified hierarchy, or both on hybrid hosts)."""
    found = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if "memory" in controllers.split(","):
            roots, version = ["/sys/fs/cgroup/memory"], "v1"
        elif controllers == "":
            roots, version = ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"], "v2"
        else:
            continue
        for root in roots:
            parts = [p for p in group.split("/") if p]
            for depth in range(len(parts), -1, -1):
                found.append((os.path.join(root, *parts[:depth]), version))
    return found


def _read_bytes(path: str) -> int | None:
    """A cgroup file's number of bytes (None: absent, unreadable, or "max"/unlimited)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < (1 << 60) else None  # v1 writes "unlimited" as ~2**63


def memory_limit() -> int | None:
    """The tightest memory cgroup limit over this process (None when unlimited or unknown)."""
    limits = [limit for directory, version in _memory_cgroups()
              if (limit := _read_bytes(os.path.join(directory, _CGROUP_FILES[version][0]))) is not None]
    return min(limits) if limits else None


def _page_cache(directory: str, keys: tuple[str, ...]) -> int:
    """A cgroup's file pages (memory.stat), which it reclaims before it runs out."""
    total = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                total += int(value) if key in keys else 0
    except (OSError, ValueError):
        return 0
    return total


def memory_available() -> tuple[int, str]:
    """The bytes this process can still allocate, and where that number comes from: the
    least of the host's MemAvailable (/proc/meminfo; psutil's estimate where there is none)
    and, for every memory cgroup over this process that has a limit, that limit less its
    usage that is not page cache (file pages are reclaimed before the limit kills anything)."""
    available = _meminfo_available()
    best = (available, "MemAvailable in /proc/meminfo") if available is not None else (
        psutil.virtual_memory().available, "the host's available memory (psutil)")
    for directory, version in _memory_cgroups():
        limit_file, usage_file, cache_keys = _CGROUP_FILES[version]
        limit = _read_bytes(os.path.join(directory, limit_file))
        usage = _read_bytes(os.path.join(directory, usage_file))
        if limit is None or usage is None:
            continue
        room = max(limit - max(usage - _page_cache(directory, cache_keys), 0), 0)
        if room < best[0]:
            best = (room, f"the memory cgroup {directory}: {limit_file} {limit:,} less {limit - room:,} in use")
    return best


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None
