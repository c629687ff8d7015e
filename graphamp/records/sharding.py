"""How ZeRO cuts a parameter into rows, one per rank (read by step/components/zero.py and the runtime).

One layout for every stage, FSDP2's: a parameter is cut along its first dimension into ``W``
chunks of ``ceil(d0 / W)`` rows (the last ranks' chunks shorter or empty, as ``torch.chunk``
cuts), and each rank's chunk is zero-padded to that many rows. Flattened, rank ``r``'s row is
the elements ``[r * chunk, (r + 1) * chunk)`` of the parameter flattened and zero-padded to
``W * chunk``; so ZeRO-1/2's flat rows and ZeRO-3's ``Shard(0)`` DTensors are the same bytes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def rows_of(shape: Sequence[int], world: int) -> int:
    """Rows of the first dimension each rank holds (padded): ``ceil(d0 / W)``, at least 1. A
    0-dim parameter counts as one row."""
    d0 = shape[0] if len(shape) else 1
    return max(1, math.ceil(d0 / world))


def chunk_of(shape: Sequence[int], world: int) -> int:
    """Elements of one rank's row of a parameter of ``shape``: its padded rows times the
    elements of one row."""
    return rows_of(shape, world) * math.prod(shape[1:])


def rows_held(shape: Sequence[int], world: int, rank: int) -> int:
    """The rows of the first dimension rank ``rank`` holds unpadded (``torch.chunk``'s cut)."""
    d0, rows = shape[0], rows_of(shape, world)
    return max(0, min(rows, d0 - rank * rows))


# ZeRO-3 (runner/sharded_params.py): each shard's local tensor views a flat padded row that
# graphamp made, of ``chunk`` elements from offset 0 of its storage. The rows are known by their
# storage, not by the parameter object: ``module.cpu()``, ``.to()`` and ``.float()`` swap a
# DTensor parameter's contents (torch.utils.swap_tensors), keeping the object and the storage
# but not the attributes graphamp would set on it. A weak reference: a dropped model's rows go.
_ROWS: dict[StorageWeakRef, int] = {}
_ROW_ATTRIBUTE = "_graphamp_row"  # the row tensor, cached on the parameter while it lasts


def register_row(row: torch.Tensor) -> None:
    """``row`` (flat, from offset 0 of its own storage) is a ZeRO-3 shard's row."""
    _ROWS[StorageWeakRef(row.untyped_storage())] = row.numel()


def forget_released_rows() -> None:
    """Drop the rows whose storage is gone (a dropped model's), once per sharding."""
    for key in [k for k in _ROWS if k.expired()]:
        del _ROWS[key]


def _local(t: object) -> torch.Tensor | None:
    local = getattr(t, "_local_tensor", None)  # a DTensor's
    return local if isinstance(t, torch.Tensor) and isinstance(local, torch.Tensor) else None


def is_shard(t: object) -> bool:
    """Whether ``t`` is a parameter graphamp's ZeRO-3 sharded (a DTensor viewing its row)."""
    local = _local(t)
    return local is not None and StorageWeakRef(local.untyped_storage()) in _ROWS


def holds_shards(module: object) -> bool:
    """Whether any parameter of ``module`` (an nn.Module) is a ZeRO-3 shard."""
    parameters = getattr(module, "parameters", None)
    return callable(parameters) and any(is_shard(p) for p in parameters())


def row_of(p: torch.Tensor) -> torch.Tensor:
    """The flat padded row of the shard ``p`` the compiled step reads and updates in place."""
    local = _local(p)
    if local is None:
        raise ValueError("not a ZeRO-3 shard: a DTensor parameter is expected")
    cached = getattr(p, _ROW_ATTRIBUTE, None)
    storage = local.untyped_storage()
    if cached is not None and cached.untyped_storage().data_ptr() == storage.data_ptr():
        return cached
    row = local.new_empty(0).set_(storage, 0, (_ROWS[StorageWeakRef(storage)],), (1,))
    setattr(p, _ROW_ATTRIBUTE, row)
    return row


@dataclasses.dataclass(frozen=True)
class FullyShardWrap:
    """What graphamp kept of a model the user wrapped with FSDP2's ``fully_shard``
    (runtime/fsdp_adopt.py): the step is ZeRO-3 over ``group``, gathering each wrapped module's
    parameters as one block, and the wrap's ``MixedPrecisionPolicy`` is checked against AMP."""

    group: Any  # the 1-D mesh's process group
    blocks: tuple[str, ...]  # the wrapped modules' paths from the Graph ("model.layers.0", "model")
    param_dtype: torch.dtype | None  # MixedPrecisionPolicy.param_dtype: must be AMP's dtype
    # the blocks whose wrap keeps its gathered parameters from the forward to the backward
    # (reshard_after_forward=False, or FSDP2's default for the root)
    kept: tuple[str, ...] = ()

    def merged(self, other: FullyShardWrap) -> FullyShardWrap:
        """Two registered wraps (a model and its loss module, say) on one group."""
        return dataclasses.replace(
            self, blocks=self.blocks + other.blocks, kept=self.kept + other.kept
        )


def block_of(name: str, blocks: Sequence[str] = ()) -> str:
    """The block a parameter is gathered with, from its path. With ``blocks`` (the modules a
    user wrapped with ``fully_shard``), the innermost one holding it. Otherwise, or outside
    them, up to the first index (``model.layers.3`` of ``model.layers.3.attn.q.weight``: a
    transformer block, a ResNet stage's unit), else its registered module's child
    (``model.embed``), as FSDP2's users wrap each block and then the root."""
    holders = [b for b in blocks if name.startswith(b + ".")]
    if holders:
        return max(holders, key=len)
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[: min(2, len(parts) - 1)])
