"""A checkpoint's quantization_config (from its config.json) read with each field's type
checked: a field of the wrong type is a CheckpointError naming it, never a Python error
(AttributeError, ValueError, ZeroDivisionError) from deep in the detection."""
from __future__ import annotations

from ..errors import CheckpointError, shown
from ..headers import MAX_INT64


def _malformed(field: str, value, want: str) -> CheckpointError:
    return CheckpointError(f"config.json: quantization_config.{field} is {shown(value)}, not {want}; the config is "
                           "malformed. Fix or remove its quantization_config.")


def weight_groups(config: dict) -> list[tuple[str, dict, dict]]:
    """compressed-tensors' `config_groups` that quantize weights: (name, group, its
    `weights`) each, checked to be objects (a null group or null weights declare nothing)."""
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise _malformed("config_groups", groups, "an object of groups")
    out = []
    for name, group in groups.items():
        if group is None:
            continue
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(group, dict) or not isinstance(weights, (dict, type(None))):
            raise _malformed(f"config_groups.{name}", group, "an object whose weights are an object or null")
        if weights:
            out.append((name, group, weights))
    return out


def _is_size(value) -> bool:
    return type(value) is int and 0 < value <= MAX_INT64  # noqa: E721 (a bool is no size)


def positive_int(value, field: str) -> int:
    """A size the config gives (a group size)."""
    if not _is_size(value):
        raise _malformed(field, value, "a positive integer")
    return value


def block_shape(value, field: str) -> tuple[int, int]:
    """A block's (rows, columns) as the config lists them."""
    if not (isinstance(value, list) and len(value) == 2 and all(map(_is_size, value))):
        raise _malformed(field, value, "a list [rows, columns] of positive integers")
    return value[0], value[1]
