"""Ops whose own form cannot be captured, or is captured wrong, and the forms capture uses.

**CTC loss.** ``aten._ctc_loss`` returns, besides the loss, the forward variables ``log_alpha``
that its backward reads, of shape ``(batch, T, 2 * max(target_lengths) + 1)``: a size read
from the targets' lengths, so fake tensors cannot run it ("dynamic output shape"). Its only
reader is the backward, so graphamp's ``graphamp::ctc_loss`` returns ``log_alpha`` padded to
the bound the padded targets give (their width, or the number of concatenated targets) and
``graphamp::ctc_loss_backward`` cuts it back before calling torch's backward kernel: the same
kernels as eager PyTorch, with shapes that follow from the inputs' shapes. ``F.ctc_loss`` and
``torch.ctc_loss`` are captured as that op plus the reduction torch's composite applies.

**RReLU in training.** ``aten.rrelu_with_noise`` draws its slopes into a ``noise`` tensor it is
given (filled in place) and its backward reads that tensor. Functionalized, the op becomes
``rrelu_with_noise_functional``, whose derivative reads the *input* noise, an uninitialised
``empty_like``: gradients from garbage memory. Captured instead as the slopes drawn by
``uniform_`` and the product, ``where(x <= 0, x * r, x)``: autograd's backward of that product
reads the very slopes the forward drew, as eager's kernel does (its distribution: one slope
uniform in ``[lower, upper]`` per non-positive element). A range torch treats as one value
(``upper - lower <= 1e-6``) draws that value everywhere: leaky ReLU with it, forward and
backward, which is what is captured. torch's other ``*_functional``
variants (batch norm's, the fused observer + fake-quantize, ``normal_``) were audited for the
same shape: their backward reads no input they fill (tests/test_ops_capture.py keeps the
list).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C._nn, torch.ops.aten._ctc_loss, torch.ops.aten._ctc_loss_backward
import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import CaptureError

aten = torch.ops.aten

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch.ctc_loss takes the enum's value


# ``graphamp::ctc_loss`` and ``graphamp::ctc_loss_backward``: their kernels, fake kernels and
# derivative, registered by ``torchkit/ops.py`` (the package's one import-time registration)
def ctc_loss_kernel(
    log_probs: Tensor,
    targets: Tensor,
    input_lengths: Tensor,
    target_lengths: Tensor,
    blank: int,
    zero_infinity: bool,
) -> tuple[Tensor, Tensor]:
    nll, log_alpha = aten._ctc_loss.Tensor(
        log_probs, targets, input_lengths, target_lengths, blank, zero_infinity
    )
    padded = log_alpha.new_full(_alpha_shape(log_probs, targets), float("-inf"))
    padded[..., : log_alpha.shape[-1]] = log_alpha
    return nll, padded


def ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):  # noqa: ARG001 - the op's schema
    return log_probs.new_empty(log_probs.shape[1:2]), log_probs.new_empty(
        _alpha_shape(log_probs, targets)
    )


def _alpha_shape(log_probs: Tensor, targets: Tensor) -> tuple[int, int, int]:
    """log_alpha's shape with the longest target the targets' layout allows."""
    longest = targets.shape[1] if targets.dim() == 2 else targets.numel()
    return (log_probs.shape[1], log_probs.shape[0], 2 * longest + 1)


def ctc_loss_backward_kernel(
    grad: Tensor,
    log_probs: Tensor,
    targets: Tensor,
    input_lengths: Tensor,
    target_lengths: Tensor,
    nll: Tensor,
    log_alpha: Tensor,
    blank: int,
    zero_infinity: bool,
) -> Tensor:
    used = 2 * int(target_lengths.max()) + 1 if target_lengths.numel() else 1
    return aten._ctc_loss_backward.Tensor(
        grad,
        log_probs,
        targets,
        input_lengths,
        target_lengths,
        nll,
        log_alpha[..., :used].contiguous(),
        blank,
        zero_infinity,
    )


def ctc_loss_backward_fake(grad: Tensor, log_probs: Tensor, *_rest) -> Tensor:  # noqa: ARG001
    return torch.empty_like(log_probs)


def ctc_setup_context(ctx, inputs, output) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths, *output)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def ctc_backward(ctx, grad_nll, _grad_alpha):
    log_probs, targets, input_lengths, target_lengths, nll, log_alpha = ctx.saved_tensors
    grad = torch.ops.graphamp.ctc_loss_backward(
        grad_nll,
        log_probs,
        targets,
        input_lengths,
        target_lengths,
        nll,
        log_alpha,
        ctx.blank,
        ctx.zero_infinity,
    )
    return grad, None, None, None, None, None


def capture_ctc_loss(
    log_probs: Tensor,
    targets: Tensor,
    input_lengths,
    target_lengths,
    blank: int = 0,
    reduction: str | int = "mean",
    zero_infinity: bool = False,
) -> Tensor:
    """``F.ctc_loss`` as graphamp captures it: torch's composite around ``graphamp::ctc_loss``
    (lengths given as Python ints become constant tensors, as torch converts them)."""
    reduction = _REDUCTIONS.get(reduction, reduction) if isinstance(reduction, int) else reduction
    batched = log_probs.dim() == 3
    lp = log_probs if batched else log_probs.unsqueeze(1)
    if torch.is_autocast_enabled(lp.device.type):  # the autocast oracle: ctc_loss is fp32-listed
        lp = lp.float()
    lengths = [_lengths(v, lp.device) for v in (input_lengths, target_lengths)]
    nll, _ = torch.ops.graphamp.ctc_loss(
        lp, targets.to(lp.device, torch.long), *lengths, blank, zero_infinity
    )
    if zero_infinity:
        nll = torch.where(nll == float("inf"), nll.new_zeros(()), nll)
    if reduction == "mean":
        return (nll / lengths[1].to(nll.dtype).clamp_min(1)).mean()
    if reduction == "sum":
        return nll.sum()
    return nll if batched else nll.squeeze(0)


def _lengths(value, device: torch.device) -> Tensor:
    return torch.as_tensor(value, dtype=torch.long, device=device).reshape(-1)


def capture_rrelu(
    input: Tensor,
    lower: float = 1.0 / 8,
    upper: float = 1.0 / 3,
    training: bool = False,
    inplace: bool = False,
) -> Tensor:
    """``F.rrelu`` as graphamp captures it (module docstring). Eval mode is torch's own (its
    backward reads no noise). In training, a range torch treats as one value (``upper - lower
    <= 1e-6``) draws every slope as that value: the output and torch's backward are leaky
    ReLU's with slope ``(lower + upper) / 2``, which is what is captured (torch's functional
    form of the op, traced, gave NaN gradients from the second step)."""
    if not training:
        return (torch.rrelu_ if inplace else torch.rrelu)(input, lower, upper, training)
    if upper - lower <= 1e-6:
        slope = (lower + upper) / 2
        return (F.leaky_relu_ if inplace else F.leaky_relu)(input, slope)
    out = input * _slopes(input, lower, upper)
    return input.copy_(out) if inplace else out


def _slopes(input: Tensor, lower: float, upper: float) -> Tensor:
    """Eager rrelu's noise: a slope uniform in [lower, upper] where input <= 0, else 1."""
    drawn = torch.empty_like(input).uniform_(lower, upper)
    return torch.where(input <= 0, drawn, torch.ones_like(input))


def _rrelu_with_noise(input, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    """The aten-level entry: fills ``noise`` with the slopes, as torch's kernel does."""
    _refuse_generator(generator, training)
    if not training:
        return torch._C._nn.rrelu_with_noise(  # type: ignore[attr-defined]
            input, noise, lower, upper, training, generator
        )
    if upper - lower <= 1e-6:  # every slope drawn is the one value (capture_rrelu)
        slopes = torch.where(input <= 0, (lower + upper) / 2, torch.ones_like(input))
    else:
        slopes = _slopes(input, lower, upper)
    noise.copy_(slopes)
    return input * slopes


def _torch_rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    _refuse_generator(generator, training)
    return capture_rrelu(input, lower, upper, training)


def _rrelu_inplace(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    _refuse_generator(generator, training)
    return capture_rrelu(input, lower, upper, training, inplace=True)


def _refuse_generator(generator, training: bool) -> None:
    if generator is not None and training:
        raise CaptureError(
            "torch.rrelu(..., generator=...) in training: the compiled step draws its random "
            "numbers from torch's default generator. Leave generator out (seed with "
            "torch.manual_seed), or compute the activation outside build()"
        )


# What capture calls instead (CaptureMode routes the user-level calls here).
REPAIRED_OPS = {
    F.ctc_loss: capture_ctc_loss,
    torch.ctc_loss: capture_ctc_loss,
    F.rrelu: capture_rrelu,
    F.rrelu_: _rrelu_inplace,
    torch.rrelu: _torch_rrelu,
    torch.rrelu_: _rrelu_inplace,
    torch._C._nn.rrelu_with_noise: _rrelu_with_noise,  # type: ignore[attr-defined]
}
