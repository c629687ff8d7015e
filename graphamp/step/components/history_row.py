"""The history row every training step writes on the device (``records.history.HISTORY_COLUMNS``):
step, summed scalar loss, scale used, skipped, grad norm; ``Graph.history()`` reads the table
without a host sync per step."""

from __future__ import annotations

import torch

from ...records.spec import StepPlan
from ...records.state import SharedState
from ...records.subgraphs import Subgraph
from ...torchkit.fxutil import NodeTagger
from .component import StepComponent, StepContext


class History(StepComponent):
    name = "history"
    part = "the step's history row"
    group = "history"
    inputs = ("history_step", "history_table")
    on_skip = "its row is written, with skipped = 1"
    across_ranks = (
        "the step, scale, skip and norm are the same on every rank; the loss is the rank's own"
    )

    def active(self, plan: StepPlan) -> bool:
        return plan.training

    def example_inputs(
        self,
        plan: StepPlan,  # noqa: ARG002 - every component's signature
        state: SharedState,
        device: torch.device,
    ) -> list:
        return state.history.materialize(device)

    def start(self, ctx: StepContext) -> None:
        ctx.step_number = self.own(ctx)[0]

    def record(self, ctx: StepContext) -> None:
        # before the scaler's state is written (FINISH): a read after copy_ sees the new value
        with NodeTagger(Subgraph.HISTORY.tag()):
            record_history(self.own(ctx), ctx.fwd.losses, ctx.scale, ctx.any_skip, ctx.norms)


def record_history(
    history: list[torch.Tensor],
    losses: list[torch.Tensor],
    scale: torch.Tensor | None,
    any_skip: torch.Tensor | None,
    norms: list[torch.Tensor],
) -> None:
    """Write row ``step % capacity``: step, summed scalar loss, scale used, skipped, grad norm."""
    step, table = history
    scalar_losses = [loss for loss in losses if loss.numel() == 1]

    def full(value: float) -> torch.Tensor:
        return torch.full((), value, dtype=torch.float32, device=step.device)

    nan = full(float("nan"))
    loss = (
        torch.stack([v.reshape(()).float() for v in scalar_losses]).sum() if scalar_losses else nan
    )
    # the table is float64: the step column is exact for 2**53 steps (float32: 2**24, a
    # few days of fast steps); the fp32 values above are stored exactly
    if norms:
        grad_norm = (
            norms[0].float()
            if len(norms) == 1
            else torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
        )
    else:
        grad_norm = nan
    row = torch.stack(
        [
            step.double(),
            loss.detach().double(),
            scale.double() if scale is not None else full(1.0).double(),
            any_skip.double() if any_skip is not None else full(0.0).double(),
            grad_norm.detach().double(),
        ]
    )
    index = torch.remainder(step, table.shape[0]).reshape(1)
    table.index_copy_(0, index, row.reshape(1, -1))
    step.copy_(step + 1)
