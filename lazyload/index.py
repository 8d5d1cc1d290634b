"""Index: every tensor of every checkpoint file, as (file, key, dtype, shape, byte range),
from metadata alone (safetensors headers: `headers.py` parses and checks them).

Each format (`formats/`, one registered module each: safetensors, pre-sharded layouts,
`.bin`/`.pt`, Megatron, DeepSpeed) builds it from its own metadata (`CheckpointIndex.of`).
A tensor stored in pieces (one per source tensor-parallel rank) is one logical name whose
expression concatenates the pieces; the Mapping stage sees names (`names`, `expr`), the
Plan reads stored entries.
"""
from __future__ import annotations

import copy
import re
from collections.abc import Mapping as MappingABC
from types import MappingProxyType
from typing import Any, Collection, Iterable, Iterator, Mapping as MappingT

from .errors import CheckpointError
from .expr import Expr, Source
from .headers import FileIdentity, TensorEntry, entries_of_file

INDEX_JSON = "model.safetensors.index.json"

_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> list:
    """Sort 'layers.10' after 'layers.9' (experts must stack in index order): the digit
    runs (odd places of the split) compare as numbers."""
    parts: list = _DIGITS.split(key)
    parts[1::2] = map(int, parts[1::2])
    return parts


class CheckpointIndex(MappingABC):
    """key -> TensorEntry for every stored tensor of the checkpoint, built from headers only.

    The checkpoint's tensors as a model sees them are `names()`: each stored key, except
    that the pieces of a tensor split across files appear once, as their logical name, whose
    `expr` concatenates them (a `Layout` from `formats/`)."""

    def __init__(self, files: Iterable[str]):
        """The index of local safetensors files (`formats/` opens every other checkpoint)."""
        self._start(files, None)
        for path in self.files:
            entries, data_start, self.identities[path] = entries_of_file(path)
            self.header_bytes_read += data_start
            self._add((entry.key, entry) for entry in entries)

    @classmethod
    def of(cls, files: Iterable[str], entries: Iterable[tuple[str, TensorEntry]], layouts: MappingT[str, Any] | None = None,
           header_bytes_read: int = 0, description: str | None = None,
           identities: MappingT[str, FileIdentity] | None = None) -> "CheckpointIndex":
        """An index a format built: stored entries keyed by their unique key (`entry.key` is
        the name inside its file; pairs (key, entry)), and logical tensors `name -> Layout` over those keys."""
        index = cls.__new__(cls)
        index._start(files, description)
        index.header_bytes_read = header_bytes_read
        index.identities = dict(identities or {})  # files the readers check are unchanged when read
        index._add(entries)
        index._layouts = dict(layouts or {})
        for name, layout in index._layouts.items():
            for key in layout.keys():
                if key not in index._entries:
                    raise CheckpointError(f"{description or name}: logical tensor {name!r} names the piece {key!r}, "
                                          "which no file stores; the checkpoint description and its files disagree.")
                index._owner[key] = name
        index._exprs = {name: layout.expr() for name, layout in index._layouts.items()}
        return index

    def _start(self, files: Iterable[str], index_json: str | None) -> None:
        self.files = list(files)
        self.index_json = index_json
        self.header_bytes_read = 0
        self._entries: dict[str, TensorEntry] = {}
        self.identities: dict[str, FileIdentity] = {}  # path -> the file as indexed
        self._layouts: dict[str, Any] = {}
        self._exprs: dict[str, Expr] = {}
        self._owner: dict[str, str] = {}  # stored key -> the logical name it is a piece of
        self._natural: tuple[Collection[str], list[str]] | None = None  # (left out, natural_names())

    def _add(self, entries: Iterable[tuple[str, TensorEntry]]) -> None:
        for key, entry in entries:
            other = self._entries.get(key)
            if other is not None:
                raise CheckpointError(f"tensor {key!r} is stored twice: in {other.file} and in "
                                      f"{entry.file}; remove one of the files from the checkpoint.")
            self._entries[key] = entry

    def __getitem__(self, key: str) -> TensorEntry:
        return self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:  # a dict lookup, not Mapping's try/except around __getitem__
        return key in self._entries

    def keys(self):  # the dict's own view: fast iteration and membership
        return self._entries.keys()

    def items(self):  # the dict's own view: no lookup per key
        return self._entries.items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries.values())

    def by_key(self) -> MappingT[str, TensorEntry]:
        """key -> entry, read-only, looked up without a method call per key (a plan asks 90k)."""
        return MappingProxyType(self._entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # The checkpoint's tensors as the Mapping stage sees them.

    def names(self) -> list[str]:
        """Every tensor name: stored keys that are whole tensors, and logical names."""
        return [k for k in self._entries if k not in self._owner] + list(self._layouts)

    def natural_names(self, leaving_out: Collection[str] = frozenset()) -> list[str]:
        """`names()` less `leaving_out`, in `natural_key` order; sorted once for the last set
        asked (both mapping passes leave out the same scale siblings, DeepSeek-V3's half of
        its 92k keys: 46k names sort in ~0.1 s)."""
        if self._natural is None or self._natural[0] is not leaving_out:
            names = [n for n in dict.fromkeys(self.names()) if n not in leaving_out]
            self._natural = (leaving_out, sorted(names, key=natural_key))
        return self._natural[1]

    def expr(self, name: str) -> Expr:
        return self._exprs.get(name) or Source(name)

    def shape(self, name: str) -> tuple[int, ...]:
        layout = self._layouts.get(name)
        return layout.shape if layout is not None else self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype tensor `name` is stored in (a logical tensor's: its first piece's)."""
        return self._entries[name].dtype if name in self._entries else self._entries[self.expr(name).first_key()].dtype

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The shape of stored key `key`: what expressions are pushed down with (an
        expression remembers shapes per index: `index.shape_of == index.shape_of`)."""
        return self._entries[key].shape

    def name_of(self, key: str) -> str:
        """The name a stored key belongs to (a piece's logical name, else the key)."""
        return self._owner.get(key, key)

    def files_of(self, name: str) -> list[str]:
        keys = self.expr(name).keys()
        return sorted({self._entries[k].file for k in keys})

    def for_rank(self, rank: int, world: int) -> "CheckpointIndex":
        """This index with each logical tensor's copies (a replicated tensor stored in every
        source rank's file) taken from the file of the source rank nearest to `rank` of
        `world`: at the world a checkpoint was sharded for, each rank reads its own file."""
        if not self._layouts:
            return self
        index = copy.copy(self)
        index._exprs = {name: layout.expr(rank, world) if _has_copies(layout) else self._exprs[name]
                        for name, layout in self._layouts.items()}  # without copies: the same tiling
        return index


def _has_copies(layout) -> bool:
    """Whether a logical tensor has a box stored more than once (where `for_rank` chooses);
    a Megatron split (`Derived`, no parts) is one expression for every rank."""
    parts = getattr(layout, "parts", ())
    return len({part.box for part in parts}) < len(parts)
