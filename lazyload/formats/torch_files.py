"""PyTorch `.bin`/`.pt` state dicts (torch.save's zip format): every tensor located in its
file by byte offset, from the pickle alone.

`torch.load(map_location="meta", weights_only=True)` unpickles the object tree with each
storage on the meta device and its byte offset in the file (`_checkpoint_offset`): no
tensor byte is read. The readers then map (as `torch.load(mmap=True)` would: tensors are
views of the file, a rank touches only its slices' pages) or pread exactly those bytes.

`weights_only` is torch's restricted unpickler: tensors, containers, numbers, strings and
a few torch types. A file that needs any other global (a class, a function: arbitrary code
on unpickling) is refused with a CheckpointError naming those globals, before anything of
it runs, unless the caller passes `trust_pickle=True`. Formats that need more allow exactly
that (Megatron: `argparse.Namespace` for its args, numpy arrays for its RNG state).
Before torch.load sees a file, its pickle's object graph is bounded (`pickle_bounds`) and a
big-endian archive is refused (torch would byte-swap it; lazyload reads bytes as they lie).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import stat
from typing import Any, Iterable

import torch

from ..errors import CheckpointError
from ..expr import Source, Transpose, box_shape, full_box
from ..headers import TensorEntry, files_from_index_json
from ..index import INDEX_JSON, CheckpointIndex
from .logical import Layout, Part
from .pickle_bounds import problem
from .protocol import CheckpointSource, Format, OpenOptions, Storage
from .torch_zip import byteorder_problem

BIN_INDEX_JSON = "pytorch_model.bin.index.json"

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format (torch >= 1.6) is a zip archive
# Top-level keys under which training checkpoints keep the model's state dict.
_MODEL_KEYS = ("module", "model", "state_dict")


def is_torch_file(path: str) -> bool:
    """A regular file that starts like torch.save's output (a FIFO is not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        head = os.read(fd, 9) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    # torch's legacy format is a bare pickle (PROTO opcode); safetensors has '{' after its length.
    legacy = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and head[8:9] != b"{"
    return head[:4] == ZIP_MAGIC or legacy


def numpy_arrays() -> list:
    """The globals that plain numpy arrays unpickle through (an RNG state, not code)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return [np.ndarray, np.dtype, core.multiarray._reconstruct] + [type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFD"]


def load_tree(path: str, trust_pickle: bool = False, allowed: Iterable = (), data: bytes | None = None) -> Any:
    """The file's object tree, every tensor on the meta device (nothing of its data read);
    `data`: the file's bytes, already read (from a URL), `path` then only names it."""
    source = path if data is None else io.BytesIO(data)
    with open(path, "rb") if data is None else contextlib.nullcontext(io.BytesIO(data)) as f:
        if f.read(4) != ZIP_MAGIC:
            raise CheckpointError(f"{path}: not in torch.save's zip format (torch >= 1.6): a legacy pickle cannot be "
                                  "mapped; load it once with torch.load and save it again with torch.save (or as "
                                  "safetensors).")
    try:
        _check_archive(path, path if data is None else io.BytesIO(data), trust_pickle)
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="meta", weights_only=not trust_pickle)
    except pickle.UnpicklingError as exc:
        found = re.findall(r"GLOBAL ([\w.]+)", str(exc))
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(
                path if data is None else io.BytesIO(data)) or found
        except Exception:  # the list is a courtesy; the refusal stands without it
            pass
        if not found:
            raise CheckpointError(f"{path}: torch's safe unpickler refused it ({str(exc).splitlines()[-1][:300]}); "
                                  "the file is corrupt or not a torch checkpoint.") from exc
        raise CheckpointError(
            f"{path}: unpickling it would run code it names ({', '.join(sorted(set(found)))}), which a state dict "
            "does not need; lazyload unpickles only tensors, containers and plain values. If you trust whoever "
            "wrote this file, pass trust_pickle=True (the file's pickled code then runs with your privileges), "
            "or allow just those names with torch.serialization.add_safe_globals.") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: torch cannot read it ({str(exc)[:300]}); the file is truncated or not a "
                              "torch checkpoint.") from exc


def _check_archive(path: str, source, trust_pickle: bool) -> None:
    """What torch.load must not meet, read through torch's own zip reader first: a pickle
    whose object graph runs away (`pickle_bounds`: an exponential tuple hangs it, a deep one
    overflows the stack; a trusted pickle may run any code anyway), and a big-endian archive
    (torch 2.13 crashes byte-swapping meta storages)."""
    reader = torch._C.PyTorchFileReader(source)
    why = None if trust_pickle or not reader.has_record("data.pkl") else problem(reader.get_record("data.pkl"))
    if why:
        raise CheckpointError(f"{path}: its pickle (data.pkl) is not a checkpoint's: {why}. The file is corrupt or "
                              "hostile; lazyload does not unpickle it.")
    why = byteorder_problem(reader.get_record("byteorder") if reader.has_record("byteorder") else b"little")
    if why:
        raise CheckpointError(f"{path}: {why}. Load it with torch.load on this machine and save it again with "
                              "torch.save.")


def tensors_of(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of nested dicts, under dotted names; other values are skipped."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            out.update(tensors_of(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def state_dict_of(tree: Any) -> dict[str, torch.Tensor]:
    """A plain state dict as it is; a training checkpoint's model part (DeepSpeed 'module',
    'model', 'state_dict'), its optimizer and RNG state skipped."""
    if isinstance(tree, dict) and not all(isinstance(v, torch.Tensor) for v in tree.values()):
        for key in _MODEL_KEYS:
            if isinstance(tree.get(key), dict):
                return tensors_of(tree[key])
    return tensors_of(tree)


def locate(path: str, tensors: dict[str, torch.Tensor], size: int, prefix: str = "",
           rank: int = 0) -> tuple[list[tuple[str, TensorEntry]], dict[str, Part]]:
    """Stored entries for `tensors` (meta tensors loaded from `path`) and, per name, the
    `Part` (expression over the stored key) that gives it: a contiguous tensor is its
    bytes; a transposed 2-D one is the transpose of its storage's layout."""
    entries, parts = [], {}
    for name, tensor in tensors.items():
        key = f"{prefix}{name}"
        offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
        if offset is None:
            raise CheckpointError(f"{path}: torch {torch.__version__} does not report where tensors lie in the file; "
                                  "lazyload needs torch >= 2.6 to read .bin/.pt files (or convert to safetensors).")
        shape, stride = tuple(tensor.shape), tensor.stride()
        transposed = len(shape) == 2 and stride == (1, shape[0]) and shape[0] > 1 and shape[1] > 1
        stored = (shape[1], shape[0]) if transposed else shape
        if not transposed and not tensor.is_contiguous():
            raise CheckpointError(f"{path}: tensor {name!r} is saved as a strided view (shape {list(shape)}, stride "
                                  f"{list(stride)}); lazyload reads contiguous or transposed tensors: save it with "
                                  ".contiguous().")
        start = offset + tensor.storage_offset() * tensor.element_size()
        end = start + tensor.numel() * tensor.element_size()
        if end > offset + tensor.untyped_storage().nbytes() or end > size:
            raise CheckpointError(f"{path}: tensor {name!r} runs past its storage or the end of the file; the file "
                                  "is corrupt (re-download or re-save it).")
        stored_key = f"{key}@T" if transposed else key
        entries.append((stored_key, TensorEntry(path, name, tensor.dtype, stored, start, end)))
        expr = Transpose(Source(stored_key)) if transposed else Source(stored_key)
        parts[key] = Part(expr, full_box(shape), rank)
    return entries, parts


def storage_bytes(tree: Any) -> int:
    """Bytes of every distinct storage in the tree (model, optimizer, anything)."""
    seen = {}
    for tensor in tensors_of(tree).values():
        storage = tensor.untyped_storage()
        seen[getattr(storage, "_checkpoint_offset", id(storage))] = storage.nbytes()
    return sum(seen.values())


def open_index(files: list[str], trust_pickle: bool = False) -> CheckpointIndex:
    """An index over whole-tensor state dicts, one or several files (`pytorch_model-*.bin`)."""
    entries, layouts, header_bytes = [], {}, 0
    for path in files:
        tree = load_tree(path, trust_pickle)
        size = os.path.getsize(path)
        header_bytes += size - storage_bytes(tree)  # the pickle and the zip directory: what unpickling reads
        stored, parts = locate(path, state_dict_of(tree), size)
        entries += stored
        by_key = dict(stored)
        for name, part in parts.items():
            if not isinstance(part.expr, Source):  # a transposed tensor: a name over its stored layout
                layouts[name] = Layout(name, box_shape(part.box), by_key[part.expr.keys()[0]].dtype, (part,))
    return CheckpointIndex.of(files, entries, layouts, header_bytes)


def detect(storage: Storage, target) -> CheckpointSource | None:
    """A directory of `.bin`/`.pt` state dicts (and no safetensors, which are preferred),
    `pytorch_model.bin.index.json`, or files that are all torch.save's."""
    if isinstance(target, str) and storage.is_dir(target):
        names = storage.list(target) or []
        if INDEX_JSON in names or any(n.endswith(".safetensors") for n in names):
            return None
        if BIN_INDEX_JSON in names:
            return CheckpointSource("torch", files_from_index_json(os.path.join(target, BIN_INDEX_JSON)))
        files = [os.path.join(target, n) for n in names if n.endswith((".bin", ".pt", ".pth"))]
        return CheckpointSource("torch", files) if files else None
    if isinstance(target, str) and target.endswith(".index.json") and os.path.isfile(target):
        files = files_from_index_json(target)  # e.g. pytorch_model.bin.index.json's shards
    else:
        files = [target] if isinstance(target, str) else list(target)
    return CheckpointSource("torch", files) if files and all(is_torch_file(f) for f in files) else None


def _open(source: CheckpointSource, storage: Storage, options: OpenOptions) -> CheckpointIndex:
    return open_index(source.files, options.trust_pickle)


FORMAT_TORCH = Format("torch", detect, _open)
