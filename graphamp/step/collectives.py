"""Data parallel inside the step: functional collectives on torch.distributed."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def average_over_ranks(grads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """DDP's gradient averaging, as one coalesced functional all-reduce inside the step."""
    world = dist.get_world_size(group)
    reduced = funcol.all_reduce_coalesced(list(grads), "sum", group)
    return [g / world for g in reduced]


def agree_on_overflow(found_infs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Every rank skips a step if any rank overflowed (all-reduce max of the flags)."""
    agreed = funcol.all_reduce(torch.stack(found_infs), "max", group)
    return list(agreed.unbind(0))
