"""How ZeRO cuts a parameter into rows, one per rank (read by step/zero.py and the runtime).

One layout for every stage, FSDP2's: a parameter is cut along its first dimension into ``W``
chunks of ``ceil(d0 / W)`` rows (the last ranks' chunks shorter or empty, as ``torch.chunk``
cuts), and each rank's chunk is zero-padded to that many rows. Flattened, rank ``r``'s row is
the elements ``[r * chunk, (r + 1) * chunk)`` of the parameter flattened and zero-padded to
``W * chunk``; so ZeRO-1/2's flat rows and ZeRO-3's ``Shard(0)`` DTensors are the same bytes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


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


# ZeRO-3 (runner/sharded_params.py): the attribute of each sharded parameter holding the flat
# padded row its local tensor views; it lives and dies with the parameter (a detached copy does
# not carry it)
ROW_ATTRIBUTE = "_graphamp_row"


def is_shard(t: object) -> bool:
    """Whether ``t`` is a parameter graphamp's ZeRO-3 sharded."""
    return isinstance(t, torch.Tensor) and getattr(t, ROW_ATTRIBUTE, None) is not None


def row_of(p: torch.Tensor) -> torch.Tensor:
    """The flat padded row of the shard ``p`` the compiled step reads and updates in place."""
    return getattr(p, ROW_ATTRIBUTE)
