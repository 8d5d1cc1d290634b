"""The control plane of a weight sync at scale (issue 39): every rank of a job constructs its
`WeightSync` in one process, without torch.distributed, over an in-memory store that counts
the bytes and keys each rank writes and reads.

Each rank is a thread running the real `WeightSync.__init__` (its layout exchange,
`source_index`, `plan_load` of a meta model on server ranks, the requests, `choose_copies`,
the routes and the plan's agreement); only the source's layout is synthetic: the boxes FSDP
(and TP) would give each trainer rank, written as `SourceTensor`s, and the trainer mesh's
strided rules derived from them (`job_rules`, as `layout.mesh_rules` derives them from real
DTensors' placements; a process-free run has no DeviceMesh for real DTensors). Store traffic is counted for every rank of the job. The job's
threads are not timed (waking each other, they would count the fake store's waits): the first
and last trainer and server ranks are, each constructed again over the store the job left in
a Python process of its own (`time_apart`: its heap its own and the collector on, as a rank
runs; the median CPU seconds of `--repeat` constructions after a first), and again in the
job's process under tracemalloc for its peak. Models at their published widths and a reduced
depth; the last columns project to the full depth by the tensors' count (every figure grows
with it); `--layers A,B` runs two depths and also projects along the line through both (what
does not grow with depth counted once; depths a few layers apart, since one layer's
difference is within the noise of the seconds). `--divide N` runs fewer ranks (FSDP and
replicas divided by N): a job's figures against its world.

    python benchmarks/bench_sync_plan.py --cases deepseek-v3 --layers 4,8   # and its line to 61 layers
    python benchmarks/bench_sync_plan.py --cases llama-405b,llama-70b-1024 --layers 1,2
    python benchmarks/bench_sync_plan.py --cases tiny     # a few seconds: 8 ranks of a small Llama
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, replace
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB = 1 << 20
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROWWISE = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # a shape of sparse_checkpoint.SHAPES, or "tiny"
    full_layers: int
    fsdp: int  # trainer ranks: fsdp x tp, rank = dp * tp + t
    tp: int
    replicas: int  # server ranks after the trainer's: replicas x world
    world: int
    plan: str | None = None  # the server's plan ("ep": experts split over its ranks)


CASES = {
    "llama-405b": Case("Llama 405B, FSDP 64 x TP 8 -> 16 x TP 8", "llama-405b", 126, 64, 8, 16, 8),
    "deepseek-v3": Case("DeepSeek-V3, FSDP 256 -> 4 x EP 16", "deepseek-v3", 61, 256, 1, 4, 16, "ep"),
    "llama-70b-1024": Case("Llama 70B, FSDP 64 x TP 8 -> 64 x TP 8", "llama-70b", 80, 64, 8, 64, 8),
    "tiny": Case("tiny Llama, FSDP 2 x TP 2 -> 2 x TP 2", "tiny", 2, 2, 2, 2, 2),
}


def config_of(case: Case, layers: int):
    import sparse_checkpoint
    from transformers import LlamaConfig

    if case.model == "tiny":
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if case.model == "llama-70b":
        return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                           num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False, dtype="bfloat16")
    config, _ = sparse_checkpoint.SHAPES[case.model](layers)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the trainer holds bf16 weights
    return config


def meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _chunk(lo: int, hi: int, parts: int, i: int) -> tuple[int, int]:
    """FSDP2's (torch.chunk's) i-th of `parts` pieces of rows lo..hi."""
    size = -(-(hi - lo) // parts)
    return min(hi, lo + i * size), min(hi, lo + (i + 1) * size)


def trainer_layout(shapes: dict, dtype: str, case: Case, rank: int) -> list:
    """The boxes a FSDP x TP trainer rank holds: TP (Megatron's colwise/rowwise) first, then
    FSDP's dim-0 chunk of the TP shard; norms and biases replicated over TP (copies)."""
    from lazyload.sync.layout import Held, SourceTensor

    dp, t = divmod(rank, case.tp)
    out = []
    for name, shape in shapes.items():
        box = [(0, n) for n in shape]
        dim = _style(name, shape, case)
        if dim is not None:
            box[dim] = _chunk(0, shape[dim], case.tp, t)
        box[0] = _chunk(*box[0], case.fsdp, dp)
        held = (Held(tuple(box), (0,) * len(shape)),) if box[0][1] > box[0][0] else ()
        out.append(SourceTensor(name, dtype, tuple(shape), held))
    return out


def _style(name: str, shape: tuple, case: Case) -> int | None:
    """The dim TP splits a trainer's tensor on (colwise 0, rowwise 1), None: replicated over TP."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if case.tp > 1 and len(shape) >= 2 and leaf in COLWISE + ROWWISE:
        return 0 if leaf in COLWISE else 1
    return None


class CountingStore:
    """An in-memory store with TCPStore's verbs; bytes and keys counted per calling rank
    (the thread's `rank`). Deleted keys are kept: a rank constructed again alone reads what
    it read in the job."""

    def __init__(self):
        self.values, self.cond, self.local = {}, threading.Condition(), threading.local()
        self.read, self.written, self.gets, self.sets = Counter(), Counter(), Counter(), Counter()
        self.keys_read = defaultdict(set)  # rank -> the keys it read
        self.read_at = defaultdict(Counter)  # rank -> construction stage -> bytes read

    def _rank(self):
        return getattr(self.local, "rank", -1)

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        with self.cond:
            self.values[key] = value
            self.written[self._rank()] += len(value) + len(key)
            self.sets[self._rank()] += 1
            self.cond.notify_all()

    def get(self, key):
        self.wait([key], timedelta(seconds=60))
        value = self.values[key]
        self.read[self._rank()] += len(value) + len(key)
        self.read_at[self._rank()][stage_of(key)] += len(value) + len(key)
        self.gets[self._rank()] += 1
        self.keys_read[self._rank()].add(key)
        return value

    def multi_get(self, keys):
        return [self.get(k) for k in keys]

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + (timeout.total_seconds() if timeout else 60)
        with self.cond:
            while not all(k in self.values for k in keys):
                if not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"store wait timed out: {[k for k in keys if k not in self.values][:3]}")

    def check(self, keys):
        return all(k in self.values for k in keys)

    def add(self, key, amount):
        with self.cond:
            value = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(value).encode()
            counted = self.written if amount else self.read  # a count read, or a counter bumped
            counted[self._rank()] += len(key) + len(self.values[key])
            if not amount:
                self.read_at[self._rank()][stage_of(key)] += len(key) + len(self.values[key])
            (self.sets if amount else self.gets)[self._rank()] += 1
            self.cond.notify_all()
            return value

    def delete_key(self, key):
        with self.cond:
            return key in self.values

    def num_keys(self):
        return len(self.values)


def stage_of(key: str) -> str:
    """The construction stage a store key belongs to ("…/layout/3", "…/planned/3>9": the
    part before the last "/"), for the bytes read per stage."""
    return key.rsplit("/", 2)[-2] if key.count("/") >= 2 else key


class FakeGroup:
    """A process group of its own as `sync.peers.Peers` sees one (construction sends nothing)."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def name(self):
        return "gloo"

    def send(self, *args):
        raise AssertionError("construction sends nothing")

    recv = send


class FakeMesh:
    """A 1-D tensor-parallel mesh: the server rank's coordinate and size."""

    ndim, mesh_dim_names = 1, None

    def __init__(self, rank, size):
        self.rank, self.world = rank, size

    def get_local_rank(self):
        return self.rank

    def size(self):
        return self.world


def job_rules(layouts: dict, case: Case):
    """Every trainer rank's boxes as its mesh's strided rules (`layout.Rules`, what each rank
    of a real mesh derives from its DTensors' placements, `layout.mesh_rules`): derived once
    per distinct shape and parallel style, as `mesh_rules` does per distinct placements."""
    from lazyload.sync.layout import RuledTensor, Rules, strided

    ranks, derived, tensors = sorted(layouts), {}, []
    for i, tensor in enumerate(layouts[ranks[0]]):
        kind = (tensor.shape, _style(tensor.name, tensor.shape, case))
        if kind not in derived:
            derived[kind] = strided({rank: layouts[rank][i].held for rank in ranks})
        tensors.append(RuledTensor(tensor.name, tensor.dtype, tensor.shape, derived[kind]))
    return Rules(tuple(ranks), tuple(tensors))


def simulated_sync(layouts: dict, rules=None):
    """WeightSync whose source layout is the synthetic one of its rank (with the job's
    strided rules, `job_rules`)."""
    from lazyload.sync.weight_sync import WeightSync

    class SimulatedSync(WeightSync):
        def _layout(self, gather):
            self._source_cuda = False
            layout = layouts.get(self.rank)
            if layout is None:
                self._planned_layout = {}
                return False, None, None
            return True, None, self._publish(gather, layout, rules)  # max_host_bytes: the default

    return SimulatedSync


def construct(cls, rank, world, store, model, case):
    server = rank - case.fsdp * case.tp
    target = model if server >= 0 else None
    mesh = FakeMesh(server % case.world, case.world) if server >= 0 else None
    return cls(source=object() if server < 0 else None, target=target, target_mesh=mesh, group=FakeGroup(rank, world),
               store=store, rank_timeout=3600, plan=case.plan)


def run_case(case: Case, layers: int, apart: int = 0) -> dict:
    """The job; `apart`: the sampled ranks' construction timed that many times each in a
    process of its own (`time_apart`) instead of in this one, beside the job's leftovers."""
    import lazyload.sync.weight_sync as weight_sync

    config = config_of(case, layers)
    model = meta_model(config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    trainers = case.fsdp * case.tp
    world = trainers + case.replicas * case.world
    layouts = {r: trainer_layout(shapes, "torch.bfloat16", case, r) for r in range(trainers)}
    cls = simulated_sync(layouts, job_rules(layouts, case))
    store, results, errors = CountingStore(), {}, []
    construction = weight_sync.construction
    weight_sync.construction = lambda ranks: ("lazyload/sync/bench/0", 0)  # one process stands for every rank
    # one rank plans its target at a time: planning sets torch's default dtype while it builds a
    # model on meta (buffers.py), which threads doing at once would leave set for the process
    plan_load, planning = weight_sync.plan_load, threading.Lock()

    def plan_alone(*args, **kwargs):
        with planning:
            return plan_load(*args, **kwargs)
    weight_sync.plan_load = plan_alone

    shared = shared_values(weight_sync)  # the job's threads share what every rank decodes alike
    # each server rank's own meta model, built here: transformers' from_config(dtype=) sets torch's
    # default dtype while it runs, and threads doing it at once left bf16 as the process's default
    models = {rank: meta_model(config) for rank in range(trainers, world)}

    def one(rank):
        store.local.rank = rank
        try:
            own = models.get(rank)  # planning a model is not thread-safe: one model per rank
            results[rank] = routes_figures(construct(cls, rank, world, store, own, case), rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((rank, exc))

    try:
        threading.stack_size(1 << 20)
        threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"rank {errors[0][0]} failed") from errors[0][1]
        shared.restore()  # the sample constructs alone, decoding its own
        # the job's leftovers (every rank's plan, the store) out of the collector's way: a rank's
        # own process would not scan them at each collection
        gc.collect()
        gc.freeze()
        seconds, peaks, samples = {}, {}, {}
        sampled = sorted({0, trainers - 1, trainers, world - 1})
        for rank in sampled:  # alone, the store left as the job left it
            store.local.rank = ("again", rank)
            if not apart:
                started = time.process_time()
                construct(cls, rank, world, store, model, case)
                seconds[rank] = time.process_time() - started
            tracemalloc.start()
            samples[rank] = construct(cls, rank, world, store, model, case)
            peaks[rank] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    finally:
        gc.unfreeze()
        shared.restore()
        weight_sync.construction, weight_sync.plan_load = construction, plan_load
    if apart:
        seconds = {rank: statistics.median(times) for rank, times in time_apart(case, layers, store, sampled,
                                                                                  apart).items()}
    traffic = [store.read[r] + store.written[r] for r in range(world)]
    layouts_read = [store.read_at[r]["layout"] for r in range(world)]
    pairs_read = [sum(len(k) + len(store.values[k]) for k in store.keys_read[r] if k.endswith(f">{r}"))
                  for r in range(world)]  # values addressed to that rank alone: its pairs' requests and slots
    figures = [results[r] for r in range(world) if results[r]]
    return {"world": world, "tensors": len(shapes), "full_tensors": None, "seconds": list(seconds.values()), "peaks": peaks,
            "traffic": traffic, "gets": [store.gets[r] for r in range(world)], "layouts_read": max(layouts_read),
            "pairs_read": max(pairs_read), "rest_read": max(store.read[r] - layouts_read[r] - pairs_read[r]
                                                             for r in range(world)),
            "pieces": sum(len(h.held) for layout in layouts.values() for h in layout),
            "messages": max(f[0] for f in figures), "holders": max(f[1] for f in figures),
            "requests": max(f[2] for f in figures), "steps": max(f[3] for f in figures), "store": store,
            "samples": samples}


def time_apart(case: Case, layers: int, store: CountingStore, ranks: list[int], repeat: int) -> dict[int, list[float]]:
    """Each of `ranks` constructed again over the store the job left, in a Python process of its
    own (as a rank runs: its heap its own, the collector on), `repeat` times after a first
    construction that warms its caches: rank -> the CPU seconds of each."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        with open(path, "wb") as f:
            pickle.dump(store.values, f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this lazyload
        out = {}
        for rank in ranks:
            spec = json.dumps({"case": asdict(case), "layers": layers, "store": path, "rank": rank, "repeat": repeat})
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--apart", spec], env=env,
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode:
                raise RuntimeError(f"rank {rank} constructed apart failed:\n{done.stderr[-4000:]}")
            out[rank] = json.loads(done.stdout.splitlines()[-1])
        return out


def construct_apart(spec: dict) -> list[float]:
    """`time_apart`'s process: one rank's construction over a job's stored values."""
    import lazyload.sync.weight_sync as weight_sync

    case, layers, rank = Case(**spec["case"]), spec["layers"], spec["rank"]
    store = CountingStore()
    with open(spec["store"], "rb") as f:
        store.values = pickle.load(f)
    store.local.rank = "apart"
    weight_sync.construction = lambda ranks: ("lazyload/sync/bench/0", 0)  # the job's, as `run_case` set it
    trainers = case.fsdp * case.tp
    world = trainers + case.replicas * case.world
    model = meta_model(config_of(case, layers)) if rank >= trainers else None
    layouts = {}
    if rank < trainers:
        shapes = {n: tuple(t.shape) for n, t in meta_model(config_of(case, layers)).state_dict().items()}
        layouts = {r: trainer_layout(shapes, "torch.bfloat16", case, r) for r in range(trainers)}
    cls = simulated_sync(layouts, job_rules(layouts, case) if layouts else None)
    construct(cls, rank, world, store, model, case)  # caches warmed, as in a rank's later constructions
    seconds = []
    for _ in range(spec["repeat"]):
        started = time.process_time()
        construct(cls, rank, world, store, model, case)
        seconds.append(time.process_time() - started)
    return seconds


class shared_values:
    """While the job's threads construct, the values every rank reads alike (the layouts,
    and the sources' index built from them) decoded once and shared, so that a whole job
    fits in one process: each rank still reads every byte from the store (counted), but
    holds one copy of the job's layouts instead of one per rank. The measured sample is
    constructed after `restore`, decoding all it reads itself."""

    def __init__(self, weight_sync):
        import lazyload.sync.gather as gather

        self.gather, self.weight_sync = gather, weight_sync
        self.index, self.indexed = weight_sync.source_index, weight_sync.indexed
        decoded, indexed, lock = {}, {}, threading.Lock()

        def loads(data):
            if len(data) < 512:
                return pickle.loads(data)
            with lock:
                if data not in decoded:
                    decoded[data] = pickle.loads(data)
                return decoded[data]

        def shared_indexed(layouts, tiled=True, rules=None, ranks=None, wanted=None, own=None, prefer=None):
            asked = None if wanted is None else tuple(sorted((name, tuple(boxes)) for name, boxes in wanted.items()))
            key = (tiled, own, prefer, tuple(map(id, (rules or {}).values())), None if ranks is None else tuple(ranks),
                   asked) + tuple((rank, id(layout)) for rank, layout in sorted(layouts.items()))
            with lock:
                if key not in indexed:
                    indexed[key] = self.indexed(layouts, tiled, rules, ranks, wanted, own, prefer)
                return indexed[key]

        def source_index(layouts, tiled=True):
            return shared_indexed(layouts, tiled)[:2]

        gather.pickle = type("SharedPickle", (), {"dumps": staticmethod(pickle.dumps), "loads": staticmethod(loads)})
        weight_sync.source_index, weight_sync.indexed = source_index, shared_indexed

    def restore(self):
        self.gather.pickle, self.weight_sync.source_index, self.weight_sync.indexed = pickle, self.index, self.indexed


def routes_figures(sync, rank) -> tuple | None:
    """A server rank's (most messages in a step, most distinct source ranks holding that step's
    boxes, most requests in a step, steps); None on a trainer rank."""
    if not sync.items:
        return None
    copies = {key: set(held) for key, (_, held) in sync._copies.items()}  # every replicated box's, as the sync found them
    by_step_sources, by_step_requests, by_step_holders = Counter(), Counter(), defaultdict(set)
    for step, by_source in sync.routes.receives.items():
        by_step_sources[step] = len(by_source)
        for source, positions in by_source.items():
            by_step_requests[step] += len(positions)
            for p in positions:
                key = sync.items[p].entry.key
                by_step_holders[step] |= copies.get(key, {sync.pieces[key].rank})
    steps = sync.routes.steps
    return (max(by_step_sources.values(), default=0), max((len(h) for h in by_step_holders.values()), default=0),
            max(by_step_requests.values(), default=0), steps)


def full_tensors(case: Case) -> int:
    if case.model == "tiny":
        return len(meta_model(config_of(case, case.full_layers)).state_dict())
    config = config_of(case, case.full_layers)
    return len(meta_model(config).state_dict())


def row(case: Case, layers: int, r: dict, full: int) -> str:
    scale = full / r["tensors"]
    world, seconds, traffic = r["world"], r["seconds"], r["traffic"]
    peak = max(r["peaks"].values())
    return (f"| {case.name} | {world:,} | {layers}: {r['tensors']:,} tensors, {r['pieces']:,} pieces "
            f"| {max(seconds):.2f} s | {peak / MiB:,.1f} MiB | {max(traffic) / MiB:,.1f} MiB "
            f"| {sum(traffic) / MiB:,.0f} MiB | {max(r['gets']):,} "
            f"| {r['layouts_read'] / MiB:,.2f} / {r['pairs_read'] / MiB:,.2f} / {r['rest_read'] / MiB:,.3f} MiB "
            f"| {r['messages']} / {r['holders']} ({r['requests']:,} boxes, {r['steps']} steps) "
            f"| {max(seconds) * scale:.1f} s | {peak * scale / MiB:,.0f} MiB | {max(traffic) * scale / MiB:,.0f} MiB "
            f"| {sum(traffic) * scale / 2**30:,.1f} GiB |")


HEADER = ("| job | ranks | layers: tensors, source pieces | construction (slowest rank, CPU) | peak memory (its "
          "largest) | store traffic, most of a rank | store traffic, all ranks | store reads, most "
          "of a rank | store bytes read, most of a rank: layouts / its own pairs / the rest | messages / distinct holders, a server rank's busiest step | projected: construction "
          "| projected: peak memory | projected: traffic of a rank | projected: all traffic |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    if sys.argv[1:2] == ["--apart"]:  # `time_apart`'s process
        print(json.dumps(construct_apart(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama-405b,deepseek-v3,llama-70b-1024")
    parser.add_argument("--layers", default="1", help="decoder layers simulated (projected to the full depth); "
                        "two, comma-separated: each, and the line through both projected")
    parser.add_argument("--divide", type=int, default=1, help="fewer ranks: FSDP and replicas divided by this")
    parser.add_argument("--repeat", type=int, default=5, help="each sampled rank constructed this many times in a "
                        "process of its own (the median); 0: once, in the job's process")
    args = parser.parse_args()
    print(HEADER)
    lines = []
    for name in args.cases.split(","):
        case = CASES[name]
        if args.divide > 1:
            case = replace(case, name=f"{case.name} / {args.divide}", fsdp=max(1, case.fsdp // args.divide),
                           replicas=max(1, case.replicas // args.divide))
        depths = []
        for layers in map(int, args.layers.split(",")):
            layers = min(layers, case.full_layers)
            if case.model == "deepseek-v3":
                layers = max(layers, 4)  # the first MoE layer is the fourth
            r = run_case(case, layers, args.repeat)
            print(row(case, layers, r, full_tensors(case)), flush=True)
            depths.append((layers, r))
        if len(depths) == 2:
            lines.append(line_through(case, depths, full_tensors(case)))
    print(*lines, sep="\n")


def line_through(case: Case, depths: list, full: int) -> str:
    """The slowest sampled rank's construction and the largest peak projected to the full
    depth along the line through two depths' (what does not grow with depth counted once)."""
    (l1, r1), (l2, r2) = depths
    n1, n2 = r1["tensors"], r2["tensors"]

    def at_full(y1: float, y2: float) -> float:
        return y1 + (y2 - y1) / (n2 - n1) * (full - n1)
    seconds = at_full(max(r1["seconds"]), max(r2["seconds"]))
    peak = at_full(max(r1["peaks"].values()), max(r2["peaks"].values())) / MiB
    return (f"{case.name}: the line through {l1} and {l2} layers ({n1} and {n2} tensors) projects {seconds:.1f} s "
            f"and {peak:,.0f} MiB at {full:,} tensors.")

if __name__ == "__main__":
    main()
