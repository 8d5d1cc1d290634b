"""`lazyload inspect`: what a checkpoint holds, from its headers alone."""
from __future__ import annotations

import os
from collections import defaultdict

from .checkpoint import LazyCheckpoint
from .report import group_layers
from .schedule import layer_of


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return ""


def inspect_checkpoint(path: str) -> str:
    ckpt = LazyCheckpoint(path)
    index = ckpt.index
    lines = [f"{path}: {len(index)} tensors in {len(ckpt.files)} file(s), {_size(index.total_bytes)} "
             f"(headers read: {index.header_bytes_read} bytes)", "", "tensors:"]
    names = sorted(index.keys(), key=lambda k: (layer_of(k) != "", k))
    for pattern, count in group_layers(names):
        example = next(k for k in names if _matches(pattern, k))
        entry = index[example]
        tail = f"  x{count}" if count > 1 else ""
        lines.append(f"  {pattern:<60} {str(entry.dtype).removeprefix('torch.'):<9} {str(list(entry.shape)):<18} "
                     f"{_size(entry.nbytes)}{tail}")
    lines += ["", "bytes per file:"]
    per_file = defaultdict(int)
    for entry in index.entries():
        per_file[entry.file] += entry.nbytes
    lines += [f"  {os.path.basename(f):<40} {_size(per_file[f])}" for f in ckpt.files]
    lines += ["", "bytes per layer:"]
    per_layer = defaultdict(int)
    for entry in index.entries():
        per_layer[layer_of(entry.key) or "(outside layers)"] += entry.nbytes
    lines += [f"  {layer:<40} {_size(n)}" for layer, n in per_layer.items()]
    lines += ["", f"total: {_size(index.total_bytes)} ({index.total_bytes} bytes)"]
    return "\n".join(lines)


def _matches(pattern: str, name: str) -> bool:
    if "{" not in pattern:
        return pattern == name
    head, _, rest = pattern.partition("{")
    tail = rest.partition("}")[2]
    return name.startswith(head) and name.endswith(tail)
