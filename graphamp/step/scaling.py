"""The grad-scaler and clipping subgraphs: unscale + overflow check, clip, scale update.

``torch.amp.GradScaler.unscale_`` / ``clip_grad_norm_`` / ``update`` on values, traced into the
step: the overflow flag never leaves the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the user's scaler object reaches the step through the StepPlan
    from ..scaler import GradScaler


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


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float, norm_of=None):
    """torch.nn.utils.clip_grad_norm_ on values: (clipped grads, total norm). ``norm_of(grads,
    norm_type)`` computes the total norm where the grads are shards (ZeRO)."""
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
