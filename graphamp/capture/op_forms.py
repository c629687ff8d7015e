"""The forms capture records in place of some of the user's calls (``CaptureMode``): gradients
build() takes itself, scaled by the loss scale; BatchNorm with its running statistics updated
where functionalization sees it; dropout as one op; attention kept whole under AMP; the
Gaussian negative log likelihood without its check of the variance's values."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.autograd._unsafe_preserve_version_counter, torch.ops.aten._native_batch_norm_legit,
#   torch.ops.aten._native_batch_norm_legit_functional,
#   torch.ops.aten._native_batch_norm_legit_no_training
import math

import torch

from ..errors import CaptureError
from ..torchkit.capture_rewrites import capture_sdpa

aten = torch.ops.aten

__all__ = [
    "functional_batch_norm",
    "gaussian_nll_loss",
    "native_dropout",
    "scaled_grad",
    "sdpa_with_autocast_policy",
]


def scaled_grad(scale: torch.Tensor, outputs, inputs, grad_outputs=None, *args, **kwargs):
    """torch.autograd.grad with the loss scale: seeds times ``scale``, results divided by it
    (what torch documents for gradient penalties under a GradScaler, done for the user)."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    if grad_outputs is None or isinstance(grad_outputs, torch.Tensor):
        grad_outputs = (grad_outputs,) * len(outputs) if grad_outputs is None else (grad_outputs,)
    seeds = [
        (torch.ones_like(o) if g is None else g) * scale.to(o.dtype)
        for o, g in zip(outputs, grad_outputs)
    ]
    grads = torch.autograd.grad(outputs, inputs, seeds, *args, **kwargs)
    return tuple(None if g is None else g / scale.to(g.dtype) for g in grads)


def sdpa_with_autocast_policy(
    dtype: torch.dtype,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    def low(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t

    return capture_sdpa(
        low(query), low(key), low(value), low(attn_mask), dropout_p, is_causal, scale, enable_gqa
    )


def functional_batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    if training and input.numel() // input.shape[1] <= 1:
        raise CaptureError(
            f"BatchNorm in training mode got an input of shape {tuple(input.shape)}: it needs "
            "more than one value per channel"
        )
    if training and running_mean is not None and running_var is not None:
        out, _, _, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
            input, weight, bias, running_mean, running_var, True, momentum, eps
        )
        # the backward of training-mode batch norm never reads the running statistics, but
        # saves them: a version bump would fail a gradient build() takes later (SAM, AGC),
        # where eager's in-op update does not
        with torch.autograd._unsafe_preserve_version_counter(running_mean):
            running_mean.copy_(new_mean)
        with torch.autograd._unsafe_preserve_version_counter(running_var):
            running_var.copy_(new_var)
        return out
    if training or running_mean is None or running_var is None:
        return aten._native_batch_norm_legit.no_stats(input, weight, bias, True, momentum, eps)[0]
    return aten._native_batch_norm_legit_no_training.default(
        input, weight, bias, running_mean, running_var, momentum, eps
    )[0]


def native_dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    if not training or p == 0.0:
        return input
    if p < 0.0 or p > 1.0:
        raise CaptureError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 1.0:
        out = input * 0.0
    else:
        out = aten.native_dropout.default(input, p, True)[0]
    if inplace:
        input.copy_(out)
        return input
    return out


def gaussian_nll_loss(
    input: torch.Tensor,
    target: torch.Tensor,
    var: torch.Tensor | float,
    full: bool = False,
    eps: float = 1e-6,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.gaussian_nll_loss`` (``nn.GaussianNLLLoss``) as torch defines it, but for its check
    that no entry of a tensor ``var`` is negative: that check reads values, which a compiled step
    cannot (eager raises ValueError there; here such an entry is clamped to ``eps`` as small ones
    are). The variance's shape rules, the clamp that passes gradients through unchanged, the
    constant term of ``full`` and the reductions are torch's."""
    if isinstance(var, float):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = var * torch.ones_like(input)
    if var.shape != input.shape:
        if input.shape[:-1] == var.shape:  # one variance per row: broadcast over the last dim
            var = var.unsqueeze(-1)
        elif not (
            input.dim() == var.dim()
            and sum(v for i, v in zip(input.shape, var.shape) if i != v) == 1
        ):  # anything but a single size-1 dimension to broadcast is refused, as torch does
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():  # the gradient flows as if unclamped, as in torch
        var.clamp_(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + 0.5 * math.log(2 * math.pi)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss
