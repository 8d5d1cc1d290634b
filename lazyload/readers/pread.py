"""The pread reader: exact byte runs with `os.preadv` into a staging arena allocated once
and reused (pinned when the destination is a GPU), or straight into the destination when
no conversion is needed.

It keeps readahead off for files it reads only part of, and can drop consumed pages from
the cache so that RSS stays bounded. Strided (row-parallel) boxes whose runs are short are
read as whole spans in a few large reads through a small per-thread bounce buffer and
gathered in memory, when that costs at most SPAN_WASTE times the pages of the exact runs
(see `runs.span_is_cheaper`); `bytes_read` counts what was actually read.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Mapping

import numpy as np
import torch

from ..errors import ReadError
from ..expr import box_shape
from ..headers import FileIdentity
from ..plan import STAGE_ALIGN, ReadItem
from ..quant.dequant import QuantizedBox
from ..system import PAGE, fadvise
from .base import Reader
from .identity import RERUN, open_checked
from .runs import byte_runs, is_one_range, span_is_cheaper

IOV_MAX = 1024
SPAN_CHUNK = 4 << 20  # bounce buffer per read thread for strided boxes read as whole spans
ALIGN = 64  # staging ranges start on a cache line: a multiple of every dtype's element size
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable

logger = logging.getLogger("lazyload")


class Arena:
    """One staging buffer, allocated once; first-fit ranges handed out and given back, each
    starting on an ALIGN-byte boundary (a range is then viewed as its tensor's dtype, which
    needs an offset divisible by the element size). `alloc` blocks until a range is free:
    that is the back-pressure on reading.

    `pin`: the buffer is page-locked for asynchronous copies to a GPU (registered with
    CUDA, as torch.distributed.checkpoint's stager does, rather than taken from torch's
    pinned allocator, which rounds a request up to a power of two and keeps the block for
    the life of the process); `close` unlocks it. `pinned_bytes` says how much is locked."""

    def __init__(self, nbytes: int, pin: bool = False):
        self.size = max(nbytes, 1)
        raw = torch.empty(self.size + PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % PAGE  # page-aligned: the pages locked are exactly ours
        self.buffer = raw[skip:skip + self.size]
        self.pinned_bytes = _pin(self.buffer) if pin else 0
        self._used: list[tuple[int, int]] = []  # sorted (start, stop)
        self._cond = threading.Condition()

    def _find(self, n: int) -> int | None:
        cursor = 0
        for start, stop in self._used:
            if start - cursor >= n:
                return cursor
            cursor = -(-stop // STAGE_ALIGN) * STAGE_ALIGN  # every range can be viewed as any dtype
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

    def close(self) -> None:
        """Unlock the pages (call once no copy from the buffer is in flight)."""
        if self.pinned_bytes:
            code = int(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()))
            if code != 0:
                logger.warning("could not unpin %d bytes of staging memory (CUDA error %d)", self.pinned_bytes, code)
            self.pinned_bytes = 0


def _pin(buffer: torch.Tensor) -> int:
    """Page-lock `buffer` for the current CUDA device's context (and, portable, for the
    others); returns the bytes locked: 0 when CUDA refuses, the copies then being
    synchronous (staged by the driver) but still correct."""
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, HOST_REGISTER_PORTABLE))
    if code != 0:
        clear_cuda_error()  # else the user's next kernel launch would raise this error as its own
        logger.warning("could not pin %d bytes of staging memory (CUDA error %d); copying to the GPU from "
                       "pageable memory instead (slower)", buffer.nbytes, code)
        return 0
    return buffer.nbytes


def loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), or None (statically linked,
    or no CUDA). torch's `cudart()` bindings lack cudaGetLastError; dlopen of a library
    already loaded returns that same library, so its per-thread last error is the one
    torch's kernel launches check."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libcudart.so" in line), None)
    except OSError:
        return None
    return ctypes.CDLL(path) if path else None


def clear_cuda_error() -> None:
    """Reset CUDA's last error of this thread (cudaGetLastError), after a refused call."""
    cudart = loaded_cudart()
    if cudart is not None:
        cudart.cudaGetLastError()


class PreadReader(Reader):
    name = "pread"
    prefetching = False  # it reads exact ranges itself

    def __init__(self, release_pages: bool = False, partial_files: set[str] = frozenset(),
                 identities: Mapping[str, FileIdentity] | None = None):
        self.release_pages = release_pages
        self._identities = identities or {}  # path -> the file as indexed, checked on open
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._partial = partial_files  # files this rank reads only part of: no readahead
        self._local = threading.local()
        self.bytes_read = 0

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = open_checked(path, self._identities.get(path))
                fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if path in self._partial else os.POSIX_FADV_SEQUENTIAL)
                self._fds[path] = fd
            return fd

    def read_into(self, item: ReadItem, out: torch.Tensor) -> torch.Tensor | QuantizedBox:
        """Read the item's bytes into `out` (a contiguous uint8 CPU tensor of item.nbytes);
        returns `out` viewed as the source box (a dequantized item: its parts' views)."""
        if item.scales is not None:
            return QuantizedBox.of(item.scales, [self.read_into(part, view) for part, view in item.staging(out)])
        fd = self._fd(item.entry.file)
        offsets, run = byte_runs(item)
        memory = memoryview(out.numpy()).cast("B")
        path = item.entry.file
        if is_one_range(offsets, run):
            _pread_exact(fd, memory, int(offsets[0]), path)
            read = len(memory)
        elif span_is_cheaper(offsets, run):
            read = _read_spans(fd, out.numpy(), offsets, run, self._bounce(), path)
        else:
            for i in range(0, len(offsets), IOV_MAX):
                chunk = offsets[i:i + IOV_MAX]
                _preadv_runs(fd, memory[i * run:(i + len(chunk)) * run], chunk, run, path)
            read = len(memory)
        with self._lock:
            self.bytes_read += read
        if self.release_pages:
            fadvise(fd, int(offsets[0]), int(offsets[-1]) + run - int(offsets[0]), os.POSIX_FADV_DONTNEED)
        return out.view(item.entry.dtype).view(box_shape(item.src_box))

    def _bounce(self) -> np.ndarray:
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            buf = self._local.bounce = np.empty(SPAN_CHUNK, dtype=np.uint8)
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _pread_exact(fd: int, memory: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(memory):
        n = os.preadv(fd, [memory[done:]], offset + done)
        if n <= 0:
            raise ReadError(f"{path}: short read at byte {offset + done} (the file was truncated since it was "
                            f"indexed); {RERUN}")
        done += n


def _preadv_runs(fd: int, memory: memoryview, offsets: np.ndarray, run: int, path: str) -> None:
    # Runs that are not adjacent in the file need a read each (preadv scatters memory, not
    # file offsets); their pages are all this rank needs, so nothing else is fetched.
    # Announce every run first (POSIX_FADV_WILLNEED queues their pages' I/O at once), so
    # that the reads below find them cached instead of waiting on each page in turn.
    for offset in offsets.tolist():
        fadvise(fd, offset, run, os.POSIX_FADV_WILLNEED)
    for j, offset in enumerate(offsets.tolist()):
        _pread_exact(fd, memory[j * run:(j + 1) * run], offset, path)


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
