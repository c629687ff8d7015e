"""Loss scaling (the grad scaler): unscale and check each optimizer's gradients, decide whether
the step is skipped, and update the scale, as ``torch.amp.GradScaler`` does, on the device.

The forward seeds its losses with the scale (``gradients.py``: the scale is an input of the
forward); the rest of the scaler's part of the step is here. Its state is the scaler's four
tensors (scale, growth tracker, hysteresis tracker, found_inf), inputs of the step it writes in
place. A new loss-scale rule is a new ``graphamp.GradScaler.update_scale``; a new step-time
behaviour of the scaler is a change here.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._amp_foreach_non_finite_check_and_unscale_
from typing import TYPE_CHECKING, cast

import torch

from ...records.spec import StepPlan
from ...records.state import SharedState
from ...records.subgraphs import Subgraph
from ...torchkit.fxutil import NodeTagger
from .component import OptimizerUpdate, StepComponent, StepContext

if TYPE_CHECKING:  # the user's scaler object reaches the step through the StepPlan
    from ...scaler import GradScaler

STATE_NAMES = ("scale", "growth_tracker", "hysteresis_tracker", "found_inf")


class LossScaling(StepComponent):
    name = "scaler"
    part = "unscaling, the overflow check or the scale update"
    group = "scaler"
    inputs = tuple(f"scaler_{n}" for n in STATE_NAMES)
    on_skip = (
        "its state goes through GradScaler.update_scale (backoff, hysteresis; a static scale stays)"
    )
    across_ranks = "the same on every rank: it reads the agreed overflow flags"

    def active(self, plan: StepPlan) -> bool:
        return plan.training and plan.scaler is not None

    def example_inputs(
        self,
        plan: StepPlan,
        state: SharedState,  # noqa: ARG002 - every component's signature
        device: torch.device,
    ) -> list:
        scaler = cast("GradScaler", plan.scaler)
        scaler._materialize(device)  # the scaler's own tensors, which the step updates
        return scaler.state_tensors()

    def start(self, ctx: StepContext) -> None:
        ctx.scale = self.own(ctx)[0]

    def optimizer_gradients(self, ctx: StepContext, u: OptimizerUpdate) -> None:
        with NodeTagger(Subgraph.GRAD_SCALER.tag()):
            u.grads, u.found = unscale_and_check(u.grads, cast(torch.Tensor, ctx.scale))

    def skip(self, ctx: StepContext) -> None:
        with NodeTagger(Subgraph.GRAD_SCALER.tag()):
            total = _total([u.found for u in ctx.updates if u.found is not None])
            ctx.found_total, ctx.any_skip = total, total > 0

    def finish(self, ctx: StepContext) -> None:
        with NodeTagger(Subgraph.GRAD_SCALER.tag()):
            found_total, any_skip = (
                cast(torch.Tensor, ctx.found_total),
                cast(torch.Tensor, ctx.any_skip),
            )
            scaler = cast("GradScaler", ctx.plan.scaler)
            write_scale_update(scaler, self.own(ctx), found_total, any_skip)


def _total(found: list[torch.Tensor]) -> torch.Tensor:
    """The overflow flags of all optimizers, summed (> 0: the step overflowed somewhere)."""
    total = found[0]
    for f in found[1:]:
        total = total + f
    return total


def unscale_and_check(grads: list[torch.Tensor], scale: torch.Tensor):
    """(unscaled grads, found_inf): torch.amp.GradScaler.unscale_ for one optimizer."""
    inv_scale = scale.double().reciprocal().float()
    # A scale whose reciprocal overflows fp32 (below 2**-128: reachable only with min_scale=0,
    # after ~140 backoffs from 2**12) turns finite scaled gradients into inf/NaN. torch's check
    # looks at the scaled values, so torch's GradScaler then writes NaN into the parameters;
    # here it counts as an overflow and the step is skipped, the state kept.
    found_inf = torch.isinf(inv_scale).to(torch.float32)
    if grads:
        # in place on the fresh gradients: functionalization turns it into the functional op
        # (a clone first would make inductor copy every gradient for this fallback kernel)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    return grads, found_inf


def write_scale_update(
    scaler: GradScaler, state: list[torch.Tensor], found_total: torch.Tensor, any_skip: torch.Tensor
) -> None:
    """The scale update after a step, written into the scaler's state tensors in place."""
    scale_t, growth_t, hysteresis_t, found_t = state
    new_scale, new_growth, new_hysteresis = scaler.update_scale(
        scale_t, growth_t, hysteresis_t, found_total
    )
    scale_t.copy_(new_scale)
    growth_t.copy_(new_growth)
    hysteresis_t.copy_(new_hysteresis)
    found_t.copy_(any_skip.to(found_t.dtype))
