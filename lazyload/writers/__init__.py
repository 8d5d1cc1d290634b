"""Writers: checkpoints written by lazyload, beside the readers they mirror (see each module)."""
from .sharded import save_sharded

__all__ = ["save_sharded"]
