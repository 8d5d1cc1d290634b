"""Replicas reading one checkpoint over a shared storage uplink: `load_into(model, mesh=...)`
on a ("dp", "tp") mesh with and without cooperative reads (issue 23).

The storage is the tests' HTTP Range server (tests/remote_servers.py) in its own process,
with ONE bandwidth cap shared by all its connections (a storage uplink, `--mbps`). Four
gloo processes on this host load the quick bf16 Llama (about 200 MB) onto meta models as
4 replicas of tp 1 and as 2 replicas of tp 2, each with cooperative=False (every replica
reads its whole share) and with cooperation (each shard's replicas split its reads and
broadcast them). Per case: wall time (the slowest rank's load), storage bytes per rank
(`bytes_read`), bytes received from peers, peak anonymous memory per rank (the largest),
and the check the design promises: each rank's peak anonymous memory above its baseline
(just before the load) and its destination (its local tensors) stays within one host
budget of reads plus one of exchange staging (2 x `max_host_bytes`, here set to the
checkpoint's largest layer or tensor).

Then the same meshes from the local files with a cold page cache (dropped before every
load: root only, else skipped with a message): storage bytes per rank as lazyload counts
them (`bytes_read + bytes_mapped`) and as the kernel does (`read_bytes` of /proc/self/io;
ranks on one host share a page cache, so a page one rank faulted in is not read again
for another).

Usage: python benchmarks/bench_replicas.py [--mbps 50] [--ckpt-dir DIR]
"""

import argparse
import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402

WORLD = 4
CASES = [((4, 1), False), ((4, 1), True), ((2, 2), False), ((2, 2), True)]

SERVER = """
import sys, threading, time
sys.path.insert(0, {tests!r})
from remote_servers import RangeServer

class Uplink:
    '''One pace for every connection: each write waits for its turn on the shared link.'''
    def __init__(self, rate):
        self.rate, self.free, self.lock = rate, time.monotonic(), threading.Lock()
    def take(self, n):
        with self.lock:
            start = max(time.monotonic(), self.free)
            self.free = start + n / self.rate
        time.sleep(max(0.0, self.free - time.monotonic()))

class Capped:
    def __init__(self, wfile, uplink):
        self.wfile, self.uplink = wfile, uplink
    def write(self, data):
        view = memoryview(data)
        for i in range(0, len(view), 1 << 18):
            self.uplink.take(len(view[i:i + (1 << 18)]))
            self.wfile.write(view[i:i + (1 << 18)])
        return len(view)
    def __getattr__(self, name):
        return getattr(self.wfile, name)

uplink = Uplink({rate})
with RangeServer({directory!r}) as server:
    base = server.RequestHandlerClass
    class Handler(base):
        def setup(self):
            super().setup()
            self.wfile = Capped(self.wfile, uplink)
    server.RequestHandlerClass = Handler
    print(server.url, flush=True)
    time.sleep(1e9)
"""


def start_server(directory, rate):
    tests = os.path.join(os.path.dirname(common.BENCH_DIR), "tests")
    code = SERVER.format(tests=tests, directory=directory, rate=rate)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip() + "/"


def _rank(rank, url, ckpt_dir, cold, budget, init_file, out):
    import torch
    import torch.distributed as dist

    os.environ["LAZYLOAD_PROGRESS"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    for source in (ckpt_dir, url):  # warm-up: one-time allocations (of each reader) stay out of the baselines
        _load_case(source, ckpt_dir, 4, 1, True, budget)
    results = [_load_case(url, ckpt_dir, dp, tp, cooperative, budget) for (dp, tp), cooperative in CASES]
    for (dp, tp), cooperative in CASES if cold else []:
        results.append(_load_case(ckpt_dir, ckpt_dir, dp, tp, cooperative, budget, cold=True))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _load_case(source, ckpt_dir, dp, tp, cooperative, budget, cold=False):
    """One load of `source` (`ckpt_dir`'s files, or its URL) on every rank (after a barrier,
    and with `cold` the page cache dropped by rank 0); this rank's figures."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from lazyload import LazyCheckpoint

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = meta_model(ckpt_dir)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory of the last case leaves the baseline
    dist.barrier()  # every rank's last model is gone: its mapped pages can be dropped
    if cold and dist.get_rank() == 0 and (why_not := common.drop_page_cache()) is not None:
        raise RuntimeError(f"could not drop the page cache: {why_not}")
    dist.barrier()
    baseline, disk = common.read_status()["RssAnon"], common.read_io()["read_bytes"]
    start = time.perf_counter()
    report = LazyCheckpoint(source).load_into(model, mesh=mesh, cooperative=cooperative, progress=False,
                                              max_host_bytes=budget)
    seconds = time.perf_counter() - start
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    return dict(dp=dp, tp=tp, cooperative=cooperative, seconds=seconds, read=report.bytes_read,
                storage=report.bytes_read + report.bytes_mapped, disk=common.read_io()["read_bytes"] - disk,
                received=report.bytes_received, anon=report.peak_anon, above=report.peak_anon - baseline - local)


def meta_model(ckpt_dir):
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(ckpt_dir)
    with torch.device("meta"):
        return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbps", type=float, default=50.0, help="the uplink's cap, MB/s (all connections)")
    parser.add_argument("--ckpt-dir", default=None)
    args = parser.parse_args()
    ckpt_dir = args.ckpt_dir or common.write_llama_checkpoint(common.default_ckpt_dir(quick=True), quick=True)
    budget = max([common.largest_layer_bytes(ckpt_dir, 2),  # bf16
                  *(2 * math.prod(shape) for _, shape in common.read_headers(ckpt_dir).values())])
    why_not = common.can_drop_page_cache()
    import torch.multiprocessing as mp

    proc, url = start_server(ckpt_dir, args.mbps * 1e6)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result")
            mp.spawn(_rank, args=(url, ckpt_dir, why_not is None, budget, os.path.join(tmp, "pg"), out),
                     nprocs=WORLD, join=True)
            ranks = [json.load(open(f"{out}.{r}")) for r in range(WORLD)]
    finally:
        proc.kill()
    print(f"uplink {args.mbps:g} MB/s shared, {WORLD} processes, {ckpt_dir}, max_host_bytes {budget / MiB:.1f} MiB")
    print_uplink(ranks, 2 * budget)
    if why_not is not None:
        print(f"local files with a cold page cache: skipped ({why_not})")
    else:
        print_local(ranks)


def print_uplink(ranks, bound):
    print("| mesh (dp, tp) | cooperative | wall s | vs not | storage MiB per rank (max) | received MiB (max) "
          f"| peak anon MiB (max) | anon above destination MiB (max; bound {bound / MiB:.0f}) |")
    print("|---|---|---|---|---|---|---|---|")
    base = {}
    for i, ((dp, tp), cooperative) in enumerate(CASES):
        rows = [r[i] for r in ranks]
        wall = max(r["seconds"] for r in rows)
        base.setdefault((dp, tp), wall)
        above = max(r["above"] for r in rows)
        print(f"| ({dp}, {tp}) | {cooperative} | {wall:.2f} | {common.ratio(wall, base[(dp, tp)])} "
              f"| {max(r['read'] for r in rows) / MiB:.1f} | {max(r['received'] for r in rows) / MiB:.1f} "
              f"| {max(r['anon'] for r in rows) / MiB:.0f} | {above / MiB:.0f} "
              f"({'within' if above <= bound else 'OVER'}) |")


def print_local(ranks):
    print("local files, cold page cache before every load:")
    print("| mesh (dp, tp) | cooperative | wall s | storage MiB per rank (lazyload, max) "
          "| disk MiB per rank (kernel, max) | disk MiB all ranks | received MiB (max) |")
    print("|---|---|---|---|---|---|---|")
    for i, ((dp, tp), cooperative) in enumerate(CASES, start=len(CASES)):
        rows = [r[i] for r in ranks]
        print(f"| ({dp}, {tp}) | {cooperative} | {max(r['seconds'] for r in rows):.2f} "
              f"| {max(r['storage'] for r in rows) / MiB:.1f} | {max(r['disk'] for r in rows) / MiB:.1f} "
              f"| {sum(r['disk'] for r in rows) / MiB:.1f} | {max(r['received'] for r in rows) / MiB:.1f} |")


if __name__ == "__main__":
    main()
