"""A plan as data: every field of a `LoadPlan` (and its cooperative share) as JSON, and
digests of it that replicas compare before any byte moves (`agreement.py`).

The encoding is generic: a dataclass or named tuple becomes an object of its fields, a
dtype or device its name, a tensor its shape and dtype (never its values), a container a
list or object, and anything else (a module, an index, a process group, a callable) its
type's or its own qualified name. A field added to `LoadPlan` is thus in the JSON and the
digest without being named here. What describes this process or host rather than the load
(`LOCAL`: the device index, file paths and offsets, the reader, the options object itself)
is left out of the digests, so that replicas on other hosts digest the same plan alike;
`lazyload plan --json` prints it all."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Callable

import torch

from .gcpause import no_cycle_collection

# class name -> fields that describe this process or host, not what the load does
LOCAL = {
    "LoadPlan": frozenset({"device", "remote", "mapped", "options", "reader", "release_pages", "views"}),
    "TensorEntry": frozenset({"file", "start", "end"}),  # a copy of the file elsewhere is the same tensor
    "Circle": frozenset({"group", "me"}),  # this rank's process group and index in it
}


class _Encoder:
    """One encoding pass: objects met again (the items of `groups`, shared entries) are
    encoded once; each type's encoding is chosen once (plans hold 100k+ small objects);
    `portable`: without the `LOCAL` fields."""

    def __init__(self, portable: bool):
        self.portable = portable
        self.memo: dict[int, Any] = {}
        self.handlers: dict[type, Callable[[Any], Any]] = {}

    def data(self, value: Any) -> Any:
        kind = type(value)
        handler = self.handlers.get(kind)
        if handler is None:
            handler = self.handlers[kind] = self._handler(kind)
        return handler(value)

    def _handler(self, kind: type) -> Callable[[Any], Any]:
        if kind is type(None) or issubclass(kind, (bool, int, str)):
            return _same
        if issubclass(kind, float):
            return lambda v: v if math.isfinite(v) else repr(v)
        if issubclass(kind, (torch.dtype, torch.device)):
            return lambda v: str(v).removeprefix("torch.")
        if issubclass(kind, torch.Tensor):
            return lambda v: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        if issubclass(kind, dict):
            return lambda v: {k if isinstance(k, str) else json.dumps(self.data(k)): self.data(x) for k, x in v.items()}
        if issubclass(kind, (set, frozenset)):
            return lambda v: sorted((self.data(x) for x in v), key=json.dumps)
        names = self._field_names(kind)
        if names is not None:
            return lambda v: self._object(v, names)
        if issubclass(kind, (list, tuple)):  # boxes: tuples of ints, as they are
            return lambda v: v if all(type(x) is int for x in v) else [self.data(x) for x in v]
        return _name_of

    def _object(self, value: Any, names: tuple[str, ...]) -> dict[str, Any]:
        key = id(value)
        if key not in self.memo:
            self.memo[key] = {name: self.data(getattr(value, name)) for name in names}
        return self.memo[key]

    def _field_names(self, kind: type) -> tuple[str, ...] | None:
        """A dataclass's or named tuple's fields (less the local ones when portable), else None."""
        if dataclasses.is_dataclass(kind):
            names = tuple(f.name for f in dataclasses.fields(kind))
        elif issubclass(kind, tuple) and hasattr(kind, "_fields"):
            names = tuple(kind._fields)
        else:
            return None
        local = LOCAL.get(kind.__name__, frozenset()) if self.portable else frozenset()
        return tuple(n for n in names if n not in local)


def _same(value: Any) -> Any:
    return value


def _name_of(value: Any) -> str:
    """What stands for an object that is not data: a function's or class's qualified name,
    a device mesh's shape and dim names, else its type's name (no address: it differs per process)."""
    if hasattr(value, "mesh_dim_names") and hasattr(value, "mesh"):
        return f"DeviceMesh{tuple(value.mesh.shape)}{tuple(value.mesh_dim_names or ())}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return type(value).__qualname__


def plan_fields(plan: Any, portable: bool = False) -> dict[str, Any]:
    """Every field of `plan` as JSON data, then its cooperative `share` (None when the
    replicas do not split their reads); `portable`: without the `LOCAL` fields."""
    encoder = _Encoder(portable)
    local = LOCAL["LoadPlan"] if portable else frozenset()
    with no_cycle_collection():  # many small objects, no cycles (see gcpause.py)
        out = {f.name: encoder.data(getattr(plan, f.name)) for f in dataclasses.fields(plan) if f.name not in local}
        out["share"] = encoder.data(getattr(plan, "share", None))
    return out


def _hash(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def field_digests(plan: Any) -> dict[str, str]:
    """field -> digest of its portable data, in the plan's field order (`share` last).
    json's C encoder walks the plan, calling back only for objects it does not know (100k+
    read items: a digest at every cooperative load); a field it cannot encode so (a dict
    keyed by tuples) goes through the generic encoder."""
    names = [f.name for f in dataclasses.fields(plan) if f.name not in LOCAL["LoadPlan"]] + ["share"]
    fields: dict[type, tuple[str, ...] | None] = {}
    seen: dict[int, str] = {}  # objects met again (the items of `groups`) stand as the order they were met in
    digests = {}
    with no_cycle_collection():
        for name in names:
            value = getattr(plan, name, None)
            try:
                text = json.dumps(value, default=lambda v: _portable(v, fields, seen), sort_keys=True,
                                  separators=(",", ":"), ensure_ascii=False)
            except TypeError:
                text = json.dumps(_Encoder(True).data(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            digests[name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return digests


def _portable(value: Any, fields: dict[type, tuple[str, ...] | None], seen: dict[int, str]) -> Any:
    """`json.dumps`'s fallback for the digests: what `_Encoder(portable=True)` makes of an
    object json does not know (named tuples are json's lists there); a dataclass met before
    as a reference to when (json walks the plan in the same order on every rank)."""
    kind = type(value)
    if kind not in fields:
        fields[kind] = _Encoder(True)._field_names(kind)
    if fields[kind] is not None:
        if id(value) in seen:
            return seen[id(value)]
        seen[id(value)] = f"@{len(seen)}"
        return {name: getattr(value, name) for name in fields[kind]}
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return _Encoder(True).data(value)


def plan_digest(plan: Any) -> str:
    """The plan's digest: equal on every rank that plans the same load (replicas of one
    shard), whichever host it runs on."""
    return _hash(field_digests(plan))


def plan_data(plan: Any) -> dict[str, Any]:
    """The whole plan as JSON data (`lazyload plan --json`): its digest, then every field."""
    return {"digest": plan_digest(plan), **plan_fields(plan)}


def plan_json(plan: Any, indent: int | None = None) -> str:
    return json.dumps(plan_data(plan), indent=indent, ensure_ascii=False)


def header_digest(index: Any) -> str:
    """The digest of the checkpoint as this rank's index describes it: every stored tensor's
    key, dtype and shape (not where the files are)."""
    digest = hashlib.sha256()
    with no_cycle_collection():
        for key, dtype, shape in sorted((e.key, e.dtype, e.shape) for e in index.entries()):
            digest.update(f"{key}\0{dtype}\0{shape}\n".encode())
    return digest.hexdigest()[:16]


def message_bytes(plan: Any) -> dict[str, int]:
    """target -> the bytes its destination holds, as the plan says (8-bit data and float32
    scales for a target quantized on load): what replicas send and receive for it."""
    from .quant.onload import scale_shape

    sizes = {}
    for target in plan.targets:
        nbytes = math.prod(target.local_shape) * target.dtype.itemsize
        grid = plan.quantized.get(target.name)
        if grid is not None:
            nbytes += math.prod(scale_shape(target.local_shape, grid.group, grid.axis, grid.rows)) * 4
        sizes[target.name] = nbytes
    return sizes


def check_messages(sizes: dict[str, int], dests: dict[str, Any]) -> None:
    """Every destination a replica sends or receives holds the bytes the plan says (`sizes`,
    from `message_bytes`): replicas agreed on their plans, so equal sizes on both ends mean
    equal messages on the wire (a broadcast does not tell a short message from a full one)."""
    from .errors import ExchangeError

    for name, expected in sizes.items():
        held = sum(t.nbytes for t in dests[name].tensors(name).values()) if name in dests else None
        if held != expected:
            raise ExchangeError(f"{name}: its destination holds {held} bytes where the plan says {expected}: "
                                "the replicas would exchange messages of other sizes (a lazyload bug: please report "
                                "it).")


def load_facts(plan: Any) -> list[tuple[str, str, Any]]:
    """What the ranks of a torch.distributed load compare at "planned" (`agreement.py`):
    (field, group, value), group "" for every rank of the load, "tp rank N" for the replicas
    of shard N (a mesh's ranks with the same `tp` coordinate), which, when they exchange what
    they read, must plan the same load of the same checkpoint: its header digest, then each
    plan field's digest."""
    mesh, share = plan.options.mesh, getattr(plan, "share", None)
    facts = [("mesh shape", "", [plan.world] if mesh is None else list(mesh.mesh.shape)),
             ("mesh dims", "", [] if mesh is None else list(mesh.mesh_dim_names or ())),
             ("cooperative", "", plan.options.cooperating), ("exchange", "", share is not None)]
    if share is None:
        return facts  # no exchange: replicas (FSDP shards over "dp", say) may load otherwise
    replicated = sorted(share.replicated_names)  # targets every rank holds whole: split over the whole mesh
    facts.append(("share of replicated targets", "", _hash([list(map(list, share.replicated)),
                                                            [(n, share.readers[n], share.sizes[n]) for n in replicated]])))
    group = f"tp rank {plan.rank}"
    facts.append(("checkpoint", group, header_digest(plan.index)))
    return facts + [(f"plan.{field}", group, digest) for field, digest in field_digests(plan).items()]
