"""Live weight sync: a load whose source is other ranks' memory (`WeightSync`).

    layout (each source rank's boxes; a mesh's as strided rules) -> index (a checkpoint of those boxes,
    a target's expanded only where it reads) -> plan_load on the target
    -> copies (which holder of a replicated box sends it) -> routes (per source/target pair, per step)
    -> transfer (point-to-point, every sync; boxes of a quantized target quantized before sending: wire)

The target's side is planned by the same planner as `load_into` (mapping rules, TP plan,
`quantize=`); only its index comes from the source ranks' tensors instead of file headers."""
from __future__ import annotations

from .weight_sync import SyncReport, WeightSync

__all__ = ["SyncReport", "WeightSync"]
