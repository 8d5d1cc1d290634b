"""dtype names, as users (and transformers) write them: "bfloat16", "bf16", "torch.float16"."""
from __future__ import annotations

from typing import Any

import torch

from .errors import DtypeError

# torch's dtypes by attribute name ("float32", "float", "bfloat16"): looked up here, never
# by getattr on torch, whose lazy submodules (`torch._inductor`) a name would import.
TORCH_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_SHORT = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16, "fp32": torch.float32,
          "f32": torch.float32, "fp64": torch.float64, "f64": torch.float64}


def dtype_named(value: Any, argument: str = "dtype") -> Any:
    """The torch.dtype a name stands for; "auto", None and torch.dtypes pass as they are."""
    if not isinstance(value, str) or value == "auto":
        return value
    name = value.strip().lower().removeprefix("torch.")
    dtype = _SHORT.get(name, TORCH_DTYPES.get(name))
    if not isinstance(dtype, torch.dtype):
        raise DtypeError(f"{argument}={value!r} is no dtype name; pass 'auto', a torch.dtype, or a name such as "
                         "'bfloat16' ('bf16'), 'float16' ('fp16') or 'float32' ('fp32').")
    return dtype
