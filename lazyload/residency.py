"""Which parts of the checkpoint are already in the page cache (mincore), to choose a reader:
mapping is the fastest way to take warm pages, reading exact ranges the fastest (and the
only bounded) way to fetch cold ones."""
from __future__ import annotations

import ctypes
import mmap
import os
from collections import defaultdict

import numpy as np

from .plan import ReadItem
from .reader import PAGE, byte_runs, libc_function

def resident_pages(path: str) -> np.ndarray | None:
    """One bool per page of `path`: in the page cache or not (None where mincore is not
    available). The private mapping made for the question is never touched, so asking
    faults nothing in."""
    mincore = libc_function("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    size = os.path.getsize(path)
    if mincore is None or size == 0:
        return None
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        vec = np.zeros((size + PAGE - 1) // PAGE, dtype=np.uint8)
        try:
            if mincore(ctypes.c_void_p(address), size, vec.ctypes.data_as(ctypes.c_void_p)) != 0:
                return None
        finally:
            del address  # no buffer export may outlive the mapping
    return (vec & 1).astype(bool)


def resident_fraction(items: list[ReadItem]) -> float:
    """Share of the pages spanned by these items that are in the page cache (1.0 when it
    cannot be told, so that nothing is read twice on a guess)."""
    spans = defaultdict(list)
    for item in items:
        offsets, run = byte_runs(item)
        spans[item.entry.file].append((int(offsets[0]), int(offsets[-1]) + run))
    wanted = present = 0
    for path, ranges in spans.items():
        pages = resident_pages(path)
        if pages is None:
            return 1.0
        counts = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)])
        for start, end in ranges:
            first, last = start // PAGE, min((end + PAGE - 1) // PAGE, len(pages))
            wanted += last - first
            present += int(counts[last] - counts[first])
    return present / wanted if wanted else 1.0
