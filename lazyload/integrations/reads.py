"""The reads behind `LazyTensor`s: copies an engine's weight loaders make are collected, then
read together, box by box, through lazyload's planner, schedule and readers.

`BoxReads` is the sink of every `LazySource` of one load: `copy` records (checkpoint
tensor, box, destination) and reads nothing; `run()` then reads every recorded box in layer
order under the byte budget, casting into the destinations (`totals.casts` counts the bytes
cast, by dtype path). `read` (an operation the geometry cannot record) reads a view whole
at once and counts it as a fallback.

With `peers` (an engine's TP workers reading a URL, `tp_share`), `run()` first gathers every
worker's boxes; the tensors some worker's box cuts strided (row-parallel) are fetched one
contiguous range of rows per worker and exchanged layer by layer; the rest is read as above.
A reload with `peers` plans them in `expect` (`SharedReload`, from every worker's boxes of the
last load) and exchanges a layer at its first copy of one of them.

A reload (`deferred` False: vLLM processes each layer as soon as its copies are done, so each
copy is read as it is made) gets the load's prefetch through `expect`: the boxes the last
load's weight loaders copied, planned on this checkpoint and scheduled by layer as a load's
are; on cold pages (the reader's `prefetching`) the first copy of each layer announces that
layer and the next (`engine.announce`, one thread), so that storage reads a layer ahead of
vLLM's copies. `totals.prefetched_bytes` counts the bytes announced a layer ahead, at a load
and at a reload alike.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine import announce, run_schedule
from ..errors import PlanError
from ..expr import box_numel, box_shape, box_within
from ..index import natural_key
from ..placer import Destination, TensorDest, with_whole
from ..plan import plan_boxes
from ..planner import byte_budget
from ..readers.choice import choose_reader, reader_name
from ..schedule import Group, layer_of, schedule
from ..stored import StoredCheckpoint
from .lazy_tensor import Box, LazySource, LazyTensor
from .tp_share import Peers, SharedTensor, exchange, gather_boxes, layer_rounds, plan_shared, within

logger = logging.getLogger("lazyload")

READERS = ("auto", "mmap", "pread")


@dataclass
class ReadOptions:
    """`load_into`'s keywords that apply to reads an engine's loaders ask for."""

    reader: str = "auto"
    max_host_bytes: int | None = None
    release_pages: bool = False

    def __post_init__(self) -> None:
        if self.reader not in READERS:
            raise PlanError(f"unknown reader {self.reader!r}; use 'auto', 'mmap' or 'pread'.")
        if self.max_host_bytes is not None and (not isinstance(self.max_host_bytes, int) or self.max_host_bytes < 1):
            raise PlanError(f"max_host_bytes must be a positive integer, got {self.max_host_bytes!r}.")


@dataclass
class Copy:
    name: str  # the checkpoint tensor
    box: Box  # of the stored tensor
    dst: torch.Tensor  # the destination seen as the box, in stored dim order (a view of the loader's tensor)
    via: torch.dtype | None = None  # a cast the loader asked for first (`.to(dtype)`), when neither side's dtype


@dataclass
class ReadTotals:
    bytes_read: int = 0
    bytes_planned: int = 0  # tensor bytes of the boxes asked for
    bytes_repeated: int = 0  # of those, boxes asked for again (an engine copying the same box twice)
    boxes: int = 0
    prefetched_bytes: int = 0  # of the boxes read, bytes whose pages were announced a layer ahead (cold pages)
    bytes_received: int = 0  # tensor bytes other TP workers fetched and sent this one (`tp_share`)
    # the most bytes one exchange round held: its fetch, send and receive buffers, at a reload with this
    # worker's values of the layer kept beside them (`SharedReload`)
    exchange_peak_bytes: int = 0
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (tensor, operation)
    casts: dict[str, int] = field(default_factory=dict)  # "int8->float32" (via a loader's cast: "a->b->c"): stored bytes
    reader: str = ""
    fields: dict[str, Any] = field(default_factory=dict)  # a remote reader's request counts, its unversioned files

    def add_fields(self, more: dict[str, Any]) -> None:
        """Add one read's fields: counts are summed, lists (files) joined."""
        for key, value in more.items():
            if isinstance(value, list):
                self.fields[key] = sorted(set(self.fields.get(key, [])) | set(value))
            else:
                self.fields[key] = self.fields.get(key, 0) + value


class BoxReads:
    """Copies recorded from lazy tensors of `checkpoint`, read by `run()` (see the module)."""

    def __init__(self, checkpoint: StoredCheckpoint, options: ReadOptions, world: int = 1, deferred: bool = True):
        self.checkpoint, self.options, self.world = checkpoint, options, world
        self.deferred = deferred  # False: each copy is read as it is made
        self.pending: list[Copy] = []
        self.totals = ReadTotals()
        self.asked: set[tuple[str, Box]] = set()
        self.prefetch: LayerPrefetch | None = None
        self.peers: Peers | None = None  # TP workers to share strided fetches with (a URL's load, `tp_share`)
        self.shared_reload: SharedReload | None = None

    def expect(self, boxes: list[tuple[str, Box]]) -> None:
        """Copies read as they are made (a reload) will ask for about these boxes (the last
        load's), in this order: announce their pages a layer ahead (see the module)."""
        self.close()
        if reader_name(self.options.reader, torch.device("cpu"), self.checkpoint.remote) == "mmap":
            self.prefetch = LayerPrefetch(self, boxes)  # pread and remote readers announce nothing
        if self.peers is not None:
            self.shared_reload = SharedReload(self, boxes)

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
            self.prefetch = None
        self.shared_reload = None

    def tensor(self, name: str) -> LazyTensor:
        """The checkpoint tensor `name` as a lazy tensor whose copies land here."""
        index = self.checkpoint.index
        return LazyTensor(LazySource(name, tuple(index.shape(name)), index.dtype(name), self))

    def copy(self, dst: torch.Tensor, lazy: LazyTensor) -> None:
        if dst.is_meta:  # a pass that only measures (vLLM's reload counts the copies on meta)
            return
        via = lazy.dtype if lazy.dtype not in (lazy.source.dtype, dst.dtype) else None
        if (lazy.source.name, lazy.geometry.box) in self.asked:
            self.totals.bytes_repeated += box_numel(lazy.geometry.box) * lazy.source.dtype.itemsize
        self.asked.add((lazy.source.name, lazy.geometry.box))
        copy = Copy(lazy.source.name, lazy.geometry.box, lazy.geometry.as_stored(dst), via)
        if self.deferred:
            self.pending.append(copy)
        elif self.shared_reload is not None and (values := self.shared_reload.take(copy)) is not None:
            copy.dst.copy_(values if via is None else values.to(via))
            self._count_served(copy)
        else:
            if self.prefetch is not None:
                self.totals.prefetched_bytes += self.prefetch.before(copy)
            self._read([copy])

    def read(self, lazy: LazyTensor, why: str) -> torch.Tensor:
        self.totals.fallbacks.append((lazy.source.name, why))
        self.asked.add((lazy.source.name, lazy.geometry.box))
        logger.debug("lazyload: %s of %s reads its view whole (fallback)", why, lazy.source.name)
        values = torch.empty(box_shape(lazy.geometry.box), dtype=lazy.dtype)
        self._read([Copy(lazy.source.name, lazy.geometry.box, values)])
        return lazy.geometry.as_view(values)

    def run(self) -> None:
        """Read every recorded copy (layer order, byte budget), then forget them."""
        copies, self.pending = self.pending, []
        if self.peers is not None:
            copies = self._share(copies)
        self._read(copies)

    def _share(self, copies: list[Copy]) -> list[Copy]:
        """Fetch this worker's part of the tensors it shares with the other TP workers and
        exchange the parts layer by layer (`tp_share`), before any other read (so that the
        workers meet at each exchange after balanced work); returns the copies left to read."""
        index = self.checkpoint.index
        boxes = sorted({(c.name, c.box) for c in copies}, key=lambda pair: (natural_key(pair[0]), pair[1]))
        shared = plan_shared(gather_boxes(self.peers, boxes), index.shape)
        mine = [c for c in copies if c.name in shared]
        by_box: dict[tuple[str, Box], list[Copy]] = {}
        for c in mine:
            by_box.setdefault((c.name, c.box), []).append(c)

        def deliver(name: str, box: Box, part: Box, values: torch.Tensor) -> None:
            for c in by_box[(name, box)]:
                c.dst[within(part, box)].copy_(values if c.via is None else values.to(c.via))

        for layer in self._rounds(shared):
            self._fetch_and_exchange(layer, deliver)
        for c in mine:
            self._count_served(c)
        return [c for c in copies if c.name not in shared]

    def _rounds(self, shared: dict[str, SharedTensor], keep: bool = False) -> list[list[list[SharedTensor]]]:
        """Each layer's exchange rounds under the byte budget (`tp_share.rounds`; `keep`: a reload's)."""
        return layer_rounds(shared, self.peers.world, self.checkpoint.index.dtype, self.options.max_host_bytes, keep)

    def _fetch_and_exchange(self, layer: list[list[SharedTensor]], deliver, kept=lambda: 0) -> None:
        """Round by round, fetch this worker's rows of the round's shared tensors, then exchange
        them (`tp_share.exchange`); a round's buffers are gone before the next is fetched.
        `kept()`: the bytes `deliver` keeps beside them (a reload's values), counted in the peak."""
        index, me = self.checkpoint.index, self.peers.rank
        for tensors in layer:
            fetched = {t.name: torch.empty(box_shape(t.fetch[me]), dtype=index.dtype(t.name))
                       for t in tensors if t.fetch[me] is not None}
            self._read([Copy(t.name, t.fetch[me], fetched[t.name]) for t in tensors if t.name in fetched], asked=False)
            received, held = exchange(self.peers, tensors, fetched, index.dtype, deliver)
            self.totals.bytes_received += received
            self.totals.exchange_peak_bytes = max(self.totals.exchange_peak_bytes, held + kept())
            del fetched  # before the next round allocates its own

    def _count_served(self, c: Copy) -> None:
        """Count a copy the exchange filled as one read is counted (not its bytes: others fetched part)."""
        self._count_cast(c)
        self.totals.bytes_planned += box_numel(c.box) * self.checkpoint.index.dtype(c.name).itemsize
        self.totals.boxes += 1

    def _read(self, copies: list[Copy], asked: bool = True) -> None:
        """Read `copies` (`asked` False: fetches for the TP workers to share, not this
        worker's boxes: counted as read, not as planned)."""
        if not copies:
            return
        index = self.checkpoint.index
        staged = {id(c): torch.empty(box_shape(c.box), dtype=c.via) for c in copies if c.via is not None}
        targets = {f"{c.name}#{k}": c for k, c in enumerate(copies)}  # one target per copy; layer_of reads the prefix
        exprs, plans, items = plan_boxes(index, {t: (c.name, c.box, c.via or c.dst.dtype) for t, c in targets.items()})
        groups = schedule(items)
        budget = byte_budget(groups, self.options.max_host_bytes)
        device = torch.device("cpu")
        reader = self._reader(items)
        if reader.prefetching:  # the engine announces each group with the next one: all but the first ahead
            self.totals.prefetched_bytes += sum(group.nbytes for group in groups[1:])
        dests: dict[str, Destination] = {t: TensorDest(staged.get(id(c), c.dst)) for t, c in targets.items()}
        try:
            run_schedule(groups, reader, with_whole(dests, plans, exprs, items, index.shape_of), budget)
        finally:
            reader.close()
        for c in copies:
            if c.via is not None:
                c.dst.copy_(staged[id(c)])
            if asked:
                self._count_cast(c)
        self.totals.bytes_read += reader.bytes_read
        if asked:
            self.totals.bytes_planned += sum(item.nbytes for item in items)
            self.totals.boxes += len(copies)
        self.totals.reader = reader_name(self.options.reader, device, self.checkpoint.remote)
        self.totals.add_fields(reader.report_fields())

    def _reader(self, items: list) -> Any:
        return choose_reader(self.options.reader, torch.device("cpu"), self.options.release_pages, items,
                             self.checkpoint.index, self.world, self.checkpoint.remote)

    def _count_cast(self, c: Copy) -> None:
        """Count a copy whose stored dtype is not its destination's (a quantized weight that
        should pass through as stored shows up here)."""
        stored = self.checkpoint.index.dtype(c.name)
        path = [stored] + ([c.via] if c.via is not None else []) + [c.dst.dtype]
        if len(set(path)) > 1:
            key = "->".join(str(d).removeprefix("torch.") for d in path)
            self.totals.casts[key] = self.totals.casts.get(key, 0) + box_numel(c.box) * stored.itemsize


class LayerPrefetch:
    """The expected boxes of a reload, by layer, announced a layer ahead of the copies when
    their pages are cold (see the module); a box not expected is read all the same."""

    def __init__(self, reads: BoxReads, boxes: list[tuple[str, Box]]):
        self.index = index = reads.checkpoint.index
        names = set(index.names())  # stored keys and logical names (a DCP, Megatron or DeepSpeed tensor)
        wanted = {f"{name}#{k}": (name, box, index.dtype(name)) for k, (name, box) in enumerate(boxes)
                  if name in names and box_within(box, index.shape(name))}
        _, _, items = plan_boxes(index, wanted) if wanted else ({}, [], [])
        first = {}  # layer -> its first box: the groups in the order the copies come (the boxes'), not the files'
        for k, (name, _) in enumerate(boxes):
            first.setdefault(layer_of(name), k)
        self.groups: list[Group] = sorted(schedule(items), key=lambda g: first[layer_of(g.items[0].target)])
        self.layers = {layer_of(g.items[0].target): k for k, g in enumerate(self.groups)}  # the target: name#k
        self.reader = reads._reader(items) if items else None
        self.announced: dict[int, Future] = {}
        self.started: set[int] = set()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="lazyload-prefetch")

    def before(self, copy: Copy) -> int:
        """A copy of `copy.name` is read next: announce its layer and the next one (the first
        copy of a layer); returns its bytes when its layer was announced ahead of it."""
        k = self.layers.get(layer_of(copy.name))
        if k is None or self.reader is None or not self.reader.prefetching:
            return 0
        ahead = k in self.announced
        if k not in self.started:
            self.started.add(k)
            announce(self.reader, self.groups, k, self.announced, self.thread)
        return box_numel(copy.box) * self.index.dtype(copy.name).itemsize if ahead else 0

    def close(self) -> None:
        self.thread.shutdown(wait=True)
        if self.reader is not None:
            self.reader.close()


class SharedReload:
    """A reload's shared tensors (`tp_share`), planned from every worker's boxes of the last
    load (gathered at the start, so on every worker at once): at the first copy of a layer
    that asks for one of them, the layer's rows are fetched and exchanged, and the values are
    held until the next layer's exchange (the copies come in layer order); a copy they do
    not cover is read alone. Each of this worker's boxes is held whole from its tensor's first
    round on, beside the later rounds' buffers: the rounds leave room for them (`keep`)."""

    def __init__(self, reads: BoxReads, boxes: list[tuple[str, Box]]):
        index = reads.checkpoint.index
        names = set(index.names())
        mine = sorted({(name, box) for name, box in boxes if name in names and box_within(box, index.shape(name))},
                      key=lambda pair: (natural_key(pair[0]), pair[1]))
        self.reads, self.rank = reads, reads.peers.rank
        self.shared = plan_shared(gather_boxes(reads.peers, mine), index.shape)
        self.layers = {layer_of(layer[0][0].name): layer for layer in reads._rounds(self.shared, keep=True)}
        self.values: dict[tuple[str, Box], torch.Tensor] = {}
        self.exchanged: set[str] = set()

    def take(self, copy: Copy) -> torch.Tensor | None:
        """The values of `copy`'s box in its stored dtype, or None (read it alone)."""
        tensor = self.shared.get(copy.name)
        if tensor is None or copy.box not in tensor.boxes[self.rank]:
            return None
        layer = layer_of(copy.name)
        if layer not in self.exchanged:
            self.exchanged.add(layer)
            self.values = {}
            self.reads._fetch_and_exchange(self.layers[layer], self._keep, self.held_bytes)
        return self.values.get((copy.name, copy.box))

    def held_bytes(self) -> int:
        return sum(values.nbytes for values in self.values.values())

    def _keep(self, name: str, box: Box, part: Box, values: torch.Tensor) -> None:
        held = self.values.get((name, box))
        if held is None:
            held = self.values[(name, box)] = torch.empty(box_shape(box), dtype=values.dtype)
        held[within(part, box)].copy_(values)
