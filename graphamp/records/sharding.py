"""How ZeRO cuts a parameter into rows, one per rank (read by step/zero.py and the runtime)."""

from __future__ import annotations

import math


def chunk_of(numel: int, world: int) -> int:
    """Elements of one rank's row of a parameter with ``numel`` elements: the parameter is
    flattened, zero-padded to ``chunk * world`` and rank ``r`` owns ``[r*chunk, (r+1)*chunk)``."""
    return max(1, math.ceil(numel / world))
