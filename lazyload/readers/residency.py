"""Which of a rank's pages are already in the page cache (mincore), to choose a reader:
mapping is the fastest way to take warm pages, announcing exact ranges ahead the fastest
way to fetch cold ones."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..plan import ReadItem
from ..system import PAGE, resident_pages
from .runs import byte_runs


def resident_fraction(items: list[ReadItem]) -> float:
    """Share of the pages spanned by these items that are in the page cache (1.0 when it
    cannot be told, so that nothing is read twice on a guess)."""
    spans = defaultdict(list)
    for item in items:
        offsets, run = byte_runs(item)
        spans[item.entry.file].append((int(offsets[0]), int(offsets[-1]) + run))
    wanted = present = 0
    for path, ranges in spans.items():
        try:
            pages = resident_pages(path)
        except OSError:  # gone or unreadable: the reader says so, naming the file, when it opens it
            pages = None
        if pages is None:
            return 1.0
        counts = np.concatenate([[0], np.cumsum(pages, dtype=np.int64)])
        for start, end in ranges:
            first, last = start // PAGE, min((end + PAGE - 1) // PAGE, len(pages))
            wanted += last - first
            present += int(counts[last] - counts[first])
    return present / wanted if wanted else 1.0
