"""lazyload: load huge sharded safetensors checkpoints into PyTorch models, each rank
reading only its own slices, with host memory bounded by about one layer.

The names below are imported on first use (PEP 562), so that `import lazyload` and the
command line's `--version` and `--help` do not wait for torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_ERRORS = ("LazyLoadError", "ArgumentError", "CheckpointError", "MappingError", "MissingKeysError",
           "UnexpectedKeysError", "ShapeMismatchError", "DtypeError", "OutputError", "PlanError", "RankFailedError",
           "ReadError", "CorruptValuesError", "MetaBufferError", "DeviceError", "ExchangeError", "SyncError",
           "RemoteError", "ObjectNotFoundError", "AccessDeniedError", "ObjectChangedError", "RequestRefusedError")
_WHERE = {"LazyCheckpoint": ".checkpoint", "load_model": ".auto", "save_sharded": ".writers", "LoadReport": ".report",
          "Placement": ".plan", "Quantization": ".quant.onload", "TensorEntry": ".headers",
          "WeightSync": ".sync", "SyncReport": ".sync",
          **{name: ".errors" for name in _ERRORS}}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lazyload' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # what type checkers and IDEs see
    from .auto import load_model
    from .checkpoint import LazyCheckpoint
    from .errors import (AccessDeniedError, ArgumentError, CheckpointError, CorruptValuesError, DeviceError,
                         DtypeError, ExchangeError, LazyLoadError, MappingError, MetaBufferError, MissingKeysError,
                         ObjectChangedError, ObjectNotFoundError, OutputError, PlanError, RankFailedError,
                         ReadError, RemoteError, RequestRefusedError, ShapeMismatchError, SyncError,
                         UnexpectedKeysError)
    from .headers import TensorEntry
    from .plan import Placement
    from .quant.onload import Quantization
    from .report import LoadReport
    from .sync import SyncReport, WeightSync
    from .writers import save_sharded
