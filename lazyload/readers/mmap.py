"""The mmap reader: safetensors' `safe_open(...).get_slice(...)` over its own mapping of
each file; copies cast straight from the page cache.

safetensors (0.8, framework="pt") maps the whole file once per `safe_open` and returns
slices as views of that mapping: no anonymous memory is used, but every page touched stays
in RSS (as RssFile) until unmapped. With `release_pages`, the pages of each item are
dropped after it is placed (`madvise(MADV_DONTNEED)` on the view's address range, then
`posix_fadvise(DONTNEED)` for the page cache), so RSS stays about one budget.

Cold pages (`prefetch=True`): the engine announces each layer's exact page ranges one
layer ahead (`prefetch`, POSIX_FADV_WILLNEED: the kernel queues their reads at once), so
that the storage works while the previous layer is copied and cast, and copies find their
pages cached. Mappings of files this rank reads only part of are advised MADV_RANDOM: a
fault then reads its own page, not the 8 MB read-around of the device's readahead, most of
it other ranks' slices.
"""
from __future__ import annotations

import errno
import os
import threading
from typing import Mapping

import torch

from ..errors import ReadError
from ..headers import FileIdentity
from ..plan import ReadItem
from ..quant.dequant import QuantizedBox
from ..system import (FAULT_AROUND, MADV_DONTNEED, MADV_POPULATE_READ, MADV_RANDOM, fadvise, file_mappings,
                      madvise, madvise_checked, readahead_window)
from .base import Reader
from .identity import RERUN, check_size, open_checked
from .runs import byte_runs, is_one_range, span_is_cheaper

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive; safetensors starts with a length


class MmapReader(Reader):
    name = "mmap"
    staged = False  # slices are views of the mapping, cast straight from the page cache
    maps_views = True
    # Its threads fault pages and copy: about one per core.
    threads = min(4, os.cpu_count() or 2)

    def __init__(self, release_pages: bool = False, partial_files: set[str] = frozenset(),
                 prefetch: bool = False, host_ranks: int = 1, identities: Mapping[str, FileIdentity] | None = None):
        self.release_pages = release_pages
        self._identities = identities or {}  # path -> the file as indexed, checked on open
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
        """safe_open's handle for a safetensors file; for torch.save's zip format (.bin,
        .pt) a uint8 tensor mapping the whole file (MAP_PRIVATE), whose tensors the index
        located by byte offset."""
        from safetensors import safe_open

        with self._lock:
            handle = self._files.get(path)
            if handle is None:
                if os.pread(self._fd(path), 4, 0) == ZIP_MAGIC:  # _fd: the file as indexed, or a ReadError
                    try:
                        handle = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
                    except (OSError, RuntimeError) as exc:
                        raise ReadError(f"{path}: cannot map it ({exc}).") from exc
                else:
                    if path in self._partial:
                        self._cache_header(path)
                    try:
                        handle = safe_open(path, framework="pt")
                    except Exception as exc:  # safetensors raises its own error types
                        raise ReadError(f"{path}: safetensors cannot open it ({exc}).") from exc
                self._files[path] = handle
                if path in self._partial:
                    for lo, hi in self._mappings(path):
                        madvise(lo, hi - lo, MADV_RANDOM)
            return handle

    def _fd(self, path: str) -> int:  # callers hold self._lock
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = open_checked(path, self._identities.get(path))
            self._windows[path] = readahead_window(path)
            fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # reads fetch what they ask, no more
        return fd

    def _cache_header(self, path: str) -> None:
        """Bring the header's pages, and only them, into the page cache. safe_open parses the
        header through a mapping, and a fault on an uncached page 0 reads the 8 MB around it
        (the device's readahead): other ranks' tensors, or the whole of a small file."""
        fd = self._fd(path)
        raw = os.pread(fd, 8, 0)
        if len(raw) == 8:  # a shorter file is safe_open's error to report
            os.pread(fd, int.from_bytes(raw, "little"), 8)

    def read(self, item: ReadItem) -> torch.Tensor | QuantizedBox:
        """The item's bytes as a view of the mapping, once the file is checked to still
        hold them: a page beyond the end of a file truncated since would be SIGBUS when
        copied (a ReadError instead; only a truncation during this one item's copy, after
        the check, is not caught)."""
        if item.scales is not None:  # a dequantized weight: its box, its scale blocks
            return QuantizedBox.of(item.scales, [self.read(part) for part in item.reads()])
        self._check_size(item)
        handle = self._open(item.entry.file)
        tensor = self.view(item) if item.src_box or isinstance(handle, torch.Tensor) else handle.get_tensor(item.entry.key)
        with self._lock:
            self.bytes_read += item.nbytes
        return tensor

    def view(self, item: ReadItem) -> torch.Tensor:
        """The item's bytes as a view of the file mapping, nothing read yet: pages are
        faulted in when first used (copy-on-write: writing to it never changes the file)."""
        handle = self._open(item.entry.file)
        box = tuple(slice(a, b) for a, b in item.src_box)
        if isinstance(handle, torch.Tensor):
            entry = item.entry
            raw = handle[entry.start:entry.end]
            if entry.start % entry.itemsize:  # a DCP chunk's zip sits at any byte: its box is copied out
                box_bytes = raw.view(*entry.shape, entry.itemsize)[box]
                return box_bytes.clone(memory_format=torch.contiguous_format).view(entry.dtype)[..., 0]
            return raw.view(entry.dtype).view(entry.shape)[box]
        return handle.get_slice(item.entry.key)[box]

    def prefetch(self, items: tuple[ReadItem, ...]) -> None:
        """Queue the reads of these items' pages (no waiting): the whole span of an item
        when that costs few extra pages (see `span_is_cheaper`), else run by run."""
        if not hasattr(os, "posix_fadvise"):
            return
        for item in (part for item in items for part in item.reads()):
            with self._lock:
                fd = self._fd(item.entry.file)
                chunk = self._windows[item.entry.file]
            offsets, run = byte_runs(item)
            if is_one_range(offsets, run) or span_is_cheaper(offsets, run, self._sharers):
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
        On a kernel without it (< 5.14) the pages were at least announced by `prefetch`.
        Pages beyond the end of a file truncated since it was mapped are EFAULT here (not
        SIGBUS): a ReadError."""
        self._check_size(item)
        if madvise_checked(view.data_ptr(), view.nbytes, MADV_POPULATE_READ) == errno.EFAULT:
            raise ReadError(f"{item.entry.file}: changed since it was indexed (its mapped pages end before tensor "
                            f"{item.entry.key!r}); {RERUN}")

    def _check_size(self, item: ReadItem) -> None:
        path = item.entry.file
        self._open(path)
        with self._lock:
            fd = self._fd(path)
        check_size(fd, path, self._identities.get(path), item.entry.end)

    def release(self, item: ReadItem, tensor: torch.Tensor | QuantizedBox) -> None:
        """Drop the item's pages: from this process's mapping (RSS), then from the page
        cache. `tensor` is the view `read` returned; the mapping is never written, so a
        page dropped here is read again from the file if another item needs it."""
        if not self.release_pages:
            return
        if item.scales is not None:
            for part, view in zip(item.reads(), tensor.parts()):
                self.release(part, view)
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
            madvise(lo, hi - lo, MADV_DONTNEED)
        with self._lock:
            fd = self._fd(item.entry.file)
        fadvise(fd, int(offsets[0]), span, os.POSIX_FADV_DONTNEED)

    def check_mapped(self) -> None:
        """Every file mapped here still has its indexed size: targets left as views of a
        mapping would otherwise be SIGBUS when the model reads a page the file lost."""
        with self._lock:
            fds = {path: self._fds[path] for path in self._files}
        for path, fd in fds.items():
            expected = self._identities.get(path)
            check_size(fd, path, expected, expected.size if expected is not None else 0)

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

