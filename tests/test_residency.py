"""The page-cache probe that chooses between mapping warm pages and prefetching cold ones
(`readers.residency.resident_fraction`) asks mincore about the pages a rank's items span,
not about whole files: on a 405B-shaped checkpoint at world 128 a rank spans a third of
the files, and a probe of every page of every file was 2.5 CPU seconds (about a tenth
of the load) before a byte was read. Counted here in bytes held by the probe, not timed."""
from __future__ import annotations

import os
import sys
import tracemalloc
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def rank0_items(tmp_path_factory):
    """Rank 0 of 128's read items of a 405B-shaped sparse checkpoint of 2 layers (files of
    about 7 GB, holes: no disk used), as load_into plans them."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_scale
        import sparse_checkpoint
    finally:
        sys.path.remove(str(BENCH))
    directory = str(tmp_path_factory.mktemp("llama-405b-L2"))
    sparse_checkpoint.write("llama-405b", directory, layers=2)
    _, items, _, _ = bench_scale.rank_plan(directory, bench_scale.meta_model(directory), 128, 0)
    return items


def _spans(items):
    """(file, first page, last page) of each item's span, as the probe reads them."""
    from lazyload.readers import byte_runs
    from lazyload.system import PAGE

    spans = []
    for item in items:
        offsets, run = byte_runs(item)
        spans.append((item.entry.file, int(offsets[0]) // PAGE, (int(offsets[-1]) + run + PAGE - 1) // PAGE))
    return spans


def test_probe_holds_one_span_at_a_time_not_a_file(rank0_items):
    from lazyload.readers.residency import resident_fraction
    from lazyload.system import PAGE

    spans = _spans(rank0_items)
    largest_span = max(last - first for _, first, last in spans)
    largest_file = max(os.path.getsize(path) // PAGE for path, _, _ in spans)
    assert largest_span * 3 < largest_file  # rank 0 spans a part of each file
    tracemalloc.start()
    try:
        resident_fraction(rank0_items)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # mincore answers a byte per page asked, one span at a time (beside it, the span's run
    # offsets); asking about whole files held a byte and a running count per page of a file.
    assert peak <= 2 * largest_span + (256 << 10)


def test_probe_counts_the_cached_pages_of_the_spans(rank0_items):
    """The fraction is the spans' pages in the page cache over their pages, as the
    whole-file probe (`system.resident_pages`) counts them: after reading one span alone,
    its pages."""
    from checkpoints import evict

    from lazyload.readers.residency import resident_fraction
    from lazyload.system import PAGE, resident_pages

    spans = _spans(rank0_items)
    files = sorted({path for path, _, _ in spans})
    if not evict(files):
        pytest.skip("the page cache cannot be emptied here (posix_fadvise DONTNEED had no visible effect)")
    assert resident_fraction(rank0_items) == 0.0
    path, first, last = min(spans, key=lambda span: (span[2] - span[1] < 2, span[2] - span[1]))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead still landing while we count
        os.pread(fd, (last - first) * PAGE, first * PAGE)  # holes: cached as zero pages
    finally:
        os.close(fd)
    pages = {f: resident_pages(f) for f in files}
    expected = sum(int(pages[f][a:b].sum()) for f, a, b in spans) / sum(b - a for _, a, b in spans)
    assert expected > 0
    assert resident_fraction(rank0_items) == expected
    evict(files)
