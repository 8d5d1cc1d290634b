"""Which of a rank's pages are already in the page cache (mincore), to choose a reader:
mapping is the fastest way to take warm pages, announcing exact ranges ahead the fastest
way to fetch cold ones."""
from __future__ import annotations

import numpy as np

from ..plan import ReadItem
from ..system import PAGE, resident_pages
from .runs import byte_runs


def resident_fraction(items: list[ReadItem]) -> float:
    """Share of the pages spanned by these items that are in the page cache (1.0 when it
    cannot be told, so that nothing is read twice on a guess). Only the spans are looked up,
    one at a time, not the files: rank 0 of 128 of a 405B checkpoint spans a third of it."""
    wanted = present = 0
    for item in items:
        offsets, run = byte_runs(item)
        try:
            pages = resident_pages(item.entry.file, int(offsets[0]) // PAGE, -(-(int(offsets[-1]) + run) // PAGE))
        except OSError:  # gone or unreadable: the reader says so, naming the file, when it opens it
            pages = None
        if pages is None:
            return 1.0
        wanted += len(pages)
        present += int(np.count_nonzero(pages))
    return present / wanted if wanted else 1.0
