"""The RL weight update into vLLM workers: lazyload's (each worker receives only its boxes,
`integrations.vllm_update`) against the frameworks' way (the trainer gathers full tensors,
every worker receives all of them and runs its weight loaders through `reload_weights`:
what OpenRLHF's broadcast-then-load_weights and verl's full-tensor hand-off do).

Runs in the vLLM venv (tests/in_vllm/run.sh makes one), from the clone:
`python benchmarks/bench_vllm_update.py [--quick] [--tp 2] [--updates 3]`. One TP engine
loads the checkpoint with load_format="lazyload"; two trainer processes (FSDP2 over a gloo
group of their own, bf16 as the checkpoint) join one update group with the workers; each
update is an optimizer step, then the update, timed by the engine's caller (the
collective_rpc, started once the trainers' optimizer step is done: the transfer and the
engine's reload; the reload alone apart) and by the trainers (from their side:
their sync, or their all-gather plus sends). Both ways move the trainer's weights over the
same gloo group (the tests check that lazyload's equals a fresh load: tests/in_vllm).

Usage: python benchmarks/bench_vllm_update.py [--quick] [--tp 2] [--updates 3] [--ckpt-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RL_RUN = os.path.join(os.path.dirname(HERE), "tests", "in_vllm")  # the trainer of the RL update's test
sys.path[:0] = [HERE, RL_RUN]
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, RL_RUN, os.environ.get("PYTHONPATH")) if p)  # workers import this
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

TRAINERS = 2
FULL_TAG = 1 << 30  # the full tensors' messages: a tag block of their own in the update group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensors_of(path: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every checkpoint tensor, from its headers, in layer order."""
    from lazyload.stored import StoredCheckpoint

    index = StoredCheckpoint(path).index
    return [(n, tuple(index.shape(n)), str(index.dtype(n)).removeprefix("torch.")) for n in index.natural_names()]


class BenchExtension:
    """Worker side of the frameworks' way, beside lazyload's extension: receive every full
    tensor from trainer rank 0 over the update group, then vLLM's reload from them."""

    def bench_full_update(self, tensors: list) -> dict:
        import torch

        group = self.lazyload_update_state.sync.peers.group
        received = []
        for k, (name, shape, dtype) in enumerate(tensors):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            group.recv([tensor], 0, FULL_TAG + k).wait()
            received.append((name, tensor))
        started = time.perf_counter()
        self.reload_weights(weights_iterator=iter(received))
        return {"bytes_received": sum(t.numel() * t.element_size() for _, t in received),
                "reload_seconds": time.perf_counter() - started}


def _extension_classes():
    from lazyload.integrations.vllm_update import WeightUpdateExtension

    return type("Extension", (BenchExtension, WeightUpdateExtension), {})


def __getattr__(name: str):
    if name == "Extension":  # vLLM imports it by name in each worker
        return _extension_classes()
    raise AttributeError(name)


def trainer(rank: int, path: str, ports: tuple[int, int], world: int, tensors: list, go, done) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rl_update_run import fsdp_trainer  # the test's trainer, as RL frameworks run one

    model, group, sync = fsdp_trainer(rank, path, ports, world, 600, torch.bfloat16, lambda: done.put(("ready", rank)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = 0
    while (way := go.get()) is not None:
        step += 1
        ids = (torch.arange(64).reshape(2, 32) * (step + 3)) % model.config.vocab_size
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        done.put(("stepped", rank))  # the engine starts its update (and its clock) now
        started = time.perf_counter()
        if way == "lazyload":
            sent = sync().bytes_sent
        else:  # the frameworks' way: full tensors gathered, trainer rank 0 sends all of them to every worker
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            sent = 0
            if rank == 0:
                works = [group.send([full[name].contiguous()], worker, FULL_TAG + k)
                         for worker in range(TRAINERS, world) for k, (name, _, _) in enumerate(tensors)]
                for work in works:
                    work.wait()
                sent = sum(full[name].numel() * full[name].element_size() for name, _, _ in tensors) * (world - TRAINERS)
        done.put((rank, way, time.perf_counter() - started, sent))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~200 MB checkpoint instead of ~2.2 GB")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--updates", type=int, default=3, help="updates of each way (alternating)")
    parser.add_argument("--ckpt-dir", default=None)
    args = parser.parse_args()

    import torch.multiprocessing as mp
    from vllm import LLM

    from common import default_ckpt_dir, shard_files, write_llama_checkpoint
    from lazyload.integrations.vllm_update import join_engine, update_engine

    path = str(write_llama_checkpoint(args.ckpt_dir or default_ckpt_dir(quick=args.quick), quick=args.quick))
    checkpoint_bytes = sum(os.path.getsize(p) for p in shard_files(path))
    tensors = tensors_of(path)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(args.tp)))
    from rl_update_run import stop_trainers  # after the bind above: importing it sets the test's vLLM defaults
    llm = LLM(model=path, load_format="lazyload", tensor_parallel_size=args.tp, enforce_eager=True,
              skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, max_num_seqs=4,
              distributed_executor_backend="mp" if args.tp > 1 else None,
              worker_extension_cls="bench_vllm_update.Extension")
    world, ports = TRAINERS + args.tp, (free_port(), free_port())
    context = mp.get_context("spawn")
    go, done = context.Queue(), context.Queue()
    trainers = [context.Process(target=trainer, args=(r, path, ports, world, tensors, go, done)) for r in range(TRAINERS)]
    for process in trainers:
        process.start()
    rows: dict[str, list] = {"lazyload": [], "full tensors": []}
    try:
        assert sorted(done.get(timeout=900) for _ in trainers) == [("ready", r) for r in range(TRAINERS)]
        join_engine(llm, "127.0.0.1", ports[1], world, TRAINERS, 600)
        for update in range(2 * args.updates):
            way = "lazyload" if update % 2 == 0 else "full tensors"
            for _ in trainers:
                go.put(way)
            assert sorted(done.get(timeout=900) for _ in trainers) == [("stepped", r) for r in range(TRAINERS)]
            started = time.perf_counter()
            if way == "lazyload":
                replies = update_engine(llm)
            else:
                replies = llm.collective_rpc("bench_full_update", args=(tensors,))
            seconds = time.perf_counter() - started
            sides = [done.get(timeout=900) for _ in trainers]
            rows[way].append((seconds, max(s[2] for s in sides), [r["bytes_received"] for r in replies],
                              sum(s[3] for s in sides), max(r["reload_seconds"] for r in replies)))
    finally:
        stop_trainers(trainers, go, 60)
    print(f"checkpoint {path}: {checkpoint_bytes / 2**20:.0f} MiB; TP {args.tp}; {TRAINERS} FSDP2 trainer ranks; "
          f"{args.updates} updates each way, alternating; {os.cpu_count()} CPUs\n")
    print("| update | engine-side s (median) | of which vLLM's reload s | trainer-side s (median) | MiB received "
          "per worker | x the checkpoint | MiB sent by the trainers |")
    print("|---|---|---|---|---|---|---|")
    for way, measured in rows.items():
        per_worker = " / ".join(f"{b / 2**20:.0f}" for b in measured[-1][2])
        share = max(measured[-1][2]) / checkpoint_bytes
        print(f"| {way} | {statistics.median(m[0] for m in measured):.2f} | "
              f"{statistics.median(m[4] for m in measured):.2f} | {statistics.median(m[1] for m in measured):.2f} | {per_worker} | {share:.2f} | "
              f"{measured[-1][3] / 2**20:.0f} |")
    lazy, full = (statistics.median(m[0] for m in rows[w]) for w in ("lazyload", "full tensors"))
    print(f"\nlazyload's update takes {lazy / full:.2f}x the frameworks' way's time (engine side)")


if __name__ == "__main__":
    main()
