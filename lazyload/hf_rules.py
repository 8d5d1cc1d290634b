"""transformers' published conversion mapping, read as lazyload rules.

transformers >= 5 describes, per model type, how checkpoint keys become model keys
(renames, MergeModulelist, Concatenate, Chunk, Transpose...). Its own matcher is reused for
keys (scopes, prefixes and capture groups behave exactly as in `from_pretrained`); its
operations are translated into lazyload's shape-level ops so that a rank's box can be pushed
down through them. A conversion with any other operation is run as transformers runs it
(`HFConvert.run`), on the whole source tensors (`expr.Whole`).
"""
from __future__ import annotations

import copy
from typing import Any

from .quant.fp8_modules import fp8_quantizer
from .rules import CatOp, ChunkOp, StackOp, TransposeOp


class Unsupported:
    """An operation lazyload cannot push a box through: its conversion runs whole."""

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
        compiled = getattr(transform, "compiled_sources", None)
        self.search = compiled.search if compiled is not None and hasattr(transform, "scope_prefix") else None

    def apply(self, key: str) -> str:
        # Most keys match no rename (DeepSeek-V3: 46k keys, 5 renames): an unscoped rename's own
        # regex says so first, as rename_source_key would, without its layers of calls.
        if self.search is not None and self.transform.scope_prefix is None and self.search(key) is None:
            return key
        return self.transform.rename_source_key(key)[0]

    def __repr__(self) -> str:
        return repr(self.transform)


class HFConvert:
    def __init__(self, transform: Any, model: Any):
        self.transform = transform
        self.model = model
        self.sources = tuple(transform.source_patterns)
        self.targets = tuple(transform.target_patterns)
        self.ops = tuple(_translate(op) for op in transform.operations)

    def match(self, key: str) -> tuple[str, int] | None:
        renamed, pattern = self.transform.rename_source_key(key)
        if pattern is None:
            return None
        return renamed, self.sources.index(pattern)

    def run(self, layer_name: str, tensors: list[tuple[int, Any]]) -> dict[str, Any]:
        """transformers' own conversion of `tensors` ((source pattern index, tensor), in the
        order from_pretrained collects them) for the target `layer_name`, the first target's
        model name: {model name: tensor} of every output, as from_pretrained computes them."""
        converter = copy.deepcopy(self.transform)  # holds the tensors it converts: one per call
        for index, tensor in tensors:
            converter.add_tensor(layer_name, layer_name, self.sources[index], lambda t=tensor: t)
        out = converter.convert(layer_name, model=self.model, config=getattr(self.model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}

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
    transforms = get_model_conversion_mapping(model, hf_quantizer=fp8_quantizer(model))
    renames = [HFRename(t) for t in transforms if not isinstance(t, WeightConverter)]
    converts = [HFConvert(t, model) for t in transforms if isinstance(t, WeightConverter)]
    return renames, converts
