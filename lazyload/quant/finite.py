"""Dequantized weights that would not be finite. Finite codes and scales can still multiply
past a dtype's range (an NVFP4 global scale of 1e-40 dividing, a ModelOpt scale_2 of 1e38
multiplying, an E8M0 exponent of 254, a bfloat16 INT4 scale of 3e38 times -8): the weights
would load as inf, or NaN (0 x inf), without a word. Each dequantizer bounds what it can
produce from its scales (cheap: the scales are a fraction of the weight); only a box whose
bound passes the range of a dtype its values go through is checked value by value, before
those values are placed."""
from __future__ import annotations

import torch

from ..errors import CheckpointError


def fits(bound: float, *dtypes: torch.dtype | None) -> bool:
    """Whether magnitudes up to `bound` are finite in float32 (the scratch) and in each of
    `dtypes` (None: none); a NaN bound does not fit."""
    return bound <= min(torch.finfo(d).max for d in (torch.float32, *dtypes) if d is not None)


def refuse_non_finite(values: torch.Tensor, dtypes: tuple[torch.dtype | None, ...], why: str) -> None:
    """Refuse dequantized float32 `values` that are inf or NaN, or become so cast through
    `dtypes` in turn (the roundings on their way to the destination). `why`: the scales
    that give such values, for the message."""
    final = values
    for dtype in dtypes:
        final = final.to(dtype) if dtype is not None else final
    bad = ~torch.isfinite(final)
    if bool(bad.any()):
        dtype = str(final.dtype).removeprefix("torch.")
        raise CheckpointError(f"{why} make {int(bad.sum())} of the weights read with this box inf or NaN in {dtype} "
                              f"(the first at {bad.nonzero()[0].tolist()}); the checkpoint is corrupt, or its weights "
                              f"are too large for {dtype}.")
