"""Which reader a load uses, and what it is told about this rank's reads: the files it
reads only part of, whether its pages are already cached, how many ranks of the load
share this host's page cache, and whether consumed pages must be released."""
from __future__ import annotations

import os

import psutil
import torch

from ..errors import PlanError
from ..index import CheckpointIndex
from ..plan import ReadItem
from ..system import PAGE, memory_limit
from ..remote import RemoteCheckpoint
from .base import Reader
from .mmap import MmapReader
from .pread import PreadReader
from .remote import RemoteReader
from .residency import resident_fraction
from .runs import byte_runs, pages_touched

# Share of this rank's pages that must already be in the page cache to skip prefetching.
WARM_FRACTION = 0.9


def reader_name(name: str, device: torch.device, remote: RemoteCheckpoint | None) -> str:
    """The reader a load uses: "remote" for a URL; "auto" is mmap for a CPU destination,
    pread (pinned staging) for a GPU (see `choose_reader`)."""
    if remote is not None:
        return "remote"
    return ("mmap" if device.type == "cpu" else "pread") if name == "auto" else name


def choose_reader(name: str, device: torch.device, release_pages: bool, items: list[ReadItem],
                  index: CheckpointIndex, world: int,
                  remote: RemoteCheckpoint | None = None) -> Reader:
    """"auto": mmap for a CPU destination, pread (pinned staging) for a GPU. The mmap
    reader casts straight from the page cache, where pread pays one more copy (into its
    staging) and, for same-dtype targets, cannot keep views of the mapping: measured on
    cold storage too (benchmarks/bench_stream.py), mapping with exact prefetch wins. Its
    prefetch is on when this rank's pages are not in the page cache (asked only for mmap:
    announcing cached pages costs a page-cache lookup each). A remote checkpoint is read by
    ranged GETs (`remote.py`), whatever `name` says (the loader refuses any but "auto")."""
    name = reader_name(name, device, remote)
    if name == "remote":
        return RemoteReader(remote, index.identities)
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


def must_release_pages(items: list[ReadItem], dest_bytes: int, world: int) -> bool:
    """Whether consumed pages must be dropped as the load goes (`release_pages`): under a
    memory cgroup limit smaller than the files this rank reads from, or when the page cache
    this rank's reads touch exceeds what the host can spare beside the destinations of its
    ranks. A strided slice touches whole pages: rank 0 of 128 of a 405B checkpoint touches
    about 21 GB of page cache for 7.3 GB of data, and a 24 GB host then spends the load in
    reclaim (docs/architecture.md). Kept pages are otherwise worth keeping: other ranks of
    the host, and the next load, find them cached."""
    files = sum(_size(f) for f in {part.entry.file for item in items for part in item.reads()})
    limit = memory_limit()
    if limit is not None and limit < files:
        return True
    sharers = host_ranks(world)
    spare = psutil.virtual_memory().available // sharers - dest_bytes
    if files <= spare:  # cheap bound: every page of every file
        return False
    return touched_bytes(items) > spare


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # gone or unreadable: the reader says so, naming the file, when it opens it
        return 0


def touched_bytes(items: list[ReadItem]) -> int:
    """Page-cache bytes this rank's reads touch: whole pages of every run."""
    total = 0
    for item in items:
        for part in item.reads():
            offsets, run = byte_runs(part)
            total += pages_touched(offsets, run) * PAGE
    return total
