"""transformers' published conversion mapping, read as lazyload rules.

transformers >= 5 describes, per model type, how checkpoint keys become model keys
(renames, MergeModulelist, Concatenate, Chunk, Transpose...). Its own matcher is reused for
keys (scopes, prefixes and capture groups behave exactly as in `from_pretrained`); its
operations are translated into lazyload's shape-level ops so that a rank's box can be pushed
down through them.
"""
from __future__ import annotations

from typing import Any

from .rules import CatOp, ChunkOp, StackOp, TransposeOp


class Unsupported:
    """An operation lazyload cannot express; the error is raised only if it is used."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _translate(op: Any):
    name = type(op).__name__
    if name == "MergeModulelist":
        return StackOp(op.dim)
    if name == "Concatenate":
        return CatOp(op.dim)
    if name == "Chunk":
        return ChunkOp(op.dim)
    if name == "Transpose" and not getattr(op, "check_dims", False):
        return TransposeOp(op.dim0, op.dim1)
    return Unsupported(repr(op))


class HFRename:
    def __init__(self, transform: Any):
        self.transform = transform

    def apply(self, key: str) -> str:
        return self.transform.rename_source_key(key)[0]

    def __repr__(self) -> str:
        return repr(self.transform)


class HFConvert:
    def __init__(self, transform: Any):
        self.transform = transform
        self.sources = tuple(transform.source_patterns)
        self.targets = tuple(transform.target_patterns)
        self.ops = tuple(_translate(op) for op in transform.operations)

    def match(self, key: str) -> tuple[str, int] | None:
        renamed, pattern = self.transform.rename_source_key(key)
        if pattern is None:
            return None
        return renamed, self.sources.index(pattern)

    def __repr__(self) -> str:
        return repr(self.transform)


def hf_rules(model: Any) -> tuple[list[HFRename], list[HFConvert]] | None:
    """The model's own conversion rules, or None when it is no transformers model."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    renames = [HFRename(t) for t in transforms if not isinstance(t, WeightConverter)]
    converts = [HFConvert(t) for t in transforms if isinstance(t, WeightConverter)]
    return renames, converts
