"""Readers: the bytes of a read item, off disk or from a remote store (see each module)."""
from .base import Reader
from .choice import choose_reader, must_release_pages, reader_name
from .mmap import MmapReader
from .pread import Arena, PreadReader
from .remote import RemoteReader
from .runs import byte_runs

__all__ = ["Arena", "MmapReader", "PreadReader", "Reader", "RemoteReader", "byte_runs", "choose_reader", "must_release_pages",
           "reader_name"]
