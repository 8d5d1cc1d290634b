"""The structural rule: how a model without a transformers TP plan (plain nn.Module, GPT-2)
is split, by the names of its Linear / Conv1D layers (`lazyload.names`): input projections
column-parallel, output projections row-parallel, fused ones packed; a block is split only
where its forward can run split (`paired_structural`), else it stays whole."""
from __future__ import annotations

from torch import nn

from ..names import COLWISE_NAMES, KV_NAMES, PACKED_NAMES, Q_NAMES, ROWWISE_NAMES
from ..plan import Placement
from .heads import attention_shape

# `dense` layers by their parent's name: BERT's intermediate/output, CTRL's attention output
BERT_DENSE = {"intermediate": "colwise", "output": "rowwise", "multi_head_attention": "rowwise"}
BERT_BLOCKS = {"self", "intermediate", "output", "w_in"}  # a parent one level below its block (w_in: CPM-Ant)
# Attention whose forward takes its width from outside the module, so it cannot run on a
# rank's heads: the structural rule keeps these whole. BigBird swaps in an attention built
# from the config for inputs too short for block-sparse; TrOCR reshapes its output to its
# input's width.
WHOLE_ATTENTION = {"BigBirdSelfAttention", "BigBirdBlockSparseAttention", "TrOCRAttention"}


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")  # transformers' GPT-2 layer: weight [in, out]


def structural_style(module: nn.Module, module_name: str, attr: str) -> tuple[str | None, int]:
    """(style, packed parts) for a parameter by its module's name: input projections
    colwise, output projections rowwise; anything else (routers, norms, embeddings) None."""
    if not (isinstance(module, nn.Linear) or is_conv1d(module)) or attr not in ("weight", "bias"):
        return None, 1
    parent, _, last = module_name.rpartition(".")
    if last in PACKED_NAMES:
        return "packed", PACKED_NAMES[last]
    if last in COLWISE_NAMES:
        return "colwise", 1
    if last in ROWWISE_NAMES:
        return "rowwise", 1
    if last == "dense":  # BERT's layout: intermediate.dense feeds output.dense; attention.self feeds attention.output.dense
        return BERT_DENSE.get(parent.rpartition(".")[2]), 1
    return None, 1


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or Conv1D layer (Conv1D stores its weight [in, out])."""
    rows, cols = module.weight.shape
    return (rows, cols) if is_conv1d(module) else (cols, rows)


def _block_of(module_name: str) -> str:
    """The module whose colwise layers feed its rowwise ones: a projection's parent, or for
    BERT's layout (`attention.self.query` -> `attention.output.dense`, `intermediate.dense` ->
    `output.dense`) its grandparent."""
    parent = module_name.rpartition(".")[0]
    owner, _, parent_last = parent.rpartition(".")
    return owner if parent_last in BERT_BLOCKS else parent


def paired_structural(model: nn.Module, structural: dict[str, tuple[Placement, str]]) -> dict[str, Placement]:
    """The structural rule's placements that a forward can run: in each block, colwise
    layers must feed a rowwise one (that sums their partial products back) and a rowwise layer
    must be fed by colwise ones; an attention block must split into whole heads on equal q/k/v
    parts (`attention_split`). A block that fails stays replicated, whole: its math is then
    the world=1 math (Mamba's in_proj/out_proj, MPT's unsharded Wqkv, GPTBigCode's
    multi-query c_attn)."""
    blocks: dict[str, dict[str, set]] = {}
    for name, (_, style) in structural.items():
        module_name = name.rpartition(".")[0]
        side = "row" if style == "rowwise" else "col"
        blocks.setdefault(_block_of(module_name), {"col": set(), "row": set()})[side].add(module_name)
    keep, fused = set(), set()
    for block in blocks.values():
        if block["col"] and block["row"] and all(attention_split(model, m) and not _full_width_sibling(model, m)
                                                 and not _in_whole_attention(model, m) for m in block["col"]):
            widths = _mlp_widths(model, block)
            if widths is None:
                keep |= block["col"] | block["row"]
            elif list(widths.values()) == [2]:  # one colwise layer twice as wide: gate|up fused
                keep |= block["col"] | block["row"]
                fused |= set(widths)
    out = {}
    for name, (placement, _) in structural.items():
        module_name = name.rpartition(".")[0]
        if module_name in fused and placement.kind == "shard":
            placement = Placement("packed", placement.dim, parts=2)
        if module_name in keep:
            out[name] = placement
    return out


def _in_whole_attention(model: nn.Module, module_name: str) -> bool:
    return type(model.get_submodule(module_name.rpartition(".")[0])).__name__ in WHOLE_ATTENTION


def _mlp_widths(model: nn.Module, block: dict[str, set]) -> dict[str, int] | None:
    """An MLP block's colwise layers whose output is not as wide as its rowwise layer's
    input, with their width in units of that input (Moshi's fc1: gate and up fused, twice
    fc2's input: 2); None when all match, or for an attention block (q/k/v widths differ
    by design)."""
    attention_names = Q_NAMES | KV_NAMES | PACKED_NAMES.keys()
    if any(m.rpartition(".")[2] in attention_names for m in block["col"]):
        return None
    inputs = {features(model.get_submodule(m))[0] for m in block["row"]}
    if len(inputs) != 1:
        return {m: 0 for m in block["col"]}  # nothing consistent to split: kept whole
    (row_in,) = inputs
    outputs = {m: features(model.get_submodule(m))[1] for m in block["col"]}
    odd = {m: out / row_in for m, out in outputs.items() if out != row_in}
    return odd or None


def _full_width_sibling(model: nn.Module, module_name: str) -> bool:
    """A colwise projection beside a module holding a tensor as wide as its full output
    (BitNet's attn_sub_norm / ffn_sub_norm: a norm over the whole width between the colwise
    and the rowwise layer), which a rank holding part of that width cannot compute. Where the
    output is as wide as the input, a decoder layer's own norms (OPT's fc1/fc2 beside
    final_layer_norm: a parent that also holds a block of projections) are the residual
    stream's, not the colwise output's."""
    parent_name, _, last = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    projection = getattr(parent, last)
    in_width, width = features(projection)
    width //= PACKED_NAMES.get(last, 1)
    others = {name: child for name, child in parent.named_children()
              if structural_style(child, f"{parent_name}.{name}", "weight")[0] is None}
    if width == in_width and any(structural_style(m, n, "weight")[0] for child in others.values()
                                 for n, m in child.named_modules()):
        return False
    return any(width in p.shape for child in others.values() for p in child.parameters())


def attention_split(model: nn.Module, module_name: str) -> bool:
    """False for a fused q/k/v projection whose parts are not the three equal ones a packed
    split assumes (GPTBigCode's multi-query c_attn: q heads, then one k and one v head)."""
    last = module_name.rpartition(".")[2]
    if PACKED_NAMES.get(last) != 3:
        return True
    module = model.get_submodule(module_name)
    heads, head_dim = attention_shape(model.get_submodule(module_name.rpartition(".")[0]))
    out = features(module)[1]
    return heads is None or head_dim is None or out == 3 * heads * head_dim
