"""build()'s own gradient code (``records.captured.GradientCode``): the ``.grad`` build() left is
added to the step's gradients (and checked, with a scaler), and the parameters build() changed
in place (SAM's restore, a clamp) take their new values, which a skipped step puts back."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._amp_foreach_non_finite_check_and_unscale_
import torch

from ...records.spec import StepPlan
from ...records.subgraphs import Subgraph
from ...torchkit.fxutil import NodeTagger
from ..update_math import masked
from .component import OptimizerUpdate, StepComponent, StepContext


class GradientCode(StepComponent):
    name = "gradient_code"
    part = "the gradient code of build()"
    on_skip = "the parameters build() changed in place get their old values back"
    across_ranks = (
        "it reads the gradients after data parallel averaged them: the same on every rank"
    )

    def active(self, plan: StepPlan) -> bool:
        code = plan.captured.gradient_code
        return plan.training and bool(code.changed_params or code.grad_params)

    def gradients(self, ctx: StepContext) -> None:
        """The changed parameters' new values written; their old ones kept (by position) for
        a skipped step."""
        s, before = ctx.inputs, {}
        for i, value in zip(ctx.plan.captured.gradient_code.changed_params, ctx.fwd.new_params):
            if ctx.plan.scaler is not None:
                before[i] = s.params[i].clone()
            s.params[i].copy_(value)
        ctx.kept[self.name] = before

    def optimizer_gradients(self, ctx: StepContext, u: OptimizerUpdate) -> None:
        if not ctx.fwd.explicit:
            return
        with NodeTagger(Subgraph.GRAD_SCALER.tag()):
            u.grads, u.found = add_explicit_gradients(
                u.opt.forward_positions, u.grads, ctx.fwd.explicit, ctx.fwd.reached, u.found
            )

    def skip(self, ctx: StepContext) -> None:
        """A skipped step is skipped whole: the parameters build() changed get their values
        back, as the buffers do."""
        params = ctx.inputs.params
        for i, old in ctx.kept[self.name].items():
            params[i].copy_(masked(ctx.any_skip, old, params[i]))


def add_explicit_gradients(
    positions: list[int],
    grads: list[torch.Tensor],
    explicit: dict[int, torch.Tensor],
    reached: set[int],
    found: torch.Tensor | None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The gradients with the ``.grad`` build() left added (``positions``: the parameters of
    ``grads``; ``explicit`` and ``reached``: ``ForwardResult``'s), as eager's ``backward()``
    adds to ``.grad``: ``.grad + new``. With a scaler, the sums are checked for overflow (after
    the user's gradient code) and ``found`` counts them."""
    out, summed = list(grads), []
    for j, i in enumerate(positions):
        if i in explicit:
            out[j] = explicit[i] + grads[j] if i in reached else explicit[i]
            summed.append(j)
    if found is not None and summed:
        checked = [out[j] for j in summed]
        # multiplying by one is exact: only the check is wanted
        torch._amp_foreach_non_finite_check_and_unscale_(checked, found, torch.ones_like(found))
        for j, g in zip(summed, checked):
            out[j] = g
    return out, found
