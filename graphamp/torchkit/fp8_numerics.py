"""fp8 matmuls: what a ``graphamp::fp8_mm`` node computes, forward and backward.

The AMP pass ``use_fp8_matmuls`` (``passes/fp8_matmuls.py``) turns chosen bf16 matmuls of the forward
graph into ``graphamp::fp8_mm(a, b, recipe)`` nodes; step assembly expands each into
``fp8_matmul`` (``EXPANSIONS``), whose ops are traced into the step, so the compiler sees (and
fuses) every amax, scale and cast. Scales are dynamic: computed inside the step from the amax of
the value being cast, as torchao's float8 training computes them.

Recipes (the names torchao's ``Float8LinearConfig.from_recipe_name`` uses):

- ``tensorwise``: one scale per tensor; activations and weights in e4m3, gradients in e5m2
  (more range, less precision: gradients span more decades than they need digits). The
  backward reuses the forward's fp8 copies, so a weight is quantised once per step.
- ``rowwise``: one scale per row of the left operand and per column of the right, everything
  in e4m3 (torch's rowwise ``_scaled_mm`` takes e4m3); the backward quantises the saved bf16
  values again along the axes its matmuls reduce over.
- ``delayed`` (Transformer Engine's recipe): tensorwise formats, but each scale comes from the
  amax history of that operand over the last steps (step state, ``FP8History``) instead of the
  tensor being cast, so no reduction precedes a cast. The step records each operand's amax in
  its history's first column (the largest over micro-batches); after the backward the step
  rolls the histories (untouched by a skipped step, agreed across ranks).

``torch._scaled_mm`` wants its second operand column-major; both recipes give it that layout.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._scaled_mm
import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "delayed")
AMAX_EPS = 1e-12  # a zero tensor gets a finite scale (torchao's EPS)


def quantize(x: Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[Tensor, Tensor]:
    """(``x`` in ``dtype``, the inverse scale): ``x * scale`` saturated to the format's range,
    ``scale = max / amax`` over the whole tensor (``dim`` None) or along ``dim`` (kept)."""
    magnitude = x.abs()
    amax = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    scale = torch.finfo(dtype).max / amax.float().clamp(min=AMAX_EPS)
    return cast_with_scale(x, dtype, scale), scale.reciprocal()


def _column_major(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


def scaled_mm(a8: Tensor, a_inv: Tensor, b8: Tensor, b_inv: Tensor, out: torch.dtype) -> Tensor:
    """``a @ b`` from fp8 operands and inverse scales (``b8`` column-major).

    On the CPU the product is taken from the operands widened to fp32 (exact: every fp8 value
    is an fp32 value), summed in fp32 and scaled, as a GPU's fp8 matmul accumulates: torch's
    CPU ``_scaled_mm`` took 95 ms for a (64, 512) x (512, 64) product with tensor scales in
    e4m3 where this takes 0.3 ms (torch 2.14.1, two threads; 197 ms against 0.38 ms on one),
    which made an fp8 step on the CPU a hundred times a bf16 one. The sums' order, and so the last bit, may differ from that
    kernel's; the CPU's fp8 is an emulation of the GPU's either way."""
    if a8.device.type == "cpu":
        return (torch.mm(a8.float(), b8.float()) * a_inv * b_inv).to(out)
    return torch._scaled_mm(a8, b8, scale_a=a_inv, scale_b=b_inv, out_dtype=out)


def forward_mm(a: Tensor, b: Tensor, recipe: str) -> Tensor:
    """``a @ b`` in fp8 by ``recipe`` (no autograd): what the op computes."""
    if recipe == "rowwise":
        a8, a_inv = quantize(a, E4M3, dim=1)
        b8, b_inv = quantize(b, E4M3, dim=0)
    else:
        a8, a_inv = quantize(a, E4M3)
        b8, b_inv = quantize(b, E4M3)
    return scaled_mm(a8, a_inv, _column_major(b8), b_inv, a.dtype)


class Fp8MatMul(torch.autograd.Function):
    """``a @ b`` with fp8 operands in the forward and in both backward matmuls."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, recipe: str) -> Tensor:  # type: ignore[override]
        ctx.recipe = recipe
        if recipe == "rowwise":
            ctx.save_for_backward(a, b)
            return forward_mm(a, b, recipe)
        a8, a_inv = quantize(a, E4M3)
        b8, b_inv = quantize(b.contiguous(), E4M3)
        ctx.save_for_backward(a8, a_inv, b8, b_inv)  # fp8 copies: half the bytes of bf16
        return scaled_mm(a8, a_inv, _column_major(b8), b_inv, a.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        if ctx.recipe == "rowwise":
            return (*_rowwise_backward(grad, *ctx.saved_tensors), None)
        a8, a_inv, b8, b_inv = ctx.saved_tensors
        g8, g_inv = quantize(grad, E5M2)
        return (*_tensorwise_grads(g8, g_inv, a8, a_inv, b8, b_inv, grad.dtype), None)


def _tensorwise_grads(
    g8: Tensor,
    g_inv: Tensor,
    a8: Tensor,
    a_inv: Tensor,
    b8: Tensor,
    b_inv: Tensor,
    out: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Both gradients from the fp8 gradient and the forward's fp8 operands (``b8``
    row-major), one scale per tensor."""
    # grad_a = g @ b.T: b8 is row-major (K, N), so b8.t() is column-major (N, K)
    grad_a = scaled_mm(g8, g_inv, b8.t(), b_inv, out)
    # grad_b = a.T @ g: the left operand row-major, the right column-major
    grad_b = scaled_mm(a8.t().contiguous(), a_inv, _column_major(g8), g_inv, out)
    return grad_a, grad_b


def _rowwise_backward(grad: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Both gradients with one scale per row of the left operand and per column of the right,
    quantised from the saved values along the dimension each matmul keeps."""
    g_rows, g_rows_inv = quantize(grad, E4M3, dim=1)  # (M, N), a scale per row
    b_rows, b_rows_inv = quantize(b.contiguous(), E4M3, dim=1)  # b.T's columns are b's rows
    grad_a = scaled_mm(g_rows, g_rows_inv, b_rows.t(), b_rows_inv.reshape(1, -1), grad.dtype)
    a_cols, a_cols_inv = quantize(a, E4M3, dim=0)  # a.T's rows are a's columns
    g_cols, g_cols_inv = quantize(grad, E4M3, dim=0)
    left, left_inv = a_cols.t().contiguous(), a_cols_inv.reshape(-1, 1)
    grad_b = scaled_mm(left, left_inv, _column_major(g_cols), g_cols_inv, grad.dtype)
    return grad_a, grad_b


# -- delayed scaling: one (3, 1 + H) fp32 state tensor per fp8 matmul ------------------------------
# rows: the left operand (activations), the right one (weights), the gradient; column 0: this
# step's amax so far; columns 1..H: the amax history, newest first.
HISTORY_ROWS = 3


def history_scale(history: Tensor, row: int, dtype: torch.dtype, margin: int) -> Tensor:
    """Transformer Engine's scale from one row's history: ``max / amax / 2**margin`` over the
    largest amax it holds; 1 while the history holds no amax yet."""
    amax = history[row, 1:].amax()
    scale = torch.finfo(dtype).max / amax.clamp(min=AMAX_EPS) / 2.0**margin
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def cast_with_scale(x: Tensor, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """``x * scale`` in ``dtype``, finite values saturated at the format's largest (a stale
    scale must not overflow); inf and NaN become NaN (torch's CPU conversion would saturate
    inf to a finite value), so an overflow still reaches the step's check."""
    largest = torch.finfo(dtype).max
    scaled = x.float() * scale
    nan = torch.full_like(scaled, float("nan"))
    return torch.where(scaled.isfinite(), scaled.clamp(-largest, largest), nan).to(dtype)


def _record_amax(history: Tensor, row: int, x: Tensor) -> None:
    """The largest |x| of this step so far, in place in column 0 (non-finite values record
    nothing: they never enter a history)."""
    amax = x.abs().amax().float()
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    history[row, 0] = torch.maximum(history[row, 0], amax)


class Fp8MatMulDelayed(torch.autograd.Function):
    """``a @ b`` with tensorwise fp8 formats and scales from ``history`` (written in place)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, history: Tensor, margin: int) -> Tensor:  # type: ignore[override]
        a_scale = history_scale(history, 0, E4M3, margin)
        b_scale = history_scale(history, 1, E4M3, margin)
        _record_amax(history, 0, a)
        _record_amax(history, 1, b)
        a8 = cast_with_scale(a, E4M3, a_scale)
        b8 = cast_with_scale(b.contiguous(), E4M3, b_scale)
        a_inv, b_inv = a_scale.reciprocal(), b_scale.reciprocal()
        ctx.margin = margin
        ctx.save_for_backward(a8, a_inv, b8, b_inv, history)
        return scaled_mm(a8, a_inv, _column_major(b8), b_inv, a.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        a8, a_inv, b8, b_inv, history = ctx.saved_tensors
        g_scale = history_scale(history, 2, E5M2, ctx.margin)
        _record_amax(history, 2, grad)
        g8, g_inv = cast_with_scale(grad, E5M2, g_scale), g_scale.reciprocal()
        return (*_tensorwise_grads(g8, g_inv, a8, a_inv, b8, b_inv, grad.dtype), None, None)


def rolled_history(history: Tensor) -> Tensor:
    """The history after a step: column 0's amaxes pushed in front (the oldest dropped),
    column 0 cleared for the next step."""
    newest = history[:, :1]
    return torch.cat([torch.zeros_like(newest), newest, history[:, 1:-1]], dim=1)


def fp8_matmul_delayed(a: Tensor, b: Tensor, history: Tensor, margin: int) -> Tensor:
    """What a ``graphamp::fp8_mm_delayed`` node expands to in the step."""
    return Fp8MatMulDelayed.apply(a, b, history, margin)


# ``graphamp::fp8_mm_delayed`` and ``graphamp::fp8_mm``: their kernels and fake kernel, registered
# by ``torchkit/ops.py`` (the package's one import-time registration; ``ops.FP8_MM``, ...)
def fp8_mm_delayed_kernel(a: Tensor, b: Tensor, history: Tensor, margin: int) -> Tensor:
    with torch.no_grad():
        return fp8_matmul_delayed(a, b, history, margin)


def fp8_mm_fake(a: Tensor, b: Tensor, *_rest) -> Tensor:
    """The output of either op: ``a @ b``'s shape."""
    return a.new_empty((a.shape[0], b.shape[1]))


def fp8_matmul(a: Tensor, b: Tensor, recipe: str) -> Tensor:
    """What a ``graphamp::fp8_mm`` node expands to in the step (differentiable)."""
    return Fp8MatMul.apply(a, b, recipe)


def fp8_mm_kernel(a: Tensor, b: Tensor, recipe: str) -> Tensor:
    return forward_mm(a, b, recipe)
