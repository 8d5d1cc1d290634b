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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    recomputed_buffers: list[str] = field(default_factory=list)
    # checkpoint keys of buffers the model computes itself (e.g. a legacy position_ids): not
    # loaded, as from_pretrained ignores them; the buffer is recomputed if it was on meta
    ignored_buffer_keys: list[str] = field(default_factory=list)
    bytes_read: int = 0
    # tensors left as views of the file mapping (CPU, same dtype); with cold pages (`prefetched`)
    # they are paged in during the load, with warm ones the pages are cached and mapped on first use
    bytes_mapped: int = 0
    seconds: float = 0.0
    peak_rss: int = 0
    peak_anon: int = 0
    peak_file: int = 0
    rank: int = 0
    world: int = 1
    reader: str = ""
    prefetched: bool = False  # cold pages: each layer's ranges announced to the kernel a layer ahead

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [f"lazyload: rank {self.rank}/{self.world}, {len(self.loaded)} tensors loaded, "
                 f"{_gib(self.bytes_read)} read" + (f", {_gib(self.bytes_mapped)} mapped" if self.bytes_mapped else "")
                 + f" in {self.seconds:.2f} s ({self.reader} reader{', prefetched' if self.prefetched else ''}); "
                 f"peak RSS {_gib(self.peak_rss)}, peak anonymous {_gib(self.peak_anon)}"]
        sections = [("loaded", self.loaded), ("missing", self.missing), ("unexpected", self.unexpected),
                    ("recomputed buffers", self.recomputed_buffers),
                    ("checkpoint keys of computed buffers, not loaded", self.ignored_buffer_keys)]
        for title, names in sections:
            if names:
                lines.append(f"  {title}:")
                lines += [f"    {pattern}" + (f"  x{count}" if count > 1 else "")
                          for pattern, count in group_layers(names)]
        if self.mismatched:
            lines.append("  mismatched (checkpoint shape vs model shape):")
            lines += [f"    {name}: {list(c)} vs {list(m)}" for name, c, m in self.mismatched]
        return "\n".join(lines)
