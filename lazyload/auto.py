"""`load_model`: the common case in one line: build a transformers model from the
checkpoint's `config.json` on the meta device and load this rank's share into it."""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .checkpoint import LazyCheckpoint
from .dtypes import dtype_named
from .errors import ArgumentError, CheckpointError
from .keywords import check_keywords, keywords_of
from .report import LoadReport
from .stored import transformers_config


def load_model(path: str | os.PathLike, rank: int = 0, world: int = 1, *, dtype: torch.dtype | str | None = "auto",
               device: str | torch.device | None = None, model_class: type | str | None = None,
               config: Any = None, model_kwargs: dict | None = None,
               **load_kwargs: Any) -> tuple[nn.Module, LoadReport]:
    """Build the model a checkpoint directory describes and load it; returns (model, report).

    - `path`: a checkpoint directory holding `config.json` (or pass `config=`), or a URL
      (`s3://`, `https://`, `hf://`) whose store holds it beside the files.
    - `dtype`: "auto" (default) keeps the dtype `config.json` records, else the checkpoint's
      floating dtype; a `torch.dtype` or its name ("bfloat16", "bf16", "float16") casts; None builds in torch's default dtype (float32),
      as `from_pretrained` does without `dtype`.
    - `model_class`: a transformers class (or its name); default the first of the config's
      `architectures`, else `AutoModelForCausalLM`, else `AutoModel`.
    - `model_kwargs`: passed to the class's `_from_config` (e.g. `attn_implementation`).
    - `rank`, `world`, `device` and every other keyword go to `LazyCheckpoint.load_into`.
    """
    _check_keywords(load_kwargs)
    dtype = dtype_named(dtype)
    ckpt = LazyCheckpoint(path)
    if config is None:
        config = _checkpoint_config(path, ckpt)
    cls = _model_class(config, model_class)
    build_dtype = _build_dtype(dtype, config, ckpt)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=build_dtype, **(model_kwargs or {}))
    model.eval()
    report = ckpt.load_into(model, rank, world, device=device, **load_kwargs)
    return model, report


_NO_CONFIG = ("{}: no config.json to build the model from; pass config= (a transformers config), or build the "
              "model yourself and call LazyCheckpoint(path).load_into(model).")


def _checkpoint_config(path: str | os.PathLike, ckpt: LazyCheckpoint) -> Any:
    """The transformers config of the config.json beside the checkpoint's files (for a URL,
    the one its store holds, fetched while indexing): the one `lazyload plan` and the writer read."""
    if ckpt.config_json() is None:
        raise CheckpointError(_NO_CONFIG.format(path))
    return transformers_config(ckpt)


def _check_keywords(load_kwargs: dict) -> None:
    """A keyword neither load_model nor load_into takes, refused before the model is built."""
    passed_on = keywords_of(LazyCheckpoint.load_into)
    check_keywords("load_model", {k: v for k, v in load_kwargs.items() if k not in passed_on}, load_model,
                   LazyCheckpoint.load_into)


def _model_class(config: Any, model_class: type | str | None) -> type:
    import transformers

    if model_class is None:
        for name in getattr(config, "architectures", None) or []:
            if hasattr(transformers, name):
                return getattr(transformers, name)
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            if type(config) in auto._model_mapping:
                return auto._model_mapping[type(config)]
        raise CheckpointError(f"no transformers class for {type(config).__name__}; pass model_class=.")
    if isinstance(model_class, str):
        if not hasattr(transformers, model_class):
            raise CheckpointError(f"transformers has no class {model_class!r}; pass the class itself or its exact "
                                  "name (e.g. 'LlamaForCausalLM').")
        return getattr(transformers, model_class)
    return model_class


def _build_dtype(dtype: torch.dtype | str | None, config: Any, ckpt: LazyCheckpoint) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        raise ArgumentError(f"dtype must be 'auto', None, a torch.dtype or its name ('bfloat16'), got {dtype!r}.")
    recorded = getattr(config, "dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    if isinstance(recorded, torch.dtype):
        return recorded
    stored = [e.dtype for e in ckpt.index.entries() if e.dtype.is_floating_point and e.dtype.itemsize > 1]
    return stored[0] if stored else torch.get_default_dtype()
