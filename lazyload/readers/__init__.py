"""Readers: the bytes of a read item, off disk (see each module)."""
from .choice import choose_reader, must_release_pages
from .mmap import MmapReader
from .pread import Arena, PreadReader
from .runs import byte_runs

__all__ = ["Arena", "MmapReader", "PreadReader", "byte_runs", "choose_reader", "must_release_pages"]
