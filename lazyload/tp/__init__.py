"""Tensor parallel: where each tensor's split comes from, and making a model runnable split.

One module per job, in dependency order (each imports only those above it):
`autotp` (DeepSpeed AutoTP's shard sizes), `autotp_fused` (its fused qkv and gate_up cuts), `styles` (transformers' style names and plans),
`heads` (attention heads and KV groups), `structural` (the structural rule for models
without a plan), `placements` (each target's Placement for a rank, validated before any
byte is read), `parallel_plan` (the `ParallelPlan`: how a load makes the model runnable
split, planned with its checks before the model changes) and `runnable` (`make_runnable`
carries a ParallelPlan out: DTensor styles, local sizes, head bookkeeping, hooks;
`parallelize` plans and carries it out in one call).
The projection name tables the formats share live below both, in `lazyload.names`."""
from .runnable import parallelize

__all__ = ["parallelize"]
