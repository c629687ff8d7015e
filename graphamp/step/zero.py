"""ZeRO stages 1 and 2 inside the step: reduce-scatter, update the local shard, all-gather.

Every parameter is cut along its first dimension as ``torch.chunk`` cuts it (FSDP2's layout):
``ceil(d0 / W)`` rows of the first dimension per rank, padded, flattened into a row of
``chunk = ceil(d0 / W) * prod(shape[1:])`` elements (``records/sharding.chunk_of``): rank ``r``
owns row ``r`` of every parameter. An optimizer's parameters form one bucket, ``(W, sum of chunks)``, so each step has
one reduce-scatter of gradients and one all-gather of updated parameters per optimizer, both
functional collectives inside the compiled program. The optimizer state held on a rank is its
rows only (``runner/zero_state.py`` keeps them in ``optimizer.state`` and gathers torch's
format for ``optimizer.state_dict()``).

The update math is elementwise (SGD, Adam), so running it on a shard equals running it on the
whole tensor and slicing. What needs every shard is said where it happens: the overflow flag
(all-reduce max, as for data parallel) and the clipping norm (all-reduce of the local norms).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..records.sharding import chunk_of


def _rows(tensors: list[torch.Tensor], world: int) -> torch.Tensor:
    """The bucket ``(W, sum of chunks)``: each tensor flattened, padded, cut into W rows."""
    parts = []
    for t in tensors:
        chunk = chunk_of(t.shape, world)
        flat = t.reshape(-1)
        pad = chunk * world - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        parts.append(flat.view(world, chunk))
    return torch.cat(parts, dim=1)


def _split_row(row: torch.Tensor, shapes: list, world: int) -> list[torch.Tensor]:
    return list(row.split([chunk_of(shape, world) for shape in shapes], dim=-1))


def scatter_gradients(grads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """This rank's rows of the gradients averaged over the ranks (one reduce-scatter)."""
    if not grads:
        return []
    world = dist.get_world_size(group)
    bucket = _rows(grads, world).reshape(-1)
    row = funcol.reduce_scatter_tensor(bucket, "sum", 0, group) / world
    return _split_row(row, [g.shape for g in grads], world)


def local_rows(params: list[torch.Tensor], rank: torch.Tensor, group) -> list[torch.Tensor]:
    """This rank's rows of the parameters. ``rank`` is a graph input (0-dim int64), so every
    rank traces the same graph (the ranks compare their graphs at build time)."""
    if not params:
        return []
    world = dist.get_world_size(group)
    row = _rows(params, world).index_select(0, rank.reshape(1)).squeeze(0)
    # separate tensors, not views of one row: the optimizer writes each in place, and writes
    # into views of a shared base make functionalization regenerate the whole row every time
    return [piece.clone() for piece in _split_row(row, [p.shape for p in params], world)]


def gather_parameters(rows: list[torch.Tensor], shapes: list[torch.Size], group) -> list:
    """The whole parameters of ``shapes`` from every rank's rows (one all-gather). Rows of
    several dtypes (a block's bf16 copies and its float32 norms) travel as bytes in that one
    all-gather, as FSDP2's copy-in does: ``_gather_bytes``."""
    if not rows:
        return []
    if len({row.dtype for row in rows}) > 1:
        return _gather_bytes(rows, shapes, group)
    world = dist.get_world_size(group)
    gathered = funcol.all_gather_tensor(torch.cat(rows), 0, group).view(world, -1)
    pieces = _split_row(gathered, shapes, world)
    return [
        piece.reshape(-1)[: math.prod(shape)].view(shape) for piece, shape in zip(pieces, shapes)
    ]


_ALIGN = 16  # bytes: every rank's part starts where any dtype's view of it may start


def _gather_bytes(rows: list[torch.Tensor], shapes: list[torch.Size], group) -> list:
    """``gather_parameters`` for rows of mixed dtypes: each row viewed as bytes, the widest
    dtypes first (so every piece starts at a multiple of its element size), each rank's part
    padded to ``_ALIGN`` bytes; after the gather each piece is viewed back as its dtype."""
    world = dist.get_world_size(group)
    order = sorted(range(len(rows)), key=lambda i: -rows[i].element_size())
    sizes = [rows[i].numel() * rows[i].element_size() for i in order]
    padding = -sum(sizes) % _ALIGN
    parts = [rows[i].contiguous().view(torch.uint8) for i in order]
    if padding:
        parts.append(rows[0].new_zeros(padding, dtype=torch.uint8))
    gathered = funcol.all_gather_tensor(torch.cat(parts), 0, group).view(world, -1)
    pieces = gathered.split([*sizes, padding], dim=-1)
    out: list = [None] * len(rows)
    for i, piece in zip(order, pieces):
        whole = piece.contiguous().view(rows[i].dtype).reshape(-1)
        out[i] = whole[: math.prod(shapes[i])].view(shapes[i])
    return out


def global_norm(shards: list[torch.Tensor], norm_type: float, group) -> torch.Tensor:
    """``clip_grad_norm_``'s total norm of the whole gradients, from each rank's rows (padding
    is zero, so it adds nothing)."""
    norms = torch._foreach_norm(shards, norm_type)
    local = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
    if math.isinf(norm_type):
        return funcol.all_reduce(local, "max", group)
    return funcol.all_reduce(local**norm_type, "sum", group) ** (1.0 / norm_type)
