"""An RL weight update into a vLLM engine, in its own process: a TP-`--tp` engine loads
checkpoint MODEL with load_format="lazyload"; two trainer processes (a gloo group of their
own, FSDP2) start from the same checkpoint, and after each optimizer step send every worker
its boxes (`lazyload.integrations.vllm_update`). Two updates; then trainer rank 1 dies in
the third. After each update the engine's tokens and a digest of every worker's parameters
are taken; finally each step's weights, saved by the trainers, are loaded into the engine
afresh (`reload_weights`) and the same taken again, and so is MODEL's (against the load's).
One JSON line `RESULT {...}`.

    python tests/in_vllm/rl_update_run.py MODEL OUT --tp 2 --timeout 20
    python tests/in_vllm/rl_update_run.py MODEL-FP8 OUT --trainer-model MODEL --scheme FP8_DYNAMIC

A quantized engine (MODEL-FP8, compressed-tensors' FP8_DYNAMIC of MODEL) is updated from the
trainers' float32 weights, and each step's fresh load is of the checkpoint compressed-tensors
writes from them.

Run by case_vllm.py (in a process of its own: vLLM's workers and the trainers go with it).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/quant_checkpoints.py
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

TRAINERS = 2
UPDATES = 2  # then a third, in which trainer rank 1 dies


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_trainer(rank: int, model_dir: str, ports: tuple[int, int], world: int, timeout: float, dtype, ready):
    """A trainer rank as RL frameworks run it: `model_dir`'s model in `dtype`, FSDP2 over the
    trainers' own gloo group (port `ports[0]`), then `ready()` (the engine's workers may join),
    then a WeightSync into the workers over the update group (port `ports[1]`, `world` ranks
    with the trainers first). Returns (model, update group, sync). `benchmarks/bench_vllm_update.py`
    runs the same trainer."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from lazyload import WeightSync
    from lazyload.integrations.vllm_update import update_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=TRAINERS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    mesh = init_device_mesh("cpu", (TRAINERS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ready()  # construction below waits only for the others' planning
    group, store = update_group("127.0.0.1", ports[1], rank, world, timeout)
    return model, group, WeightSync(source=model, group=group, store=store, rank_timeout=timeout)


def trainer(rank: int, model_dir: str, out: str, ports: tuple[int, int], world: int, timeout: float, go, done) -> None:
    """One trainer rank (`fsdp_trainer`): at each `go`, an optimizer step, then the sync,
    then the step's full weights saved (rank 0) for the engine's fresh load."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, _, sync = fsdp_trainer(rank, model_dir, ports, world, timeout, torch.float32,
                                  lambda: done.put(("ready", rank)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = 0
    while go.get() is not None:
        step += 1
        ids = (torch.arange(32).reshape(2, 16) * (step + 3)) % 256
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step > UPDATES and rank == 1:
            os._exit(3)  # dies mid-update: its sends never come
        try:
            report = sync()
        except Exception as exc:  # rank 0, when rank 1 died: the sync fails here too
            done.put((rank, step, f"{type(exc).__name__}: {exc}"))
            continue
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(os.path.join(out, f"step{step}"), state_dict=full)
        done.put((rank, step, report.bytes_sent))
    dist.destroy_process_group()


def step_checkpoint(out: str, step: int, scheme: str | None) -> str:
    """Where a step's weights are saved for the engine's fresh load: as the trainer holds
    them, or quantized by compressed-tensors in `scheme`."""
    return os.path.join(out, f"step{step}" + (f"-{scheme}" if scheme else ""))


def parameters_digest(worker) -> str:
    """A digest of every parameter of this worker's model (collective_rpc runs it there)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, param in sorted(worker.model_runner.model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--trainer-model", help="the trainers' checkpoint (full precision) when MODEL is quantized")
    parser.add_argument("--scheme", help="MODEL's compressed-tensors preset (FP8_DYNAMIC): each step's fresh load is "
                                         "of the trainer's weights quantized so by compressed-tensors")
    args = parser.parse_args()
    trainer_model = args.trainer_model or args.model

    import torch.multiprocessing as mp
    from vllm import LLM

    from engine_run import generate
    from lazyload import SyncError
    from lazyload.integrations.vllm_update import join_engine, update_engine

    llm = LLM(model=args.model, load_format="lazyload", tensor_parallel_size=args.tp, enforce_eager=True,
              skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
              distributed_executor_backend="mp" if args.tp > 1 else None,
              worker_extension_cls="lazyload.integrations.vllm_update.WeightUpdateExtension")
    result = {"tokens": [generate(llm)], "digests": [llm.collective_rpc(parameters_digest)]}
    world, ports = TRAINERS + args.tp, (free_port(), free_port())
    context = mp.get_context("spawn")
    go, done = context.Queue(), context.Queue()
    trainers = [context.Process(target=trainer, args=(r, trainer_model, args.out, ports, world, args.timeout, go, done))
                for r in range(TRAINERS)]
    for process in trainers:
        process.start()
    try:
        assert sorted(done.get(timeout=600) for _ in trainers) == [("ready", r) for r in range(TRAINERS)]
        result["joined"] = join_engine(llm, "127.0.0.1", ports[1], world, TRAINERS, args.timeout)
        result["updates"] = []
        for step in range(1, UPDATES + 1):
            for _ in trainers:
                go.put(step)
            result["updates"].append(update_engine(llm))
            result["trainers"] = sorted(done.get(timeout=300) for _ in trainers)
            result["tokens"].append(generate(llm))
            result["digests"].append(llm.collective_rpc(parameters_digest))
        for _ in trainers:
            go.put(UPDATES + 1)
        started = time.monotonic()
        try:
            update_engine(llm)
            result["failed"] = None
        except SyncError as exc:
            result["failed"] = {"message": str(exc), "workers": sorted(exc.ranks)}
        result["failed_after"] = time.monotonic() - started
        result["trainer_failed"] = done.get(timeout=300)
        result["after_failure"] = {"tokens": generate(llm), "digests": llm.collective_rpc(parameters_digest)}
        result["fresh"] = []
        for step in range(1, UPDATES + 1):
            if args.scheme:  # here, not in a trainer: compressed-tensors compresses over a process group it finds
                from quant_checkpoints import write_ct_packed_checkpoint

                write_ct_packed_checkpoint(os.path.join(args.out, f"step{step}"),
                                           step_checkpoint(args.out, step, args.scheme), args.scheme)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": step_checkpoint(args.out, step, args.scheme)})
            result["fresh"].append({"tokens": generate(llm), "digests": llm.collective_rpc(parameters_digest)})
        # MODEL reloaded likewise: against `LLM()`'s load of it (the first digests), that such a
        # reload is a fresh load
        llm.collective_rpc("reload_weights", kwargs={"weights_path": args.model})
        result["reloaded_model"] = {"tokens": generate(llm), "digests": llm.collective_rpc(parameters_digest)}
    finally:
        for _ in trainers:
            go.put(None)
        for process in trainers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
