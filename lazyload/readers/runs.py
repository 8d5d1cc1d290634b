"""Where a read item's bytes lie in its file: the contiguous runs of its box, the pages
they touch, and whether reading the whole span beats reading run by run."""
from __future__ import annotations

import math

import numpy as np

from ..plan import ReadItem
from ..system import PAGE

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


def is_one_range(offsets: np.ndarray, run: int) -> bool:
    """The runs follow each other in the file: one read covers them all."""
    return len(offsets) == 1 or bool(np.all(np.diff(offsets) == run))


def pages_touched(offsets: np.ndarray, run: int) -> int:
    """Distinct pages covered by runs of `run` bytes at sorted `offsets`."""
    first = offsets // PAGE
    last = (offsets + run - 1) // PAGE
    shared = int(np.count_nonzero(first[1:] == last[:-1])) if len(offsets) > 1 else 0
    return int(np.sum(last - first + 1)) - shared


def span_is_cheaper(offsets: np.ndarray, run: int, sharers: int = 1) -> bool:
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
