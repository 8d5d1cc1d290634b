"""Remote checkpoints: lazyload reading each rank's byte ranges from a local S3 server
(moto's, in its own process), against download-then-load and Run:ai's model streamer on
the same objects, and the same loaders on the local files.

Cases (one process, one after another; the S3 server is a separate process):

  lazyload s3       LazyCheckpoint("s3://bench/llama/").load_into(meta model, rank, world),
                    each rank of world 1, 2, 4 in turn (no process group: rank and world
                    alone give the rank its shards), report.bytes_requested vs its share
  lazyload http     the same over HTTP: the tests' Range server (tests/remote_servers.py,
                    reads only the asked range of the file) in its own process
  ... fill/cached   (--cache) world 1 with RemoteOptions(cache_dir=...): the load that fills
                    the cache, then one answered from it (each entry's sha256 checked)
  download+load     every object downloaded (boto3; urllib over HTTP) into a temp directory,
                    then a world-1 lazyload load of it
  runai s3          runai_model_streamer.SafetensorsStreamer over the objects (every tensor
                    whole: what each rank of a TP load would stream), cloned into a state dict
  lazyload local    the same loads from the local directory (page cache warm)
  runai local       the streamer over the local files
  index 191 files   LazyCheckpoint("s3://bench/many/").index over 191 small shards and their
                    index json (the issue's target: under 2 s)

Seconds include building the model on meta. Both servers are Python on the same cores as
the loaders; moto reads and copies the whole object for every ranged GET (its `key.value`),
so there a GET costs in proportion to the object's size, whatever its range: many small
GETs lose to a few whole-object downloads, unlike on a real store. Compare rows, not with a
real store.

Usage: python benchmarks/bench_remote.py [--quick] [--worlds 1,2,4] [--ckpt-dir DIR] [--index-files 191] [--cache]
Needs: pip install -e '.[remote-bench]'
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import MiB  # noqa: E402

BUCKET = "bench"


def start_s3():
    """moto's S3 server in a child process (so that it does not share the loaders' GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_EC2_METADATA_DISABLED="true",
                      RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")
    return proc


def start_http(directory):
    """The tests' Range server (tests/remote_servers.py) over `directory`, in a child process."""
    tests = os.path.join(os.path.dirname(common.BENCH_DIR), "tests")
    code = (f"import sys, time; sys.path.insert(0, {tests!r}); from remote_servers import RangeServer\n"
            f"with RangeServer({directory!r}) as s:\n    print(s.url, flush=True); time.sleep(1e9)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip() + "/"


def download_http(url, names, directory):
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    def get(name):
        with urllib.request.urlopen(url + name) as response, open(os.path.join(directory, name), "wb") as f:
            shutil.copyfileobj(response, f, 8 * MiB)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(get, names))


def s3_client():
    import boto3
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def upload(directory, prefix):
    client = s3_client()
    for name in sorted(os.listdir(directory)):
        if name.endswith((".safetensors", ".json")):
            client.upload_file(os.path.join(directory, name), BUCKET, f"{prefix}/{name}")


def meta_model(ckpt_dir):
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    config = AutoConfig.from_pretrained(ckpt_dir)
    with torch.device("meta"):
        return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


def lazyload_case(path, ckpt_dir, rank, world, options=None):
    from lazyload import LazyCheckpoint
    t = time.perf_counter()
    model = meta_model(ckpt_dir)
    report = LazyCheckpoint(path, remote=options).load_into(model, rank, world, progress=False)
    seconds = time.perf_counter() - t
    return dict(requested=report.bytes_requested if report.requests else None,
                share=report.bytes_read + report.bytes_mapped, requests=report.requests,
                retries=report.retries, seconds=seconds)


def download_then_load(ckpt_dir, total, http_url=None):
    t = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="lazyload-download-")
    try:
        if http_url is not None:
            download_http(http_url, [n for n in os.listdir(ckpt_dir) if n.endswith((".safetensors", ".json"))], tmp)
        else:
            from boto3.s3.transfer import TransferConfig
            client = s3_client()
            for obj in client.list_objects_v2(Bucket=BUCKET, Prefix="llama/")["Contents"]:
                client.download_file(BUCKET, obj["Key"], os.path.join(tmp, obj["Key"].split("/")[-1]),
                                     Config=TransferConfig(max_concurrency=16))
        row = lazyload_case(tmp, ckpt_dir, 0, 1)
    finally:
        shutil.rmtree(tmp)
    return dict(row, requested=total, seconds=time.perf_counter() - t)


def runai_case(paths, ckpt_dir, total):
    from runai_model_streamer import SafetensorsStreamer
    t = time.perf_counter()
    model = meta_model(ckpt_dir)
    state = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(paths)
        for name, tensor in streamer.get_tensors():
            state[name] = tensor.clone()  # the streamer reuses its buffers
    model.load_state_dict(state, assign=True, strict=False)
    return dict(requested=total, share=sum(v.nbytes for v in state.values()), requests=0, retries=0,
                seconds=time.perf_counter() - t)


def cache_rows(where, path, ckpt_dir):
    """World 1 with `RemoteOptions(cache_dir=...)`: the load that fills the cache, then one
    answered from it (every entry's sha256 checked)."""
    from lazyload.remote import RemoteOptions
    cache = tempfile.mkdtemp(prefix="lazyload-cache-")
    try:
        options = RemoteOptions(cache_dir=cache)
        return [(f"lazyload {where} {step}", "0/1", lazyload_case(path, ckpt_dir, 0, 1, options))
                for step in ("fill", "cached")]
    finally:
        shutil.rmtree(cache)


def index_many(n):
    """n small shards (8 tensors each) and their index json in the bucket; seconds to index."""
    import json
    import torch
    from safetensors.torch import save
    from lazyload import LazyCheckpoint
    client = s3_client()
    weight_map = {}
    for i in range(n):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = {f"layers.{i}.w{j}": torch.zeros(64, 64, dtype=torch.bfloat16) for j in range(8)}
        client.put_object(Bucket=BUCKET, Key=f"many/{name}", Body=save(tensors))
        weight_map.update(dict.fromkeys(tensors, name))
    client.put_object(Bucket=BUCKET, Key="many/model.safetensors.index.json",
                      Body=json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    t = time.perf_counter()
    ckpt = LazyCheckpoint("s3://bench/many/")
    tensors = len(ckpt.index)
    return time.perf_counter() - t, tensors, ckpt.remote.stats.requests


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the ~200 MB checkpoint instead of ~2.2 GB")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--index-files", type=int, default=191)
    parser.add_argument("--skip-runai", action="store_true")
    parser.add_argument("--cache", action="store_true", help="also world 1 with a cache_dir: filling it, then from it")
    common.add_clean_flag(parser)
    args = parser.parse_args()
    os.environ.setdefault("LAZYLOAD_PROGRESS", "0")
    import transformers
    transformers.logging.set_verbosity_error()

    ckpt_dir = common.write_llama_checkpoint(args.ckpt_dir or common.default_ckpt_dir(quick=args.quick),
                                             quick=args.quick)
    files = common.shard_files(ckpt_dir)
    total = sum(os.path.getsize(f) for f in files)
    worlds = [int(w) for w in args.worlds.split(",")]
    server = start_s3()
    http, http_url = start_http(ckpt_dir)
    rows = []
    try:
        s3_client().create_bucket(Bucket=BUCKET)
        upload(ckpt_dir, "llama")
        print(f"checkpoint {ckpt_dir}: {len(files)} files, {total / MiB:.0f} MiB, uploaded", file=sys.stderr)
        for where, path in (("s3", f"s3://{BUCKET}/llama/"), ("http", http_url), ("local", ckpt_dir)):
            common.warm_page_cache(ckpt_dir)  # the HTTP server's reads too: the same files
            for world in worlds:
                for rank in range(world):
                    rows.append((f"lazyload {where}", f"{rank}/{world}", lazyload_case(path, ckpt_dir, rank, world)))
            if where != "local" and args.cache:
                rows += cache_rows(where, path, ckpt_dir)
            if where != "local":
                rows.append((f"download+load {where}", "0/1",
                             download_then_load(ckpt_dir, total, http_url if where == "http" else None)))
            if not args.skip_runai and where != "http":
                paths = [f"s3://{BUCKET}/llama/{os.path.basename(f)}" for f in files] if where == "s3" else files
                try:
                    rows.append((f"runai {where}", "every", runai_case(paths, ckpt_dir, total)))
                except Exception as exc:  # not installed, or no CPU build for this machine
                    print(f"runai {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        seconds, tensors, requests = index_many(args.index_files)
    finally:
        for proc in (server, http):
            proc.terminate()
            proc.wait()
    print(f"\n{total / MiB:.0f} MiB checkpoint, {len(files)} files; S3 = moto on localhost (Python server)\n")
    print(f"{'case':21s} {'rank':>6s} {'requested':>11s} {'rank share':>11s} {'GETs':>6s} {'retries':>7s} "
          f"{'seconds':>8s}")
    for case, rank, r in rows:
        requested = f"{r['requested'] / MiB:9.1f} M" if r["requested"] is not None else f"{'-':>11s}"
        print(f"{case:21s} {rank:>6s} {requested} {r['share'] / MiB:9.1f} M {r['requests']:6d} "
              f"{r['retries']:7d} {r['seconds']:8.2f}")
    print(f"\nindex of {args.index_files} files ({tensors} tensors) from S3: {seconds:.2f} s, {requests} GETs")
    if args.clean:
        common.remove_checkpoint(ckpt_dir)


if __name__ == "__main__":
    main()
