"""Tensors that hold no data until copied: what lazyload hands another engine's weight loaders.

A `LazyTensor` stands for one checkpoint tensor (`LazySource`: its name, shape and dtype)
seen through a `Geometry`: the box of the stored tensor it covers and how the view's dims
map onto the stored ones. The views a weight loader takes (narrow, slicing, select, chunk,
split, unbind, transpose, permute, t, unsqueeze/squeeze, a view or reshape that only adds or drops
dims of size 1, a cast) only change the geometry. Copying it into a real tensor
(`dst.copy_(lazy)`) hands the copy to the source's `sink`, which reads exactly that box
(the loader defers these copies and reads them all in layer order, `integrations.reads`).
Any other operation reads the view whole, now, and counts as a fallback (`sink.fallback`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map

from ..errors import ShapeMismatchError

aten = torch.ops.aten

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Geometry:
    """`box`: per stored dim, the (start, stop) this view covers; `dims`: per view dim, the
    stored dim it runs along, or None for a dim of size 1 the view added. Stored dims that
    no view dim names were selected away (their span is 1)."""

    box: Box
    dims: tuple[int | None, ...]

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> "Geometry":
        return cls(tuple((0, n) for n in shape), tuple(range(len(shape))))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(1 if d is None else self.box[d][1] - self.box[d][0] for d in self.dims)

    def sliced(self, dim: int, start: int, stop: int) -> "Geometry":
        """View dim `dim` narrowed to [start, stop) (already clamped to its size)."""
        stored = self.dims[dim]
        if stored is None:
            if (start, stop) != (0, 1):
                raise Unsupported("an empty slice of an added dim")
            return self
        begin = self.box[stored][0]
        box = self.box[:stored] + ((begin + start, begin + stop),) + self.box[stored + 1:]
        return Geometry(box, self.dims)

    def selected(self, dim: int, index: int) -> "Geometry":
        geometry = self.sliced(dim, index, index + 1)
        return Geometry(geometry.box, self.dims[:dim] + self.dims[dim + 1:])

    def permuted(self, order: tuple[int, ...]) -> "Geometry":
        return Geometry(self.box, tuple(self.dims[d] for d in order))

    def unsqueezed(self, dim: int) -> "Geometry":
        return Geometry(self.box, self.dims[:dim] + (None,) + self.dims[dim:])

    def squeezed(self, dims: tuple[int, ...]) -> "Geometry":
        shape = self.shape
        gone = {d for d in dims if shape[d] == 1}
        return Geometry(self.box, tuple(s for d, s in enumerate(self.dims) if d not in gone))

    def reshaped(self, shape: tuple[int, ...]) -> "Geometry":
        """A view that only adds or drops dims of size 1 (else Unsupported: it would need
        the stored layout to merge or split dims)."""
        kept = [d for d, n in zip(self.dims, self.shape) if n != 1]
        if [n for n in shape if n != 1] != [n for n in self.shape if n != 1]:
            raise Unsupported(f"a view from {list(self.shape)} to {list(shape)}")
        dims, it = [], iter(kept)
        for n in shape:
            dims.append(None if n == 1 else next(it))
        return Geometry(self.box, tuple(dims))

    def stored_order(self) -> list[int]:
        """Stored dims in view order, then the selected ones (span 1)."""
        named = [d for d in self.dims if d is not None]
        return named + [d for d in range(len(self.box)) if d not in named]

    def as_view(self, stored: torch.Tensor) -> torch.Tensor:
        """The values of the box (a tensor in the stored dims' order) as this view."""
        return stored.permute(self.stored_order()).reshape(self.shape)

    def as_stored(self, view: torch.Tensor) -> torch.Tensor:
        """A tensor of this view's shape seen as the box in stored order: a view of it, so
        that writing the box writes `view`."""
        for dim in reversed([d for d, s in enumerate(self.dims) if s is None]):
            view = view.select(dim, 0)
        for _ in range(len(self.box) - view.dim()):
            view = view.unsqueeze(-1)
        order = self.stored_order()
        inverse = [order.index(d) for d in range(len(self.box))]
        return view.permute(inverse)


class Unsupported(Exception):
    """A view the geometry cannot record: the operation falls back to reading."""


@dataclass(frozen=True)
class LazySource:
    """One checkpoint tensor as stored: its name, shape and dtype, and where copies go."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sink: "Sink"


class Sink(Protocol):
    def copy(self, dst: torch.Tensor, lazy: "LazyTensor") -> None:
        """Fill `dst` (a real tensor of the lazy view's shape) with the view's values, casting."""

    def read(self, lazy: "LazyTensor", why: str) -> torch.Tensor:
        """The view's values now (a fallback: `why` names the operation)."""


class LazyTensor(torch.Tensor):
    """A checkpoint tensor's view that holds no data (see the module docstring)."""

    source: LazySource
    geometry: Geometry

    @staticmethod
    def __new__(cls, source: LazySource, geometry: Geometry | None = None, dtype: torch.dtype | None = None):
        geometry = geometry or Geometry.whole(source.shape)
        tensor = torch.Tensor._make_wrapper_subclass(cls, geometry.shape, dtype=dtype or source.dtype,
                                                     device=torch.device("cpu"))
        tensor.source, tensor.geometry = source, geometry
        return tensor

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"LazyTensor({self.source.name!r}, box={list(self.geometry.box)}, shape={list(self.shape)}, "
                f"dtype={self.dtype})")

    def _with(self, geometry: Geometry) -> "LazyTensor":
        return LazyTensor(self.source, geometry, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.copy_.default and isinstance(args[1], LazyTensor) and not isinstance(args[0], LazyTensor):
            dst, lazy = args[0], args[1]
            if tuple(dst.shape) != tuple(lazy.shape):
                raise ShapeMismatchError(f"{lazy.source.name}: a weight loader copies a view of shape "
                                         f"{list(lazy.shape)} into a tensor of shape {list(dst.shape)}.",
                                         [(lazy.source.name, tuple(lazy.shape), tuple(dst.shape))])
            lazy.source.sink.copy(dst, lazy)
            return dst
        view = VIEWS.get(func)
        if view is not None and isinstance(args[0], LazyTensor):
            try:
                return view(args[0], *args[1:], **kwargs)
            except Unsupported:
                pass
        return fallback(func, args, kwargs)


def fallback(func, args, kwargs):
    """Read every lazy argument's view now, then run the operation on real tensors."""
    def real(value):
        if isinstance(value, LazyTensor):
            return value.source.sink.read(value, str(func.overloadpacket.__name__))
        return value
    return func(*tree_map(real, args), **tree_map(real, kwargs))


def _dim(dim: int, ndim: int) -> int:
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"dimension {dim} out of range for a tensor of {ndim} dims")
    return dim % max(ndim, 1)


def _slice(t: LazyTensor, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1):
    if step != 1:
        raise Unsupported("a strided slice")
    dim = _dim(dim, t.dim())
    size = t.shape[dim]
    start, end, _ = slice(start, end).indices(size)
    return t._with(t.geometry.sliced(dim, start, max(start, end)))


def _select(t: LazyTensor, dim: int, index: int):
    dim = _dim(dim, t.dim())
    size = t.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {size}")
    return t._with(t.geometry.selected(dim, index % size))


def _split(t: LazyTensor, size: int, dim: int = 0):
    dim = _dim(dim, t.dim())
    n = t.shape[dim]
    return _pieces(t, [min(size, n - s) for s in range(0, n, size)] if size else [n], dim)


def _split_sizes(t: LazyTensor, sizes: list[int], dim: int = 0):
    return _pieces(t, list(sizes), _dim(dim, t.dim()))


def _pieces(t: LazyTensor, sizes: list[int], dim: int) -> list[LazyTensor]:
    if sum(sizes) != t.shape[dim]:
        raise Unsupported("split sizes that do not add up")
    out, start = [], 0
    for size in sizes:
        out.append(t._with(t.geometry.sliced(dim, start, start + size)))
        start += size
    return out


def _unbind(t: LazyTensor, dim: int = 0):
    dim = _dim(dim, t.dim())
    return [t._with(t.geometry.selected(dim, i)) for i in range(t.shape[dim])]


def _transpose(t: LazyTensor, a: int, b: int):
    order = list(range(t.dim()))
    a, b = _dim(a, t.dim()), _dim(b, t.dim())
    order[a], order[b] = order[b], order[a]
    return t._with(t.geometry.permuted(tuple(order)))


def _t(t: LazyTensor):
    return t if t.dim() < 2 else _transpose(t, 0, 1)


def _permute(t: LazyTensor, order: list[int]):
    return t._with(t.geometry.permuted(tuple(_dim(d, t.dim()) for d in order)))


def _unsqueeze(t: LazyTensor, dim: int):
    return t._with(t.geometry.unsqueezed(_dim(dim, t.dim() + 1)))


def _squeeze(t: LazyTensor, dims: int | list[int] | None = None):
    if dims is None:
        dims = list(range(t.dim()))
    elif isinstance(dims, int):
        dims = [dims]
    return t._with(t.geometry.squeezed(tuple(_dim(d, t.dim()) for d in dims)))


def _view(t: LazyTensor, shape: list[int]):
    shape = list(shape)
    if shape.count(-1) == 1:
        known = 1
        for n in shape:
            known *= n if n != -1 else 1
        shape[shape.index(-1)] = t.numel() // known if known else 0
    return t._with(t.geometry.reshaped(tuple(shape)))


def _same(t: LazyTensor, *args, **kwargs):
    return t._with(t.geometry)


def _cast(t: LazyTensor, *args, dtype: torch.dtype | None = None, device: Any = None, **kwargs):
    """`.to(dtype)` (on CPU): the same view, cast when it is read."""
    if device is not None and torch.device(device).type != "cpu":
        raise Unsupported("a copy to another device")
    return LazyTensor(t.source, t.geometry, dtype or t.dtype)


VIEWS = {
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_sizes,
    aten.unbind.int: _unbind,
    aten.transpose.int: _transpose,
    aten.t.default: _t,
    aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: _squeeze,
    aten.squeeze.dim: _squeeze,
    aten.squeeze.dims: _squeeze,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.alias.default: _same,
    aten.detach.default: _same,
    aten.clone.default: _same,  # the stored values do not change: a clone is the same view
    aten._to_copy.default: _cast,
}
