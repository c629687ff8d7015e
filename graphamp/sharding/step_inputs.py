"""How the step takes each parameter and optimizer state tensor: whole, or under ZeRO as this
rank's row. The runner (the live inputs of every call) and ``step/examples.py`` (the inputs the
step is traced and compiled with) both ask here, so the two cannot disagree."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..records.optimizers import OptimizerPlan
from ..records.spec import StepPlan
from . import zero_state
from .cuts import chunk_of
from .rows import row_of


def parameter_input(plan: StepPlan, p: torch.Tensor) -> torch.Tensor:
    """The step's input for parameter ``p``: itself, or under ZeRO-3 the row its shard views."""
    return row_of(p) if plan.zero_stage == 3 else p


def state_is_row(plan: StepPlan, key: str) -> bool:
    """Does the step hold optimizer state ``key`` as this rank's row (ZeRO; the step count is
    whole on every rank)?"""
    return bool(plan.zero_stage) and key != "step"


def state_row_example(plan: StepPlan, p: torch.Tensor) -> torch.Tensor:
    """A row shaped as this rank's state for ``p`` (nothing installed)."""
    chunk = chunk_of(p.shape, dist.get_world_size(plan.process_group))
    return torch.zeros(chunk, dtype=p.dtype, device=p.device)


def state_row(
    plan: StepPlan, opt: OptimizerPlan, key: str, p: torch.Tensor, existing: torch.Tensor | None
) -> torch.Tensor:
    """This rank's live state row for (``p``, ``key``) (``zero_state.local_state``; ValueError
    where ``existing`` is not state of ``p``)."""
    return zero_state.local_state(opt.optimizer, key, p, existing, plan.process_group)


def track_state_rows(plan: StepPlan) -> None:
    """Under ZeRO, each optimizer's ``state_dict()`` gathers its rows into torch's format."""
    if plan.zero_stage:
        for opt in plan.optimizers:
            zero_state.track(opt, plan.process_group)
