"""One vLLM engine, in its own process: load a checkpoint, generate greedily, reload another
checkpoint through `reload_weights` (unless it is "-"), generate again (for each of several), and print the results as one JSON line
(`RESULT {...}`): the tokens, and with load_format="lazyload" each worker's reports.

    python tests/in_vllm/engine_run.py MODEL RELOAD --format lazyload --tp 2 [--extra '{"reader": "pread"}']

RELOAD "=" reloads without `weights_path` (vLLM reads the weights it loaded again).

Run by case_vllm.py (each engine in a process of its own: vLLM's workers go with it).
"""
from __future__ import annotations

import argparse
import json
import os

# vLLM on a CPU of two cores: one OpenMP thread per TP worker, none reserved, a 1 GiB KV cache;
# callables over collective_rpc (the reports) need cloudpickle
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [100, 27, 42, 5]]
MAX_TOKENS = 8


def generate(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outputs]


def evict(directory: str) -> None:
    """Drop every file of `directory` (its tree) from the page cache: the next reads are cold."""
    for folder, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages (files just written) are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("reload", help="the checkpoint to reload, = for the loaded one again, or - for none; "
                                       "several, comma-separated: reloaded in turn (`reloads`: each one's tokens)")
    parser.add_argument("--format", default="lazyload")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--cold", action="store_true", help="each checkpoint's pages dropped before its (re)load")
    args = parser.parse_args()
    extra = json.loads(args.extra)
    if args.cold:
        evict(extra.get("weights", args.model))

    from vllm import LLM

    llm = LLM(model=args.model, load_format=args.format, tensor_parallel_size=args.tp, enforce_eager=True,
              skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
              model_loader_extra_config=extra,
              distributed_executor_backend="mp" if args.tp > 1 else None)
    result = {"tokens": generate(llm)}
    if args.reload != "-":
        result["reloads"] = []
        for path in args.reload.split(","):
            if args.cold and path != "=":
                evict(path)
            llm.collective_rpc("reload_weights", kwargs={} if path == "=" else {"weights_path": path})
            result["reloads"].append(generate(llm))
        result["reloaded"] = result["reloads"][0]
    if args.format == "lazyload":
        from lazyload.integrations.vllm import last_reports

        result["reports"] = llm.collective_rpc(last_reports)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
