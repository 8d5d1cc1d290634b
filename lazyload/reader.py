"""Readers: the bytes of a read item, off disk.

- `MmapReader`: safetensors' `safe_open(...).get_slice(...)` over mmap; fastest when the
  page cache is warm; its pages count as file-backed RSS.
- `PreadReader`: exact byte runs with `os.preadv` into a staging arena allocated once and
  reused (pinned when the destination is a GPU), or straight into the destination when
  no conversion is needed; keeps readahead off for partial reads, and can drop consumed
  pages from the cache so that RSS stays bounded.
"""
from __future__ import annotations

import math
import os
import threading
import numpy as np
import torch

from .errors import ReadError
from .expr import Box, box_shape
from .plan import ReadItem

IOV_MAX = 1024


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

    def __init__(self, release_pages: bool = False, partial_files: set[str] = frozenset()):
        self.release_pages = release_pages
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._partial = partial_files  # files this rank reads only part of: no readahead
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
        if len(offsets) == 1 or _adjacent(offsets, run):
            _pread_exact(fd, memory, int(offsets[0]), item.entry.file)
        else:
            for i in range(0, len(offsets), IOV_MAX):
                chunk = offsets[i:i + IOV_MAX]
                _preadv_runs(fd, memory[i * run:(i + len(chunk)) * run], chunk, run, item.entry.file)
        with self._lock:
            self.bytes_read += item.nbytes
        if self.release_pages and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, int(offsets[0]), int(offsets[-1]) + run - int(offsets[0]), os.POSIX_FADV_DONTNEED)
        return _as_tensor(out, item)

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
    for j, offset in enumerate(offsets.tolist()):
        _pread_exact(fd, memory[j * run:(j + 1) * run], offset, path)


class MmapReader:
    """safetensors' `get_slice` over its own mmap of each file."""

    name = "mmap"

    def __init__(self, release_pages: bool = False):
        self.release_pages = release_pages
        self._files: dict[str, object] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _open(self, path: str):
        from safetensors import safe_open

        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                try:
                    handle = safe_open(path, framework="pt")
                except Exception as exc:  # safetensors raises its own error types
                    raise ReadError(f"{path}: safetensors cannot open it ({exc}).") from exc
                self._files[path] = handle
            return handle

    def read(self, item: ReadItem) -> torch.Tensor:
        handle = self._open(item.entry.file)
        slices = tuple(slice(a, b) for a, b in item.src_box)
        tensor = handle.get_slice(item.entry.key)[slices] if slices else handle.get_tensor(item.entry.key)
        with self._lock:
            self.bytes_read += item.nbytes
        return tensor

    def release(self, item: ReadItem) -> None:
        """Drop the item's file pages from the page cache (and so from RSS)."""
        if not self.release_pages or not hasattr(os, "posix_fadvise"):
            return
        offsets, run = byte_runs(item)
        fd = os.open(item.entry.file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, int(offsets[0]), int(offsets[-1]) + run - int(offsets[0]), os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._files.clear()


def choose_reader(name: str, device: torch.device, release_pages: bool,
                  partial_files: set[str]) -> MmapReader | PreadReader:
    """"auto": pread where the destination is a GPU (pinned staging), where pages must be
    released, or where the rank reads only parts of files; mmap otherwise."""
    if name == "auto":
        name = "pread" if (device.type != "cpu" or release_pages or partial_files) else "mmap"
    if name == "pread":
        return PreadReader(release_pages, partial_files)
    if name == "mmap":
        return MmapReader(release_pages)
    raise ValueError(f"unknown reader {name!r}; use 'auto', 'mmap' or 'pread'.")

