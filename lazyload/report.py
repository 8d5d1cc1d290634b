"""LoadReport: what was loaded, missing, unexpected, mismatched; bytes, seconds, memory."""
from __future__ import annotations

import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import psutil


def _status_kib(fields: tuple[str, ...]) -> dict[str, int]:
    """Selected lines of /proc/self/status, in bytes (Linux only; empty elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


class MemorySampler:
    """Peak RSS and peak anonymous memory of this process while a load runs, sampled in a
    thread (anonymous = RssAnon; file-backed pages of mapped checkpoints are RssFile)."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak_rss = 0
        self.peak_anon = 0
        self.peak_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lazyload-memory")

    def sample(self) -> None:
        status = _status_kib(("RssAnon", "RssFile"))
        rss = psutil.Process().memory_info().rss
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_anon = max(self.peak_anon, status.get("RssAnon", 0))
        self.peak_file = max(self.peak_file, status.get("RssFile", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> "MemorySampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


_NUMBER = re.compile(r"\.(\d+)\.")


def group_layers(names: list[str]) -> list[tuple[str, int]]:
    """'model.layers.{0...21}.mlp.up_proj.weight' with its count, for names that differ only
    in one layer number."""
    groups: dict[str, list[int]] = defaultdict(list)
    order = []
    for name in names:
        m = _NUMBER.search(name)
        pattern = name if m is None else name[:m.start()] + ".{}." + name[m.end():]
        if pattern not in groups:
            order.append(pattern)
        groups[pattern].append(int(m.group(1)) if m else -1)
    out = []
    for pattern in order:
        numbers = sorted(groups[pattern])
        if numbers == [-1]:
            out.append((pattern, 1))
        else:
            span = f"{numbers[0]}...{numbers[-1]}" if len(numbers) > 1 else str(numbers[0])
            out.append((pattern.replace("{}", "{" + span + "}"), len(numbers)))
    return out


def size(n: float) -> str:
    """Bytes in binary units, the one family lazyload prints: B, KiB, MiB, GiB, TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}" if unit != "GiB" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class LoadReport:
    """What `load_into` did, for this rank. `print(report)` groups layer-numbered names.

    - `loaded`: model tensors filled from the checkpoint (one name per tied group).
    - `missing`: model tensors the checkpoint has no tensor for (strict=False).
    - `unexpected`: checkpoint tensors no model tensor uses (strict=False: not read).
    - `mismatched`: (name, checkpoint shape, model shape) of tensors left unfilled because
      the shapes differ (strict=False).
    - `initialized`: missing or mismatched tensors given the model's own initialisation
      (strict=False, missing="init"), as `from_pretrained` does; also, unless missing="keep",
      those the model expects to be missing (its `_keys_to_ignore_on_load_missing`, e.g.
      Marian's sinusoidal positions), which are no error.
    - `recomputed_buffers`: non-persistent buffers left on meta (rotary `inv_freq`, ...)
      that the model's own init computed.
    - `ignored_buffer_keys`: checkpoint keys of buffers the model computes itself (a
      `position_ids` or rotary `inv_freq` older versions saved): not read, as
      `from_pretrained` ignores them.
    - `other_stages`: checkpoint tensors of modules this model left out as a pipeline stage
      (layers set to None or missing from a ModuleDict of numbered layers, `embed_tokens` or
      `lm_head` set to None): the other stages' share, not read, not unexpected.
    - `read_whole`: targets built by a conversion no box can be pushed through (one of
      transformers' operations outside lazyload's vocabulary, e.g. an interleave): name ->
      bytes of its source tensors, read whole by this rank, converted here by transformers'
      own operation, and sliced to this rank's share.
    - `bytes_read`: tensor bytes copied out of the files by the reader.
    - `bytes_mapped`: bytes of tensors left as copy-on-write views of the file mapping
      (CPU, checkpoint dtype); with cold pages (`prefetched`) they are paged in during the
      load, with warm ones the pages are cached and mapped on first use.
    - `bytes_received`: tensor bytes this rank got from its replicas instead of storage
      (`load_into(..., mesh=...)` with a `dp` dim: cooperative reads).
    - `seconds`: wall time of the whole `load_into` call (not the imports before it, nor
      building the model).
    - `peak_rss`, `peak_anon`, `peak_file`: peaks of this process's resident memory, its
      anonymous part and its file-backed part (mapped checkpoint pages) during the load,
      sampled from /proc/self/status every 5 ms (0 where unavailable): the whole process
      (Python, torch, anything else it holds), not the load's own growth.
    - `rank`, `world`: the share this report is for.
    - `plan`: the split followed at world > 1: "tp" (the model's TP plan, else the structural
      rule), "ep" (whole experts per rank: `plan="ep"`, and the default for MoE models whose
      TP plan leaves the experts whole), "custom" (a plan= dict), "none" (plan={}), "model"
      (the model held its split already); "" at world 1.
    - `reader`: the reader that ran, "mmap" or "pread".
    - `prefetched`: True when this rank's pages were cold and each layer's page ranges were
      announced to the kernel a layer ahead.
    - `released_pages`: True when consumed file pages were dropped as the load went
      (`release_pages=True`, or on by itself: a tight memory cgroup, or more page cache
      touched than the host can spare).
    - `pinned_bytes`: page-locked staging of a GPU load (exactly the host budget, held
      during the load only, then unlocked); 0 on CPU.
    - `h2d_bytes`, `h2d_seconds`: the host-to-device copies of a GPU load and their GPU time
      (CUDA events): bytes / seconds is their rate.
    - `quantized`: the modules quantized on load (`quantize=`), `quantized_to` what they
      hold (e.g. "int8, a float32 scale per 128 input columns"), `bytes_saved` the bytes
      their weights take less than in full precision (scales counted).
    - `requests`, `retries`, `bytes_requested`, `bytes_served`: a remote checkpoint's ranged
      GETs for this rank (every attempt, retries among them), the bytes they asked for and
      the bytes that arrived (gaps merged into a GET included); 0 for local files.
      `bytes_cached`: bytes taken from `RemoteOptions.cache_dir` instead. `unversioned`: remote
      files whose server sends neither ETag nor Last-Modified: a change of one during the load
      cannot be detected (it would give a mix of old and new weights).
    - `ok` (property): True when nothing was missing, unexpected or mismatched."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    initialized: list[str] = field(default_factory=list)
    recomputed_buffers: list[str] = field(default_factory=list)
    # checkpoint keys of buffers the model computes itself (e.g. a legacy position_ids): not
    # loaded, as from_pretrained ignores them; the buffer is recomputed if it was on meta
    ignored_buffer_keys: list[str] = field(default_factory=list)
    other_stages: list[str] = field(default_factory=list)
    read_whole: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_mapped: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    peak_rss: int = 0
    peak_anon: int = 0
    peak_file: int = 0
    rank: int = 0
    world: int = 1
    plan: str = ""
    reader: str = ""
    prefetched: bool = False
    released_pages: bool = False
    pinned_bytes: int = 0
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    quantized: list[str] = field(default_factory=list)
    quantized_to: str = ""
    bytes_saved: int = 0
    requests: int = 0
    retries: int = 0
    bytes_requested: int = 0
    bytes_served: int = 0
    bytes_cached: int = 0
    unversioned: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [f"lazyload: rank {self.rank}/{self.world}" + (f" ({self.plan} plan)" if self.plan else "")
                 + f", {len(self.loaded)} tensors loaded, "
                 f"{size(self.bytes_read)} read" + (f", {size(self.bytes_mapped)} mapped" if self.bytes_mapped else "")
                 + (f", {size(self.bytes_received)} from replicas" if self.bytes_received else "")
                 + f" in {self.seconds:.2f} s of load_into (no imports, no model construction; "
                 f"{self.reader} reader{', prefetched' if self.prefetched else ''}); "
                 f"peak RSS of the whole process during it {size(self.peak_rss)}, peak anonymous {size(self.peak_anon)}"
                 + (f", pinned {size(self.pinned_bytes)}" if self.pinned_bytes else "")
                 + (f"; {self.requests} GETs ({self.retries} retries), {size(self.bytes_requested)} requested, "
                    f"{size(self.bytes_served)} served" if self.requests else "")
                 + (f", {size(self.bytes_cached)} from the cache" if self.bytes_cached else "")]
        initialized = set(self.initialized)
        sections = [("loaded", self.loaded),
                    ("missing, given the model's own initialisation", [n for n in self.missing if n in initialized]),
                    ("missing, left as they were", [n for n in self.missing if n not in initialized]),
                    ("not in the checkpoint, as the model expects; given its own initialisation",
                     [n for n in self.initialized if n not in set(self.missing) | {m[0] for m in self.mismatched}]),
                    ("unexpected (not read)", self.unexpected), ("recomputed buffers", self.recomputed_buffers),
                    ("checkpoint keys of computed buffers, not loaded", self.ignored_buffer_keys),
                    ("other pipeline stages' (not read)", self.other_stages),
                    (f"quantized to {self.quantized_to}, {size(self.bytes_saved)} saved", self.quantized),
                    (f"read whole, converted by transformers' own operation ({size(sum(self.read_whole.values()))})",
                     list(self.read_whole))]
        for title, names in sections:
            if names:
                lines.append(f"  {title}:")
                lines += [f"    {pattern}" + (f"  x{count}" if count > 1 else "")
                          for pattern, count in group_layers(names)]
        if self.unversioned:
            lines.append("  remote files without ETag or Last-Modified (a change during the load cannot be detected):")
            lines += [f"    {url}" for url in self.unversioned]
        if self.mismatched:
            lines.append("  mismatched (checkpoint shape vs model shape):")
            lines += [f"    {name}: {list(c)} vs {list(m)}" + ("  (given the model's own initialisation)"
                                                             if name in initialized else "")
                      for name, c, m in self.mismatched]
        return "\n".join(lines)
