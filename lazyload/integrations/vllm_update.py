"""The RL weight update into vLLM workers: each worker receives from the trainer only the
boxes its weight loaders took when it loaded (load_format="lazyload" records them), then
vLLM's own in-place reload copies them into its parameters, fusing and processing as after
a load (re-quantizing a quantized model; on a GPU the parameters keep their storage). An
engine serving a compressed-tensors checkpoint quantized per channel (FP8_DYNAMIC, W8A8)
receives its weights quantized by the trainer in that stored layout, as the library writes
them (`quant.channel`): the 8-bit data and the scales of its rows, nothing else.

On the trainer ranks: `group, store = update_group(host, port, rank, world)` and
`WeightSync(source=model, group=group, store=store)`, called at each step. On the engine,
either vLLM's weight-transfer engine `lazyload` (`LLM(weight_transfer_config={"backend":
"lazyload"})`, `llm.init_weight_transfer_engine({"init_info": {host, port, world,
first_rank, rank_timeout}})`, then per step `start_weight_update`, `update_weights({"update_info":
{}})`, `finish_weight_update`), or, for any vLLM, the worker extension
(`worker_extension_cls=".../vllm_update.WeightUpdateExtension"`, `join_engine` once,
`update_engine` per step). README's "RL weight update into vLLM workers" runs both ways.

The group is a `ProcessGroupGloo` of its own over a TCPStore that trainer rank 0 serves:
vLLM's workers and the trainers each keep their own default group. The update is received
whole before vLLM's reload starts, so a trainer that fails or dies mid-update makes every
worker raise a SyncError within `rank_timeout` while the engine keeps the weights it had.
The received boxes stay in host memory between updates (the worker's share of the model).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from ..agreement import RANK_TIMEOUT
from ..errors import ArgumentError, LazyLoadError, SyncError
from ..expr import Box
from ..index import natural_key
from ..quant.channel import channel_dtype
from ..sync.box_target import BoxTarget
from ..sync.weight_sync import WeightSync
from .lazy_tensor import LazySource, LazyTensor

STORE_PREFIX = "lazyload-update"
# the (tensor, box) pairs this worker's weight loaders took at its last lazyload load (the
# loader, `integrations.vllm`, records them): what the worker asks the trainer for
LOADED_BOXES: list[tuple[str, Box]] = []
# the `quantization_config` of that load's checkpoint ({} when not quantized): a worker whose
# checkpoint stores compressed-tensors' per-channel 8-bit weights asks for them so (`quant.channel`)
LOADED_QUANTIZATION: dict[str, Any] = {}


def update_group(host: str, port: int, rank: int, world: int, rank_timeout: float = RANK_TIMEOUT) -> tuple[Any, Any]:
    """(group, store) of one update group: rank 0 (a trainer rank) serves the TCPStore at
    `host:port`, every other rank connects; pass both to `WeightSync(group=, store=)`."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = timedelta(seconds=rank_timeout)
    server = TCPStore(host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    store = PrefixStore(STORE_PREFIX, server)
    return ProcessGroupGloo(store, rank, world, timeout), store


class Received:
    """The sink of the lazy tensors handed to vLLM's reload: each copy its weight loaders
    make is served from the boxes the sync received (`BoxTarget.received`)."""

    def __init__(self, target: BoxTarget):
        self.target = target
        self.fallbacks: list[tuple[str, str]] = []

    def copy(self, dst: torch.Tensor, lazy: LazyTensor) -> None:
        if dst.is_meta:  # vLLM's reload counts the copies on meta first
            return
        values = self.target.received(lazy.source.name, lazy.geometry.box)
        lazy.geometry.as_stored(dst).copy_(values.to(lazy.dtype))

    def read(self, lazy: LazyTensor, why: str) -> torch.Tensor:
        self.fallbacks.append((lazy.source.name, why))
        values = self.target.received(lazy.source.name, lazy.geometry.box)
        return lazy.geometry.as_view(values.to(lazy.dtype))


def received_weights(sync: WeightSync, sink: Received) -> Iterator[tuple[str, LazyTensor]]:
    """The received tensors as (name, lazy tensor), in layer order, for `reload_weights`."""
    names = sorted({name for name, _ in sync.target.boxes}, key=natural_key)
    for name in names:
        shape, dtype = sync.target.stored[name]  # a quantized weight's 8-bit data and scales, as the engine holds them
        yield name, LazyTensor(LazySource(name, shape, dtype, sink))


def worker_boxes() -> list[tuple[str, Box]]:
    """The boxes this worker's weight loaders took at its last lazyload load."""
    if not LOADED_BOXES:
        raise ArgumentError("lazyload's weight update needs the engine loaded with load_format='lazyload' (each "
                            "worker records the boxes its weight loaders take, which are what it asks the trainer "
                            "for); this worker has no such load.")
    return list(LOADED_BOXES)


class WorkerUpdate:
    """One worker's side of the update: its WeightSync over the update group, asking for the
    boxes of its last lazyload load; `run` receives them all, then hands them to `reload`
    (vLLM's in-place reload, given an iterator of lazy tensors)."""

    def __init__(self, host: str, port: int, world: int, rank: int, rank_timeout: float = RANK_TIMEOUT):
        group, store = update_group(host, port, rank, world, rank_timeout)
        self.rank = rank
        target = BoxTarget(worker_boxes(), quantized=channel_dtype(LOADED_QUANTIZATION))
        self.sync = WeightSync(target=target, group=group, store=store, rank_timeout=rank_timeout)

    def joined(self) -> dict:
        return {"rank": self.rank, "boxes": len(self.sync.target.boxes), "plan_digest": self.sync.plan_digest}

    def run(self, reload) -> dict:
        report = self.sync()  # a failure raises here: the weights untouched
        sink = Received(self.sync.target)
        started = time.perf_counter()
        reload(received_weights(self.sync, sink))
        return {**dataclasses.asdict(report), "fallbacks": sink.fallbacks, "reload_seconds": time.perf_counter() - started}


class WeightUpdateExtension:
    """vLLM's `worker_extension_cls`: methods every worker gains, called through
    `llm.collective_rpc` (`join_engine` and `update_engine` below do). A lazyload error is
    returned as `{"error": ...}`, not raised: vLLM 0.32's collective_rpc raises at the first
    failed reply and leaves the other workers' replies to answer the next call."""

    def lazyload_join(self, host: str, port: int, world: int, first_rank: int,
                      rank_timeout: float = RANK_TIMEOUT) -> dict:
        """Join the update group as rank `first_rank` + this worker's rank (the trainers
        construct their WeightSync meanwhile); returns what this worker will receive."""
        def join() -> dict:
            self.lazyload_update_state = WorkerUpdate(host, port, world, first_rank + self.rank, rank_timeout)
            return self.lazyload_update_state.joined()
        return _replied(join)

    def lazyload_update(self) -> dict:
        """One update: receive every box (a failure leaves the weights untouched), then vLLM's
        in-place reload from them. Returns this worker's SyncReport and the reload's fallbacks."""
        def update() -> dict:
            state = getattr(self, "lazyload_update_state", None)
            if state is None:
                raise ArgumentError("call lazyload_join on every worker (and construct the trainers' WeightSync) "
                                    "before lazyload_update.")
            return state.run(lambda weights: self.reload_weights(weights_iterator=weights))
        return _replied(update)


def _replied(call) -> dict:
    try:
        return call()
    except LazyLoadError as exc:
        from vllm.logger import init_logger

        init_logger("vllm.lazyload").error("lazyload: %s: %s", type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def join_engine(llm: Any, host: str, port: int, world: int, first_rank: int,
                rank_timeout: float = RANK_TIMEOUT) -> list[dict]:
    """Every worker of `llm` joins the update group (ranks `first_rank`...); each worker's
    reply, or a SyncError naming every worker that failed."""
    return _checked(llm.collective_rpc("lazyload_join", args=(host, port, world, first_rank, rank_timeout)), "join")


def update_engine(llm: Any) -> list[dict]:
    """One weight update of every worker of `llm` (the trainers call their sync meanwhile):
    each worker's report, or a SyncError naming every worker that failed (the engine then
    serves the weights it had)."""
    return _checked(llm.collective_rpc("lazyload_update"), "update")


def _checked(replies: list[dict], what: str) -> list[dict]:
    failed = {worker: reply["error"] for worker, reply in enumerate(replies) if "error" in reply}
    if failed:
        raise SyncError("; ".join(f"worker {w}: {e}" for w, e in failed.items()) + f" (the weight {what} failed on "
                        f"{len(failed)} of {len(replies)} workers; the engine serves the weights it had)", failed)
    return replies



def transfer_engine_class() -> type:
    """vLLM's weight-transfer engine `lazyload` (vLLM 0.32's `WeightTransferEngine` API):
    the same worker side as the extension, through `init_weight_transfer_engine({"host",
    "port", "world", "first_rank", "rank_timeout"})` and `update_weights({})`; it raises, as
    vLLM's engines do. Made on first use: it subclasses vLLM's own."""
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    @dataclasses.dataclass
    class LazyLoadInitInfo(WeightTransferInitInfo):
        host: str
        port: int
        world: int
        first_rank: int
        rank_timeout: float = RANK_TIMEOUT

    @dataclasses.dataclass
    class LazyLoadUpdateInfo(WeightTransferUpdateInfo):
        pass

    class LazyLoadTransferEngine(WeightTransferEngine):
        init_info_cls, update_info_cls = LazyLoadInitInfo, LazyLoadUpdateInfo
        supports_draft_weight_update = False
        state: WorkerUpdate | None = None
        last_report: dict | None = None

        def init_transfer_engine(self, info: LazyLoadInitInfo) -> None:
            import torch.distributed as dist  # vLLM's own default group: this worker's rank

            self.state = WorkerUpdate(info.host, info.port, info.world, info.first_rank + dist.get_rank(),
                                      info.rank_timeout)

        def start_weight_update(self) -> None:
            """Nothing: the update is received whole before vLLM's reload starts (in
            `receive_weights`), so a failed one leaves the model as it was."""

        def finish_weight_update(self) -> None:
            """Nothing: `receive_weights` ran vLLM's whole in-place reload."""

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: LazyLoadUpdateInfo) -> None:
            if self.state is None:
                raise ArgumentError("init_weight_transfer_engine must run on every worker (and the trainers construct "
                                    "their WeightSync) before update_weights.")
            self.last_report = self.state.run(lambda weights: reload_weights(self.vllm_config, self.model, weights,
                                                                             None, True))

        def shutdown(self) -> None:
            self.state = None

    return LazyLoadTransferEngine


def register_transfer_engine() -> None:
    """Register the weight-transfer engine `lazyload` where the installed vLLM has the API."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # an older vLLM: the worker extension only
        return
    if "lazyload" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("lazyload", __name__, "LazyLoadTransferEngine")


def __getattr__(name: str) -> Any:
    if name == "LazyLoadTransferEngine":  # what the factory imports, made on first use
        return transfer_engine_class()
    raise AttributeError(name)

__all__ = ["WeightUpdateExtension", "WorkerUpdate", "update_group", "join_engine", "update_engine", "Received",
           "received_weights", "register_transfer_engine"]
