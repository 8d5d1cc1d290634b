"""What a failed first load most often means, said first in its error: one file of a
checkpoint of several given alone, a model built from another config than the checkpoint's,
a tensor-parallel world that does not split the model (and the worlds that do)."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Callable

from torch import nn

from .errors import LazyLoadError, MappingError, PlanError
from .formats import resolve
from .planner import plan_load
from .remote import is_remote

# Config entries that describe no tensor's shape: never a reason for keys or shapes to differ.
_NOT_SHAPES = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures", "model_type",
               "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings"}


def one_of_several(paths: Any) -> tuple[str, int] | None:
    """(directory, file count) when `paths` is one local .safetensors file of a checkpoint
    of several files in its directory: loaded alone, it fills only that file's tensors."""
    if isinstance(paths, (list, tuple)) or is_remote(paths):
        return None
    path = os.fspath(paths)
    if not os.path.isfile(path) or not path.endswith(".safetensors"):
        return None
    directory = os.path.dirname(os.path.abspath(path))
    count = len(resolve(directory).files)
    return (directory, count) if count > 1 else None


def config_differences(model: nn.Module, config_json: tuple[str, bytes] | None) -> list[str]:
    """'name: model's vs checkpoint's' for the size entries (ints, one level of nested
    configs such as text_config) where the model's config and the checkpoint's config.json differ."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or config_json is None:
        return []
    try:
        stored = json.loads(config_json[1])
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        return []
    return _differences(config.to_dict(), stored, "") if isinstance(stored, dict) else []


def _differences(mine: dict, theirs: dict, prefix: str) -> list[str]:
    found = []
    for key, want in theirs.items():
        have = mine.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            found += _differences(have, want, f"{prefix}{key}.")
        elif (key not in _NOT_SHAPES and type(want) is int and type(have) is int  # noqa: E721 (bools are no sizes)
              and have != want):
            found.append(f"{prefix}{key} {have} (model) vs {want} (checkpoint)")
    return found


def plans(plan: Callable[[int, int], Any], world: int) -> bool:
    """Whether `world` can be planned: its first and last ranks (where uneven splits show)."""
    try:
        plan(0, world)
        plan(world - 1, world)
    except LazyLoadError:
        return False
    return True


def worlds_that_plan(plan: Callable[[int, int], Any], world: int) -> list[int]:
    """The worlds of 1 to max(world, 8), other than `world`, that can be planned."""
    return [w for w in range(1, max(world, 8) + 1) if w != world and plans(plan, w)]


def explain(exc: LazyLoadError, checkpoint: Any, model: nn.Module, world: int, options: Any) -> None:
    """Put what the failed plan most likely means at the front of `exc`'s message (in place:
    the same error, its type and fields kept)."""
    first = ""
    if isinstance(exc, MappingError) and (several := one_of_several(checkpoint.paths)) is not None:
        first = (f"{checkpoint.paths} is one of the {several[1]} files of the checkpoint in {several[0]}: the others "
                 f"hold the rest of the model. Pass the directory, LazyCheckpoint({several[0]!r}).")
    elif (isinstance(exc, MappingError) and "config.json" not in str(exc)  # the layer counts say it already
          and (differ := config_differences(model, checkpoint.config_json()))):
        first = (f"The model's config differs from the checkpoint's config.json: {'; '.join(differ[:6])}. Build "
                 "the model from the checkpoint's config (AutoConfig.from_pretrained(the checkpoint's directory)), "
                 "or use lazyload.load_model.")
    elif isinstance(exc, PlanError) and world > 1 and options.mesh is None:
        alone = replace(options, shards_only=True, max_host_bytes=None)  # the split alone: no group, no budget
        plan = lambda r, w: plan_load(checkpoint, model, r, w, alone, preview=True)  # noqa: E731
        if not plans(plan, world):  # the split itself fails, not how this process runs
            worlds = worlds_that_plan(plan, world)
            exc.args = (f"{exc} Worlds that work (of 1 to {max(world, 8)}): {', '.join(map(str, worlds)) or 'none'}.",
                        *exc.args[1:])
        return
    if first:
        exc.args = (f"{first}\n{exc}", *exc.args[1:])
