"""vLLM load format `lazyload`: each worker reads only the boxes its weight loaders copy.

    LLM(model=path, load_format="lazyload", model_loader_extra_config={"reader": "pread"})

The package's `vllm.general_plugins` entry point (`register`) registers the format in every
vLLM process. vLLM's own `model.load_weights` keeps doing the name mapping, fusing (QKV,
gate/up, experts), padding and its TP arithmetic; it is handed `LazyTensor`s
(`integrations.lazy_tensor`) instead of tensors, so each narrow or slice it takes only moves
a box, and each copy into a parameter is recorded. Once `load_weights` has run, the recorded
boxes are read in layer order under the byte budget (`integrations.reads`), casting into
the parameters; then vLLM's strict check and `process_weights_after_loading` run as for any
format.

`model_loader_extra_config` takes `load_into`'s read keywords (`reader`, `max_host_bytes`,
`release_pages`) and the checkpoint's (`trust_pickle`, `remote`: a dict of
`RemoteOptions`' fields, `iteration`); any other key is an ArgumentError naming the
nearest one. Each worker logs a `WorkerReport` and keeps it in `REPORTS`.

From a URL at TP > 1, the row-parallel tensors (each worker's box the column half of every
row) are fetched once between the workers, at a load and a reload, each a contiguous range of rows, and
exchanged over vLLM's TP group (`integrations.tp_share`): each worker fetches 1/TP of them in
few GETs. `cooperative: False` turns it off (each worker fetches its own boxes);
`rank_timeout` (seconds, 60 by default) bounds each collective of it, so that a worker that
fails or dies is a LazyLoadError on the others, not a hang. Local files keep their own
reads (the page cache is shared already).

The checkpoint is read from vLLM's `model_weights` when set, else from `model`. An object
store's URL (`s3://`, ...) vLLM takes in neither for a load format not its own (it pulls
config files through Run:ai's streamer, then refuses the format), so the key `weights`
names it instead, with `model` a local directory holding config.json (and the tokenizer):

    LLM(model="/configs/llama", load_format="lazyload",
        model_loader_extra_config={"weights": "s3://bucket/llama/", "remote": {"concurrency": 32}})

The loader puts `weights` in `model_config.model_weights` (vLLM's field for weights stored
apart from `model`), so that a reload without `weights_path` reads it again, and one with
`weights_path` reads that (vLLM's reload clears `model_weights`).

Reload (`llm.collective_rpc("reload_weights", kwargs={"weights_path": ...})`): vLLM asks
the loader's `get_all_weights` for the new checkpoint and runs the weight loaders under its
layer-wise reload, which processes a layer as soon as its last copy is done; there the
copies are read as they are made (still only each box), not deferred.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..agreement import RANK_TIMEOUT
from ..errors import ArgumentError
from ..keywords import check_keywords
from ..remote import RemoteOptions
from ..report import MemorySampler, size
from ..stored import StoredCheckpoint
from ..index import natural_key
from .lazy_tensor import LazyTensor
from .reads import BoxReads, ReadOptions
from .tp_share import Peers
from .vllm_update import LOADED_BOXES, LOADED_QUANTIZATION, register_transfer_engine

FORMAT = "lazyload"

# Keywords of load_into that do not apply inside vLLM, and why (named in the error).
NOT_HERE = {
    "device": "vLLM places the parameters", "dtype": "vLLM's dtype= sets the parameters' dtype",
    "plan": "vLLM's weight loaders split the tensors", "mesh": "vLLM's tensor_parallel_size sets the split",
    "quantize": "use vLLM's quantization=", "strict": "vLLM checks that every parameter was loaded",
    "shards_only": "vLLM's weight loaders split the tensors",
    "missing": "vLLM checks that every parameter was loaded", "key_map": "vLLM's weight loaders map the names",
}

REPORTS: list["WorkerReport"] = []  # this process's reports, the latest last (tests read them over collective_rpc)


def _extra_config(reader: str = "auto", max_host_bytes: int | None = None, release_pages: bool = False,
                  trust_pickle: bool = False, remote: dict | None = None, iteration: int | None = None,
                  weights: str | None = None, cooperative: bool | None = None,
                  rank_timeout: float = RANK_TIMEOUT) -> None:
    """The keys `model_loader_extra_config` takes (this signature is their list)."""


@dataclass
class LoaderConfig:
    read: ReadOptions
    trust_pickle: bool = False
    remote: RemoteOptions | None = None
    iteration: int | None = None
    weights: str | None = None  # the checkpoint's path or URL, when not `model` (see the module)
    cooperative: bool | None = None  # False: TP workers do not share a URL's row-parallel fetches
    rank_timeout: float = RANK_TIMEOUT  # seconds each collective of that sharing may take

    @classmethod
    def of(cls, extra: Any) -> "LoaderConfig":
        """From `model_loader_extra_config`; a key it does not take is an ArgumentError."""
        extra = dict(extra or {})
        for key in extra:
            if key in NOT_HERE:
                raise ArgumentError(f"model_loader_extra_config key {key!r} does not apply to load_format="
                                    f"'{FORMAT}': {NOT_HERE[key]}.")
        unknown = {k: v for k, v in extra.items() if k not in _known()}
        check_keywords(f"load_format='{FORMAT}' (model_loader_extra_config)", unknown, _extra_config)
        remote = extra.pop("remote", None)
        if remote is not None and not isinstance(remote, (dict, RemoteOptions)):
            raise ArgumentError(f"model_loader_extra_config 'remote' must be a dict of RemoteOptions' fields, "
                                f"got {type(remote).__name__}.")
        if isinstance(remote, dict):
            remote = RemoteOptions(**remote)
        weights = extra.get("weights")
        if weights is not None and (not isinstance(weights, str) or not weights):
            raise ArgumentError(f"model_loader_extra_config 'weights' must be the checkpoint's path or URL "
                                f"(e.g. 's3://bucket/model/'), got {weights!r}.")
        if extra.get("cooperative") not in (None, True, False):
            raise ArgumentError(f"model_loader_extra_config 'cooperative' must be true or false, got "
                                f"{extra['cooperative']!r}.")
        timeout = extra.get("rank_timeout", RANK_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ArgumentError(f"model_loader_extra_config 'rank_timeout' must be a positive number of seconds, "
                                f"got {timeout!r}.")
        read = ReadOptions(**{k: extra.pop(k) for k in ("reader", "max_host_bytes", "release_pages") if k in extra})
        return cls(read, remote=remote, **extra)


def _known() -> set[str]:
    import inspect

    return set(inspect.signature(_extra_config).parameters)


@dataclass
class WorkerReport:
    """What one worker's load (or reload) read: `bytes_read` tensor bytes (`bytes_planned`:
    the boxes its weight loaders copied; a fallback reads more; the pread reader may read
    across a small gap; `bytes_repeated` of them were boxes copied again: vLLM's layer-wise
    reload replays some loads; `bytes_received` tensor bytes of its boxes that other TP
    workers fetched and sent it, not counted in `bytes_read` (a URL at TP > 1, whose
    `bytes_read` counts the rows it fetched for all instead; `exchange_peak_bytes` the most
    bytes one round of that exchange held: its buffers, at a reload with the layer's values
    kept beside them, within `max_host_bytes` when set); `prefetched_bytes` of them were announced a layer ahead of their
    reads, on cold pages, at a load and a reload alike), `header_bytes` of the checkpoint's headers, `read_syscall_bytes`
    what the worker process read through read()/pread() meanwhile (the kernel's count,
    not lazyload's: with reader "pread" about `bytes_read` + `header_bytes`), `fallbacks` (tensor, operation) read whole because a weight
    loader did something no box records, `casts` the bytes read into another dtype than
    stored, by dtype path ("float8_e4m3fn->float32"; a pre-quantized weight that vLLM's
    quantization method loads as stored has none), `peak_rss`/`peak_anon` of the worker process."""

    checkpoint: str
    rank: int
    world: int
    reload: bool
    tensors: int = 0
    boxes: int = 0
    bytes_read: int = 0
    prefetched_bytes: int = 0
    bytes_received: int = 0
    exchange_peak_bytes: int = 0
    bytes_planned: int = 0
    bytes_repeated: int = 0
    header_bytes: int = 0
    checkpoint_bytes: int = 0
    seconds: float = 0.0
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    casts: dict[str, int] = field(default_factory=dict)
    peak_rss: int = 0
    peak_anon: int = 0
    read_syscall_bytes: int | None = None  # the worker's read()/pread() bytes during the load (/proc/self/io rchar)
    reader: str = ""
    remote: dict[str, Any] = field(default_factory=dict)  # a remote reader's counts (requests, bytes_served, ...)

    def __str__(self) -> str:
        what = "reload" if self.reload else "load"
        share = self.bytes_read / self.checkpoint_bytes if self.checkpoint_bytes else 0.0
        return (f"lazyload {what} of {self.checkpoint}, TP rank {self.rank}/{self.world}: read {size(self.bytes_read)} "
                f"({share:.0%} of {size(self.checkpoint_bytes)}; {self.boxes} boxes of {self.tensors} tensors, "
                f"reader {self.reader}) + {size(self.header_bytes)} of headers in {self.seconds:.2f} s; "
                + (f"{size(self.bytes_received)} received from the other TP workers (exchange peak "
                   f"{size(self.exchange_peak_bytes)}); " if self.bytes_received else "")
                + f"{len(self.fallbacks)} fallbacks"
                + (f", {size(self.bytes_repeated)} asked for again" if self.bytes_repeated else "")
                + f"; peak RSS {size(self.peak_rss)}, anonymous {size(self.peak_anon)}"
                + (f"; fallbacks: {self.fallbacks[:8]}" if self.fallbacks else ""))


def tp_rank_world() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # no TP group (a loader used outside a worker)
        return 0, 1


def tp_peers(config: LoaderConfig, checkpoint: StoredCheckpoint, world: int, group: Any = None) -> Peers | None:
    """The TP workers to share a URL's fetches with (`tp_share`) over `group`, by default the
    engine's TP group on CPU (gloo); None where each fetches its own boxes: one worker, local
    files, or `cooperative: False`."""
    import torch.distributed as dist

    if world == 1 or checkpoint.remote is None or config.cooperative is False:
        return None
    if group is None:
        from vllm.distributed import get_tp_group

        group = get_tp_group().cpu_group
    return Peers(group, dist.get_rank(group), dist.get_world_size(group), config.rank_timeout)


def checkpoint_of(model_config: Any, config: LoaderConfig) -> StoredCheckpoint:
    """The checkpoint at vLLM's `model_weights` when set (see the module), else at `model`."""
    return StoredCheckpoint(model_config.model_weights or model_config.model, trust_pickle=config.trust_pickle,
                            remote=config.remote, iteration=config.iteration)


def quantization_config(model_config: Any) -> dict:
    """The checkpoint's `quantization_config` as a dict ({} when not quantized)."""
    config = getattr(model_config.hf_config, "quantization_config", None) or {}
    return config if isinstance(config, dict) else config.to_dict()


def lazy_weights(reads: BoxReads) -> Generator[tuple[str, LazyTensor], None, None]:
    """Every checkpoint tensor, in layer order, as a lazy tensor whose copies go to `reads`."""
    for name in reads.checkpoint.index.natural_names():
        yield name, reads.tensor(name)


def has_online_processing(model: nn.Module) -> bool:
    """Layers vLLM processes during loading (online quantization): copies cannot wait."""
    return any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules())


class Load:
    """One worker's load or reload: the checkpoint, its reads, the report."""

    def __init__(self, model_config: Any, config: LoaderConfig, reload: bool, deferred: bool = True):
        self.started = time.perf_counter()
        self.rank, self.world = tp_rank_world()
        self.checkpoint = checkpoint_of(model_config, config)
        self.reads = BoxReads(self.checkpoint, config.read, self.world, deferred)
        self.reads.peers = tp_peers(config, self.checkpoint, self.world)
        self.reload = reload
        self.memory = MemorySampler()
        self.rchar = read_syscall_bytes()

    def report(self) -> WorkerReport:
        totals, index = self.reads.totals, self.checkpoint.index
        report = WorkerReport(str(self.checkpoint.paths), self.rank, self.world, self.reload, tensors=len(index),
                              boxes=totals.boxes, bytes_read=totals.bytes_read, bytes_planned=totals.bytes_planned,
                              bytes_repeated=totals.bytes_repeated, prefetched_bytes=totals.prefetched_bytes,
                              bytes_received=totals.bytes_received, exchange_peak_bytes=totals.exchange_peak_bytes,
                              header_bytes=index.header_bytes_read, checkpoint_bytes=index.total_bytes,
                              seconds=time.perf_counter() - self.started, fallbacks=list(totals.fallbacks),
                              casts=dict(totals.casts),
                              peak_rss=self.memory.peak_rss, peak_anon=self.memory.peak_anon, reader=totals.reader,
                              read_syscall_bytes=None if self.rchar is None else read_syscall_bytes() - self.rchar,
                              remote=dict(totals.fields))
        REPORTS.append(report)
        logger().info("%s", report)
        return report


def read_syscall_bytes() -> int | None:
    """Bytes this process has read through read()/pread() (Linux /proc/self/io rchar; None elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return None


def logger():
    from vllm.logger import init_logger

    return init_logger("vllm.lazyload")  # under vLLM's logger: its handlers print it


def loader_class() -> type:
    """The vLLM model loader class (made on first use: it subclasses vLLM's own)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class LazyLoadModelLoader(DefaultModelLoader):
        """load_format='lazyload' (see the module docstring). It reuses DefaultModelLoader's
        strict check (`track_weights_loading`) and nothing of its file iteration."""

        def __init__(self, load_config: Any):
            self.load_config = load_config
            self.config = LoaderConfig.of(load_config.model_loader_extra_config)
            self.local_expert_ids = None
            self._encoder_only_lm_prefixes = None
            self._encoder_only_weights_mapper = None
            self.enable_weights_track = None
            self.last_report: WorkerReport | None = None

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the checkpoint is read where it is (a path or URL)."""

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            if self.config.weights:  # kept there for a reload without weights_path (see the module)
                model_config.model_weights = self.config.weights
            load = Load(model_config, self.config, reload=False, deferred=not has_online_processing(model))
            with load.memory, torch.no_grad():
                loaded = model.load_weights(lazy_weights(load.reads))
                load.reads.run()
            LOADED_BOXES[:] = sorted(load.reads.asked, key=lambda pair: (natural_key(pair[0]), pair[1]))
            LOADED_QUANTIZATION.clear()
            LOADED_QUANTIZATION.update(quantization_config(model_config))
            self.last_report = load.report()
            if model_config.quantization is None and loaded is not None:
                self.track_weights_loading(model, loaded, quantized=False)

        def get_all_weights(self, model_config: Any, model: nn.Module) -> Generator[tuple[str, torch.Tensor], None, None]:
            """The checkpoint's tensors for vLLM's reload (`reload_weights`): each copy is read
            as it is made (vLLM processes each layer once its copies are done)."""
            load = Load(model_config, self.config, reload=True, deferred=False)
            load.reads.expect(LOADED_BOXES)  # the load's boxes: their pages announced a layer ahead when cold
            try:
                with load.memory:
                    yield from lazy_weights(load.reads)
            finally:
                load.reads.close()
            self.last_report = load.report()

    return LazyLoadModelLoader


def register() -> None:
    """The `vllm.general_plugins` entry point: registers load_format='lazyload' and, where the
    installed vLLM has the API, the weight-transfer engine 'lazyload' (`vllm_update`); run in
    every vLLM process, registering twice is harmless."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    if FORMAT not in _LOAD_FORMAT_TO_MODEL_LOADER:
        register_model_loader(FORMAT)(loader_class())
    register_transfer_engine()


def last_reports(worker: Any = None) -> list[dict]:
    """This worker's reports as dicts (for `llm.collective_rpc(last_reports)`)."""
    return [dataclasses.asdict(r) for r in REPORTS]


__all__ = ["register", "LoaderConfig", "WorkerReport", "REPORTS", "last_reports", "FORMAT"]
