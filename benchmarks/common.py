"""Shared pieces of the lazyload benchmarks.

- a Llama-shaped checkpoint written by transformers' ``save_pretrained``, cached under the
  system temp directory (``CACHE_DIR``) or a ``--ckpt-dir`` of your choice, so that reruns
  skip the write; ``--clean`` (on any benchmark) deletes it after the run,
- a memory sampler reading ``/proc/self/status`` every few milliseconds,
- ``run_isolated``: one measured case per fresh Python process, result as JSON,
- table cells (MiB, ratios against a row measured in the same run).

Run ``python benchmarks/common.py --write-checkpoint [--layers N | --quick]`` to only
write the checkpoint (e.g. in the background before a benchmark), and
``python benchmarks/common.py --clean`` to delete every cached one.
"""

import argparse
import contextlib
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

MiB = 1024 * 1024
PAGE = 4096
MARKER = ".bench_complete.json"
CACHE_DIR = os.path.join(tempfile.gettempdir(), "lazyload-bench")
DEFAULT_CKPT_DIR = os.path.join(CACHE_DIR, "llama")
BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- checkpoint

# ~2.2 GB in bf16 with 22 layers; 44 layers give ~4.1 GB.
FULL_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
# ~200 MB in bf16, for smoke tests.
QUICK_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                   num_attention_heads=16, num_key_value_heads=4, vocab_size=16000)


def checkpoint_shape(layers=None, quick=False):
    shape = dict(QUICK_SHAPE if quick else FULL_SHAPE)
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return shape


def default_ckpt_dir(layers=None, quick=False):
    if quick:
        return DEFAULT_CKPT_DIR + "_quick" + (f"_L{layers}" if layers else "")
    if layers is None or layers == FULL_SHAPE["num_hidden_layers"]:
        return DEFAULT_CKPT_DIR
    return f"{DEFAULT_CKPT_DIR}_L{layers}"


def add_clean_flag(parser):
    parser.add_argument("--clean", action="store_true",
                        help="delete the checkpoints this benchmark wrote once it is done (default: keep them in "
                             f"{CACHE_DIR} or --ckpt-dir, so that the next run skips the write)")


def remove_checkpoint(ckpt_dir):
    """Delete a checkpoint directory written by ``write_llama_checkpoint`` (it holds the
    marker file); anything else is left alone."""
    if os.path.exists(os.path.join(ckpt_dir, MARKER)):
        shutil.rmtree(ckpt_dir)
        print(f"removed {ckpt_dir}", file=sys.stderr)
    with contextlib.suppress(OSError):  # the cache folder too, once nothing is left in it
        os.rmdir(CACHE_DIR)


def llama_config(shape):
    from transformers import LlamaConfig
    import torch
    config = LlamaConfig(**shape, tie_word_embeddings=False, max_position_embeddings=2048)
    config.dtype = torch.bfloat16
    return config


def checkpoint_is_complete(ckpt_dir, shape):
    """True when ``ckpt_dir`` holds a finished checkpoint of this shape (marker + file sizes)."""
    marker = os.path.join(ckpt_dir, MARKER)
    if not os.path.exists(marker):
        return False
    with open(marker) as f:
        info = json.load(f)
    if info.get("shape") != shape:
        raise SystemExit(f"{ckpt_dir} holds a checkpoint of another shape {info.get('shape')}; "
                         f"wanted {shape}. Use another --ckpt-dir or delete it.")
    for name, size in info["files"].items():
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path) or os.path.getsize(path) != size:
            return False
    return True


@contextlib.contextmanager
def default_dtype(dtype):
    """Build modules in ``dtype`` the way from_pretrained does (fp32 buffers stay fp32)."""
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def write_llama_checkpoint(ckpt_dir=DEFAULT_CKPT_DIR, layers=None, quick=False, min_shards=5):
    """Write a random bf16 Llama checkpoint with ``save_pretrained``; skip if already there.

    The model is built on meta, then materialised with ``to_empty`` and filled with
    ``normal_(0, 0.02)`` in bf16: real random bytes without an fp32 init of every weight.
    """
    import torch
    from transformers import LlamaForCausalLM

    shape = checkpoint_shape(layers, quick)
    if checkpoint_is_complete(ckpt_dir, shape):
        return ckpt_dir
    os.makedirs(ckpt_dir, exist_ok=True)
    config = llama_config(shape)
    t0 = time.perf_counter()
    with default_dtype(torch.bfloat16), torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(ckpt_dir, max_shard_size=total // min_shards)
    files = {name: os.path.getsize(os.path.join(ckpt_dir, name))
             for name in sorted(os.listdir(ckpt_dir)) if name.endswith(".safetensors")}
    with open(os.path.join(ckpt_dir, MARKER), "w") as f:
        json.dump({"shape": shape, "files": files, "tensor_bytes": total}, f, indent=1)
    print(f"wrote {ckpt_dir}: {len(files)} shards, {total / 1e9:.2f} GB "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return ckpt_dir


def shard_files(ckpt_dir):
    return sorted(os.path.join(ckpt_dir, n) for n in os.listdir(ckpt_dir) if n.endswith(".safetensors"))


def read_headers(ckpt_dir):
    """{key: (dtype_str, shape)} from the safetensors headers of every shard."""
    entries = {}
    for path in shard_files(ckpt_dir):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for key, info in header.items():
            entries[key] = (info["dtype"], tuple(info["shape"]))
    return entries


def largest_layer_bytes(ckpt_dir, itemsize):
    """Bytes of the largest ``model.layers.N.`` group, at ``itemsize`` bytes per element."""
    per_layer = {}
    for key, (_, shape) in read_headers(ckpt_dir).items():
        parts = key.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
            numel = 1
            for d in shape:
                numel *= d
            per_layer[parts[2]] = per_layer.get(parts[2], 0) + numel * itemsize
    return max(per_layer.values())


def warm_page_cache(ckpt_dir):
    """Read every shard once so that the page cache holds the whole checkpoint."""
    total = 0
    t0 = time.perf_counter()
    for path in shard_files(ckpt_dir):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(16 * MiB):
                total += len(chunk)
    return total, time.perf_counter() - t0


def can_drop_page_cache():
    """None when /proc/sys/vm/drop_caches is writable, else why not (nothing is dropped)."""
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return None
    return "/proc/sys/vm/drop_caches is not writable (needs root and a writable /proc/sys)"


def drop_page_cache():
    """Drop the page cache (root only). Returns None on success, else the reason it failed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def pread_ranges(work, threads=8, chunk=16 * MiB):
    """Read (path, offset, length <= chunk) ranges with `threads` threads of pread, each into
    its own reused buffer (nothing kept): the physical reference of a read pattern.
    Returns the bytes read."""
    work = list(work)
    lock = threading.Lock()
    total = [0]

    def worker():
        view = memoryview(bytearray(chunk))
        fds = {}
        while True:
            with lock:
                if not work:
                    break
                path, offset, length = work.pop()
            fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
            n = os.preadv(fd, [view[:length]], offset)
            with lock:
                total[0] += n
        for fd in fds.values():
            os.close(fd)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return total[0]


# --------------------------------------------------------------------------- memory

def read_status():
    """VmRSS, RssAnon, RssFile, VmHWM of this process, in bytes."""
    wanted = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in wanted:
                values[name] = int(rest.split()[0]) * 1024
    return values


def read_io():
    """read_bytes (from storage) and rchar (read syscalls) of this process, in bytes."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, rest = line.partition(":")
            values[name] = int(rest)
    return {"read_bytes": values["read_bytes"], "rchar": values["rchar"]}


class MemorySampler:
    """A thread polling /proc/self/status every ``interval`` seconds, keeping the peaks.

    VmHWM is the kernel's own peak of RSS (exact); the anon and file peaks are sampled,
    so a spike shorter than the interval can be missed.
    """

    def __init__(self, interval=0.005):
        self.interval = interval
        self.peaks = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        for name, value in read_status().items():
            self.peaks[name] = max(self.peaks.get(name, 0), value)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def start(self):
        self._sample()
        self._thread.start()
        return self

    def snapshot(self):
        self._sample()
        return dict(self.peaks)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.snapshot()


# --------------------------------------------------------------------------- isolated runs

def model_bytes(model):
    """nbytes of the model's parameters and buffers (each shared tensor counted once)."""
    seen = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type == "meta" or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def touch_pages(model):
    """Read one byte per 4 KiB page of every parameter and buffer (cheap, forces page-in)."""
    import torch
    total = 0
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            flat = tensor.detach().reshape(-1).view(torch.uint8)
            total += int(flat[::PAGE].sum())
    return total


def checksum(model, names):
    """Float sums of a few named parameters: a cheap check that loaders agree."""
    import torch
    params = dict(model.named_parameters())
    with torch.no_grad():
        return {name: float(params[name].float().sum()) for name in names if name in params}


class Meter:
    """Handed to a case function: ``start()`` right before the load, ``loaded(model)`` after."""

    def __init__(self):
        self.sampler = None
        self.baseline = None
        self.io_start = None
        self.t0 = None
        self.records = {}

    def start(self):
        import gc
        gc.collect()
        self.baseline = read_status()
        self.io_start = read_io()
        self.sampler = MemorySampler().start()
        self.t0 = time.perf_counter()

    def record(self, label, model):
        seconds = time.perf_counter() - self.t0
        peaks = self.sampler.snapshot()
        io = read_io()
        self.records[label] = {
            "seconds": seconds,
            "peak_rss": peaks["VmRSS"],
            "peak_anon": peaks["RssAnon"],
            "peak_file": peaks["RssFile"],
            "vmhwm": peaks["VmHWM"],
            "baseline_rss": self.baseline["VmRSS"],
            "baseline_anon": self.baseline["RssAnon"],
            "baseline_file": self.baseline["RssFile"],
            "end_anon": read_status()["RssAnon"],  # what the loaded model holds (views of files excluded)
            "dest_bytes": model_bytes(model),
            "read_bytes": io["read_bytes"] - self.io_start["read_bytes"],
            "rchar": io["rchar"] - self.io_start["rchar"],
        }

    def loaded(self, model):
        self.record("load", model)


def child_main(fn_name, args):
    """Run one case in this (fresh) process; print its records as JSON on the last line."""
    module_name, func_name = fn_name.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    meter = Meter()
    try:
        model = func(args, meter)
    except CaseSkipped as exc:
        print(f"skipped: {exc}", file=sys.stderr)
        sys.exit(3)
    if args.get("touch"):
        touch_pages(model)
        meter.record("load+touch", model)
    meter.sampler.stop()
    result = {"records": meter.records, "checksum": checksum(model, args.get("checksum_names", []))}
    print("BENCH_RESULT " + json.dumps(result))


class CaseSkipped(Exception):
    pass


def run_isolated(fn_name, args, timeout=1800):
    """Run ``module:function`` in a fresh Python process so that peaks do not mix.

    The function gets (args, meter); it builds what it needs, calls ``meter.start()``
    right before the load and ``meter.loaded(model)`` after it, and returns the model.
    A child that exits with code 3 is a skipped case (message on stderr).
    """
    env = dict(os.environ, LAZYLOAD_PROGRESS="0", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", fn_name, json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode == 3:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        raise CaseSkipped(last.removeprefix("skipped: "))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT "):])
    raise RuntimeError(f"{fn_name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def torchrun_ranks(script, world, worker_args, timeout, env):
    """Run ``script --worker WORKER_ARGS --out DIR`` under torchrun at ``world`` ranks, each
    rank writing one json file into DIR; returns (the ranks' records, sorted by file name,
    and the job's wall seconds). A job that fails, or leaves fewer files than ranks, raises
    with the tail of its output."""
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               os.path.abspath(script), "--worker", *worker_args, "--out", out]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        wall = time.perf_counter() - t0
        files = sorted(os.listdir(out))
        if proc.returncode != 0 or len(files) != world:
            raise RuntimeError(f"{' '.join(worker_args)} at world {world} failed (exit {proc.returncode}, "
                               f"{len(files)} rank files):\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}")
        ranks = []
        for name in files:
            with open(os.path.join(out, name)) as f:
                ranks.append(json.load(f))
    return ranks, wall


def median_records(results):
    """Per-metric median over repeated runs of the same case."""
    merged = {}
    for label in results[0]["records"]:
        runs = [r["records"][label] for r in results]
        merged[label] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    return merged


# --------------------------------------------------------------------------- table cells

def mib(n):
    return f"{n / MiB:,.0f}"


def ratio(x, ref):
    """x / ref as "1.23x", "-" without a reference."""
    return "-" if ref is None or ref <= 0 else f"{x / ref:.2f}x"


# --------------------------------------------------------------------------- CLI

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        # Import this file as ``common`` so that case modules share its classes.
        sys.path.insert(0, BENCH_DIR)
        importlib.import_module("common").child_main(sys.argv[2], json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-checkpoint", action="store_true", help="write the checkpoint and exit")
    parser.add_argument("--clean", action="store_true", help=f"delete every checkpoint cached in {CACHE_DIR}")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.write_checkpoint:
        ckpt_dir = args.ckpt_dir or default_ckpt_dir(args.layers, args.quick)
        print(write_llama_checkpoint(ckpt_dir, args.layers, args.quick))
    elif args.clean:
        for name in sorted(os.listdir(CACHE_DIR)) if os.path.isdir(CACHE_DIR) else []:
            remove_checkpoint(os.path.join(CACHE_DIR, name))
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
