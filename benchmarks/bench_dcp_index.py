"""Indexing a torch DCP checkpoint of many chunks, from disk and by URL: seconds, requests
and bytes fetched. The index reads `.metadata` and every chunk's `torch.save` zip headers
(its head and tail windows, `formats/torch_zip.windows`); over a URL the tail of one chunk
and the head of the next are one GET, all GETs 16 in flight.

Cases: `local` (LazyCheckpoint(dir).index, exact preads) and `http` (the same over the
tests' Range server, tests/remote_servers.py, in this process: Python on the same cores,
so its seconds are an upper bound of the client's work, not a real store's latency).

Usage: python benchmarks/bench_dcp_index.py [--chunks 2000] [--rows 128] [--dir DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _save(directory: str, chunks: int, rows: int) -> None:
    """A state dict of `chunks` float32 [rows, 128] tensors, saved by dcp.save (one process)."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"layers.{i}.weight": torch.randn(rows, 128) for i in range(chunks)}
    dcp.save(state, checkpoint_id=directory, no_dist=True)


def _measure(path: str) -> tuple[float, int, int]:
    from lazyload import LazyCheckpoint

    started = time.perf_counter()
    index = LazyCheckpoint(path).index
    return time.perf_counter() - started, len(list(index.entries())), index.header_bytes_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=128, help="rows of 128 float32 per chunk (default 64 KiB)")
    parser.add_argument("--dir", default=None, help="where the checkpoint is written (default a temp dir)")
    args = parser.parse_args()
    from remote_servers import RangeServer

    with tempfile.TemporaryDirectory(prefix="bench-dcp-index-") as tmp:
        root = args.dir or tmp
        directory = os.path.join(root, "ckpt")
        if not os.path.isfile(os.path.join(directory, ".metadata")):
            _save(directory, args.chunks, args.rows)
        size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(f"{args.chunks} chunks of {args.rows * 512 // 1024} KiB, {size / 2**20:.1f} MiB on disk")
        print("| case | seconds | chunks | GETs | bytes fetched | of the files |")
        print("|---|---|---|---|---|---|")
        seconds, chunks, fetched = _measure(directory)
        print(f"| local | {seconds:.2f} | {chunks} | - | {fetched:,} | {fetched / size:.2%} |")
        with RangeServer(root) as server:
            seconds, chunks, fetched = _measure(f"{server.url}/ckpt/")
            gets = sum(1 for e in server.log if e.method == "GET")
        print(f"| http | {seconds:.2f} | {chunks} | {gets} | {fetched:,} | {fetched / size:.2%} |")


if __name__ == "__main__":
    main()
