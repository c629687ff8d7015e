"""How ZeRO cuts a parameter into rows, one per rank, and which block gathers it.

One layout for every stage, FSDP2's: a parameter is cut along its first dimension into ``W``
chunks of ``ceil(d0 / W)`` rows (the last ranks' chunks shorter or empty, as ``torch.chunk``
cuts), and each rank's chunk is zero-padded to that many rows. Flattened, rank ``r``'s row is
the elements ``[r * chunk, (r + 1) * chunk)`` of the parameter flattened and zero-padded to
``W * chunk``; so ZeRO-1/2's flat rows and ZeRO-3's ``Shard(0)`` DTensors are the same bytes.
"""

from __future__ import annotations

import math
from typing import Sequence


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
