"""Which device a load targets: `device=` made concrete (a CUDA device always with its
index: `torch.device("cuda") != torch.device("cuda:0")`, so an unindexed device would never
match the model's own tensors), or, when not given, the device of the model's real
tensors, of its DTensor mesh, or the GPU of this process as torch's DeviceMesh chooses it.
Checked before any byte is read: a device that does not exist is a `DeviceError`.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from .errors import DeviceError
from .targets import is_dtensor

logger = logging.getLogger("lazyload")


def target_device(requested: str | int | torch.device | None, model: nn.Module) -> torch.device:
    """The device a load writes to: `requested`, else the model's (see the module doc)."""
    if requested is None:
        device = model_device(model)
    else:
        try:
            device = torch.device(requested)
        except (RuntimeError, TypeError) as exc:
            raise DeviceError(f"device={requested!r} is not a device ({exc}); pass e.g. 'cpu' or 'cuda:0'.") from exc
    return concrete(device)


def model_device(model: nn.Module) -> torch.device:
    """Where the model's tensors are: its first real tensor's device; for a model on meta,
    the device type of its DTensor mesh, else CUDA when available, else the CPU."""
    tensors = list(model.parameters()) + list(model.buffers())
    for tensor in tensors:
        if not tensor.is_meta:
            return tensor.device
    mesh_type = next((t.device_mesh.device_type for t in tensors if is_dtensor(t)), None)
    if mesh_type is not None:
        return torch.device(mesh_type)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def concrete(device: torch.device) -> torch.device:
    """A CUDA device with its index (`process_gpu()` when it has none), checked to exist."""
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
               else f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        raise DeviceError(f"device {device} was asked for, but CUDA is not available: {why}. Pass device='cpu' "
                          "(or leave device unset: the CPU is the default without CUDA).")
    count = torch.cuda.device_count()
    index = process_gpu() if device.index is None else device.index
    if not 0 <= index < count:
        raise DeviceError(f"device cuda:{index} does not exist: {_visible(count)}. Pass device='cuda:0' ... "
                          f"'cuda:{count - 1}'.")
    return torch.device("cuda", index)


def process_gpu() -> int:
    """The GPU of this process, as torch's DeviceMesh chooses it: the current device once
    one was chosen (CUDA initialised: `torch.cuda.set_device`, a mesh, any CUDA work; a
    warning when that is GPU 0 and LOCAL_RANK names another: a CUDA call before set_device
    leaves every rank on GPU 0); else LOCAL_RANK (a launcher's), or the only visible GPU
    when each process sees just its own (CUDA_VISIBLE_DEVICES); else, under
    torch.distributed, rank % devices; else 0."""
    count = torch.cuda.device_count()
    if torch.cuda.is_initialized():
        current = torch.cuda.current_device()
        if current == 0:  # CUDA's default: maybe chosen, maybe only never set (any other was chosen)
            with contextlib.suppress(DeviceError):
                local = _local_rank(count)
                if local:
                    _warn_once(current, local)
        return current
    local = _local_rank(count)
    if local is not None:
        return local
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() % count
    return 0


def _local_rank(count: int) -> int | None:
    """The GPU LOCAL_RANK names (0 when this process sees one GPU only), or None without it."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return None
    try:
        index = int(local)
    except ValueError:
        raise DeviceError(f"LOCAL_RANK={local!r} is not a number; pass device='cuda:N'.") from None
    if 0 <= index < count:
        return index
    if count == 1:
        return 0
    raise DeviceError(f"LOCAL_RANK={index} names no GPU of this process: {_visible(count)}. Pass "
                      "device='cuda:N', or call torch.cuda.set_device before load_into.")


_warned: set[tuple[int, int]] = set()


def _warn_once(current: int, local: int) -> None:
    if (current, local) not in _warned:
        _warned.add((current, local))
        logger.warning("LOCAL_RANK=%d, but CUDA's current device is cuda:%d (a CUDA call came before "
                       "torch.cuda.set_device): loading to cuda:%d, as torch's DeviceMesh would. Call "
                       "torch.cuda.set_device(%d) before any CUDA work, or pass device='cuda:%d'.",
                       local, current, current, local, local)


def use_device(device: torch.device) -> None:
    """Make a CUDA `device` this process's current device if none was chosen yet (CUDA not
    initialised) and it is the process's own GPU (`process_gpu`), as DeviceMesh would: a
    mesh made later then agrees with the load, and no stray CUDA call of this thread creates
    a context on GPU 0. Another device asked for explicitly leaves the current one as it is
    (the loader's allocations name their device)."""
    if device.type != "cuda" or torch.cuda.is_initialized():
        return
    with contextlib.suppress(DeviceError):  # a LOCAL_RANK naming no GPU: not this one
        if device.index == process_gpu():
            torch.cuda.set_device(device)


def use_device_in_thread(device: torch.device) -> None:
    """A worker thread's `use_device`, unconditional: CUDA's current device is per thread
    (device 0 in a new one, whatever the process chose); work there on another device would
    create a context on GPU 0."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _visible(count: int) -> str:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"{count} CUDA device{'s' if count != 1 else ''} visible" + (
        f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else "")
