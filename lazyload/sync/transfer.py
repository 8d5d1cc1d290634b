"""The transfer of one sync: the routes carried out, step by step (`routes.py`). A source
packs each target's boxes of a step into one message (the boxes' bytes as the source holds
them: exact for every dtype; or, for a box the target would only cast to a narrower dtype,
cast here, `copy_` rounding as the target's would; or, for a box the target would quantize,
its 8-bit data and scales, computed here as the target would, `wire.py`) and sends it point-to-point; a target receives one message per
source and step and places each box into its destination (cast, quantized, converted as the
load plan says); boxes a colocated rank holds itself are copied without the wire.

Every wait is bounded by `rank_timeout` and watched (`wait_polling`): a rank that fails
announces it in the store, and the others stop waiting at once, leaving their sends and
receives of that sync pending. Over gloo they are kept alive, never waited for with a
timeout (gloo closes a pair whose wait timed out, which would fail every later sync), and a
retry sends under a fresh tag (`sync_tag`), so that its messages never match the failed
sync's. NCCL ignores tags and its wait does not block the host: the wait is timed on the
host through a CUDA event (`wait_on_device`), and a failed sync's communicator is aborted
and the retry runs on a fresh one (`peers.NcclLink`)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..agreement import CollectiveError
from .layout import local_piece
from .routes import Request, Routes, packed_offsets, slot
from .source_index import Piece
from .wire import ChannelWire, QuantizedWire


@dataclass
class Traffic:
    """This rank's messages and bytes with one peer in one sync (steps completed only)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0


@dataclass
class Moved:
    """What one sync moved so far on this rank, and which targets got all their items."""

    sent: int = 0
    received: int = 0
    local: int = 0
    quantized: int = 0  # of `sent` and `received`, the bytes of boxes quantized on the wire
    left: dict[str, int] = field(default_factory=dict)  # target -> its items not placed yet
    done: list[str] = field(default_factory=list)  # targets that hold the new version
    touched: set[str] = field(default_factory=set)  # targets that got at least one item
    peers: dict[int, Traffic] = field(default_factory=dict)  # peer rank -> what moved with it

    def placed(self, target: str) -> None:
        self.touched.add(target)
        self.left[target] -= 1
        if not self.left[target]:
            self.done.append(target)

    def peer(self, rank: int) -> Traffic:
        return self.peers.setdefault(rank, Traffic())


@dataclass(frozen=True)
class Ends:
    """This rank's ends of the transfer: its source tensors, the pieces the index names,
    its target's items (in request order) and destinations, the process group and tag."""

    tensors: dict[str, torch.Tensor]
    pieces: dict[str, Piece]
    dtypes: dict[str, torch.dtype]  # stored key -> its dtype
    items: list
    dests: dict[str, Any]
    peers: Any  # how messages reach the peers: sync.peers.Peers (gloo), or its NcclLink
    tag: int  # gloo's (NCCL ignores tags)
    device: torch.device  # where messages are staged: the host for gloo, the GPU for NCCL
    timeout: float
    aborted: Callable[[], str | None]  # another rank's failure, announced, or None
    abandoned: list  # works (and their buffers) of failed syncs, kept alive
    pinned: bool = False  # host messages of CUDA tensors (gloo): page-locked, for the GPU's DMA
    # item position -> its narrower dtype on the wire, or its quantization (`wire.QuantizedWire`)
    wires: dict[int, torch.dtype | QuantizedWire] = field(default_factory=dict)


def transfer(routes: Routes, ends: Ends, moved: Moved) -> None:
    """Every step of the routes; `moved` counts as it goes (what a failure leaves done)."""
    for step in range(routes.steps):
        _step(routes, ends, moved, step)


def _step(routes: Routes, ends: Ends, moved: Moved, step: int) -> None:
    sends, receives, inbox, posted = [], [], [], {}
    for target, requests in routes.sends.get(step, {}).items():
        buffer = _pack(requests, ends)
        sends.append((buffer, target))
        posted[target] = (sum(r.nbytes for r in requests),
                          sum(r.nbytes for r in requests if isinstance(r.wire, QuantizedWire)))
    for source, positions in routes.receives.get(step, {}).items():
        offsets, nbytes = packed_offsets([(_wire(ends, p), ends.items[p].src_box) for p in positions])
        buffer = message_buffer(nbytes, ends)
        inbox.append((source, positions, offsets, buffer))
        receives.append((buffer, source))
    works = ends.peers.post(sends, receives, ends.tag)
    for position in routes.local.get(step, ()):
        item = ends.items[position]
        piece = ends.pieces[item.entry.key]
        wire = ends.wires.get(position)
        if isinstance(wire, ChannelWire):  # quantized from its whole rows, as a source rank would send it
            _local_channel(ends, wire, item, local_piece(ends.tensors[piece.name], piece.held,
                                                         wire.source_box(item.src_box)))
            moved.placed(item.target)
        else:
            _place(ends, moved, item, local_piece(ends.tensors[piece.name], piece.held, item.src_box))
        moved.local += item.nbytes
    try:
        wait_polling(works, ends, f"step {step} of the weight sync's sends and receives")
    except CollectiveError:
        ends.abandoned.append((works, sends, inbox))
        raise
    for target, (nbytes, quantized) in posted.items():  # counted once completed: a failed step's sends are not
        moved.sent += nbytes
        moved.quantized += quantized
        moved.peer(target).bytes_sent += nbytes
        moved.peer(target).messages_sent += 1
    for source, positions, offsets, buffer in inbox:
        for position, offset in zip(positions, offsets):
            nbytes = _received(ends, moved, position, buffer, offset)
            moved.received += nbytes
            moved.peer(source).bytes_received += nbytes
        moved.peer(source).messages_received += 1


def _received(ends: Ends, moved: Moved, position: int, buffer: torch.Tensor, offset: int) -> int:
    """Item `position`'s box at `offset` of a message placed into its destination (a box
    quantized on the wire: its data and scales copied in); its bytes on the wire."""
    item, wire = ends.items[position], _wire(ends, position)
    if not isinstance(wire, QuantizedWire):
        values = slot(buffer, offset, wire, item.src_box)
        _place(ends, moved, item, values)
        return values.nbytes
    with torch.no_grad():
        wire.place(buffer, offset, item.src_box, ends.dests[item.target], item.dst_box)
    moved.placed(item.target)
    moved.quantized += wire.nbytes(item.src_box)
    return wire.nbytes(item.src_box)


def _local_channel(ends: Ends, wire: ChannelWire, item: Any, rows: torch.Tensor) -> None:
    """A box this rank holds itself, of a weight stored quantized per channel: packed and
    placed through a message of its own, the same bytes a source rank would send."""
    buffer = message_buffer(wire.nbytes(item.src_box), ends)
    with torch.no_grad():
        wire.pack(buffer, 0, item.src_box, rows)
        wire.place(buffer, 0, item.src_box, ends.dests[item.target], item.dst_box)


def _wire(ends: Ends, position: int) -> torch.dtype | QuantizedWire:
    """How item `position` of this target travels: cast or quantized by its source, or as stored."""
    return ends.wires.get(position) or ends.items[position].entry.dtype


def _pack(requests: tuple[Request, ...], ends: Ends) -> torch.Tensor:
    """A target's boxes of one step, packed into one message: bytes copied as they are, or
    cast to the request's `wire` dtype (`copy_` rounds as the target's cast on arrival would),
    or quantized as the target would quantize them on arrival (`QuantizedWire.pack`)."""
    specs = [(r.wire or ends.dtypes[r.key], r.box) for r in requests]
    offsets, nbytes = packed_offsets(specs)
    buffer = message_buffer(nbytes, ends)
    for request, offset, (dtype, _) in zip(requests, offsets, specs):
        piece = ends.pieces[request.key]
        read = dtype.source_box(request.box) if isinstance(dtype, QuantizedWire) else request.box
        values = local_piece(ends.tensors[piece.name], piece.held, read)
        if isinstance(dtype, QuantizedWire):
            with torch.no_grad():
                dtype.pack(buffer, offset, request.box, values)
        else:
            slot(buffer, offset, dtype, request.box).copy_(values)
    return buffer


def message_buffer(nbytes: int, ends: Ends) -> torch.Tensor:
    """One message's bytes, where the wire takes them (`ends.device`; page-locked host memory
    when `ends.pinned`): the one place a sync allocates for the device, so that a test can
    stand in for it (tests/test_cuda_harness.py's stand-ins)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=ends.device, pin_memory=ends.pinned)


def _place(ends: Ends, moved: Moved, item: Any, values: torch.Tensor) -> None:
    dest = ends.dests[item.target]
    values = values.to(dest.device) if values.device != dest.device else values
    with torch.no_grad():
        dest.place(item, values)
    moved.placed(item.target)


def wait_polling(works: list, ends: Ends, what: str) -> None:
    """Wait for `works` in a helper thread (gloo completes a send or receive only inside a
    wait, and a timed wait that expires closes its pair), while this one watches: done,
    failed (CollectiveError), another rank's failure announced, or `ends.timeout` seconds
    passed (CollectiveError; the helper is left waiting on what will never come). NCCL's
    works: `wait_on_device`."""
    if not works:
        return
    if ends.peers.backend == "nccl":
        return wait_on_device(works, ends.timeout, ends.aborted, what)
    done, failure = threading.Event(), []

    def wait() -> None:
        try:
            for work in works:
                work.wait()
        except Exception as exc:
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, name="lazyload-sync-wait", daemon=True).start()
    deadline = time.monotonic() + ends.timeout
    while not done.wait(0.02):
        if time.monotonic() > deadline:
            raise CollectiveError(f"{what} did not finish within {ends.timeout:g} s")
        if (reason := ends.aborted()) is not None:
            raise CollectiveError(f"{what} stopped: {reason}")
    if failure:
        raise CollectiveError(f"{what} failed ({type(failure[0]).__name__}: {failure[0]})") from failure[0]


def wait_on_device(works: list, timeout: float, aborted: Callable[[], str | None], what: str) -> None:
    """NCCL's works, on this thread: `work.wait()` only makes the caller's current stream wait
    for NCCL's (the host goes on at once), so an event recorded after it on that stream
    completes when the messages have; the host polls it, and stops (CollectiveError) when
    `timeout` seconds passed or another rank's failure is announced, or when a work failed
    (its communicator broken or aborted: the event completes, the bytes are not there)."""
    try:
        for work in works:
            work.wait()
        done = torch.cuda.Event()
        done.record()
    except Exception as exc:
        raise CollectiveError(f"{what} failed ({type(exc).__name__}: {exc})") from exc
    deadline = time.monotonic() + timeout
    while not done.query():
        if time.monotonic() > deadline:
            raise CollectiveError(f"{what} did not finish within {timeout:g} s")
        if (reason := aborted()) is not None:
            raise CollectiveError(f"{what} stopped: {reason}")
        time.sleep(0.001)
    for work in works:
        if (error := _failure(work)) is not None:
            raise CollectiveError(f"{what} failed ({type(error).__name__}: {error})")


def _failure(work: Any) -> BaseException | None:
    """The error of a completed work, if it failed (None: it succeeded)."""
    try:
        return work.exception() if work.is_completed() else None
    except Exception as exc:  # an error held by the work may be raised instead of returned
        return exc
