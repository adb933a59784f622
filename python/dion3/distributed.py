# distributed.py — how dion3's PyTorch front end maps a parameter onto the engine's layouts
# (algorithm.md §3): from `distributed_mesh` (None, a ProcessGroup for DDP, or a DeviceMesh for FSDP2 /
# HSDP) and, for DTensor parameters, their mesh and placements. Also the DTensor plumbing the
# optimizer state needs: local shards of state tensors, state created as DTensors with the
# parameter's placements (what torch.distributed.checkpoint expects), and the local part of a
# full tensor loaded from a single-device checkpoint.
from __future__ import annotations

from dataclasses import dataclass
import math
import weakref
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

try:  # DTensor moved from torch.distributed._tensor to torch.distributed.tensor in 2.4
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard  # type: ignore

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover - torch without device meshes
    DeviceMesh = None  # type: ignore


# Plain tensors skip the subclass check, which costs microseconds per call.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def is_dtensor(t: Any) -> bool:
    return type(t) not in _PLAIN and isinstance(t, DTensor)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    if t is None:
        return None
    return t.to_local() if isinstance(t, DTensor) else t


def _placed_otherwise(p: torch.Tensor, g: Optional[torch.Tensor]) -> bool:
    """Whether DTensor gradient g is placed otherwise than its DTensor parameter p."""
    return isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements  # tuples, both


def placed_local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """p's local gradient where it is placed as p is (no collective needed), else None."""
    return None if _placed_otherwise(p, p.grad) else local(p.grad)


def registration_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """What the engine is given as p's gradient while p is registered: the local part as it is
    placed (a Partial one not yet summed), where it has the weight's local shape, so that
    registration runs no collective (one rank may rebuild its engine alone); else, a placement
    that changes the shape, the gradient placed as p is. Each step hands over local_grad(p)."""
    g = local(p.grad)
    return g if g is None or g.shape == local(p).shape else local_grad(p)


def local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The local part of p's gradient placed as p is. A DTensor gradient placed otherwise (Partial:
    what autograd leaves a replicated weight under sequence or tensor parallelism) is
    redistributed first, as torch.optim's DTensor ops do: stepping each rank's partial sum would
    let the ranks drift apart."""
    g = p.grad
    if _placed_otherwise(p, g):
        g = g.redistribute(p.device_mesh, p.placements)
    return local(g)


@dataclass(frozen=True)
class ParamLayout:
    """What the engine is told about one parameter."""

    kind: str  # "local", "replicated", "row_shard", "col_shard" or "block"
    group: Any = None  # the torch.distributed process group it spans
    global_rows: int = 0  # row_shard: the whole matrix's rows
    global_cols: int = 0  # col_shard: the whole matrix's columns
    row_offset: int = -1  # row_shard cut otherwise than ceil(m/P) in rank order: this rank's first row
    row_chunk: int = 0  # ... and the largest shard's rows
    col_group: Any = None  # block: the process group the columns are cut over


LOCAL = ParamLayout("local")


def check_mesh(mesh: Any, name: str) -> None:
    """Refuses anything but None, a ProcessGroup or a DeviceMesh (on every rank alike)."""
    if mesh is None:
        return
    if isinstance(mesh, dist.ProcessGroup):
        return
    outside = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", None)
    if outside is not None and type(mesh) is type(outside) and mesh == outside:
        raise ValueError(f"dion3: {name}(distributed_mesh=...) got torch's marker for a process group this rank "
                         "is not in (dist.new_group(ranks) returns it on the other ranks): make the optimizer "
                         "with that group only on its ranks")
    if DeviceMesh is not None and isinstance(mesh, DeviceMesh):
        if mesh.ndim not in (1, 2):
            raise ValueError(f"dion3: {name}(distributed_mesh=...) takes a 1-D DeviceMesh (FSDP2) or a 2-D "
                             f"(replicate, shard) one (HSDP); got a {mesh.ndim}-D mesh")
        return
    raise TypeError(f"dion3: {name}(distributed_mesh=...) must be None, a ProcessGroup (DDP) or a DeviceMesh "
                    f"(FSDP2 / HSDP); got {type(mesh).__name__}")


def gatherable(t: Any) -> bool:
    """Whether this process can gather DTensor t (full_tensor()): its mesh's ranks are of the
    current world and include this one (a per-rank file saved on another world's mesh is not)."""
    if not dist.is_initialized():
        return False
    ranks = t.device_mesh.mesh.flatten().tolist()
    return max(ranks) < dist.get_world_size() and dist.get_rank() in ranks


def same_mesh(a: Any, b: Any) -> bool:
    return a is b or (a.device_type == b.device_type and a.mesh.shape == b.mesh.shape
                      and torch.equal(a.mesh, b.mesh))


def _sub_mesh(one: Any, two: Any, dim: int) -> bool:
    """Whether 1-D mesh `one` is this rank's slice of 2-D mesh `two` along dimension dim."""
    names = two.mesh_dim_names
    if names is not None:
        return same_mesh(one, two[names[dim]])
    return sorted(dist.get_process_group_ranks(one.get_group())) == sorted(
        dist.get_process_group_ranks(two.get_group(dim)))


def _dp_slice(pmesh: Any, mesh: Any) -> bool:
    """Whether 1-D pmesh is this rank's slice of 2-D distributed_mesh along its first, data-parallel
    dimension: FSDP2 over tensor parallel, (dp, tp), where a layer left out of the TP plan is
    sharded over dp alone and replicated, with equal gradients, over tp. A slice along the second
    dimension is refused: under HSDP, (replicate, shard), a layer sharded over the shard slice alone
    would have its gradients never averaged over the replicas."""
    return isinstance(mesh, DeviceMesh) and mesh.ndim == 2 and pmesh.ndim == 1 and _sub_mesh(pmesh, mesh, 0)


def mesh_of(p: Any, mesh: Any) -> Any:
    """DTensor p's mesh, or distributed_mesh where p's mesh is its data-parallel slice (_dp_slice),
    so that such layers may share a group with the tensor-parallel ones."""
    return mesh if _dp_slice(p.device_mesh, mesh) else p.device_mesh


def _mesh_matches(mesh: Any, pmesh: Any, shard_dim: Optional[int]) -> bool:
    """distributed_mesh is the parameter's mesh, or (HSDP) the sub-mesh of its sharded dim, or
    (FSDP2 + TP) a 2-D mesh whose data-parallel slice the parameter lives on (_dp_slice)."""
    if same_mesh(mesh, pmesh):
        return True
    if shard_dim is not None and mesh.ndim == 1 and pmesh.ndim == 2:
        return _sub_mesh(mesh, pmesh, shard_dim)
    return _dp_slice(pmesh, mesh)


def layout_of(p: torch.Tensor, mesh: Any, who: str, matrix: bool, flatten: bool) -> ParamLayout:
    """The engine layout of parameter p under distributed_mesh `mesh`; ValueError /
    NotImplementedError naming the parameter where it cannot be served. Decided from metadata
    that is the same on every rank, so every rank raises alike."""
    if mesh is None:
        if is_dtensor(p):
            raise ValueError(f"dion3: {who} is a DTensor (placements {list(p.placements)}) but distributed_mesh "
                             "is None; pass the DeviceMesh it lives on (FSDP2: the mesh given to fully_shard)")
        return LOCAL
    if isinstance(mesh, dist.ProcessGroup):
        if is_dtensor(p):
            raise ValueError(f"dion3: {who} is a DTensor but distributed_mesh is a ProcessGroup (the DDP layout, "
                             "replicated parameters); pass the parameter's DeviceMesh instead")
        return ParamLayout("replicated", mesh, int(p.shape[0]) if p.dim() else 0)
    # A DeviceMesh.
    if not is_dtensor(p):
        # A plain tensor next to sharded ones: every rank holds the same copy (DDP-style).
        group = mesh.get_group(mesh.ndim - 1)
        return ParamLayout("replicated", group, int(p.shape[0]) if p.dim() else 0)
    pmesh, placements = p.device_mesh, tuple(p.placements)
    if any(not (_is_shard(pl) or pl.is_replicate()) for pl in placements):
        raise ValueError(f"dion3: {who} has placements {list(placements)}; dion3 steps Shard and Replicate "
                         "placements only (a Partial gradient must be reduced first)")
    shard_dims = [i for i, pl in enumerate(placements) if _is_shard(pl)]
    if len(shard_dims) > 1:
        if not same_mesh(mesh, pmesh):
            raise ValueError(f"dion3: {who} lives on {pmesh} but distributed_mesh is {mesh}; for parameters sharded "
                             "on several mesh dimensions pass that whole mesh")
        return _multi_dim_layout(p, pmesh, placements, shard_dims, who, matrix, flatten)
    shard_dim = shard_dims[0] if shard_dims else None
    if not _mesh_matches(mesh, pmesh, shard_dim):
        raise ValueError(f"dion3: {who} lives on {pmesh} but distributed_mesh is {mesh}; pass the mesh given to "
                         "fully_shard (for HSDP, it or its shard sub-mesh; for FSDP2 over tensor parallel, the "
                         "whole 2-D mesh)")
    if shard_dim is None:
        return ParamLayout("replicated", pmesh.get_group(pmesh.ndim - 1), int(p.shape[0]) if p.dim() else 0)
    tensor_dim = placements[shard_dim].dim
    group = pmesh.get_group(shard_dim)
    if not matrix:
        return ParamLayout("replicated", group, 0)  # element-wise: the shard is stepped as it is
    if p.dim() > 2 and not flatten:
        if tensor_dim < p.dim() - 2:
            # A stack of matrices (experts) cut between its matrices: each rank holds whole ones and
            # steps them itself, as one device would; nothing is exchanged.
            return LOCAL
        raise NotImplementedError(
            f"dion3: {who} is a stack of {list(p.shape[-2:])} matrices (shape {list(p.shape)}, flatten=False) "
            f"sharded inside its matrices (Shard({tensor_dim})); dion3 steps stacks sharded between their "
            "matrices (on a leading dimension, FSDP2's default Shard(0)). flatten=True would make the stack one "
            f"{p.shape[0]} x {math.prod(p.shape[1:])} matrix, orthogonalized as a whole: a different update")
    if tensor_dim == 0:
        return ParamLayout("row_shard", group, int(p.shape[0]))
    if tensor_dim == 1 and p.dim() == 2:
        return ParamLayout("col_shard", group, int(p.shape[0]), int(p.shape[1]))
    raise NotImplementedError(
        f"dion3: {who} with shape {list(p.shape)} is sharded on tensor dimension {tensor_dim} "
        f"(Shard({tensor_dim})); dion3 steps row (Shard(0)) and column (Shard(1)) shards of matrices")


def _is_shard(pl) -> bool:
    # FSDP2 over tensor parallel places _StridedShard, which some torch versions do not count as
    # a Shard; it cuts a tensor dimension all the same (`dim`).
    return pl.is_shard() or (type(pl).__name__ == "_StridedShard" and hasattr(pl, "dim"))


# Flattened process groups by their ranks (new_group is collective: made once while it lives).
# Held weakly, as the optimizer holds its groups: torch keeps a group until it is destroyed.
_GROUPS: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _registered(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False  # destroyed (destroy_process_group): a new one is made


def _flat_group(mesh) -> Any:
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    group = _GROUPS.get(ranks)
    if group is None or not _registered(group):
        # Only this mesh's ranks make it: another pipeline stage makes the group of its own
        # mesh at the same time, and a world-wide new_group would pair the two.
        group = _GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


def _multi_dim_layout(p, pmesh, placements, shard_dims, who, matrix, flatten) -> ParamLayout:
    """A parameter sharded on several mesh dimensions: FSDP2 over tensor parallel."""
    dims = {placements[i].dim for i in shard_dims}
    if not matrix:
        return ParamLayout("replicated", _flat_group(pmesh), 0)  # element-wise: the block as it is
    if dims == {0} and len(shard_dims) == pmesh.ndim and (p.dim() == 2 or flatten):
        m = int(p.shape[0])
        if sum(1 for s in pmesh.shape if s > 1) <= 1:
            # One mesh dimension does all the cutting: ceil(m/P) rows in rank order, the standard
            # cut (which the global selection scope needs).
            return ParamLayout("row_shard", _flat_group(pmesh), m)
        # Rows cut twice (FSDP2's _StridedShard over ColwiseParallel's Shard(0)): every rank holds
        # contiguous rows, though not in rank order. A row shard over all the mesh's ranks; the
        # largest shard is the first, ceil(ceil(m/a)/b) = ceil(m/(a*b)) rows.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(p.shape, pmesh, placements)
        chunk = -(-m // pmesh.size())
        return ParamLayout("row_shard", _flat_group(pmesh), m, 0, int(offset[0]), chunk)
    if (len(shard_dims) == 2 and sorted(dims) == [0, 1] and p.dim() == 2
            and all(type(placements[i]).__name__ != "_StridedShard" for i in shard_dims)):
        # Row and column blocks (FSDP2's Shard(0) over RowwiseParallel's Shard(1)).
        row_dim = next(i for i in shard_dims if placements[i].dim == 0)
        col_dim = next(i for i in shard_dims if placements[i].dim == 1)
        if pmesh.ndim != 2:
            raise NotImplementedError(f"dion3: {who}: row and column blocks on a {pmesh.ndim}-D mesh")
        return ParamLayout("block", pmesh.get_group(row_dim), int(p.shape[0]), int(p.shape[1]),
                           col_group=pmesh.get_group(col_dim))
    raise NotImplementedError(
        f"dion3: {who} with shape {list(p.shape)} is sharded as {list(placements)}; dion3 steps rows cut over "
        "mesh dimensions (FSDP2 over ColwiseParallel) and row x column blocks (FSDP2 over RowwiseParallel)")


# Channels-last layouts dion3 steps in memory order: the permutation of the dimensions that
# makes such a tensor contiguous.
_MEMORY_ORDERS = ((4, torch.channels_last, (0, 2, 3, 1)), (5, torch.channels_last_3d, (0, 2, 3, 4, 1)))


def memory_format(t: torch.Tensor) -> Optional[torch.memory_format]:
    """channels_last(_3d) for a plain tensor laid out so (a CNN's convolution weights after
    model.to(memory_format=...)) and not contiguous as well; None otherwise."""
    if is_dtensor(t) or t.is_contiguous():
        return None
    return next((fmt for dim, fmt, _ in _MEMORY_ORDERS if t.dim() == dim and t.is_contiguous(memory_format=fmt)),
                None)


def memory_order(t: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The permutation that gives t's dimensions in memory order when t is channels-last (the
    view dion3 steps, contiguous and on t's storage); None for a contiguous tensor."""
    fmt = memory_format(t)
    return next(perm for _, f, perm in _MEMORY_ORDERS if f == fmt) if fmt is not None else None


def state_format(p: torch.Tensor, shape: Tuple[int, ...]) -> torch.memory_format:
    """The layout of p's state tensor of `shape` as the engine steps it: p's channels-last one
    where the state has p's shape (the engine steps both in memory order), contiguous otherwise."""
    fmt = memory_format(p)
    return fmt if fmt is not None and tuple(shape) == tuple(p.shape) else torch.contiguous_format


def zeros_like_layout(p: torch.Tensor, shape: Tuple[int, ...], dtype: torch.dtype,
                      single: Optional[int] = None) -> torch.Tensor:
    """A zero state tensor for p: plain (laid out as p where it has p's shape: channels-last
    state for a channels-last weight), or a DTensor with p's mesh and placements whose global
    shape is `shape` (the momentum: p's shape; NorMuon's variance, one value per output feature:
    p[..., 0:1]'s, or p[..., 0:1, :]'s in a transposed group, `single` the dimension of size one,
    -1 or -2)."""
    if not is_dtensor(p):
        return torch.zeros(shape, dtype=dtype, device=p.device).contiguous(memory_format=state_format(p, shape))
    placements = _placements_for(shape, p.placements, tuple(p.shape), single)
    lt = torch.zeros(_local_shape(shape, p.device_mesh, placements), dtype=dtype, device=p.to_local().device)
    return DTensor.from_local(lt, p.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def _placements_for(shape: Tuple[int, ...], placements, like: Tuple[int, ...], single: Optional[int] = None) -> Tuple:
    """Placements of a state tensor of `shape` for a parameter of shape `like` placed so: a
    tensor of the parameter's shape is placed as the parameter; NorMuon's variance (`single`: its
    dimension of size one, -1 for p[..., 0:1], -2 for a transposed group's p[..., 0:1, :], even
    where the parameter has one column or row there too) keeps the shards of the output features
    and drops those of the dimension it holds one value of (every rank of such a shard holds all
    the features' values), as it drops shards of dimensions it does not have."""
    out = []
    for pl in placements:
        if _is_shard(pl) and (pl.dim >= len(shape) or (single is not None and pl.dim == len(shape) + single) or
                              (pl.dim < len(like) and shape[pl.dim] != like[pl.dim])):
            out.append(Replicate())
        else:
            out.append(pl)
    return tuple(out)


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= int(s)
    return tuple(reversed(stride))


def _chunk(size: int, parts: int, index: int) -> Tuple[int, int]:
    """(start, length) of chunk `index` of `size` split as torch.chunk does (ceil-sized, the last
    ones short or empty): DTensor's Shard layout."""
    c = -(-size // parts) if parts else size
    start = min(size, index * c)
    return start, max(0, min(c, size - start))


def _local_box(shape: Tuple[int, ...], mesh: Any, placements) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(offset, shape) of this rank's block of a tensor of `shape` placed so (the placements of
    the tensor itself). FSDP2 over tensor parallelism cuts a dimension twice (is_shard() is False
    for the strided cut): that block is as DTensor computes it."""
    if any(type(pl).__name__ == "_StridedShard" for pl in placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        size, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
        return tuple(offset), tuple(size)
    offset, size = [0] * len(shape), list(shape)
    for mdim, pl in enumerate(placements):
        if pl.is_shard():
            start, n = _chunk(size[pl.dim], mesh.size(mdim), mesh.get_local_rank(mdim))
            offset[pl.dim] += start
            size[pl.dim] = n
    return tuple(offset), tuple(size)


def _local_shape(shape: Tuple[int, ...], mesh: Any, placements) -> Tuple[int, ...]:
    """This rank's shape of a tensor of `shape` placed so (the placements of the tensor itself)."""
    return _local_box(shape, mesh, placements)[1]


def local_part(full: torch.Tensor, like: torch.Tensor, single: Optional[int] = None) -> torch.Tensor:
    """This rank's part of a full (unsharded) tensor, as a DTensor placed like `like` (a DTensor
    parameter or state tensor; single as for zeros_like_layout): loading a single-device
    checkpoint into a sharded run."""
    shape = tuple(full.shape)
    mesh, placements = like.device_mesh, _placements_for(shape, like.placements, tuple(like.shape), single)
    part = full
    for d, (start, n) in enumerate(zip(*_local_box(shape, mesh, placements))):
        if n != shape[d]:
            part = part.narrow(d, start, n)
    lt = part.detach().to(device=like.to_local().device, copy=True).contiguous()
    return DTensor.from_local(lt, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


__all__ = ["DTensor", "Shard", "Replicate", "ParamLayout", "LOCAL", "check_mesh", "layout_of", "local", "local_grad",
           "registration_grad", "memory_format", "memory_order", "state_format",
           "is_dtensor", "same_mesh", "zeros_like_layout", "local_part"]
