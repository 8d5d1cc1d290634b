"""Which reader a load uses, and what it is told about this rank's reads: the files it
reads only part of, whether its pages are already cached, and how many ranks of the load
share this host's page cache."""
from __future__ import annotations

import os

import torch

from ..errors import PlanError
from ..index import CheckpointIndex
from ..plan import ReadItem
from .mmap import MmapReader
from .pread import PreadReader
from .residency import resident_fraction

# Share of this rank's pages that must already be in the page cache to skip prefetching.
WARM_FRACTION = 0.9


def choose_reader(name: str, device: torch.device, release_pages: bool, items: list[ReadItem],
                  index: CheckpointIndex, world: int) -> MmapReader | PreadReader:
    """"auto": mmap for a CPU destination, pread (pinned staging) for a GPU. The mmap
    reader casts straight from the page cache, where pread pays one more copy (into its
    staging) and, for same-dtype targets, cannot keep views of the mapping: measured on
    cold storage too (benchmarks/bench_stream.py), mapping with exact prefetch wins. Its
    prefetch is on when this rank's pages are not in the page cache (asked only for mmap:
    announcing cached pages costs a page-cache lookup each)."""
    if name == "auto":
        name = "mmap" if device.type == "cpu" else "pread"
    partial = partially_read_files(items, index)
    if name == "pread":
        return PreadReader(release_pages, partial, index.identities)
    if name == "mmap":
        warm = resident_fraction(items) >= WARM_FRACTION
        return MmapReader(release_pages, partial, prefetch=not warm, host_ranks=host_ranks(world),
                           identities=index.identities)
    raise PlanError(f"unknown reader {name!r}; use 'auto', 'mmap' or 'pread'.")


def host_ranks(world: int) -> int:
    """Ranks of this load on this host: torchrun's LOCAL_WORLD_SIZE (1 when not set)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return min(max(local, 1), world)


def partially_read_files(items: list[ReadItem], index: CheckpointIndex) -> set[str]:
    """Files of which this rank reads less than all the tensor bytes: readahead there would
    fetch other ranks' slices, other experts, or tensors the model does not use."""
    read: dict[str, int] = {}
    for item in (part for item in items for part in item.reads()):
        read[item.entry.file] = read.get(item.entry.file, 0) + item.nbytes
    stored: dict[str, int] = {}
    for entry in index.entries():
        stored[entry.file] = stored.get(entry.file, 0) + entry.nbytes
    return {f for f in read if read[f] < stored[f]}
