"""The delayed fp8 recipe's amax histories in the step (``config.enable_fp8(recipe="delayed")``).

Each fp8 matmul of the forward records its inputs' amax of this step in column 0 of its history
(``torchkit/fp8_numerics.py``) and scales by the largest amax of the earlier steps. Here: column 0
starts afresh each step (a skipped step left its amax there), and after the update this step's
amaxes, agreed across ranks, are pushed into the histories; a skipped step leaves them as they
were. The histories are the forward's pass state (``plan.pass_state``: one per fp8 matmul, made
by ``passes/fp8_matmuls.py``), inputs of the step written in place; ``Graph.state_dict()`` saves
them. The delayed recipe is the one AMP pass that keeps state, so the pass state is its.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.distributed._functional_collectives
import torch
import torch.distributed._functional_collectives as funcol

from ...records.spec import StepPlan
from ...records.subgraphs import Subgraph
from ...torchkit.fp8_numerics import rolled_history
from ...torchkit.fxutil import NodeTagger
from ..update_math import masked
from .component import StepComponent, StepContext


class Fp8Histories(StepComponent):
    name = "fp8"
    part = "the fp8 amax histories"

    def active(self, plan: StepPlan) -> bool:
        return bool(plan.pass_state)

    def start(self, ctx: StepContext) -> None:
        if not ctx.plan.training:  # an eval step reads the histories, never writes them
            return
        for history in ctx.inputs.pass_state:
            history[:, 0] = 0.0

    def record(self, ctx: StepContext) -> None:
        histories = ctx.inputs.pass_state
        with NodeTagger(Subgraph.FP8.tag()):
            if ctx.plan.process_group is not None:
                now = torch.stack([h[:, 0] for h in histories])
                agreed = agree_on_amax(now, ctx.plan.process_group)
                for h, amax in zip(histories, agreed.unbind(0)):
                    h[:, 0] = amax
            for h in histories:
                h.copy_(masked(ctx.any_skip, h, rolled_history(h)))


def agree_on_amax(amaxes: torch.Tensor, group) -> torch.Tensor:
    """This step's amaxes, the largest over the ranks (finite by construction: non-finite
    values are never recorded), so every rank scales alike."""
    return funcol.all_reduce(amaxes, "max", group)
