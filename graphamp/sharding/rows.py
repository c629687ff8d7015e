"""ZeRO-3's rows: which parameters are graphamp's shards, and the flat row each one views.

Each shard's local tensor views a flat padded row that ``sharded_params.py`` made, of ``chunk``
elements (``cuts.chunk_of``) from offset 0 of its storage; that row is what the compiled step
reads and updates in place.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# The rows are known by their storage, not by the parameter object: ``module.cpu()``, ``.to()``
# and ``.float()`` swap a DTensor parameter's contents (torch.utils.swap_tensors), keeping the
# object and the storage but not the attributes graphamp would set on it. A weak reference: a
# dropped model's rows go.
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
