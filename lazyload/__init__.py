"""lazyload: load huge sharded safetensors checkpoints into PyTorch models, each rank
reading only its own slices, with host memory bounded by about one layer."""
from .auto import load_model
from .checkpoint import LazyCheckpoint
from .errors import (ArgumentError, CheckpointError, DeviceError, DtypeError, LazyLoadError, MappingError, MetaBufferError,
                     MissingKeysError, OutputError, PlanError, RankFailedError, ReadError, ShapeMismatchError, UnexpectedKeysError)
from .headers import TensorEntry
from .plan import Placement
from .quant.onload import Quantization
from .report import LoadReport
from .writers import save_sharded

__all__ = [
    "LazyCheckpoint", "load_model", "save_sharded", "LoadReport", "Placement", "Quantization", "TensorEntry",
    "LazyLoadError", "ArgumentError", "CheckpointError", "MappingError", "MissingKeysError", "UnexpectedKeysError",
    "ShapeMismatchError", "DtypeError", "OutputError", "PlanError", "RankFailedError", "ReadError", "MetaBufferError", "DeviceError",
]
__version__ = "0.1.0"
