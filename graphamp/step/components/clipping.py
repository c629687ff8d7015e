"""Gradient clipping (``add_optimizer(..., clip_grad_max_norm=...)``): each optimizer's gradients
scaled to a total norm at most its limit, after unscaling, as ``clip_grad_norm_`` after
``GradScaler.unscale_``. A non-finite norm counts as an overflow; the norms go to the history.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._foreach_mul, torch._foreach_norm
import torch

from ...records.spec import StepPlan
from ...records.subgraphs import Subgraph
from ...torchkit.fxutil import NodeTagger
from .component import OptimizerUpdate, StepComponent, StepContext


class Clipping(StepComponent):
    name = "clipping"
    part = "gradient clipping"
    on_skip = "nothing of its own: with a scaler, a non-finite total norm skips the step"
    across_ranks = "the total norm is over every rank's gradients: the same on every rank"

    def active(self, plan: StepPlan) -> bool:
        return any(opt.clip_max_norm is not None for opt in plan.optimizers)

    def optimizer_gradients(self, ctx: StepContext, u: OptimizerUpdate) -> None:
        if u.opt.clip_max_norm is None:
            return
        with NodeTagger(Subgraph.CLIP_GRAD.tag()):
            u.grads, total_norm = clip_grad_norm(
                u.grads, u.opt.clip_max_norm, u.opt.clip_norm_type, ctx.norm_of
            )
            if total_norm is not None:
                ctx.norms.append(total_norm)
                u.found = count_nonfinite_norm(u.found, total_norm)


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float, norm_of=None):
    """torch.nn.utils.clip_grad_norm_ on values: (clipped grads, total norm). ``norm_of(grads,
    norm_type)`` computes the total norm where the grads are shards (``StepContext.norm_of``)."""
    if not grads:
        return grads, None
    if norm_of is not None:
        total = norm_of(grads, norm_type)
    else:
        norms = torch._foreach_norm(grads, norm_type)
        total = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return list(torch._foreach_mul(grads, coef)), total


def count_nonfinite_norm(found: torch.Tensor | None, norm: torch.Tensor) -> torch.Tensor | None:
    """A non-finite gradient norm counts as an overflow (the step is skipped)."""
    if found is None:
        return None
    return torch.where(torch.isfinite(norm), found, torch.ones_like(found))
