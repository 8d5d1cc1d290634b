"""`WeightSync`: a trainer's (sharded) weights into a server's tensor-parallel model, only
the slices each server rank holds moving, with one plan made at construction and reused by
every sync. See the package docstring for the stages."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..agreement import RANK_TIMEOUT, Agreement
from ..buffers import fill_meta_buffers
from ..keywords import check_keywords
from ..errors import ArgumentError, CheckpointError, RankFailedError, SyncError
from ..gcpause import no_cycle_collection
from ..executor import allocate_destinations, assign_loaded, make_parallel, swap_quantized_layers
from ..mapping import KeyMap
from ..mesh import ranks_of
from ..placer import with_whole
from ..planner import LoadOptions, LoadPlan, check_conversions, plan_load
from ..quant.onload import Quantization
from ..quant.targets import scale_names
from ..placer import allocate
from ..targets import model_slots
from .prequantized import full_dtype, in_place_dests, planned_as_full, quantized_layers, refuse_unsupported_holders
from ..stored import StoredCheckpoint
from .copies import choose_copies
from .gather import Gather, construction
from .layout import Rules, RuledTensor, SourceTensor, local_of, mesh_rules, source_layout, source_tensors
from .routes import (Request, Routes, Summary, default_slots, largest_requests, own_steps, published, requests_of,
                     routes_for, source_slots)
from .source_index import indexed, source_index
from .box_target import BoxTarget
from .peers import NcclLink, Peers
from .split import split_plan
from .transfer import Ends, Moved, Traffic, message_buffer, transfer, wait_on_device
from .wire import host_scratch, most_scratch, quantize_on_wire, with_assembled


@dataclass(frozen=True)
class SyncReport:
    """What one `sync()` did on this rank. `bytes_received` came over the wire, `bytes_local`
    from this rank's own source tensors (colocated); `planned`: this call planned (the first
    only: the plan is made at construction, and the first sync makes a meta target real).

    - `version`: the syncs completed into this rank's target (by any WeightSync; on a rank
      without one, by this WeightSync), this one included when it completed: a failed sync
      does not advance it, so a server serves only while its version is the last sync's.
    - `peers`: peer rank (the group's) -> `Traffic`: the bytes and messages this sync sent
      to and received from it, counting the steps that completed.
    - When the sync failed: `written`, the target tensors it wrote completely (they hold the
      new version); `untouched`, those it did not write at all (they hold the last
      version); any other target tensor may be partly written (a torn mix of both).
      `partial` is `written` (its earlier name).
    - `quantized_on_wire`: of `bytes_sent` and `bytes_received`, those of boxes quantized
      by their source (the 8-bit data and scales of a target built with `quantize=`, or of
      a `BoxTarget(quantized=)`'s weights stored quantized per channel); the
      rest travelled in full precision (cast, or as the source holds it), a quantized
      target's boxes among them quantized on arrival (a conversion's sources, boxes whose
      source cannot quantize them as the target would)."""

    bytes_sent: int
    bytes_received: int
    bytes_local: int
    seconds: float
    plan_digest: str
    plan_seconds: float
    planned: bool
    written: tuple[str, ...] = ()
    tensors: int = 0
    version: int = 0
    untouched: tuple[str, ...] = ()
    peers: dict[int, Traffic] = field(default_factory=dict)
    quantized_on_wire: int = 0

    @property
    def partial(self) -> tuple[str, ...]:
        return self.written


# target -> the syncs completed into it (`SyncReport.version`), kept beside it, not on it
_VERSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# gloo keys a point-to-point message by a 32-bit tag (torch passes it as a C int): bounded, so a
# construction owns a block of _TAGS_EACH tags (constructions numbered mod the blocks that fit)
_TAGS_EACH = 1 << 16
_BLOCKS = ((1 << 31) - 1) // _TAGS_EACH


def sync_tag(construction: int, failures: int) -> int:
    """The tag of a sync after `failures` failed ones (gloo's; NCCL ignores tags: there a
    failure aborts the communicator instead, `peers.NcclLink`). A sync that completed left no
    message pending (every send and receive was waited for), so its tag is reused; only a
    failure, whose messages may still be in flight, moves to a fresh one, never repeated after."""
    if failures >= _TAGS_EACH:
        raise SyncError(f"WeightSync: {failures} syncs failed; its message tags are spent (a retry could match a "
                        "failed sync's messages): construct a new WeightSync on every rank.")
    return (construction % _BLOCKS) * _TAGS_EACH + failures


def own_holders(quantize: Any) -> Quantization | None:
    """`quantize=` kept in lazyload's quantized layers: torchao's holders would be new tensors,
    which later syncs could not update in place."""
    return None if quantize is None else replace(Quantization.of(quantize), torchao=False)


def cast_on_wire(plan: LoadPlan, items: list) -> dict[int, torch.dtype]:
    """The items (by position) whose source casts them to their target's narrower floating
    dtype before sending (float32 master weights into a bf16 server: half the bytes): those
    the target would only cast on arrival, not quantize (its cast is then a no-op). The same
    bits either way: both are a `copy_` into the narrower dtype (round to nearest even), and
    the item's ops (transposes, unsqueezes) only move values."""
    cast = {t.name: t.dtype for t in plan.targets if t.name not in plan.quantized and t.dtype.is_floating_point}
    return {position: cast[item.target] for position, item in enumerate(items)
            if item.target in cast and item.scales is None and item.entry.dtype.is_floating_point
            and cast[item.target].itemsize < item.entry.dtype.itemsize}


def _check_same_plan(rank: int, digests: dict[int, str]) -> None:
    """Every rank derived the same sync plan digest from the targets' published summaries (each
    source checked the requests it read against them): a rank running another lazyload, or
    planning otherwise, would pair messages of other sizes."""
    if len(set(digests.values())) > 1:
        counts = {d: sum(1 for v in digests.values() if v == d) for d in digests.values()}
        ref = max(counts, key=lambda d: (counts[d], -min(r for r, v in digests.items() if v == d)))
        other = {r: f"planned sync {d} where most ranks planned {ref}" for r, d in sorted(digests.items()) if d != ref}
        raise RankFailedError(f"rank {rank}: the ranks planned different weight syncs from the same requests ("
                              + "; ".join(f"rank {r}: {m}" for r, m in other.items()) + "): every rank must run "
                              "the same lazyload version; no byte moved.", other)


def _rules_key(digest: str) -> str:
    """Where a mesh's strided rules are put, by their digest (one value for all its ranks)."""
    return f"rules.{digest}"


def _described(tensor: SourceTensor | None) -> str:
    """A source tensor's dtype, shape and the boxes this rank holds, for a message."""
    if tensor is None:
        return "gone"
    boxes = ", ".join("[" + ", ".join(f"{a}:{b}" for a, b in h.box) + "]" for h in tensor.held)
    return f"{tensor.dtype} {list(tensor.shape)} holding {boxes or 'nothing'}"


class WeightSync:
    """Moves a source's weights into a target model, on every rank of `group` (default: the
    default process group); every rank constructs it, and calls it, together.

    - `source`: on trainer ranks, an `nn.Module` (plain, DTensor TP, FSDP2 `fully_shard`, or
      both over a 2-D mesh) or a state dict of such tensors, in the target's names or mapped
      by the same rules as a checkpoint (`key_map`, transformers' conversion mapping); or
      a Megatron-Core GPT model, read as its `sharded_state_dict()` describes it and named
      as the torch_dist reader names its checkpoints (`megatron_source.py`).
    - `target`: on server ranks, a model built on the meta device (the first sync makes it
      real and tensor-parallel over `target_mesh`, exactly as `load_into(mesh=...)` does) or
      one loaded already; later syncs copy into its tensors in place (same storage). A target
      loaded with `load_into(quantize=...)` is synced with the same `quantize=`: each received
      slice is quantized into its layers' own data and scales, as `load_into` would.
      Or a `BoxTarget`: the boxes of each tensor an engine's own weight loaders copy (a vLLM
      worker, `integrations.vllm_update`), received into host tensors it reads from;
      `BoxTarget(boxes, quantized=torch.float8_e4m3fn)` receives the weights it asks for
      with their `weight_scale` as compressed-tensors stores them per channel, quantized
      by the trainer (`quant/channel.py`).
    - `target_mesh`: the server ranks' DeviceMesh (1-D, tensor parallel; a pipeline stage's
      model, holding only its layers as `load_into` takes it, with its stage's TP mesh:
      each stage receives only its layers' slices); `quantize`,
      `dtype`, `plan`, `key_map`, `device`: as `load_into`'s.
    - `max_host_bytes`: this rank's bytes per step as a target (received) and as a source
      (packed, for all its targets), default about one layer; larger items are cut.
    - `group`: a group of torch.distributed's world (default: the default group), or a
      process group of its own, `ProcessGroupGloo(store, rank, size)`, made between
      processes that each have another default group (a trainer's and vLLM's workers'),
      with `store`: the store it was made with, where the ranks meet (`sync.peers`).
    - `rank_timeout`: seconds any rank waits for another, at construction and in each sync.

    The plan is made here, from metadata alone: every input error (a tensor the target needs
    that no source holds, shapes that differ, a target mesh that does not split the model)
    fails on every rank before any byte moves."""

    def __init__(self, source: Any = None, target: Any = None, *, target_mesh: Any = None,
                 group: Any = None, store: Any = None, rank_timeout: float = RANK_TIMEOUT, quantize: Any = None,
                 key_map: KeyMap | None = None, dtype: Any = None, plan: Any = None, device: Any = None,
                 max_host_bytes: int | None = None, **unknown: Any):
        check_keywords("WeightSync", unknown, WeightSync.__init__)
        started = time.perf_counter()
        self.peers = Peers.of(group)
        self.group, self.rank, self.timeout = group, self.peers.rank, rank_timeout
        self.ranks = list(self.peers.ranks)
        self.source, self.target, self.target_mesh = source, target, target_mesh
        self._options = LoadOptions(device=device, dtype=dtype, key_map=key_map, progress=False, plan=plan,
                                    reader="pread", max_host_bytes=max_host_bytes, quantize=own_holders(quantize),
                                    rank_timeout=rank_timeout, mesh=target_mesh, cooperative=False,
                                    pieces_cut_groups=True)
        store = store if store is not None else self.peers.default_store()
        prefix, number = construction(self.ranks)
        gather = Gather(store, self.rank, self.ranks, rank_timeout, prefix)
        self._prefix = gather.prefix
        held = gather.run("layout", lambda: self._layout(gather))
        self._max_host_bytes = {r: b for r, (_, b, _) in held.items()}  # every rank's: they bound the steps
        self._budgeted = any(b is not None for b in self._max_host_bytes.values())
        # a target plans from every source rank's boxes (a mesh's as its strided rules); a source
        # alone needs only its own (the requests it reads name its own pieces), so it reads no
        # other rank's layout
        self._unread: dict = {}
        if self.target is not None:
            self._sources = self._source_layouts(gather, held)
            with no_cycle_collection():  # a ruled tensor's boxes unexpanded until the target's plan says which it reads
                self._index_for({})
        else:
            self.index, self.pieces = source_index(gather.read("layout", [self.rank] if self.source is not None
                                                               else []), tiled=False)
        gather.run("asked", lambda: self._ask(gather))  # each target tells each source it asks
        askers = gather.asked_by("asked")
        if askers and self._max_host_bytes[self.rank] is not None:  # its budget shared among them
            gather.tell("slots", source_slots(askers, self._max_host_bytes[self.rank]))
        summaries, asked = gather.exchange("planned", lambda: self._stepped(gather), list(askers))
        with no_cycle_collection():
            self.routes: Routes = routes_for(self.rank, self._wanted, asked, summaries)
        _check_same_plan(self.rank, gather.run("agreed", lambda: self.routes.digest))
        gather.close(("layout", "asked", "planned", "agreed"), asked="asked", put=("layout",),
                     named=tuple(("layout", _rules_key(d)) for d in {d for _, _, d in held.values() if d}))
        self.plan_seconds = time.perf_counter() - started
        self._store, self._syncs, self._dests, self._slots, self._assigned = store, 0, None, None, False
        self._abandoned: list = []
        self._failures = 0  # failed syncs: each retry sends under a fresh tag
        self._announced = 0  # the last sync whose failure this rank announced
        self._tag = number + 1
        # NCCL sends device memory; gloo host memory
        self._wire = (torch.device("cuda", torch.cuda.current_device()) if self.peers.backend == "nccl"
                      else torch.device("cpu"))
        target_cuda = self.load_plan is not None and self.load_plan.device.type == "cuda"
        self._pinned = self._wire.type == "cpu" and (self._source_cuda or target_cuda)  # gloo, GPU tensors
        # NCCL: messages on a communicator of the sync's own, aborted after a failure (see NcclLink)
        self._link = (NcclLink(self.peers, store, self._prefix, rank_timeout)
                      if self.peers.backend == "nccl" else None)

    def _layout(self, gather: Gather) -> tuple[bool, int | None, str | None]:
        """This rank's source boxes, `put` for the target ranks to read (kept to check at each
        sync that the source still holds the shards the plan was made for): whether it has
        any (a source here), its `max_host_bytes`, and the digest of its mesh's strided rules
        (`layout.Rules`), where every rank of the mesh derives the same from the placements."""
        budget = self._options.max_host_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ArgumentError(f"WeightSync: max_host_bytes must be a positive integer (bytes per step), got "
                                f"{budget!r}.")
        self._source_cuda = False
        if self.source is None:
            self._planned_layout: dict = {}
            return False, budget, None
        tensors = source_tensors(self.source)
        self._source_cuda = any(local_of(t).is_cuda for t in tensors.values())
        return True, budget, self._publish(gather, source_layout(tensors), mesh_rules(tensors))

    def _publish(self, gather: Gather, layout: list[SourceTensor], rules: Rules | None) -> str | None:
        """`put` this rank's boxes, and its mesh's rules (by the mesh's first rank, once) where
        they give this rank the boxes it holds; their digest, or None."""
        self._planned_layout = {s.name: s for s in layout}
        gather.put("layout", layout)
        if rules is None or self.rank not in rules.ranks or any(
                t.held_by(self.rank) != self._planned_layout[t.name].held for t in rules.tensors):
            return None  # a mesh numbered otherwise than the sync's group: each rank's own boxes
        digest = rules.digest()
        if self.rank == min(rules.ranks):
            gather.put("layout", rules, _rules_key(digest))
        return digest

    def _source_layouts(self, gather: Gather, held: dict) -> tuple[dict, dict, list[int]]:
        """(the boxes of the source ranks not described by rules, ruled tensors by name, every
        source rank): a mesh's rules read once, where every rank they name published them
        (else each rank's own boxes)."""
        sources = [r for r, (has, _, _) in held.items() if has]
        claims: dict[str, set[int]] = {}
        for rank in sources:
            if held[rank][2] is not None:
                claims.setdefault(held[rank][2], set()).add(rank)
        rules: dict[str, RuledTensor] = {}
        ruled: set[int] = set()
        for digest, ranks in claims.items():
            body = gather.read_named("layout", _rules_key(digest))
            if body is None or set(body.ranks) != ranks:
                continue
            ruled |= ranks
            for t in body.tensors:
                rules[t.name] = replace(t, rules=rules[t.name].rules + t.rules) if t.name in rules else t
        return gather.read("layout", [r for r in sources if r not in ruled]), rules, sources

    def _index_for(self, wanted: dict | None) -> None:
        """The sources' index, a ruled tensor's boxes expanded where they overlap `wanted`
        (name -> boxes the target reads; None: all)."""
        layouts, rules, sources = self._sources
        prefer = None
        if self.target_mesh is not None and not isinstance(self.target, BoxTarget):  # the copy its plan takes
            rank, world = ranks_of(self.target_mesh, 0, 1)
            prefer = rank * len(sources) // max(world, 1)
        own = self.rank if self.source is not None else None
        try:
            self.index, self.pieces, self._unread, self._copies = indexed(layouts, True, rules, sources, wanted, own,
                                                                          prefer)
        except CheckpointError:  # boxes read that do not tile with the rest: every box, as the ranks hold them
            if wanted is None:
                raise
            self.index, self.pieces, self._unread, self._copies = indexed(layouts, True, rules, sources, None)

    def _source_now(self) -> dict:
        """The source's tensors now, each still the shard the plan was made for: the same
        dtype (the messages carry the planned dtype's bytes), global shape and boxes held."""
        tensors = source_tensors(self.source)
        now = {s.name: s for s in source_layout({n: tensors[n] for n in self._planned_layout if n in tensors})}
        for name, planned in self._planned_layout.items():
            if now.get(name) != planned:
                raise ArgumentError(f"WeightSync: source tensor {name!r} on rank {self.rank} is now "
                                    f"{_described(now.get(name))}, planned as {_described(planned)} (a module "
                                    "unsharded after its forward, or cast? sync after the optimizer step, from the "
                                    "tensors the sync was made for); construct a new WeightSync for another layout "
                                    "or dtype.")
        return tensors

    @property
    def plan_digest(self) -> str:
        return self.routes.digest

    def _ask(self, gather: Gather) -> None:
        """This rank's requests (the copies chosen), kept, in windows of its budget; and each
        source rank it asks over the wire told so, with its largest request there (how the
        source shares its budget among its targets, `source_slots`)."""
        with no_cycle_collection():  # thousands of boxes' objects, no cycles among them (`gcpause`)
            requests = self._plan_target()
            self._wanted = None if requests is None else choose_copies({self.rank: requests}, self.pieces,
                                                                       self._copies)[self.rank]
        if self._wanted is not None:
            gather.ask("asked", largest_requests(self.rank, self._wanted))

    def _stepped(self, gather: Gather) -> tuple[dict[int, tuple[str, list[Request]]], Summary] | None:
        """This rank's requests with their steps (in its sources' slots), each source's with
        their digest, and their summary; None on a rank without a target. Kept: its routes
        receive in their order."""
        if self._wanted is None:
            return None
        slots = default_slots(self.rank, self._wanted)
        slots.update(gather.told("slots", [s for s in slots if self._max_host_bytes.get(s) is not None]))
        with no_cycle_collection():
            self._wanted = own_steps(self.rank, self._wanted, slots)
            return published(self.rank, self._wanted)

    def _plan_target(self) -> list[Request] | None:
        """This rank's load plan of the target from the sources' index, and its requests. A
        ruled tensor's boxes are expanded only where this plan reads: planned once over
        its rules unexpanded, then again over the boxes that plan read (and over every box,
        should the second read one left unexpanded)."""
        self.load_plan: LoadPlan | None = None
        self._box_dests: dict | None = None
        self._wires: dict = {}  # item position -> cast or quantized on the wire
        self._scratch: list = []  # host scratch of blocks the trainer's shards cut (`wire.host_scratch`)
        if self.target is None:
            self.items: list = []
            return None
        budget = self._plan_items(first=bool(self._unread))
        if self._unread:
            self._index_for(self._read_boxes())
            budget = self._plan_items()
            if any(item.entry.key in self._unread for item in self.items):
                self._index_for(None)
                budget = self._plan_items()
        return requests_of(self.items, self.pieces, budget, self._wires, self._scratch)

    def _read_boxes(self) -> dict[str, list]:
        """Name -> the boxes of it this rank's items read from keys left unexpanded."""
        out: dict[str, list] = {}
        for item in self.items:
            unread = self._unread.get(item.entry.key)
            if unread is not None:
                out.setdefault(unread.name, []).append(
                    tuple((lo + a, lo + b) for (lo, _), (a, b) in zip(unread.box, item.src_box)))
        return out

    def _plan_items(self, first: bool = False) -> int:
        """This rank's items over the sources' index (`self.items`, with the load plan, its
        destinations and the items sent cast or quantized), and its bytes per step. `first`:
        the items alone, to learn which boxes it reads (a preview plan: no initial values
        or buffers computed)."""
        if isinstance(self.target, BoxTarget):  # an engine's boxes, received into host tensors
            self.items, self._box_dests, budget, self._wires = self.target.plan(self.index,
                                                                                self._options.max_host_bytes,
                                                                                self._cut_at)
            return budget
        if self.target_mesh is None:
            raise ArgumentError("WeightSync(target=...) needs target_mesh=, the server ranks' DeviceMesh (1-D, "
                                "tensor parallel), e.g. init_device_mesh('cpu', (2,), mesh_dim_names=('tp',)) over "
                                "them.")
        rank, world = ranks_of(self.target_mesh, 0, 1)
        refuse_unsupported_holders(self.target)
        layers = quantized_layers(self.target)  # loaded quantized already: planned as the full model
        budget = self._options.max_host_bytes  # the sync's, per step (`routes`): items larger are cut, not refused
        with planned_as_full(self.target, layers, full_dtype(self.target, layers)):
            plan = plan_load(StoredCheckpoint.of_index(self.index), self.target, rank, world,
                             replace(self._options, max_host_bytes=None), preview=first)
            scales = scale_names(self.target, plan.quantized)
        if first:
            self.items = [item for group in plan.groups for item in group.items]
            return 0
        check_conversions(plan.whole if plan.device.type == "cpu" else {}, budget)
        self.load_plan = split_plan(plan, self._cut_at)
        self._in_place = in_place_dests(self.load_plan, layers, scales.__getitem__) if layers else None
        self.items = [item for group in self.load_plan.groups for item in group.items]
        self._wires = {**cast_on_wire(self.load_plan, self.items), **quantize_on_wire(self.load_plan, self.items)}
        self._scratch = host_scratch(self.load_plan, self.items)  # blocks cut by the trainer's shards, assembled here
        return budget or self.load_plan.budget + most_scratch(self._scratch)

    def _cut_at(self, item) -> int | None:
        """The bytes an item of this target may hold in one step: this rank's budget, and
        unless it holds a copy itself, the budget of every source rank that may send it (the
        copy is chosen later, `copies.py`). None: no limit (the defaults hold any item)."""
        key = item.entry.key
        if key in self._unread or not self._budgeted:  # a first plan's, only to learn the boxes it reads; or
            return None  # no rank set a budget (each item of a large target asks)
        holders = set(self._copies[key][1]) if key in self._copies else {self.pieces[key].rank}
        budgets = [self._max_host_bytes[r] for r in {self.rank} | (set() if self.rank in holders else holders)]
        return min((b for b in budgets if b is not None), default=None)

    def __call__(self) -> SyncReport:
        """One sync: every rank of the group calls it together. Returns this rank's report; a
        failure on any rank is a SyncError on every rank (within about `rank_timeout`), whose
        `report.partial` names the targets already new; calling again completes the sync."""
        started, planned = time.perf_counter(), self._syncs == 0
        self._syncs += 1
        self._forget(self._syncs - 2)
        agree = self._agreement(self._syncs)
        moved = Moved(left={})
        try:
            with agree.collectives():
                self._sync(moved)
            self._completed()
        except BaseException as exc:
            self._failures += 1  # every rank raises, so every rank counts it
            self._announce(exc)
            if self._link is not None:  # before any retry: the failed sync's messages go with it
                self._link.abort()
            agree.failed(exc)
            report = self._report(moved, started, planned, failed=True)
            raise SyncError(f"rank {self.rank}: the weight sync did not complete ({type(exc).__name__}: {exc}); "
                            f"{len(report.written)} of {self._target_count()} target tensors on this rank hold the new "
                            f"version (report.written), {len(report.untouched)} the last one (report.untouched), the "
                            f"others may be partly written: do not serve from this target (its version stays "
                            f"{report.version}) until the sync completes. Call "
                            "the sync again on every rank to complete it" + (
                                " (over NCCL the retry runs on a fresh communicator: this one was aborted, with "
                                "whatever the failed sync left on it)" if self._link is not None else "") + ".",
                            getattr(exc, "ranks", None), report) from exc
        return self._report(moved, started, planned)

    def _forget(self, sync: int) -> None:
        """Delete sync number `sync`'s store keys, so that the store stays the same size over
        any number of syncs. Safe two syncs later: a rank in sync n means every rank reported
        at n - 1's agreement, which each does only after reading n - 2's verdict. Each rank
        deletes its own reports; the first rank the verdict and the failure keys."""
        if sync < 1:
            return
        agree = self._agreement(sync)
        agree.forget("exchanged")
        if agree.pos == 0:
            self._store.delete_key(self._abort_key(sync))

    def _agreement(self, sync: int) -> Agreement:
        """Sync number `sync`'s agreement: only the "exchanged" point of its collectives."""
        return Agreement(self._store, self.rank, len(self.ranks), self.timeout, self.ranks, points=(),
                         prefix=f"{self._prefix}/sync{sync}", job="sync")

    def _announce(self, exc: BaseException) -> None:
        """Tell the others this rank failed (once per sync: the first cause is the one named)."""
        if self._announced != self._syncs:
            self._announced = self._syncs
            self._store.set(self._abort_key(), f"rank {self.rank} failed ({type(exc).__name__}: {exc})")

    def _abort_key(self, sync: int | None = None) -> str:
        """Where a rank announces its failure of sync number `sync` (default: this one)."""
        return f"{self._prefix}/sync{sync or self._syncs}/aborted"

    def _aborted(self) -> str | None:
        """Another rank's failure in this sync, as it announced it (None: none yet)."""
        key = self._abort_key()
        return self._store.get(key).decode() if self._store.check([key]) else None

    def _sync(self, moved: Moved) -> None:
        first = not self._assigned and self.load_plan is not None
        if self._dests is None and self.load_plan is not None:
            self._materialize()
        dests = self._box_dests or {}
        if self.load_plan is not None:
            plan = self.load_plan
            dests = with_whole(self._dests, plan.targets, plan.mapping.exprs, plan.items, plan.index.shape_of)
            dests = with_assembled(dests, plan, self.items)
        for item in self.items:
            moved.left[item.target] = moved.left.get(item.target, 0) + 1
        ends = Ends(self._source_now(), self.pieces, {k: e.dtype for k, e in self.index.items()}, self.items,
                    dests, self._link if self._link is not None else self.peers, sync_tag(self._tag, self._failures),
                    self._wire, self.timeout, self._aborted, self._abandoned, self._pinned, self._wires)
        try:
            self._connect(ends)
            transfer(self.routes, ends, moved)
        except BaseException as exc:
            # before the agreement waits for the others: they stop waiting for this rank's messages
            self._announce(exc)
            raise
        if first:  # only now does the model hold its tensors: a failed first sync left it unassigned
            assign_loaded(self.load_plan, self._slots, self._dests)
            fill_meta_buffers(self.load_plan.recompute)
            self._assigned = True

    def _connect(self, ends: Ends) -> None:
        """Over NCCL, a communicator for this sync: the open one, else a fresh one (the first
        sync, and a retry after a failure), its first collective completed."""
        if self._link is None or self._link.comm is not None:
            return
        works = self._link.connect(self._failures, self._aborted, message_buffer(1, ends).zero_())
        wait_on_device(works, self.timeout, self._aborted, "the weight sync's NCCL communicator's first collective")

    def _materialize(self) -> None:
        """The first sync into the target: quantized layers swapped, made parallel over the
        target mesh, destinations allocated (the model's own tensors when already real; a
        target quantized already keeps its layers, their data and scales filled in place)."""
        plan = self.load_plan
        if self._in_place is not None:  # quantized layers already: every tensor filled where it is
            self._slots = model_slots(self.target)[0]
            self._dests = {t.name: self._in_place.get(t.name) or allocate(t, self._slots[t.name], plan.device)
                           for t in plan.targets}
            return
        slots = swap_quantized_layers(plan, self.target)
        make_parallel(plan, self.target, slots)
        self._slots, self._dests = slots, allocate_destinations(plan, slots, None)

    @property
    def version(self) -> int:
        """The syncs completed into this rank's target (`SyncReport.version`)."""
        holder = self if self.target is None else self.target
        return _VERSIONS.get(holder, 0)

    def _completed(self) -> None:
        holder = self if self.target is None else self.target
        _VERSIONS[holder] = _VERSIONS.get(holder, 0) + 1

    def _report(self, moved: Moved, started: float, planned: bool, failed: bool = False) -> SyncReport:
        written = untouched = ()
        if failed:
            # a model's tensors are assigned only when its first sync completes (a BoxTarget's are its own)
            written = tuple(moved.done) if self._assigned or self.load_plan is None else ()
            untouched = tuple(t for t in self._target_names() if t not in moved.touched)
        return SyncReport(bytes_sent=moved.sent, bytes_received=moved.received, bytes_local=moved.local,
                          seconds=time.perf_counter() - started, plan_digest=self.plan_digest,
                          plan_seconds=self.plan_seconds, planned=planned, written=written,
                          tensors=self._target_count(), version=self.version, untouched=untouched,
                          peers=dict(sorted(moved.peers.items())), quantized_on_wire=moved.quantized)

    def _target_names(self) -> list[str]:
        if self.load_plan is not None:
            return [t.name for t in self.load_plan.targets]
        return list(self._box_dests or ())

    def _target_count(self) -> int:
        return len(self._target_names())
