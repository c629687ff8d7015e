"""The delayed fp8 recipe's amax histories in the step (``config.enable_fp8(recipe="delayed")``).

Each fp8 matmul of the forward records its inputs' amax of this step in column 0 of its history
(``torchkit/fp8_numerics.py``) and scales by the largest amax of the earlier steps. Here: column 0
starts afresh each step (a skipped step left its amax there), and after the update this step's
amaxes, agreed across ranks, are pushed into the histories; a skipped step leaves them as they
were. The histories are the forward's pass state (``plan.pass_state``: one per fp8 matmul, made
by ``passes/fp8_matmuls.py``), inputs of the step written in place; ``Graph.state_dict()``
saves them (``saved_key``). The delayed recipe is the one AMP pass that keeps state, so the
pass state is its.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.distributed._functional_collectives
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ...errors import ConfigError
from ...records.layouts import PassState
from ...records.spec import StepPlan
from ...records.state import SharedState
from ...records.subgraphs import Subgraph
from ...torchkit.fp8_numerics import HISTORY_ROWS, rolled_history
from ...torchkit.fxutil import NodeTagger
from ..update_math import masked
from .component import StepComponent, StepContext


class Fp8Histories(StepComponent):
    name = "fp8"
    part = "the fp8 amax histories"
    on_skip = "the amax histories are kept as they were (column 0 starts afresh the next step)"
    across_ranks = "this step's amaxes are all-reduced (max) before they enter the histories"
    saved_key = "fp8_histories"  # name -> (3, history) float32: without column 0, the scratch

    def active(self, plan: StepPlan) -> bool:
        return bool(plan.pass_state)

    def start(self, ctx: StepContext) -> None:
        if not ctx.plan.training:  # an eval step reads the histories, never writes them
            return
        for history in ctx.inputs.pass_state:
            history[:, 0] = 0.0

    def record(self, ctx: StepContext) -> None:
        histories = ctx.inputs.pass_state
        with NodeTagger(Subgraph.PASS_STATE.tag()):
            if ctx.plan.process_group is not None:
                now = torch.stack([h[:, 0] for h in histories])
                agreed = agree_on_amax(now, ctx.plan.process_group)
                for h, amax in zip(histories, agreed.unbind(0)):
                    h[:, 0] = amax
            for h in histories:
                h.copy_(masked(ctx.any_skip, h, rolled_history(h)))

    def saved_state(self, state: SharedState) -> dict[str, torch.Tensor]:
        return {k: v[:, 1:].clone() for k, v in state.pass_state.items()}

    def checked_saved(self, saved: Any) -> dict[str, torch.Tensor]:
        if not isinstance(saved, dict) or not all(
            isinstance(k, str)
            and isinstance(v, torch.Tensor)
            and v.dim() == 2
            and v.shape[0] == HISTORY_ROWS
            and v.dtype == torch.float32
            for k, v in saved.items()
        ):
            raise ConfigError(
                f"the saved {self.saved_key} must map fp8 matmul names to float32 tensors of "
                f"{HISTORY_ROWS} rows"
            )
        return saved

    def load_saved(self, state: SharedState, checked: dict[str, torch.Tensor]) -> None:
        """Each saved history into the graph's state, in place where a compiled step holds
        it (a history of another length starts afresh, as a new step would make it)."""
        for name, saved in checked.items():
            held = state.pass_state.get(name)
            device = held.device if held is not None else saved.device
            shape = (saved.shape[0], 1 + saved.shape[1])
            (history,) = state.pass_state_tensors([PassState(name, shape)], device)
            history[:, 0] = 0.0
            history[:, 1:] = saved.to(device)


def agree_on_amax(amaxes: torch.Tensor, group) -> torch.Tensor:
    """This step's amaxes, the largest over the ranks (finite by construction: non-finite
    values are never recorded), so every rank scales alike."""
    return funcol.all_reduce(amaxes, "max", group)
