"""What the engine asks of a reader: the one interface every reader (mmap, pread, remote)
offers, so that the engine and the loader never tell readers apart by their class.

A reader either hands out views of what it reads (`staged` False: `read`, then `release`
once placed; the mmap reader) or reads into staging the engine gives it (`staged` True:
`read_into` a range of the arena, or straight into the destination; pread, remote). It says
how many worker threads keep it busy (`threads`), whether it announces pages ahead
(`prefetching`: `prefetch` a layer ahead, `populate` targets left as views), whether a
target can stay a view of its file mapping (`maps_views`: `view`), and how it reports:
`bytes_read`, `report_fields()` for the LoadReport, `progress_note()` for the bar.
"""
from __future__ import annotations

import torch

from ..plan import ReadItem
from ..quant.dequant import QuantizedBox


class Reader:
    """The defaults: a reader overrides what it does (see the module docstring)."""

    name = "reader"
    staged = True
    threads = 8  # readers that wait on storage: as many as its queue likes (the GIL is released)
    prefetching = False
    maps_views = False
    bytes_read = 0

    def read(self, item: ReadItem) -> torch.Tensor | QuantizedBox:
        """An unstaged reader: the item's bytes, as views (a dequantized item: its parts)."""
        raise NotImplementedError(f"the {self.name} reader reads into staging (read_into)")

    def read_into(self, item: ReadItem, out: torch.Tensor) -> torch.Tensor | QuantizedBox:
        """A staged reader: the item's bytes into `out` (contiguous uint8, item.nbytes),
        returned viewed as the source box (a dequantized item: its parts' views)."""
        raise NotImplementedError(f"the {self.name} reader hands out views (read)")

    def release(self, item: ReadItem, source: torch.Tensor | QuantizedBox) -> None:
        """The item is placed: what `read` handed out may go."""

    def view(self, item: ReadItem) -> torch.Tensor:
        """`maps_views` only: the item's bytes as a view of the file mapping, nothing read."""
        raise NotImplementedError(f"the {self.name} reader keeps no file mapping")

    def prefetch(self, items: tuple[ReadItem, ...]) -> None:
        """`prefetching` only: announce these items' pages (no waiting)."""

    def populate(self, item: ReadItem, view: torch.Tensor) -> None:
        """`prefetching` only: page in a target left as a view of the mapping."""

    def check_mapped(self) -> None:
        """After the run: targets left as views still have their pages (the files their size)."""

    def report_fields(self) -> dict[str, int]:
        """LoadReport fields beyond bytes_read (a remote reader's requests)."""
        return {}

    def progress_note(self) -> str:
        """A note beside the progress bar ("" for none)."""
        return ""

    def close(self) -> None:
        """Release files, mappings, connections."""
