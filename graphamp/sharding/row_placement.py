"""ZeRO's placement: every parameter and its optimizer state cut into one row per rank.

``RowPlacement`` is the plan's ``records.placement.Placement`` under ZeRO: stages 1 and 2 keep
the optimizer state as this rank's rows (the parameters whole), stage 3 the parameters too, and
says which blocks gather together (a ``fully_shard`` wrap's, or graphamp's own) and which stay
gathered from the forward to the backward. The ZeRO step component
(``step/components/zero.py``) decides it and reads it; the runner and ``step/examples.py`` ask it
how the step takes each tensor, without knowing it is ZeRO's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..records.optimizers import OptimizerPlan
from ..records.placement import Placement
from . import zero_state
from .cuts import chunk_of
from .rows import row_of


@dataclass(frozen=True)
class RowPlacement(Placement):
    """ZeRO ``stage`` over ``group``. ``gather_blocks``: ZeRO-3's blocks of a ``fully_shard``
    wrap, each gathered as one (``sharding.cuts.block_of``; empty: graphamp's own blocks);
    ``reshard_after_forward`` False keeps every block's gathered parameters from its forward to
    its backward (``enable_zero(reshard_after_forward=False)``), ``kept_blocks`` those of the
    wraps that ask for it."""

    stage: int
    group: Any
    gather_blocks: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    kept_blocks: tuple[str, ...] = ()

    sharded = True

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"RowPlacement.stage must be 1 to 3, got {self.stage}")
        if self.group is None:
            raise ValueError("a RowPlacement needs the process group it shards over")

    def parameter(self, p: torch.Tensor) -> torch.Tensor:
        """Under ZeRO-3 the row ``p``'s shard views; else ``p``."""
        return row_of(p) if self.stage == 3 else p

    def state_is_row(self, key: str) -> bool:
        """Every state is a row but the step count, which is whole on every rank."""
        return key != "step"

    def state_row_example(self, p: torch.Tensor) -> torch.Tensor:
        chunk = chunk_of(p.shape, dist.get_world_size(self.group))
        return torch.zeros(chunk, dtype=p.dtype, device=p.device)

    def state_row(
        self, opt: OptimizerPlan, key: str, p: torch.Tensor, existing: torch.Tensor | None
    ) -> torch.Tensor:
        """``zero_state.local_state``."""
        return zero_state.local_state(opt.optimizer, key, p, existing, self.group)

    def track(self, optimizers: list[OptimizerPlan]) -> None:
        """Each optimizer's ``state_dict()`` gathers its rows into torch's format."""
        for opt in optimizers:
            zero_state.track(opt, self.group)
