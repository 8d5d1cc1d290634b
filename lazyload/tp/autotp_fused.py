"""DeepSpeed AutoTP's fused layers: the rows of the checkpoint tensor each rank holds.

AutoTP (0.19, `deepspeed/module_inject/`) cuts a fused column-parallel layer per part, so a
rank's local rows are not one range of the checkpoint tensor but its piece of each part, laid
side by side (`layers.py` `SubParamColumnParallel`, `fusedqkv_utils.prepare_tp_fused_qkvw`):

- `GateUpPack_LinearLayer` (a layer named `gate_up_proj`: Phi-3, GLM-4): [gate; up] halves,
  each cut by the MLP grain rule; a rank holds its gate rows, then its up rows.
- `fused_LinearLayer` (`qkv_proj`, `query_key_value`, `attn.Wqkv`, `self_attn.W_pack`,
  `c_attn`), by the decoder layer's class (DeepSpeed's `FUSED_QKV_TYPE_DICT`, the longest
  class name found in the layer's repr; none: "bloomtype"):
  - bloomtype (Bloom, Falcon, GPT-NeoX): one range, by KV heads;
  - phi3type: q, k and v each by KV heads (head_dim = in_features // attention heads);
  - glmtype / qwentype: three equal parts (with 2 KV heads: q of n_embd rows, then k and v
    halving the rest), each by KV heads;
  - bigcodetype (GPT-BigCode): the q rows (n_embd) cut, the k/v rows whole on every rank;
  - codegentype: blocks permuted before the cut (`codegen_block_layout`): equal blocks.

Each rank's rows become an explicit box: one run per piece, read where it lies."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import PlanError
from ..plan import Placement
from .autotp import shard_sizes

# DeepSpeed's FUSED_QKV_TYPE_DICT (fusedqkv_utils.py): a decoder layer class -> its qkv layout.
FUSED_QKV_TYPES = {"CodeGenBlock": "codegentype", "BloomBlock": "bloomtype", "GLMBlock": "glmtype",
                   "MPTBlock": "glmtype", "MptBlock": "glmtype", "BaichuanLayer": "glmtype", "QWenBlock": "qwentype",
                   "FalconDecoderLayer": "bloomtype", "GPTBigCodeBlock": "bigcodetype", "DecoderLayer": "glmtype",
                   "Phi3DecoderLayer": "phi3type"}
CODEGEN_MP_NUM = 4  # transformers' CodeGen packs its qkv in 4 blocks (modeling_codegen.py)
Runs = list[tuple[int, int]]


def fused_kind(module: nn.Module) -> str | None:
    """"gate_up", a qkv layout name, or None: which fused layer of AutoTP `module` is (by
    DeepSpeed's class names: lazyload does not import DeepSpeed)."""
    kind = type(module).__name__
    if kind == "GateUpPack_LinearLayer":
        return "gate_up"
    if kind != "fused_LinearLayer":
        return None
    layer = str(module.fused_module.fused_module)  # the decoder layer, through DeepSpeed's wrapper
    matches = [k for k in FUSED_QKV_TYPES if k in layer]
    return FUSED_QKV_TYPES[max(matches, key=len)] if matches else "bloomtype"


def _pieces(parts: list[int], world: int, name: str, kv_heads: int | None, grain: int) -> list[Runs] | None:
    """Each rank's piece of every part (consecutive parts of the given sizes), in part order;
    None where a part's shares do not tile it (DeepSpeed's get_shard_size_list refuses it)."""
    runs: list[Runs] = [[] for _ in range(world)]
    start = 0
    for size in parts:
        sizes = shard_sizes(size, world, name, kv_heads, grain)
        if sum(sizes) != size:
            return None
        for rank, width in enumerate(sizes):
            runs[rank].append((start, start + width))
            start += width
    return runs


def _codegen_runs(rows: int, world: int, kv_heads: int | None) -> list[Runs] | None:
    """DeepSpeed's `codegen_block_layout`: each rank's equal blocks, in its local order."""
    divisor = 3 * CODEGEN_MP_NUM * world
    if kv_heads is None or kv_heads % (world * CODEGEN_MP_NUM) or not rows or rows % divisor:
        return None
    block, third = rows // divisor, rows // (3 * CODEGEN_MP_NUM)
    runs: list[Runs] = []
    for rank in range(world):
        mine = []
        for entry in range(CODEGEN_MP_NUM):
            mp_block, within = divmod(rank * CODEGEN_MP_NUM + entry, world)
            for part in range(3):
                start = (mp_block * 3 + part) * third + within * block
                mine.append((start, start + block))
        runs.append(mine)
    return runs


def fused_rows(kind: str, rows: int, in_features: int, world: int, meta: Any) -> list[Runs] | None:
    """Every rank's row runs of a fused layer of `rows` x `in_features`, as AutoTP cuts it;
    None where DeepSpeed refuses the cut. `meta`: DeepSpeed's AutoTPMeta (num_kv_heads,
    num_attention_heads, n_embd, tp_grain_size)."""
    kv, heads, n_embd, grain = meta.num_kv_heads, meta.num_attention_heads, meta.n_embd, meta.tp_grain_size
    glm_by_n_embd = kind in ("glmtype", "qwentype") and kv == 2
    if (kind == "phi3type" and not (kv and heads)) or ((kind == "bigcodetype" or glm_by_n_embd) and not n_embd):
        return None  # DeepSpeed fails on these without the config's head counts or hidden size
    if kind == "gate_up":
        return _pieces([rows // 2, rows // 2], world, "mlp", kv, grain)
    if kind == "phi3type":
        kv_rows = kv * (in_features // heads)
        return _pieces([rows - 2 * kv_rows, kv_rows, kv_rows], world, "", kv, grain)
    if kind in ("glmtype", "qwentype"):
        parts = [n_embd] + [(rows - n_embd) // 2] * 2 if glm_by_n_embd else [rows // 3] * 3
        return _pieces(parts, world, "", kv, grain)
    if kind == "bigcodetype":
        q_rows = _pieces([n_embd], world, "", kv, grain)
        return q_rows and [mine + [(n_embd, rows)] for mine in q_rows]
    if kind == "codegentype":
        return _codegen_runs(rows, world, kv)
    return _pieces([rows], world, "", kv, grain)  # bloomtype


def fused_placement(name: str, module: nn.Module, kind: str, dim: int, ckpt_shape: tuple[int, ...],
                    model_shape: tuple[int, ...], rank: int, world: int) -> Placement:
    """This rank's box of a tensor of AutoTP's fused layer `module` of `kind` (`fused_kind`;
    weight or bias, rows cut); a PlanError, before any byte is read, where the model's local
    shape is not AutoTP's cut."""
    in_features = module.weight.shape[1]  # a column-parallel layer keeps its inputs whole
    runs = fused_rows(kind, ckpt_shape[0], in_features, world, module.tp_meta) if dim == 0 else None
    ok = runs is not None and sum(b - a for a, b in runs[rank]) == model_shape[0] and all(
        0 <= a <= b <= ckpt_shape[0] for a, b in runs[rank])
    if not ok:
        raise PlanError(f"{name}: DeepSpeed AutoTP's fused layer ({kind}) holds {list(model_shape)} on rank {rank} "
                        f"of {world}, which is not the cut DeepSpeed 0.19 makes of the checkpoint's "
                        f"{list(ckpt_shape)}; build the model with the checkpoint's config and the same tp_size, or "
                        "load it with DeepSpeed's own checkpoint= loader.")
    spans = (tuple(runs[rank]),) + tuple(((0, n),) for n in ckpt_shape[1:])
    return Placement("box", spans=spans)
