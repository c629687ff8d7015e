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

``torch._scaled_mm`` wants its second operand column-major; both recipes give it that layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
AMAX_EPS = 1e-12  # a zero tensor gets a finite scale (torchao's EPS)


def quantize(x: Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[Tensor, Tensor]:
    """(``x`` in ``dtype``, the inverse scale): ``x * scale`` saturated to the format's range,
    ``scale = max / amax`` over the whole tensor (``dim`` None) or along ``dim`` (kept)."""
    magnitude = x.abs()
    amax = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    largest = torch.finfo(dtype).max
    scale = largest / amax.float().clamp(min=AMAX_EPS)
    scaled = (x.float() * scale).clamp(-largest, largest)
    return scaled.to(dtype), scale.reciprocal()


def _column_major(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


def scaled_mm(a8: Tensor, a_inv: Tensor, b8: Tensor, b_inv: Tensor, out: torch.dtype) -> Tensor:
    """``a @ b`` from fp8 operands and inverse scales (``b8`` column-major)."""
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
        # grad_a = g @ b.T: b8 is row-major (K, N), so b8.t() is column-major (N, K)
        grad_a = scaled_mm(g8, g_inv, b8.t(), b_inv, grad.dtype)
        # grad_b = a.T @ g: the left operand row-major, the right column-major
        grad_b = scaled_mm(a8.t().contiguous(), a_inv, _column_major(g8), g_inv, grad.dtype)
        return grad_a, grad_b, None


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


def fp8_matmul(a: Tensor, b: Tensor, recipe: str) -> Tensor:
    """What a ``graphamp::fp8_mm`` node expands to in the step (differentiable)."""
    return Fp8MatMul.apply(a, b, recipe)


@torch.library.custom_op("graphamp::fp8_mm", mutates_args=())
def _fp8_mm_op(a: Tensor, b: Tensor, recipe: str) -> Tensor:
    return forward_mm(a, b, recipe)


@_fp8_mm_op.register_fake
def _(a: Tensor, b: Tensor, recipe: str) -> Tensor:  # noqa: ARG001 - the op's schema
    return a.new_empty((a.shape[0], b.shape[1]))


FP8_MM = torch.ops.graphamp.fp8_mm.default
