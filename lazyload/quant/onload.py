"""Quantize on load: what to quantize (`Quantization`), and the stage between Reader and
Placer that turns a read full-precision slice into 8-bit data and float32 scales.

Scales cover groups of `group_size` elements of the input dim (the last one) per output
row: `scale = amax(|w|) / qmax` over each group, `q = w / scale` (rounded and clamped to
±127 for int8, cast to float8_e4m3fn for fp8, whose largest value is 448). Each group's
scale depends only on that group's bytes, so a tensor-parallel rank whose slice starts and
ends on group boundaries computes exactly the world=1 values of its slice. Vectorised over a
few rows at a time (a float32 scratch of about a megabyte on the CPU, cache-sized; 64 MiB on
a GPU, where small chunks would make the load launch-bound), never a Python loop per group.
"""
from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..agreement import in_process_group
from ..errors import ArgumentError, PlanError
from ..expr import Expr, Piece, ShapeOf, apply_ops, box_shape, undo_ops
from ..plan import Placement, ReadItem, local_regions
from .fp8_modules import check_block_split
from .dequant import CPU_CHUNK, GPU_CHUNK, QuantizedBox, dequantize_into
from .pack4 import FIXED_GROUP, PER_WORD, STORED

QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
PACKED = ("nvfp4", "mxfp4", "int4")  # 4-bit, kept packed (quant.packed)
KEEP = "keep"  # a 4-bit checkpoint's packed bytes held as stored (quant.kept4)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# Kept in full precision unless asked: the output head and MoE routers (embeddings and
# norms are no Linear layers, so never quantized).
BLOCK = 128  # format="transformers": rows and columns per scale (FineGrainedFP8Config's weight_block_size)
DEFAULT_SKIP = (r"(^|\.)lm_head$", r"(^|\.)(gate|router)$")


@dataclass(frozen=True)
class Quantization:
    """How `load_into(..., quantize=...)` quantizes a full-precision checkpoint on load.

    - `dtype`: "int8" (symmetric, ±127) or "fp8" (`torch.float8_e4m3fn`); or 4 bits kept
      packed in lazyload's `Packed4Linear` (Linear layers only; see `quant.pack4`): "nvfp4"
      (groups of 16, a float8 scale each and a global scale per tensor), "mxfp4" (groups of
      32, an E8M0 scale each) or "int4" (symmetric, groups of `group_size`, a multiple of 8;
      as a string "int4:g32"), each as compressed-tensors quantizes it.
    - `group_size`: input-dim elements per scale, per output row (default 128; the last
      group of a row may be shorter). None: one scale per row of what the rank holds. A
      row-parallel rank (world > 1) sees only its own columns of each row, so its scales
      cover those columns: they, the quantized values and the logits differ from world
      1's, unlike with groups, where every rank holds world 1's values.
    - `skip`: regexes (`re.search` on module names) of Linear layers (and fused experts
      modules, `mlp.experts`) kept in full precision, on top of the defaults (`lm_head`, MoE
      routers `gate` / `router`) and the model config's `modules_to_not_convert`.
    - `torchao`: True holds each quantized weight, where torchao 0.18 takes it (no short
      last group; under TP the rank's local shard, see `quant.linear`), as torchao's
      `Int8Tensor` / `Float8Tensor` in a plain `nn.Linear` (torchao must be installed:
      `pip install torchao`); the others stay `QuantizedLinear`. None (default):
      True when torchao is installed, else False. False: `QuantizedLinear` everywhere, no
      import of torchao.
    - `format`: "lazyload" (default) as above; "transformers" (fp8 only) makes each Linear
      layer whose dims are multiples of 128 transformers' `FP8Linear` with a float32
      `weight_scale_inv` per 128x128 block, quantized as transformers quantizes (the same
      bytes; `BLOCK`); other layers and fused experts stay lazyload's holders."""

    dtype: str = "int8"
    group_size: int | None = 128
    skip: tuple[str, ...] = ()
    torchao: bool | None = None
    format: str = "lazyload"

    def __post_init__(self) -> None:
        if self.dtype == KEEP:
            return object.__setattr__(self, "torchao", False)
        if self.dtype not in QDTYPES and self.dtype not in PACKED:
            raise ArgumentError(f"Quantization dtype={self.dtype!r}: use 'int8', 'fp8', 'nvfp4', 'mxfp4', 'int4' or "
                                "'keep'.")
        if self.dtype in PACKED:
            return self._check_packed()
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ArgumentError(f"Quantization group_size={self.group_size!r}: a positive integer, or None for "
                                "one scale per row.")
        object.__setattr__(self, "skip", tuple(self.skip))
        if self.format not in ("lazyload", "transformers") or (self.format == "transformers" and self.dtype != "fp8"):
            raise ArgumentError(f"Quantization format={self.format!r} with dtype={self.dtype!r}: use format "
                                "'lazyload', or 'transformers' with dtype 'fp8' (its FP8Linear layers).")
        if self.format == "transformers" and not self.torchao:
            object.__setattr__(self, "torchao", False)  # FP8Linear holds the blocked layers; the rest stay ours
        elif self.torchao is None:  # default: torchao's holders where it is installed (found, not imported)
            object.__setattr__(self, "torchao", importlib.util.find_spec("torchao") is not None)
        elif self.torchao:
            try:
                import torchao  # noqa: F401
            except ImportError as exc:
                raise ArgumentError("Quantization(torchao=True) needs torchao: pip install torchao; or pass torchao=False for lazyload's QuantizedLinear."
                                    ) from exc

    def _check_packed(self) -> None:
        """4 bits: a group the packing and the format allow, lazyload's own holder."""
        fixed = FIXED_GROUP.get(self.dtype)
        if fixed is not None and self.group_size in (128, fixed):  # 128: the dataclass default
            object.__setattr__(self, "group_size", fixed)
        group = self.group_size
        if fixed is not None and group != fixed or not isinstance(group, int) or group < 1 or group % PER_WORD[self.dtype]:
            need = f"{fixed}" if fixed is not None else "a positive multiple of 8"
            raise ArgumentError(f"Quantization({self.dtype!r}, group_size={group!r}): {self.dtype} groups are {need}.")
        if self.torchao or self.format != "lazyload":
            raise ArgumentError(f"Quantization({self.dtype!r}) is held by lazyload's Packed4Linear: pass neither "
                                "torchao=True nor format=... .")
        object.__setattr__(self, "torchao", False)
        object.__setattr__(self, "skip", tuple(self.skip))

    @property
    def packed(self) -> str:
        """The 4-bit scheme ("nvfp4", "mxfp4", "int4"), or "" for 8 bits."""
        return self.dtype if self.dtype in PACKED else ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return STORED[self.dtype] if self.packed else torch.uint8 if self.dtype == KEEP else QDTYPES[self.dtype]

    @classmethod
    def of(cls, quantize: "str | Quantization | None") -> "Quantization | None":
        """The argument of `load_into(quantize=...)`: None, "int8", "fp8", "nvfp4", "mxfp4",
        "int4" (groups of 128) or "int4:gN" (groups of N), "keep" (a 4-bit checkpoint held packed),
        or a Quantization."""
        if quantize is None or isinstance(quantize, Quantization):
            return quantize
        if isinstance(quantize, str) and (quantize in QDTYPES or quantize in PACKED or quantize == KEEP):
            return cls(quantize)
        if isinstance(quantize, str) and (m := re.fullmatch(r"int4:g(\d+)", quantize)):
            return cls("int4", group_size=int(m.group(1)))
        raise ArgumentError(f"quantize={quantize!r}: use None, 'int8', 'fp8', 'nvfp4', 'mxfp4', 'int4', 'int4:g32' "
                            "(a group size), 'keep' or lazyload.Quantization(...).")

    def describe(self, torchao_layers: int = 0) -> str:
        """What the quantized weights hold, in words (for the LoadReport), with the number
        of layers held by torchao's tensors."""
        if self.dtype == KEEP:
            return ("4-bit weights kept packed as stored: MXFP4 experts (E2M1 blocks, an E8M0 scale per 32) in "
                    "lazyload's Mxfp4Experts, compressed-tensors NVFP4 / INT4 Linear layers in lazyload's "
                    "Packed4Linear")
        if self.packed:
            scale = {"nvfp4": "a float8_e4m3fn scale per 16 input columns and a float32 global scale",
                     "mxfp4": "an E8M0 scale per 32 input columns"}.get(self.dtype, f"a scale per {self.group_size} "
                                                                                   "input columns")
            return f"{self.dtype} packed, {scale}, in lazyload's Packed4Linear"
        scales = f"per {self.group_size} input columns" if self.group_size else "per row"
        if self.format == "transformers":
            scales = f"per {BLOCK}x{BLOCK} block in transformers' FP8Linear (others {scales})"
        return f"{self.dtype}, a float32 scale {scales}" + (f" ({torchao_layers} as torchao tensors)"
                                                            if torchao_layers else "")

    def skips(self, module_name: str, not_convert: tuple[str, ...] = ()) -> bool:
        if any(re.search(p, module_name) for p in DEFAULT_SKIP + self.skip):
            return True
        # transformers' modules_to_not_convert: a module name or a prefix of it.
        return any(module_name == n or module_name.startswith(n + ".") or module_name.endswith("." + n)
                   for n in not_convert)


def not_converted(model: torch.nn.Module) -> tuple[str, ...]:
    """The model config's `quantization_config.modules_to_not_convert` (transformers')."""
    qconfig = getattr(getattr(model, "config", None), "quantization_config", None)
    names = (qconfig.get("modules_to_not_convert") if isinstance(qconfig, dict)
             else getattr(qconfig, "modules_to_not_convert", None))
    return tuple(names or ())


class QuantizedDest(NamedTuple):
    """The destination of a quantized target: its 8-bit data and its scale grid (the data's
    shape with the input dim `axis` divided by `group`, rounded up); `group` input elements
    per scale. `keep`: a pre-quantized source kept as stored (`keep_into`). `rows` > 1:
    blocks of `rows` x `group`, quantized as transformers does (`quantize_blocks_into`)."""

    data: torch.Tensor
    scale: torch.Tensor
    group: int
    axis: int = -1
    keep: bool = False
    rows: int = 1

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    # The destination interface (see `placer.Destination`).
    def box(self, item: ReadItem) -> None:
        return None  # bytes never land as they are: they are quantized (or kept with re-gridded scales)

    def place(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        """The quantize-on-load stage: the item's values quantized into their box."""
        if self.keep:
            return keep_into(self, item, source)
        self.write(item.dst_box, full_precision(item, source, self.device))

    def write(self, box: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
        (quantize_blocks_into if self.rows > 1 else quantize_into)(self, box, values)

    def scratch_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # whole sources are converted in full precision, quantized after

    def bytes_saved(self, full_dtype: torch.dtype) -> int:
        """Bytes held less than in `full_dtype`, the scales counted."""
        return self.data.numel() * full_dtype.itemsize - self.data.nbytes - self.scale.nbytes

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        # the 8-bit data, and its scales beside it (transformers' FP8Linear names them `weight_scale_inv`)
        return {name: self.data, name + ("_scale_inv" if self.rows > 1 else "_scale"): self.scale}


class Grid(NamedTuple):
    """How one target is quantized: `group` elements of its input dim `axis` (-1; -2 for
    transposed experts [E, in, out]) per scale, and whether its pre-quantized source is
    kept as stored (`keep`) rather than dequantized and quantized again."""

    group: int
    axis: int = -1
    keep: bool = False
    rows: int = 1  # > 1: rows per scale too (format="transformers": 128x128 blocks)
    packed: str = ""  # a 4-bit scheme: held packed (quant.packed.PackedDest)
    shared_amax: bool = False  # NVFP4 at world > 1: the global scale's amax is the max over the ranks'


def scale_shape(shape: tuple[int, ...], group: int, axis: int = -1, rows: int = 1) -> tuple[int, ...]:
    axis %= len(shape)
    return tuple(-(-n // group) if d == axis else -(-n // rows) if d == len(shape) - 2 else n
                 for d, n in enumerate(shape))


def quantize_blocks_into(dest: QuantizedDest, box: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
    """Quantize `values` (the `box` of a 2-D local weight, whole blocks: the plan checks it)
    in blocks of `dest.rows` x `dest.group` as transformers' `Fp8Quantize` does, bit for bit:
    `scale = 448 / amax` (1 for an all-zero block), `q = fp8(clamp(w * scale))`, stored
    `scale_inv = 1 / scale`. Whole block-rows at a time, as many as `chunk_rows` allows:
    about ten kernels a chunk, not a dozen per 128 rows (a GPU load would be launch-bound)."""
    (r0, r1), (c0, c1) = box
    rb, cb = dest.rows, dest.group
    qmax = QMAX[dest.data.dtype]
    step = max(1, chunk_rows(values.device, c1 - c0) // rb) * rb
    for r in range(0, r1 - r0, step):
        w = values[r:r + step].to(torch.float32)
        blocks = w.reshape(-1, rb, (c1 - c0) // cb, cb)  # (block-rows, rows, column blocks, cb)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, qmax / torch.where(amax > 0, amax, torch.ones_like(amax)), 1.0)
        q = (blocks * scale[:, None, :, None]).clamp(-qmax, qmax).to(dest.data.dtype)
        dest.data[r0 + r:r0 + r + w.shape[0], c0:c1] = q.reshape(w.shape)
        first = (r0 + r) // rb
        dest.scale[first:first + scale.shape[0], c0 // cb:c1 // cb] = (1.0 / scale).to(torch.float32)


def quantize_into(dest: QuantizedDest, box: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
    """Quantize `values` (the full-precision `box` of the local tensor, on dest's device)
    into `dest`. The box's input dim starts on a group boundary and ends on one or at the
    end of the row (the plan checks it), so its groups are whole groups of the local tensor.
    A transposed destination (input dim -2) is quantized through transposed views."""
    if dest.axis % dest.data.ndim != dest.data.ndim - 1:
        flipped = QuantizedDest(dest.data.transpose(dest.axis, -1), dest.scale.transpose(dest.axis, -1), dest.group)
        axis = dest.axis % len(box)
        return quantize_into(flipped, box[:axis] + (box[-1],) + box[axis + 1:-1] + (box[axis],),
                             values.transpose(dest.axis, -1))
    (c0, c1) = box[-1]
    g = dest.group
    qmax = QMAX[dest.data.dtype]
    # A device tensor, not a Python number: CUDA divides by a CPU scalar as `a * (1 / b)`,
    # which may differ from the CPU's `a / b` in the last bit (scales GPU != CPU).
    divisor = torch.full((1,), qmax, dtype=torch.float32, device=values.device)
    data = dest.data[tuple(slice(a, b) for a, b in box)]
    scale = dest.scale[tuple(slice(a, b) for a, b in box[:-1]) + (slice(c0 // g, -(-c1 // g)),)]
    cols = c1 - c0
    groups = -(-cols // g)
    rows_of = values.reshape(-1, cols)
    data2, scale2 = data.reshape(-1, cols), scale.reshape(-1, groups)  # copies of non-contiguous views
    step = chunk_rows(values.device, groups * g)
    for r in range(0, rows_of.shape[0], step):
        w = rows_of[r:r + step]
        scratch = torch.zeros((w.shape[0], groups * g), dtype=torch.float32, device=w.device)
        scratch[:, :cols] = w
        blocks = scratch.view(w.shape[0], groups, g)
        amax = blocks.abs().amax(-1)
        s = amax / divisor
        s.masked_fill_(s == 0, 1.0)  # an all-zero group: any scale gives zeros back (no host sync)
        blocks.div_(s.unsqueeze(-1))
        if dest.data.dtype == torch.int8:
            blocks.round_()
        blocks.clamp_(-qmax, qmax)
        data2[r:r + step] = scratch[:, :cols]
        scale2[r:r + step] = s
    if data2.data_ptr() != data.data_ptr() or not data.is_contiguous():  # reshape made a copy: write back
        data.copy_(data2.view(data.shape))
    if scale2.data_ptr() != scale.data_ptr() or not scale.is_contiguous():
        scale.copy_(scale2.view(scale.shape))


def chunk_rows(device: torch.device, width: int) -> int:
    """Rows of `width` float32 elements quantized per step: a cache-sized scratch on the CPU,
    a large one on a GPU, where each step costs about a dozen kernel launches."""
    return max(1, (GPU_CHUNK if device.type == "cuda" else CPU_CHUNK) // width)


def grid_for(name: str, expr: Expr, shape: tuple[int, ...], placement: Placement, rank: int, world: int,
             config: Quantization, axis: int, dtype_of, shape_of: ShapeOf, pieces_whole: bool = True) -> Grid:
    """The scale grid of target `name` quantized on load, checked before any byte is read.
    A pre-quantized source already in the asked dtype (symmetric, contracted over its last
    dim) is kept (`kept_group`); otherwise groups of `config.group_size`, or with None one
    scale per row of what this rank holds (a row-parallel rank: its own columns only).
    `pieces_whole`: refuse source pieces that cut a group or block (False: the caller
    assembles their values before quantizing, a weight sync's `sync.wire.AssembledDest`)."""
    if config.packed:
        return packed_grid(name, expr, shape, placement, rank, world, config, shape_of)
    if blocked(config, shape, axis):  # transformers' FP8Linear: whole 128x128 blocks on every rank
        check_block_split(name, shape, (BLOCK, BLOCK), placement, rank, world)
        for dim in (-2, -1):  # fused sources (pieces) must not cut a block either
            check_groups(name, expr, shape, placement, rank, world, BLOCK, shape_of, dim, pieces_whole)
        return Grid(BLOCK, -1, False, BLOCK)
    full = expr.pieces(tuple((0, n) for n in shape), shape_of)
    keep = axis % len(shape) == len(shape) - 1 and bool(full) and all(
        p.scales is not None and p.scales.zero is None and dtype_of(p.key) == config.torch_dtype
        and not any(op[0] == "transpose" for op in p.ops) for p in full)
    if keep:
        group = kept_group(full, shape, placement, world)
    elif config.group_size is not None:
        group = config.group_size
    else:
        group = max(1, local_regions(name, shape, placement, rank, world)[0][axis])
    check_groups(name, expr, shape, placement, rank, world, group, shape_of, axis, pieces_whole)
    return Grid(group, axis, keep)


def packed_grid(name: str, expr: Expr, shape: tuple[int, ...], placement: Placement, rank: int, world: int,
                config: Quantization, shape_of: ShapeOf) -> Grid:
    """The grid of a Linear weight quantized to 4 bits: whole groups on every rank (the
    formats have no short group). NVFP4's global scale is the amax of the whole tensor,
    which a rank reading its slice never sees: at world > 1 within a process group, every
    rank's amax of each tensor is all-reduced (max) before it quantizes (`shared_amax`);
    without one, a split tensor is refused."""
    group, cols = config.group_size, shape[-1]
    if cols % group:
        raise PlanError(f"{name}: {cols} input columns are no whole number of {config.dtype} groups of {group}; "
                        "keep this layer in full precision (Quantization(skip=[...])) or pick a group that "
                        "divides it.")
    local, _ = local_regions(name, shape, placement, rank, world)
    shared = config.packed == "nvfp4" and in_process_group(rank, world)  # every NVFP4 target: the same on all ranks
    if config.packed == "nvfp4" and tuple(local) != tuple(shape) and not shared:
        raise PlanError(f"{name}: rank {rank} of {world} holds {list(local)} of {list(shape)}, but NVFP4's global "
                        "scale is the amax of the whole tensor, which a rank reading its slice never sees, so its "
                        "bytes would differ from world 1's. Load within a torch.distributed process group of this "
                        "rank and world (the ranks then share their amax), or quantize at world 1: `lazyload "
                        "reshard --quantize nvfp4` writes a checkpoint every rank of any world reads its slice of; "
                        "or use quantize='mxfp4' / 'int4:gN' under TP.")
    check_groups(name, expr, shape, placement, rank, world, group, shape_of, -1)
    return Grid(group, -1, False, 1, config.packed, shared)


def blocked(config: Quantization, shape: tuple[int, ...], axis: int) -> bool:
    """Whether a target becomes transformers' FP8Linear weight: format="transformers", a 2-D
    Linear weight whose dims are whole blocks (transformers quantizes no other shape)."""
    return (config.format == "transformers" and len(shape) == 2 and axis % 2 == 1
            and shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0)


def kept_group(full: list[Piece], shape: tuple[int, ...], placement: Placement, world: int) -> int:
    """The scale group of a weight kept as stored: its checkpoint's column blocks, narrowed
    (gcd) to the column offsets where each source piece starts, in the checkpoint tensor and
    in every rank's local tensor, so that each local group lies inside one checkpoint block
    of one source and its re-gridded scale is exact. `full`: the pieces of the whole weight;
    a rank's column slice of a piece starts as far into its source as into the piece (no
    transposes), so the pieces are intersected with each rank's column spans here instead of
    being pushed down again per rank (per-expert weights: thousands of pieces per tensor)."""
    columns = {(p.scales.block[-1], p.src_box[-1][0]) + p.dst_box[-1] for p in full}
    spans = {(region.global_box[-1], region.local_start[-1]) for rank in range(world)
             for region in local_regions("", shape, placement, rank, world)[1]}
    group = 0
    for block, source, c0, c1 in columns:
        group = math.gcd(group, block)
        for (a, b), local in spans:
            lo = max(a, c0)
            if lo < min(b, c1):
                group = math.gcd(group, source + lo - c0, local + lo - a)
    return max(1, group)


def full_precision(item: ReadItem, source: torch.Tensor | QuantizedBox, device: torch.device) -> torch.Tensor:
    """The item's values as its destination box sees them: the source after its ops, or a
    pre-quantized source dequantized into float32 first."""
    if item.scales is None:
        return apply_ops(source, item.ops)
    values = torch.empty(box_shape(item.dst_box), dtype=torch.float32, device=device)
    dequantize_into(undo_ops(values, item.ops), source, tuple(a for a, _ in item.src_box), item.scales.block,
                    item.scales.codec)
    return values


def keep_into(dest: QuantizedDest, item: ReadItem, source: QuantizedBox) -> None:
    """A pre-quantized weight box as stored, and its scales re-gridded from the checkpoint's
    blocks to the destination's (row, group) grid: each local group lies in one block
    (`kept_group`), whose scale it takes. The item's ops (a per-expert weight stacked into
    3-D experts) apply to both."""
    dest.data[tuple(slice(a, b) for a, b in item.dst_box)].copy_(apply_ops(source.weight, item.ops))
    g, block, src = dest.group, item.scales.block, item.src_box
    scale = source.scale.float()
    scale = scale.reshape(box_shape(item.scales.box)) if scale.numel() > 1 else scale.reshape((1,) * len(src))
    for d, ((a, b), size) in enumerate(zip(src, block)):  # the block of each row, and of each group's start
        at = torch.arange(a, b, g if d == len(src) - 1 else 1, device=scale.device)
        scale = scale.index_select(d, at // size - a // size if scale.shape[d] > 1 else at * 0)
    (e0, e1) = item.dst_box[-1]
    dest.scale[tuple(slice(a, b) for a, b in item.dst_box[:-1]) + (slice(e0 // g, -(-e1 // g)),)] = \
        apply_ops(scale, item.ops)


def check_groups(name: str, expr: Expr, shape: tuple[int, ...], placement: Placement, rank: int, world: int,
                 group: int, shape_of: ShapeOf, axis: int = -1, pieces: bool = True) -> None:
    """Refuse, before any byte is read, a split that cuts a scale group of `name`: every
    group a rank quantizes must be a whole group of the world=1 weight, so that its scale
    comes from the same bytes. `axis`: the input dim. `pieces`: the source pieces (fused
    sources, checkpoint shards) must not cut one either."""
    cols = shape[axis]
    _, regions = local_regions(name, shape, placement, rank, world)
    for region in regions:
        a, b = region.global_box[axis]
        local = region.local_start[axis]
        ok = a % group == 0 and local % group == 0 and ((b - a) % group == 0 or b == cols)
        for piece in expr.pieces(region.global_box, shape_of) if ok and pieces else ():  # fused sources along columns
            c0, c1 = piece.dst_box[axis]
            ok = ok and c0 % group == 0 and (c1 % group == 0 or c1 == cols)
        if not ok:
            worlds = [w for w in range(1, 65) if cols % w == 0 and (cols // w) % group == 0]
            raise PlanError(f"{name}: this split of the input dim ({cols} columns, rank {rank} of {world}) cuts the "
                            f"quantization groups of {group} columns, so its scales would differ from world 1's. "
                            f"Use a world whose column shards are whole groups ({worlds or 'only world 1'}), a "
                            "smaller Quantization(group_size=...), or keep this layer in full precision "
                            f"(Quantization(skip=[...])).")
