"""A load over a torch DeviceMesh: 1-D (tensor parallel) or 2-D with dims named
("dp", "tp") (replicas of one tensor-parallel model). A rank's share comes from its `tp`
coordinate; ranks with the same `tp` coordinate hold the same shard (see cooperate.py)."""
from __future__ import annotations

from typing import Any

from .errors import ArgumentError


def check_mesh(mesh: Any) -> None:
    """A 1-D mesh, or a 2-D one with dims named ("dp", "tp"); anything else refused."""
    ndim = getattr(mesh, "ndim", None)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if ndim == 1 or (ndim == 2 and set(names) == {"dp", "tp"}):
        return
    raise ArgumentError(f"mesh={mesh!r}: pass a torch DeviceMesh of one dim (tensor parallel) or of two dims named "
                        "('dp', 'tp'), e.g. init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp')).")


def tp_mesh(mesh: Any) -> Any:
    """The tensor-parallel (sub-)mesh: the mesh itself when 1-D, else `mesh["tp"]`."""
    return mesh if mesh.ndim == 1 else mesh["tp"]


def ranks_of(mesh: Any, rank: int, world: int) -> tuple[int, int]:
    """(rank, world) of this process's tensor-parallel share: its `tp` coordinate and the
    size of the `tp` dim. An explicit rank/world beside the mesh must agree with it."""
    check_mesh(mesh)
    tp = tp_mesh(mesh)
    mine = (tp.get_local_rank(), tp.size())
    if (rank, world) not in ((0, 1), mine):
        raise ArgumentError(f"load_into(rank={rank}, world={world}, mesh=...): the mesh makes this process rank "
                            f"{mine[0]} of {mine[1]} (its 'tp' dim); pass the mesh alone.")
    return mine


def cooperating(mesh: Any, cooperative: bool | None) -> bool:
    """Replicas split their identical reads: a mesh with a `dp` dim of more than one rank,
    unless `cooperative=False`."""
    return mesh is not None and cooperative is not False and mesh.ndim == 2 and mesh["dp"].size() > 1
