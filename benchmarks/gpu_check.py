"""GPU check of the load path: one run, under 8 minutes on one GPU (an H200), from the
README's install (`pip install -e '.[hf]'`; no test dependency: pytest and hypothesis are
not needed, the checkpoint writers in tests/ use torch and transformers only).

Every row is a check that can fail; the run prints one table and exits non-zero on any
failure. References do not come from lazyload: safetensors' own `get_tensor` on the CPU
(cast there), or transformers' `from_pretrained` on the CPU for converted models; tensors
are compared bit for bit.

| case | what it checks |
|---|---|
| reference | a ~1.3 GB bf16 Llama (hidden 2048, `--layers 12`) to `cuda` (pread reader: pinned staging, one side stream), bf16 and bf16 -> fp16 |
| pinned | the staging lazyload pins during that load (cudaHostRegister, counted here) is `report.pinned_bytes`, exactly `max_host_bytes`, and nothing is pinned after it; torch's pinned allocator (`torch.cuda.host_memory_stats()`) holds no more after the load than before |
| race | copies delayed on the side stream (`torch.cuda._sleep` before each), staging as small as it can be: still exact. Control: the same with the engine's wait removed must corrupt data, else this check could not see a missing synchronisation |
| mixed dtypes | bf16, fp32 and fp16 tensors of odd byte sizes, staged back to back: with and without a cast |
| mmap | `reader="mmap"` to CUDA (copies from pageable memory) |
| conversions | Mixtral (experts stacked, gate/up fused), GPT-2 (Conv1D, packed c_attn) and GPT-2 stored transposed (a registered `Transpose` conversion), at world 1 against `from_pretrained`, and rank 1 of world 2 (strided destinations) against lazyload's CPU load of that rank |
| dtensor | a Llama made tensor parallel on a 1-GPU DeviceMesh (NCCL), loaded without `device=`: DTensors on the mesh's GPU, full tensors exact |
| device index | (two GPUs) a fresh process with LOCAL_RANK=1 loads to cuda:1 by default and with `device="cuda:1"`, and leaves no CUDA context on GPU 0 |
| one visible GPU | a fresh process with CUDA_VISIBLE_DEVICES=<one GPU> and LOCAL_RANK=1 loads to cuda:0 |
| in place | a real bf16 Llama on the GPU loaded with `device="cuda"`: every tensor keeps its `data_ptr`, `max_memory_allocated` grows by less than 10% of the model |
| fp8 checkpoint | an FP8 block-scaled Llama (blocks 16x16) dequantized to bf16, kept (`quantize="fp8"`), and rank 1 of 2: GPU load = CPU load, bit for bit |
| quantize | int8 and fp8 quantize-on-load (groups of 16): GPU = CPU, bit for bit |
| fp8 modules | transformers' `FP8Linear` / `FP8Experts` (Llama, Mixtral; 128x128 blocks) filled at world 1 and as rank 1 of 2: GPU = CPU; their forward (transformers' FP8 kernels, which `kernels` fetches from the Hub: a skip saying why where it cannot be loaded) gives logits within 10% relative L2 of the dequantized bf16 model; a bf16 Llama quantized on load into `FP8Linear` (`format="transformers"`), world 1 and rank 1 of 2: GPU = CPU, bit for bit, and its forward within 10% of the bf16 model |
| whole conversion | Inkling2 (experts' gate/up interleaved by transformers' operation on whole sources): GPU = CPU |
| remote | a checkpoint served over HTTP on 127.0.0.1 (ranged GETs into pinned staging), cast to fp16: GPU = CPU |
| unpinned | `cudaHostRegister` refused for real: the load goes through bounce buffers, = the files, and the next kernel launch raises no stale CUDA error |
| second load | (two GPUs) a fresh process with LOCAL_RANK=1: two loads without `device=` both land on cuda:1, which stays current |
| quantize speed | int8 quantize on load of the ~1.3 GB Llama: seconds per GB beyond the same load in bf16, at most `--quantize-seconds-per-gb` (0.05) |
| h2d | lazyload's own host-to-device copies (`report.h2d_bytes` / `h2d_seconds`, timed with CUDA events) reach `--copy-ratio` (0.8) of a pinned 1 GiB `copy_`'s rate, warm and cold page cache; the load's end-to-end GB/s beside it |
| mmap, unpinned (big) | the ~1.3 GB Llama by mmap pages through the pinned bounce buffers, and with `cudaHostRegister` refused (copies from pageable memory, host-timed, exactly one warning, no stale CUDA error): = the files, rates shown |
| quantize at size | int8, fp8 and fp8 128x128 blocks (`format="transformers"`) quantize on load of the ~1.3 GB Llama: GPU = CPU, bit for bit |
| host memory | (fresh process) peak anonymous memory (RssAnon, sampled every 2 ms) of the ~1.3 GB load, pread and mmap: grows by at most the budget + the bounce buffers + `--memory-slack-mib` (256) |
| local rank | (fresh process, one GPU) LOCAL_RANK=0: two loads without `device=` land on cuda:0, no warning |
| sync | (two fresh processes) `WeightSync` from a bf16 Llama on rank 0's GPU into a meta Llama on rank 1 (`device=` its GPU), two syncs with the weights changed between: bit-exact, on the GPU; NCCL with two GPUs, else gloo with both on one GPU (pinned host staging) |
| sync nccl | (fresh process, one GPU) a 1-rank `WeightSync` over NCCL, colocated: its messages on a `ProcessGroupNCCL` of its own, a message to itself through it (waited for by a CUDA event) exact; a failed sync aborts it and the retry, on a fresh one, is exact |
| sync failures | (two fresh processes, NCCL, a GPU each: "skipped: needs 2 GPUs" on one) the trainer raises mid-sync: both ranks `SyncError` (saying the retry uses a fresh communicator), the retry exact; then the trainer dies mid-sync (`os._exit`): the server raises `SyncError` naming it within about `rank_timeout`, its communicator aborted, instead of hanging until NCCL's watchdog kills it. CPU half: over gloo |

`--cpu-smoke` (no CUDA needed; CI runs it): the same cases' CPU halves on tiny checkpoints,
loaded to the CPU through the staging path (pread reader, direct reads off) against the same
references; GPU-only checks are rows marked `skip`.

Usage: python benchmarks/gpu_check.py [--layers 12] [--work-dir DIR] [--cpu-smoke]
"""

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from unittest.mock import patch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # checkpoint writers and a range server: torch/transformers only

import torch  # noqa: E402

import common  # noqa: E402
from checkpoints import (build_model, evict, mixed_meta_model, reference_model, shard_files,  # noqa: E402
                         write_checkpoint, write_mixed_checkpoint)
from quant_checkpoints import fp8_model  # noqa: E402
from lazyload import LazyCheckpoint  # noqa: E402
from lazyload import engine  # noqa: E402
from lazyload.engine import BOUNCE_BYTES, CudaCopies  # noqa: E402
from lazyload.targets import is_dtensor  # noqa: E402

GB = 1e9
MiB = 1 << 20
ROWS = "GPU_CHECK_ROWS "
# Every TP slice of these is whole 128-blocks at world 2 (transformers' FP8 layers).
ALIGNED = dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
               num_hidden_layers=2)
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
            num_hidden_layers=2)  # a bf16 Llama quantized on load into FP8Linear: every Linear whole blocks


# --------------------------------------------------------------------------- comparing

def file_tensors(directory):
    """Every tensor of the checkpoint, as safetensors itself reads it (CPU)."""
    from safetensors import safe_open

    out = {}
    for path in shard_files(directory):
        with safe_open(str(path), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def bits(tensor):
    if hasattr(tensor, "full_tensor"):  # a DTensor
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def differences(got, want):
    """Names whose tensors differ in name, dtype, shape or any bit."""
    problems = [f"names differ: {sorted(set(got) ^ set(want))[:4]}"] if sorted(got) != sorted(want) else []
    for name in sorted(set(got) & set(want)):
        a, b = got[name], want[name]
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            problems.append(f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(bits(a), bits(b)):
            problems.append(f"{name}: values differ")
    return problems


def against_files(model, files):
    """The model's state against the files' tensors cast on the CPU to the model's dtypes."""
    state = model.state_dict()
    return differences(state, {k: files[k].to(state[k].dtype) for k in files})


def row(case, check, problems, detail=""):
    """A table row; `problems`: a list (empty: pass), True/False, or None (skipped)."""
    if isinstance(problems, list):
        ok = not problems
        detail = detail if ok else "; ".join(problems[:3]) + (f" (+{len(problems) - 3})" if len(problems) > 3 else "")
    else:
        ok = problems
    return [case, check, ok, detail]


def skip(case, check, why):
    return row(case, check, None, why)


# --------------------------------------------------------------------------- the run

class Run:
    """What the cases share: where to load (cuda or cpu), checkpoints written once."""

    def __init__(self, args):
        self.cuda = torch.cuda.is_available() and not args.cpu_smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.work = args.work_dir
        self.layers = args.layers
        self.sleep_cycles = args.sleep_cycles
        self.copy_ratio, self.quantize_budget = args.copy_ratio, args.quantize_seconds_per_gb
        self.memory_slack = args.memory_slack_mib * MiB
        os.makedirs(self.work, exist_ok=True)

    def written(self, name, write):
        """(directory, config) of a checkpoint `write(directory)` writes, once, into the work dir."""
        from transformers import AutoConfig

        directory = os.path.join(self.work, name)
        if not os.path.exists(os.path.join(directory, "config.json")):
            partial = tempfile.mkdtemp(dir=self.work)  # renamed into place once complete
            try:
                write(partial)
            except BaseException:
                shutil.rmtree(partial, ignore_errors=True)
                raise
            os.replace(partial, directory)
        return directory, AutoConfig.from_pretrained(directory)

    def tiny(self, arch, dtype):
        """The test suite's tiny `arch` checkpoint."""
        return self.written(f"{arch}-{dtype}", lambda directory: write_checkpoint(arch, dtype, directory))

    def mixed(self):
        return self.written("mixed", write_mixed_checkpoint)

    def big(self):
        """The ~1.3 GB Llama on a GPU; the tiny one for the CPU halves."""
        if not self.cuda:
            return self.tiny("llama", "bf16")
        from transformers import AutoConfig

        directory = os.path.join(self.work, f"llama-L{self.layers}")
        common.write_llama_checkpoint(directory, self.layers)
        return directory, AutoConfig.from_pretrained(directory)

    def staged(self):
        """On the CPU, make every item go through the staging arena, as for a GPU."""
        if self.cuda:
            return contextlib.nullcontext()
        return patch.object(engine, "direct_target", lambda dest, item: None)

    def load(self, model, directory, rank=0, world=1, **kw):
        kw.setdefault("device", self.device)
        kw.setdefault("reader", "pread")
        with self.staged():
            return LazyCheckpoint(directory).load_into(model, rank, world, progress=False, **kw)


class PinCounter:
    """torch.cuda.cudart() that counts the bytes registered (pinned) and not yet released."""

    def __init__(self, real):
        self.real, self.live, self.peak = real, {}, 0

    def cudaHostRegister(self, ptr, size, flags):
        code = self.real.cudaHostRegister(ptr, size, flags)
        if int(code) == 0:
            self.live[ptr] = size
            self.peak = max(self.peak, sum(self.live.values()))
        return code

    def cudaHostUnregister(self, ptr):
        code = self.real.cudaHostUnregister(ptr)
        if int(code) == 0:
            self.live.pop(ptr, None)
        return code

    def __getattr__(self, name):
        return getattr(self.real, name)


def host_allocator_bytes():
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


# --------------------------------------------------------------------------- cases

def case_reference(run):
    directory, config = run.big()
    files = file_tensors(directory)
    rows = []
    budget = 200 << 20 if run.cuda else 1 << 20  # not a power of two: torch's allocator would round it up
    for label, dtype in (("bf16", torch.bfloat16), ("bf16->fp16", torch.float16)):
        model = build_model("llama", config, dtype)
        if run.cuda and dtype == torch.bfloat16:
            counter = PinCounter(torch.cuda.cudart())
            before = host_allocator_bytes()
            with patch.object(torch.cuda, "cudart", lambda: counter):
                report = run.load(model, directory, max_host_bytes=budget)
            after = host_allocator_bytes()
            ok = counter.peak == report.pinned_bytes == budget and not counter.live and after <= before
            rows.append(row("pinned", "staging pinned during the load only, exactly the budget", ok,
                            f"pinned {counter.peak / 2**20:.1f} MiB (report {report.pinned_bytes / 2**20:.1f}, budget "
                            f"{budget / 2**20:.1f}), {sum(counter.live.values())} B left; torch's pinned allocator "
                            f"{before / 2**20:.1f} -> {after / 2**20:.1f} MiB"))
        else:
            report = run.load(model, directory, max_host_bytes=budget)
        placed = {t.device.type for t in model.state_dict().values()}
        problems = against_files(model, files) + ([f"tensors on {placed}"] if placed != {run.device} else [])
        rows.append(row("reference", f"{label} to {run.device}: every tensor = safetensors get_tensor", problems,
                        f"{len(files)} tensors, {report.bytes_read / GB:.2f} GB, {report.seconds:.2f} s"))
        del model
    if not run.cuda:
        rows.append(skip("pinned", "staging pinned during the load only, exactly the budget", "needs CUDA"))
    return rows


def case_race(run):
    directory, config = run.mixed()
    files = file_tensors(directory)
    budget = max(t.nbytes for t in files.values())  # the staging holds the largest read and little more
    cycles = run.sleep_cycles
    original = CudaCopies.h2d

    def delayed(self, dst, src):  # on the copy stream: the copy starts `cycles` later
        with torch.cuda.stream(self.copy_stream):
            torch.cuda._sleep(cycles)
        original(self, dst, src)

    def load(dtype):
        model = build_model("llama", config, dtype) if dtype else mixed_meta_model(config)
        run.load(model, directory, dtype=dtype, max_host_bytes=budget)
        return against_files(model, files)

    rows = []
    for label, dtype in (("no cast", None), ("cast to fp16", torch.float16)):
        check = f"{label}: exact with every copy delayed"
        if not run.cuda:
            rows.append(row("race", check + " (CPU: not delayed)", load(dtype)))
            continue
        with patch.object(CudaCopies, "h2d", delayed):
            rows.append(row("race", check, load(dtype), f"{cycles:,} cycles of sleep before each copy"))
    if run.cuda:
        with patch.object(CudaCopies, "h2d", delayed), patch.object(CudaCopies, "wait", staticmethod(lambda event: None)):
            corrupted = load(None)
        rows.append(row("race", "control: without the wait, delayed copies corrupt data", bool(corrupted),
                        f"{len(corrupted)} tensors corrupted" if corrupted else "nothing corrupted: the check is blind"))
    else:
        rows.append(skip("race", "control: without the wait, delayed copies corrupt data", "needs CUDA"))
    return rows


def case_mixed(run):
    directory, config = run.mixed()
    files = file_tensors(directory)
    rows = []
    for label, dtype in (("no cast", None), ("cast to fp16", torch.float16)):
        model = build_model("llama", config, dtype) if dtype else mixed_meta_model(config)
        run.load(model, directory, dtype=dtype)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in files.values()})
        rows.append(row("mixed dtypes", f"{'/'.join(dtypes)}, odd sizes, {label}", against_files(model, files)))
    return rows


def case_mmap(run):
    directory, config = run.tiny("llama", "bf16")
    files = file_tensors(directory)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        model = build_model("llama", config, dtype)
        LazyCheckpoint(directory).load_into(model, device=run.device, reader="mmap", progress=False)
        rows.append(row("mmap", f"reader='mmap' to {run.device}, {str(dtype).removeprefix('torch.')}",
                        against_files(model, files)))
    return rows


def write_transposed(source, target):
    """GPT-2's Conv1D weights stored transposed (as Linear weights) under `.weight_t`."""
    from safetensors.torch import load_file, save_file

    weight_map = {}
    for path in shard_files(source):
        tensors = {}
        for key, tensor in load_file(str(path)).items():
            if key.endswith(("attn.c_attn.weight", "mlp.c_fc.weight")):
                key, tensor = key[:-len("weight")] + "weight_t", tensor.t().contiguous()
            tensors[key] = tensor
        save_file(tensors, os.path.join(target, path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, path.name))
    with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    shutil.copy(os.path.join(source, "config.json"), target)


def case_conversions(run):
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    rows = []
    for arch, label in (("mixtral", "mixtral experts stacked + gate/up fused"), ("gpt2", "gpt2 Conv1D, packed c_attn"),
                        ("gpt2", "gpt2 stored transposed")):
        directory, config = run.tiny(arch, "fp32")
        reference = reference_model(arch, directory, torch.float32).state_dict()
        if label.endswith("transposed"):
            directory, _ = run.written("gpt2-transposed", lambda target: write_transposed(directory, target))
            register_checkpoint_conversion_mapping("gpt2", [WeightConverter(
                source_patterns=r"\.weight_t$", target_patterns=".weight", operations=[Transpose(0, 1)])],
                overwrite=True)
        model = build_model(arch, config, torch.float32)
        run.load(model, directory)
        rows.append(row("conversions", f"{label}, world 1: = from_pretrained", differences(model.state_dict(), reference)))
        model = build_model(arch, config, torch.float32)
        run.load(model, directory, 1, 2)
        cpu = build_model(arch, config, torch.float32)
        LazyCheckpoint(directory).load_into(cpu, 1, 2, device="cpu", reader="mmap", progress=False)
        rows.append(row("conversions", f"{label}, rank 1 of 2: = the CPU load of that rank",
                        differences(model.state_dict(), cpu.state_dict())))
    return rows


# --------------------------------------------------------------------------- GPU = CPU

def cpu_state(model_of, directory, **kw):
    """The model's state as lazyload loads it to the CPU (mmap reader, no staging)."""
    model = model_of()
    LazyCheckpoint(directory).load_into(model, device="cpu", progress=False, **kw)
    return model.state_dict()


def gpu_vs_cpu(run, case, check, model_of, directory, **kw):
    """A row: the load to run.device (staged) bit for bit the CPU load, same arguments."""
    want = cpu_state(model_of, directory, **kw)
    model = model_of()
    report = run.load(model, directory, **kw)
    where = {t.device.type for t in model.state_dict().values()}
    problems = differences(model.state_dict(), want) + ([f"tensors on {where}"] if where != {run.device} else [])
    return row(case, check, problems, f"{len(want)} tensors, {report.h2d_bytes / 2**20:.1f} MiB copied")


def fp8_checkpoint(run):
    from quant_checkpoints import write_fp8_checkpoint

    source, config = run.tiny("llama", "bf16")
    directory, _ = run.written("llama-fp8", lambda target: write_fp8_checkpoint(source, target, block=(16, 16)))
    return directory, config


def case_quantized(run):
    """Pre-quantized checkpoints (their boxes copied part by part) and quantize on load."""
    from lazyload import Quantization

    fp8, config = fp8_checkpoint(run)
    plain, _ = run.tiny("llama", "fp32")
    llama = lambda dtype: (lambda: build_model("llama", config, dtype))  # noqa: E731
    return [  # quantized rows: lazyload's own holders (torchao=False), whose int8 / fp8 bytes are compared
        gpu_vs_cpu(run, "fp8 checkpoint", "block-scaled, dequantized to bf16: GPU = CPU", llama(torch.bfloat16), fp8),
        gpu_vs_cpu(run, "fp8 checkpoint", "block-scaled, kept (quantize='fp8'): GPU = CPU", llama(torch.bfloat16),
                   fp8, quantize=Quantization("fp8", torchao=False)),
        gpu_vs_cpu(run, "fp8 checkpoint", "block-scaled, rank 1 of 2, dequantized: GPU = CPU", llama(torch.bfloat16),
                   fp8, rank=1, world=2),
        gpu_vs_cpu(run, "quantize", "int8 on load: GPU = CPU", llama(torch.float32), plain,
                   quantize=Quantization("int8", 16, torchao=False)),
        gpu_vs_cpu(run, "quantize", "fp8 on load: GPU = CPU", llama(torch.float32), plain,
                   quantize=Quantization("fp8", 16, torchao=False)),
    ]


def fp8_modules_checkpoint(run, arch):
    """An FP8 block-scaled `arch` (128x128 blocks, every TP slice at world 2 whole blocks)."""
    from quant_checkpoints import QUANTIZED, write_fp8_checkpoint

    EXPERT_NAMES = QUANTIZED + ("w1", "w2", "w3")  # Mixtral's per-expert projections, quantized too

    source, _ = run.written(f"{arch}-fp8-aligned-bf16",
                            lambda target: write_checkpoint(arch, torch.bfloat16, target, **ALIGNED))
    return run.written(f"{arch}-fp8-aligned", lambda target: write_fp8_checkpoint(source, target, names=EXPERT_NAMES))


def fp8_logits_error(run, arch, directory, config, fp8=None, **kw):
    """Relative L2 error of the FP8 model's logits (transformers' FP8 kernels) against the
    dequantized (or full-precision) bf16 model's, both loaded to the GPU by lazyload; `fp8`:
    a meta model to load with `kw` (default: transformers' FP8 layers, filled as stored)."""
    from checkpoints import fixed_input

    fp8, full = fp8 or fp8_model(arch, config), build_model(arch, config, torch.bfloat16)
    run.load(fp8, directory, **kw)
    run.load(full, directory)
    ids = fixed_input(config).to(run.device)
    with torch.no_grad():
        got, want = fp8(input_ids=ids).logits.float(), full(input_ids=ids).logits.float()
    return ((got - want).norm() / want.norm()).item()


def case_fp8_modules(run):
    """transformers' FP8Linear / FP8Experts filled with the stored bytes and block scales
    (world 1 and rank 1 of 2): GPU = CPU (the CPU load's bytes are the test suite's to
    check); on a GPU their forward (transformers' FP8 kernels) against the dequantized model."""
    rows = []
    for arch in ("llama", "mixtral"):
        directory, config = fp8_modules_checkpoint(run, arch)
        for rank, world in ((0, 1), (1, 2)):
            rows.append(gpu_vs_cpu(run, "fp8 modules", f"{arch} FP8 layers filled as stored, rank {rank} of {world}: "
                                   "GPU = CPU", lambda: fp8_model(arch, config), directory, rank=rank, world=world))
        check = f"{arch} forward (transformers' FP8 kernels): logits within 10% (relative L2) of the dequantized model"
        missing = fp8_kernel_missing(run)
        if missing:
            rows.append(skip("fp8 modules", check, missing))
            continue
        error = fp8_logits_error(run, arch, directory, config)
        rows.append(row("fp8 modules", check, error < 0.1, f"relative error {error:.4f}"))
    return rows + quantized_into_fp8_modules(run)


def fp8_kernel_missing(run):
    """Why transformers' FP8 forward cannot run here (None: it can): it needs CUDA and the
    `kernels-community/finegrained-fp8` kernel, which the `kernels` package fetches from the
    Hub (a machine without network or without `kernels` has none)."""
    if not run.cuda:
        return "needs CUDA"
    from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

    try:
        load_finegrained_fp8_kernel()
    except Exception as exc:  # ImportError, or the Hub unreachable: whatever it is, the row says it
        return f"transformers' FP8 kernel not loadable ({type(exc).__name__}: {str(exc)[:160]})"
    return None


def quantized_into_fp8_modules(run):
    """A bf16 Llama quantized on load into transformers' FP8Linear (format="transformers",
    128x128 blocks): GPU = CPU bit for bit, at world 1 and as rank 1 of 2."""
    from lazyload import Quantization

    directory, config = run.written("llama-bf16-blocks", lambda target: write_checkpoint("llama", torch.bfloat16,
                                                                                           target, **DIMS))
    llama = lambda: build_model("llama", config, torch.bfloat16)  # noqa: E731
    fp8 = Quantization("fp8", format="transformers")
    rows = [gpu_vs_cpu(run, "fp8 modules", f"quantize on load into FP8Linear, rank {rank} of {world}: GPU = CPU",
                       llama, directory, rank=rank, world=world, quantize=fp8) for rank, world in ((0, 1), (1, 2))]
    check = "quantized on load into FP8Linear, forward (transformers' FP8 kernels): logits within 10% of bf16"
    missing = fp8_kernel_missing(run)
    if missing:
        return rows + [skip("fp8 modules", check, missing)]
    error = fp8_logits_error(run, "llama", directory, config, llama(), quantize=fp8)
    return rows + [row("fp8 modules", check, error < 0.1, f"relative error {error:.4f}")]


def case_whole(run):
    import sweep_architectures
    import transformers

    directory = os.path.join(run.work, "inkling2", "Inkling2TextModel")
    if not os.path.exists(os.path.join(directory, "config.json")):  # written by the sweep, checked there
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        outcome = sweep_architectures.sweep_one("inkling2_text", "Inkling2TextModel", os.path.dirname(directory))
        if outcome["outcome"] != "exact":
            return [row("whole conversion", "the checkpoint loads on the CPU as from_pretrained", False, str(outcome))]
    cls = transformers.Inkling2TextModel
    config = cls.config_class.from_pretrained(directory)

    def model():
        with torch.device("meta"):
            return cls._from_config(config, dtype=torch.float32).eval()
    return [gpu_vs_cpu(run, "whole conversion", "Inkling2 experts interleaved on the rank: GPU = CPU", model,
                       directory)]


def case_remote(run):
    from remote_servers import RangeServer

    directory, config = run.tiny("llama", "bf16")
    root = tempfile.mkdtemp(dir=run.work)
    shutil.copytree(directory, os.path.join(root, "ckpt"))
    want = cpu_state(lambda: build_model("llama", config, torch.float16), directory, dtype=torch.float16)
    with RangeServer(root) as server:
        model = build_model("llama", config, torch.float16)
        LazyCheckpoint(server.url + "/ckpt/").load_into(model, device=run.device, dtype=torch.float16, progress=False)
    shutil.rmtree(root, ignore_errors=True)
    return [row("remote", "HTTP checkpoint (ranged GETs, pinned staging), cast to fp16: GPU = CPU",
                differences(model.state_dict(), want))]


def case_unpinned(run):
    """cudaHostRegister refused (memlock limits, WSL2): bounce buffers, and no CUDA error left."""
    check = "pinning refused: = the files, and the next kernel launch raises nothing"
    if not run.cuda:
        return [skip("unpinned", check, "needs CUDA")]
    directory, config = run.mixed()
    real = torch.cuda.cudart()
    model = mixed_meta_model(config)
    with patch.object(torch.cuda, "cudart", lambda: Refusing(real)):
        report = run.load(model, directory)
    problems = against_files(model, file_tensors(directory)) + kernel_after_the_load()
    return [row("unpinned", check, problems + ([f"pinned {report.pinned_bytes} B"] if report.pinned_bytes else []))]


class Refusing(PinCounter):
    """torch.cuda.cudart() whose cudaHostRegister is refused for real (CUDA's last error set)."""

    def cudaHostRegister(self, ptr, size, flags):
        return self.real.cudaHostRegister(0, size, flags)


def kernel_after_the_load():
    """Problems of a kernel launched after a load (a stale CUDA error would raise here)."""
    try:
        torch.ones(4, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return [f"a kernel after the load failed: {exc}"]
    return []


@contextlib.contextmanager
def warnings_of(name):
    """The messages of the warnings logger `name` logs meanwhile."""
    import logging

    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger(name).addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger(name).removeHandler(handler)


def case_quantize_speed(run):
    check = f"int8 quantize on load: seconds per GB beyond the same load in bf16 <= {run.quantize_budget}"
    if not run.cuda:
        return [skip("quantize speed", check, "needs CUDA")]
    directory, config = run.big()
    seconds = {}
    for label, quantize in (("bf16", None), ("int8", "int8")):
        model = build_model("llama", config, torch.bfloat16)
        torch.cuda.synchronize()
        report = run.load(model, directory, quantize=quantize)
        torch.cuda.synchronize()
        seconds[label] = report.seconds
        size = report.bytes_read
        del model
    extra = max(0.0, seconds["int8"] - seconds["bf16"]) / (size / GB)
    return [row("quantize speed", check, extra <= run.quantize_budget,
                f"{extra:.3f} s/GB extra (at most {run.quantize_budget}) ({seconds['int8']:.2f} s vs "
                f"{seconds['bf16']:.2f} s for {size / GB:.2f} GB)")]


def case_in_place(run):
    directory, config = run.big()
    check = "real model, device='cuda': data_ptr kept, peak < 1.1x model"
    if run.cuda:
        with torch.device("cuda"):
            model = build_model("llama", config, torch.bfloat16, empty=None)
    else:
        model = build_model("llama", config, torch.bfloat16, empty=None)
        check = "real model, device='cpu': data_ptr kept"
    pointers = {n: t.data_ptr() for n, t in model.state_dict().items()}
    size = sum(t.nbytes for t in model.state_dict().values())
    if run.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    run.load(model, directory, device=run.device)
    problems = [f"{n}: reallocated" for n, t in model.state_dict().items() if t.data_ptr() != pointers[n]]
    problems += against_files(model, file_tensors(directory))
    detail = f"model {size / GB:.2f} GB"
    if run.cuda:
        grew = torch.cuda.max_memory_allocated() - base
        detail += f", GPU memory grew by {grew / GB:.3f} GB at peak"
        if grew > 0.1 * size:
            problems.append(f"peak GPU memory grew by {grew / size:.2f}x the model")
    del model
    return [row("in place", check, problems, detail)]


def pinned_copy_rate():
    """GB/s of a pinned 1 GiB `copy_` to the GPU (best of three): the baseline of the H2D rows."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True).fill_(1)
    device_buffer = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device_buffer.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return host.nbytes / best / GB


def case_h2d(run):
    """lazyload's own copies (pinned staging, event-timed) at least `--copy-ratio` of a
    pinned copy_'s rate; the load's end-to-end rate beside it, warm and cold page cache."""
    check = f"lazyload's H2D copies >= {run.copy_ratio}x a pinned copy_, {{}}"
    if not run.cuda:
        return [skip("h2d", check.format(cache), "needs CUDA") for cache in ("warm", "cold")]
    directory, config = run.big()
    pinned_rate = pinned_copy_rate()
    rows = []
    for cache in ("warm", "cold"):
        if cache == "warm":
            common.warm_page_cache(directory)
            note = "page cache warm"
        else:
            note = "page cache dropped" if evict(shard_files(directory)) else "page cache NOT dropped (fadvise refused)"
        model = build_model("llama", config, torch.bfloat16)
        report = run.load(model, directory)
        rate = report.h2d_bytes / report.h2d_seconds / GB if report.h2d_seconds else 0.0
        expected = sum(t.nbytes for t in model.state_dict().values())
        problems = [f"{rate:.1f} GB/s < {run.copy_ratio}x {pinned_rate:.1f} GB/s"] if rate < run.copy_ratio * pinned_rate \
            else []
        problems += [f"{report.h2d_bytes} of {expected} bytes timed"] if report.h2d_bytes != expected else []
        rows.append(row("h2d", check.format(cache), problems,
                        f"copies {rate:.1f} GB/s vs copy_ {pinned_rate:.1f} GB/s ({rate / pinned_rate:.2f}x); "
                        f"end to end {expected / report.seconds / GB:.2f} GB/s ({report.seconds:.2f} s, H2D "
                        f"{report.h2d_seconds / report.seconds:.0%} of it); {note}"))
        del model
    return rows


def case_big_paths(run):
    """The ~1.3 GB Llama by the other two copy paths: mmap pages (pageable) through the
    pinned bounce buffers, and cudaHostRegister refused (every copy from pageable memory,
    host-timed, one warning): = the files, rates shown."""
    checks = ("big mmap: pageable pages through the bounce buffers = the files",
              "big unpinned: pinning refused, = the files, one warning, no stale CUDA error")
    if not run.cuda:
        return [skip(case, check, "needs CUDA") for case, check in zip(("mmap", "unpinned"), checks)]
    directory, config = run.big()
    files = file_tensors(directory)
    real = torch.cuda.cudart()
    rows = []
    for case, check in zip(("mmap", "unpinned"), checks):
        model = build_model("llama", config, torch.bfloat16)
        with warnings_of("lazyload") as logged:
            if case == "mmap":
                report = LazyCheckpoint(directory).load_into(model, device=run.device, reader="mmap", progress=False)
            else:
                with patch.object(torch.cuda, "cudart", lambda: Refusing(real)):
                    report = run.load(model, directory)
        problems = against_files(model, files)
        refusals = sum("could not pin" in message for message in logged)
        if case == "unpinned":
            problems += [f"{refusals} 'could not pin' warnings"] if refusals != 1 else []
            problems += [f"pinned {report.pinned_bytes} B"] if report.pinned_bytes else []
            problems += kernel_after_the_load()
        rate = report.h2d_bytes / report.h2d_seconds / GB if report.h2d_seconds else 0.0
        rows.append(row(case, check, problems, f"copies {rate:.1f} GB/s, end to end "
                        f"{report.h2d_bytes / report.seconds / GB:.2f} GB/s; pinned {report.pinned_bytes / MiB:.0f} MiB"))
        del model
    return rows


def case_quantize_at_size(run):
    """Quantize on load of the ~1.3 GB Llama: GPU = CPU, bit for bit (int8 and fp8 groups,
    transformers' FP8Linear blocks)."""
    from lazyload import Quantization

    directory, config = run.big()
    llama = lambda: build_model("llama", config, torch.bfloat16)  # noqa: E731
    label = "~1.3 GB Llama" if run.cuda else "tiny Llama (CPU half)"
    return [gpu_vs_cpu(run, "quantize at size", f"{name} on load, {label}: GPU = CPU", llama, directory,
                       quantize=quantization)
            for name, quantization in (("int8", Quantization("int8", torchao=False)),
                                       ("fp8", Quantization("fp8", torchao=False)),
                                       ("fp8 128x128 blocks", Quantization("fp8", format="transformers")))]


# --------------------------------------------------------------------------- fresh processes

def child_dtensor(run):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lazyload.tp import parallelize

    directory, config = run.tiny("llama", "bf16")
    dist.init_process_group("nccl" if run.cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh(run.device, (1,))
        model = parallelize(build_model("llama", config, torch.bfloat16), mesh)
        run.load(model, directory, device=None)  # follows the mesh
        params = list(model.parameters())
        dtensors = [p for p in params if is_dtensor(p)]
        where = {p.to_local().device if is_dtensor(p) else p.device for p in params}
        want = torch.device("cuda", torch.cuda.current_device()) if run.cuda else torch.device("cpu")
        problems = against_files(model, file_tensors(directory))
        problems += [f"parameters on {where}, mesh on {want}"] if where != {want} else []
        problems += ["no DTensor parameter"] if not dtensors else []
        return [row("dtensor", f"1-rank {run.device} mesh, no device=: DTensors on the mesh's device", problems,
                    f"{len(dtensors)} of {len(params)} parameters DTensors, on {want}")]
    finally:
        dist.destroy_process_group()


def child_device_index(run):
    directory, config = run.tiny("llama", "bf16")
    files = file_tensors(directory)
    check = "LOCAL_RANK=1: default and device='cuda:1' land on cuda:1, no context on GPU 0"
    had_context = run.cuda and torch._C._cuda_hasPrimaryContext(0)
    initialized = run.cuda and torch.cuda.is_initialized()
    problems = []
    want = torch.device("cuda", 1) if run.cuda else torch.device("cpu")
    for device in (None, "cuda:1" if run.cuda else "cpu"):
        model = build_model("llama", config, torch.bfloat16)
        run.load(model, directory, device=device)
        where = {t.device for t in model.state_dict().values()}
        problems += against_files(model, files) + ([f"device={device!r}: on {where}"] if where != {want} else [])
    if not run.cuda:
        return [row("device index", "LOCAL_RANK=1: default and device='cpu' land on the CPU (CPU half)", problems)]
    if had_context:
        return [skip("device index", check, "GPU 0 had a context before the load (not lazyload's)")]
    if torch._C._cuda_hasPrimaryContext(0):
        problems.append("a CUDA context was created on GPU 0")
    return [row("device index", check, problems, f"CUDA initialised before the load: {initialized}")]


def child_one_visible(run):
    directory, config = run.tiny("llama", "bf16")
    model = build_model("llama", config, torch.bfloat16)
    run.load(model, directory, device=None)
    where = {t.device for t in model.state_dict().values()}
    want = torch.device("cuda", 0) if run.cuda else torch.device("cpu")
    problems = against_files(model, file_tensors(directory)) + ([f"on {where}"] if where != {want} else [])
    return [row("one visible GPU", f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}, "
                f"LOCAL_RANK=1: lands on {want}", problems)]


def child_second_load(run):
    """Two loads without device= in a fresh process with LOCAL_RANK=1: both on cuda:1, and
    cuda:1 stays this process's current device."""
    directory, config = run.tiny("llama", "bf16")
    want = torch.device("cuda", 1) if run.cuda else torch.device("cpu")
    problems = []
    for attempt in ("first", "second"):
        model = build_model("llama", config, torch.bfloat16)
        run.load(model, directory, device=None)
        where = {t.device for t in model.state_dict().values()}
        problems += [f"{attempt} load on {where}"] if where != {want} else []
    if run.cuda and torch.cuda.current_device() != 1:
        problems.append(f"current device {torch.cuda.current_device()} after the loads")
    return [row("second load", f"LOCAL_RANK=1: a second load_into(device=None) stays on {want}", problems)]


def child_memory(run):
    """Peak anonymous memory (RssAnon, sampled) of the ~1.3 GB load in a fresh process, beyond
    what it held before: at most the staging budget + the pinned bounce buffers + slack (pread
    stages into the budget; mmap pages are file pages, its bounce buffers anonymous)."""
    from lazyload.readers.base import Reader

    directory, config = run.big()
    budget = 256 * MiB if run.cuda else 8 * MiB
    bounces = Reader.threads * 2 * BOUNCE_BYTES
    rows = []
    for reader in ("pread", "mmap"):
        model = build_model("llama", config, torch.bfloat16)
        if run.cuda:
            torch.ones(1, device="cuda")  # CUDA's context and allocator set up before the baseline
        before = common.read_status()["RssAnon"]
        sampler = common.MemorySampler(0.002).start()
        LazyCheckpoint(directory).load_into(model, device=run.device, reader=reader, max_host_bytes=budget,
                                            progress=False)
        grew = sampler.stop()["RssAnon"] - before
        allowed = budget + bounces + run.memory_slack
        if not run.cuda:  # the CPU half: the model itself lives in anonymous memory
            allowed += sum(t.nbytes for t in model.state_dict().values())
        rows.append(row("host memory", f"{reader}: peak anonymous memory <= budget + bounces + slack", grew <= allowed,
                        f"grew {grew / MiB:.0f} MiB; allowed {allowed / MiB:.0f} MiB (budget {budget / MiB:.0f}, "
                        f"bounces {bounces / MiB:.0f}, slack {run.memory_slack / MiB:.0f})"))
        del model
    return rows


def child_local_rank(run):
    """torchrun's LOCAL_RANK=0 on one GPU, CUDA untouched: a load without device= lands on
    cuda:0 and leaves it current, with no warning; then a second load, CUDA initialised."""
    directory, config = run.tiny("llama", "bf16")
    files = file_tensors(directory)
    want = torch.device("cuda", 0) if run.cuda else torch.device("cpu")
    problems = []
    with warnings_of("lazyload") as logged:
        for attempt in ("first", "second (CUDA initialised)"):
            model = build_model("llama", config, torch.bfloat16)
            run.load(model, directory, device=None)
            where = {t.device for t in model.state_dict().values()}
            problems += against_files(model, files) + ([f"{attempt} load on {where}"] if where != {want} else [])
    if run.cuda and torch.cuda.current_device() != 0:
        problems.append(f"current device {torch.cuda.current_device()}")
    problems += [f"warned: {message}" for message in logged]
    return [row("local rank", f"LOCAL_RANK=0, one GPU: two loads without device= on {want}, no warning", problems)]


def child_sync(run):
    """One rank of a 2-rank WeightSync: rank 0 a trainer (a plain bf16 Llama on its GPU),
    rank 1 a server (built on meta, made real by the first sync). NCCL with a GPU each;
    one GPU: gloo, both ranks' tensors on it, messages through pinned host staging."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import lazyload

    rank, gpus = int(os.environ["SYNC_RANK"]), torch.cuda.device_count() if run.cuda else 0
    device = torch.device("cuda", rank if gpus > 1 else 0) if run.cuda else torch.device("cpu")
    if run.cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if gpus > 1 else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{os.environ['SYNC_PORT']}", rank=rank,
                            world_size=2)
    try:
        _, config = run.tiny("llama", "bf16")
        mesh = init_device_mesh(device.type, (2, 1), mesh_dim_names=("role", "tp"))["tp"]
        trainer = build_model("llama", config, torch.bfloat16, empty=None).to(device) if rank == 0 else None
        server = build_model("llama", config, torch.bfloat16) if rank == 1 else None  # on meta
        sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh if rank == 1 else None,
                                   device=device if rank == 1 else None, rank_timeout=120)
        problems, reports = [], []
        for step in range(2):  # the second sync after the trainer's weights changed
            if trainer is not None and step:
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(1)
            reports.append(sync())
            full = [{n: t.cpu() for n, t in trainer.state_dict().items()} if rank == 0 else None]
            dist.broadcast_object_list(full, src=0)
            if server is not None:
                got = server.state_dict()
                problems += [f"sync {step + 1}: {n} on {got[n].device}" for n in full[0] if got[n].device != device]
                problems += [f"sync {step + 1}: {n} differs" for n, t in full[0].items()
                             if not torch.equal(bits(got[n]), bits(t))]
        if server is None:
            return []
        detail = (f"{backend}, tensors on {device}; received {reports[-1].bytes_received} B, "
                  f"{reports[-1].seconds * 1e3:.1f} ms per sync")
        return [row("sync", "WeightSync trainer rank -> server rank, two syncs: bit-exact, on the device", problems,
                    detail)]
    finally:
        dist.destroy_process_group()


def sync_ranks(device, backend, rank, world, port):
    """This process as rank `rank` of a `world`-rank job for a WeightSync check (a peer that
    fails unexpectedly stops the others' collectives within two minutes)."""
    from datetime import timedelta

    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))


def synced_differences(server, trainer, src):
    """The server's tensors against the trainer's (sent from rank `src`), bit for bit: a
    collective, every rank calls it."""
    import torch.distributed as dist

    full = [{n: t.cpu() for n, t in trainer.state_dict().items()} if trainer is not None else None]
    dist.broadcast_object_list(full, src=src)
    got = server.state_dict() if server is not None else {}
    return [f"{n} differs" for n, t in full[0].items() if server is not None and not torch.equal(bits(got[n]), bits(t))]


def child_sync_nccl(run):
    """A 1-rank WeightSync over NCCL on one GPU (a Llama into itself, colocated): its messages
    on a communicator of its own (`NcclLink`, a fresh ProcessGroupNCCL whose first call is an
    all-reduce), a message to itself through it arrives exact (waited for through a CUDA event
    on this stream); a sync that fails aborts that communicator and the retry, on a fresh
    one, is exact."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import lazyload
    from lazyload.sync import transfer

    device = torch.device("cuda", 0)
    sync_ranks(device, "nccl", 0, 1, free_port())
    try:
        _, config = run.tiny("llama", "bf16")
        trainer = build_model("llama", config, torch.bfloat16, empty=None).to(device)
        server = build_model("llama", config, torch.bfloat16)
        sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=init_device_mesh("cuda", (1,)),
                                   rank_timeout=60)
        sync()
        link, problems = sync._link, []
        first = link.comm
        sent, received = torch.arange(1000, device=device).float(), torch.zeros(1000, device=device)
        transfer.wait_on_device(link.post([(sent, 0)], [(received, 0)], 0), 60, lambda: None, "a message to itself")
        problems += [] if torch.equal(sent, received) else ["the message to itself differs"]
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1)
        with patch.object(transfer, "_place", lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))):
            try:
                sync()
                problems.append("the injected failure did not fail the sync")
            except lazyload.SyncError as exc:
                problems += [] if "fresh communicator" in str(exc) else [f"the error says nothing of it: {exc}"]
        problems += [] if link.comm is None and link.aborted == [first] else ["the communicator was not aborted"]
        sync()
        problems += [] if link.comm is not None and link.comm is not first else ["the retry did not get a fresh one"]
        problems += synced_differences(server, trainer, 0)
        return [row("sync nccl", "1-rank NCCL sync: own communicator, a message to itself, abort, fresh retry exact",
                    problems, f"{len(link.aborted) + 1} communicators")]
    finally:
        dist.destroy_process_group()


def child_sync_failures(run):
    """One rank of a 2-rank WeightSync whose trainer fails: rank 0 the server (it hosts the
    store), rank 1 the trainer, which raises in the middle of a sync (both ranks SyncError;
    the retry exact: under NCCL on a fresh communicator), then dies in the middle of the
    next (os._exit): the server raises SyncError naming it within about rank_timeout, its
    communicator aborted, instead of hanging until NCCL's watchdog kills it. NCCL on a GPU
    each; the CPU half over gloo."""
    from torch.distributed.device_mesh import init_device_mesh

    import lazyload
    from lazyload.sync import transfer

    rank, timeout = int(os.environ["SYNC_RANK"]), 10.0 if run.cuda else 3.0
    device = torch.device("cuda", rank) if run.cuda else torch.device("cpu")
    backend = "nccl" if run.cuda else "gloo"
    sync_ranks(device, backend, rank, 2, os.environ["SYNC_PORT"])
    _, config = run.tiny("llama", "bf16")
    mesh = init_device_mesh(device.type, (2, 1), mesh_dim_names=("role", "tp"))["tp"]
    trainer = build_model("llama", config, torch.bfloat16, empty=None).to(device) if rank == 1 else None
    server = build_model("llama", config, torch.bfloat16) if rank == 0 else None
    sizes = [t.nbytes for t in build_model("llama", config, torch.bfloat16).state_dict().values()]
    budget = max(max(sizes), sum(sizes) // 4)  # several steps, each tensor fitting one
    sync = lazyload.WeightSync(source=trainer, target=server, target_mesh=mesh if server is not None else None,
                               device=device if server is not None else None, rank_timeout=timeout,
                               max_host_bytes=budget)
    sync()
    failing, packs, pack = {"how": "raise"}, [], transfer._pack

    def failing_pack(requests, ends):  # the trainer's second message of a sync
        packs.append(1)
        if len(packs) == 2 and failing["how"] == "raise":
            raise RuntimeError("injected: the trainer fails mid-sync")
        if len(packs) == 2 and failing["how"] == "die":
            print(ROWS + "[]", flush=True)
            os._exit(0)  # no error, no goodbye
        return pack(requests, ends)

    problems = [] if sync.routes.steps > 2 else [f"{sync.routes.steps} steps: the failure would not be mid-sync"]
    if trainer is not None:
        transfer._pack = failing_pack
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1)
    try:
        sync()
        problems.append("the trainer's failure did not fail the sync")
    except lazyload.SyncError as exc:
        if backend == "nccl" and "fresh communicator" not in str(exc):
            problems.append(f"the error does not say the retry runs on a fresh communicator: {exc}")
    packs.clear()
    failing["how"] = None
    sync()  # the retry
    problems += synced_differences(server, trainer, 1)
    packs.clear()
    failing["how"] = "die"
    started = time.perf_counter()
    try:
        sync()
        problems.append("the trainer's death did not fail the sync")
    except lazyload.SyncError as exc:
        seconds = time.perf_counter() - started
        problems += [] if 1 in (exc.ranks or ()) else [f"the error does not name rank 1: {exc}"]
        problems += [] if seconds < 2 * timeout + 15 else [f"raised after {seconds:.0f} s"]
        problems += [] if backend != "nccl" or sync._link.comm is None else ["the communicator was not aborted"]
    check = "trainer raises, retry exact; trainer dies, server raises in time"
    rows = [row("sync failures", f"{backend}: {check}", problems, f"rank_timeout {timeout:g} s")]
    print(ROWS + json.dumps(rows), flush=True)
    os._exit(0)  # no teardown with a dead peer (NCCL's could wait for it)


CHILDREN = {"sync": child_sync, "sync-nccl": child_sync_nccl, "sync-failures": child_sync_failures,
            "dtensor": child_dtensor, "device-index": child_device_index, "second-load": child_second_load,
            "one-visible": child_one_visible, "memory": child_memory, "local-rank": child_local_rank}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_fresh_processes(run, children):
    """Run each child (name, env, case, check) in a new process of its own (its own CUDA
    state), all at once; their rows, in order."""
    procs = []
    for name, env, _, _ in children:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--work-dir", run.work]
        if not run.cuda:
            cmd.append("--cpu-smoke")
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, LAZYLOAD_PROGRESS="0", **env)))
    rows = []
    for proc, (_, _, case, check) in zip(procs, children):
        out, err = proc.communicate(timeout=600)
        found = [line for line in out.splitlines() if line.startswith(ROWS)]
        rows += json.loads(found[-1][len(ROWS):]) if found else [row(
            case, check, False, f"the process failed (exit {proc.returncode}): " + " | ".join(err.strip().splitlines()[-3:]))]
    return rows


def case_fresh_processes(run):
    run.tiny("llama", "bf16")  # written here, not by the children at once
    run.big()
    gpus = torch.cuda.device_count() if run.cuda else 0
    children = [("dtensor", {"LOCAL_RANK": "0"}, "dtensor", "1-rank mesh"),
                ("memory", {}, "host memory", "peak anonymous memory"),
                ("local-rank", {"LOCAL_RANK": "0"}, "local rank", "LOCAL_RANK=0")]
    if run.cuda and gpus < 2:
        skipped = [skip("device index", "LOCAL_RANK=1 lands on cuda:1, no context on GPU 0", "needs two GPUs"),
                   skip("second load", "LOCAL_RANK=1: a second load_into(device=None) stays on cuda:1",
                        "needs two GPUs")]
    else:
        skipped = []
        children.append(("device-index", {"LOCAL_RANK": "1"}, "device index", "LOCAL_RANK=1"))
        children.append(("second-load", {"LOCAL_RANK": "1"}, "second load", "LOCAL_RANK=1"))
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")  # this process's GPUs: the child sees the last one
    visible = {"CUDA_VISIBLE_DEVICES": shown.split(",")[-1] if shown else str(gpus - 1)} if run.cuda else {}
    children.append(("one-visible", dict(visible, LOCAL_RANK="1"), "one visible GPU", "LOCAL_RANK=1"))
    if not run.cuda:  # CPU halves: the environments make no difference there, one process runs them all
        children = [(",".join(c[0] for c in children), {"LOCAL_RANK": "1"}, "fresh processes", "CPU halves")]
    return in_fresh_processes(run, children) + skipped


def case_sync(run):
    """The two ranks of `child_sync`, each a fresh process."""
    run.tiny("llama", "bf16")
    port = str(free_port())
    return in_fresh_processes(run, [("sync", {"SYNC_RANK": str(rank), "SYNC_PORT": port}, "sync", "2-rank WeightSync")
                                    for rank in (0, 1)])


def case_sync_failures(run):
    """`child_sync_nccl` (one GPU) and the two ranks of `child_sync_failures` (NCCL needs a
    GPU per rank: NCCL refuses two ranks of one communicator on one GPU), each a fresh
    process; the CPU half: the second over gloo."""
    run.tiny("llama", "bf16")
    gpus = torch.cuda.device_count() if run.cuda else 0
    check = "trainer raises, retry exact; trainer dies, server raises in time"
    children, rows = [], []
    if run.cuda:
        children.append(("sync-nccl", {}, "sync nccl", "1-rank NCCL sync"))
    else:
        rows.append(skip("sync nccl", "1-rank NCCL sync: own communicator, abort, fresh retry", "needs CUDA (NCCL)"))
    if run.cuda and gpus < 2:
        rows.append(skip("sync failures", f"nccl: {check}", "skipped: needs 2 GPUs"))
    else:
        port = str(free_port())
        children += [("sync-failures", {"SYNC_RANK": str(rank), "SYNC_PORT": port}, "sync failures", check)
                     for rank in (0, 1)]
    return in_fresh_processes(run, children) + rows


CASES = (case_sync, case_sync_failures, case_reference, case_race, case_mixed, case_mmap, case_conversions,
         case_quantized, case_fp8_modules, case_whole, case_remote, case_unpinned, case_in_place, case_fresh_processes,
         case_h2d, case_big_paths, case_quantize_at_size, case_quantize_speed)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "lazyload_gpu_check"),
                        help="checkpoints are written here once and kept")
    parser.add_argument("--layers", type=int, default=12, help="layers of the ~110 MB-per-layer bf16 Llama")
    parser.add_argument("--sleep-cycles", type=int, default=20_000_000,
                        help="GPU cycles slept before each copy in the race check (~10 ms)")
    parser.add_argument("--copy-ratio", type=float, default=0.8,
                        help="lazyload's H2D copies must reach this share of a pinned copy_'s rate")
    parser.add_argument("--memory-slack-mib", type=int, default=256,
                        help="anonymous memory a load may grow by beyond its budget and bounce buffers")
    parser.add_argument("--quantize-seconds-per-gb", type=float, default=0.05,
                        help="int8 quantize on load: most seconds per GB beyond the same load in bf16")
    parser.add_argument("--cpu-smoke", action="store_true", help="the CPU halves only, on tiny checkpoints")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # names of CHILDREN, comma-separated
    args = parser.parse_args()
    run = Run(args)
    if args.child:
        print(ROWS + json.dumps([r for name in args.child.split(",") for r in CHILDREN[name](run)]))
        return 0
    if not run.cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device here; nothing to check (--cpu-smoke runs the CPU halves).")
        return 0
    print(f"device: {torch.cuda.get_device_name() if run.cuda else 'CPU (smoke: the CPU halves only)'}; "
          f"torch {torch.__version__}; work dir {run.work}")
    t0 = time.perf_counter()
    rows = []
    for case in CASES:
        try:
            rows += case(run)
        except Exception as exc:  # a crash is a failed row, the other cases still run
            rows.append(row(case.__name__.removeprefix("case_").replace("_", " "), "ran", False,
                            f"{type(exc).__name__}: {exc}"))
        if run.cuda:
            torch.cuda.empty_cache()
    print("\n| case | check | result | detail |\n|---|---|---|---|")
    for case, check, ok, detail in rows:
        print(f"| {case} | {check} | {'skip' if ok is None else 'PASS' if ok else 'FAIL'} | {detail} |")
    failed = [r for r in rows if r[2] is False]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows passed or skipped, {len(failed)} failed, "
          f"in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
