"""Data parallel: the gradients averaged over the ranks (one coalesced functional all-reduce, as
DDP), and the ranks' agreement on whether the step overflowed, so every rank skips alike (also
where a component reduces the gradients itself, ``StepContext.grads_reduced``: a sharded
update's reduce-scatter).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.distributed._functional_collectives
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ...records.spec import StepPlan
from ...records.subgraphs import Subgraph
from ...torchkit.fxutil import NodeTagger
from .component import StepComponent, StepContext


class DataParallel(StepComponent):
    name = "data_parallel"
    part = "the gradients' all-reduce"
    on_skip = "nothing of its own"
    across_ranks = (
        "the gradients are averaged over the ranks, and the overflow flags all-reduced (max): every"
        " rank skips alike"
    )

    def active(self, plan: StepPlan) -> bool:
        return plan.training and plan.process_group is not None

    def gradients(self, ctx: StepContext) -> None:
        if ctx.grads_reduced:  # by a component of its own
            return
        with NodeTagger(Subgraph.DATA_PARALLEL.tag()):
            ctx.grads = average_over_ranks(ctx.grads, ctx.plan.process_group)

    def overflow(self, ctx: StepContext) -> None:
        flagged = [u for u in ctx.updates if u.found is not None]
        flags = [u.found for u in flagged if u.found is not None]
        if not flags:
            return
        with NodeTagger(Subgraph.DATA_PARALLEL.tag()):
            agreed = agree_on_overflow(flags, ctx.plan.process_group)
        for u, found in zip(flagged, agreed):
            u.found = found


def average_over_ranks(grads: list[torch.Tensor], group) -> list[torch.Tensor]:
    """DDP's gradient averaging, as one coalesced functional all-reduce inside the step."""
    world = dist.get_world_size(group)
    reduced = funcol.all_reduce_coalesced(list(grads), "sum", group)
    return [g / world for g in reduced]


def agree_on_overflow(found_infs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Every rank skips a step if any rank overflowed (all-reduce max of the flags)."""
    agreed = funcol.all_reduce(torch.stack(found_infs), "max", group)
    return list(agreed.unbind(0))
