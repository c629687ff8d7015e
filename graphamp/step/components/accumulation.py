"""Gradient accumulation (``config.set_gradient_accumulation_steps``): one step over
``acc_steps`` micro-batches, their gradients averaged before the update.

The component decides the plan's ``acc_steps`` and refuses what it does not combine with. The
micro-batches are the shape of the forward and backward themselves: capture traces one
(``pipeline/stages.capture``) and ``gradients.py`` runs one forward and backward per
micro-batch, each loss seeded with ``1 / acc_steps``, so it adds nothing at the step's phases.
"""

from __future__ import annotations

from typing import Any

from ...errors import CaptureError
from ...records.spec import StepPlan
from .component import Planning, StepComponent


class Accumulation(StepComponent):
    name = "accumulation"
    part = "gradient accumulation"
    on_skip = "nothing: the micro-batches' gradients live within the step"
    across_ranks = "every rank runs the same number of micro-batches (the Graph's setting)"

    def active(self, plan: StepPlan) -> bool:
        return plan.training and plan.acc_steps > 1

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        spec = planning.spec
        n = spec.config.grad_acc_steps
        if n > 1 and spec.training and planning.captured.gradient_code.present:
            # gradient code in build() (GradientCode) runs once per step, on the whole batch's
            # gradients: not yet per micro-batch
            raise CaptureError(
                f"{spec.name}.build() reads or writes .grad, or changes parameters in place, "
                "and the Graph uses gradient accumulation "
                "(set_gradient_accumulation_steps): graphamp does not combine the two yet. "
                "Fix: train this step without accumulation, or move the gradient code to "
                "add_optimizer's clip_grad_max_norm where it is clipping"
            )
        return {"acc_steps": n}
