"""Conversion rules: how checkpoint keys become model keys, in lazyload's own vocabulary.

A rule either renames keys (`Rename`) or gathers several checkpoint tensors into one or
more model tensors (`Convert`, with the ops Stack, Cat, Chunk, Transpose). The same rules
come from transformers' published conversion mapping when it is installed (see
`hf_rules`), and from the small built-in table below when it is not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence


@dataclass(frozen=True)
class DimOp:
    """An operation along one dim; the subclasses say which."""
    dim: int = 0


class StackOp(DimOp):
    """Stack the tensors matched by each source pattern (sorted by their index)."""


class CatOp(DimOp):
    """Concatenate the results of all source patterns, in the rule's order."""


class ChunkOp(DimOp):
    """Split the one result into as many equal chunks as the rule has targets."""


@dataclass(frozen=True)
class TransposeOp:
    dim0: int = 0
    dim1: int = 1


Op = StackOp | CatOp | ChunkOp | TransposeOp


def _compile(pattern: str) -> re.Pattern:
    # transformers' convention: "*." stands for one module index such as "3."; a
    # pattern ending in a name character must end on a name boundary.
    regex = pattern.replace(".", r"\.").replace(r"*\.", r"\d+\.")
    if re.search(r"[A-Za-z0-9]$", regex):
        regex += r"(?!\w)"
    return re.compile(regex)


@dataclass(frozen=True)
class Rename:
    """Replace the first match of `pattern` (a regex) in a checkpoint key by `replacement`."""

    pattern: str
    replacement: str

    def apply(self, key: str) -> str:
        return re.sub(self.pattern, self.replacement, key, count=1)


@dataclass(frozen=True)
class Convert:
    """Gather the checkpoint tensors matching `sources` into the model tensors `targets`.

    A matching key has the matched source pattern replaced by targets[0]; the result (with
    the other targets substituted likewise) names the model tensors produced by `ops`."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    ops: tuple[Op, ...]
    _compiled: tuple[re.Pattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_compiled", tuple(_compile(s) for s in self.sources))

    def match(self, key: str) -> tuple[str, int] | None:
        """(renamed key, index of the matching source pattern), or None."""
        for i, regex in enumerate(self._compiled):
            m = regex.search(key)
            if m:
                return key[:m.start()] + self.targets[0] + key[m.end():], i
        return None


def rules_from(items: Sequence[Rename | Convert]) -> tuple[list[Rename], list[Convert]]:
    return [r for r in items if isinstance(r, Rename)], [c for c in items if isinstance(c, Convert)]


# Used only when transformers is not installed; with it, the model's own mapping wins.
BUILTIN_RULES: dict[str, list[Rename | Convert]] = {
    "mixtral": [
        Rename(r"\.block_sparse_moe\.", ".mlp."),
        Convert((".experts.*.w1.weight", ".experts.*.w3.weight"), (".experts.gate_up_proj",),
                (StackOp(0), CatOp(1))),
        Convert((".experts.*.w2.weight",), (".experts.down_proj",), (StackOp(0),)),
    ],
    "qwen2_moe": [
        Convert(("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"),
                ("mlp.experts.gate_up_proj",), (StackOp(0), CatOp(1))),
        Convert(("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",), (StackOp(0),)),
    ],
}
for _alias in ("qwen3_moe", "olmoe", "deepseek_v3"):
    BUILTIN_RULES[_alias] = BUILTIN_RULES["qwen2_moe"]
