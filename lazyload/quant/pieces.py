"""Where a quantized weight is stored: the file a name is read from (for messages), and its
packed data paired with its scales when a resharded copy stores both in pieces (each data
piece with the scale piece cut alike), for the formats found by their names (`fp4`,
`packed4`)."""
from __future__ import annotations

from typing import Callable

from ..expr import Cat, Expr, Source
from ..index import CheckpointIndex


def stored_file(index: CheckpointIndex, name: str) -> str:
    """The file holding (the first piece of) stored name `name`."""
    return index[index.expr(name).keys()[0]].file


def paired(data: Expr, scales: Expr, leaf: Callable[[str, str], Expr], below: int | None = None) -> Expr:
    """`leaf(data key, scales key)` of data and scales stored whole, or the same tiling of
    one leaf per piece where both are cut alike (along a dim before `below`, when given: a
    cut inside a group's bytes cannot pair); a ValueError where they are not."""
    if isinstance(data, Source) and isinstance(scales, Source):
        return leaf(data.key, scales.key)
    if not (isinstance(data, Cat) and isinstance(scales, Cat) and data.dim == scales.dim
            and (below is None or data.dim < below) and len(data.parts) == len(scales.parts)):
        raise ValueError("it is stored in pieces that are not cut where its scales are")
    return Cat(tuple(paired(d, s, leaf, below) for d, s in zip(data.parts, scales.parts)), data.dim)
