"""Pausing Python's cyclic garbage collector while a stage builds many small objects.

Mapping and planning a checkpoint like DeepSeek-V3 make hundreds of thousands of small
objects (expressions, boxes, pieces, read items) with no reference cycles among them; the
cyclic collector would rescan the growing heap all along (a third of the mapping's time,
half of the plan's). Reference counting still frees everything they drop.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """The cyclic collector off for the block, back as it was after (nested blocks are fine)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
