"""Dtype checks eager PyTorch makes but fake tensors skip.

On fake tensors the shape rules of matrix products and convolutions accept inputs of different
floating dtypes (a float64 batch into a float32 Linear), which the real kernels refuse. Captured
as is, build() would fail only when the compiled step runs, far from the user's line, and after
AMP has turned one side to fp16. Capture refuses it where eager PyTorch would, on the user's line.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# the ops whose floating tensor arguments must share one dtype in eager mode (without autocast)
SAME_DTYPE_OPS = frozenset(
    {
        F.linear,
        F.bilinear,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.Tensor.mm,
        torch.Tensor.bmm,
    }
)


def mixed_dtypes(func: Any, args: tuple, kwargs: dict, amp: bool = False) -> tuple[str, ...] | None:
    """The distinct floating dtypes ``func`` was given, when eager PyTorch would refuse them.

    With ``amp`` (graphamp's AMP will decide the dtypes), a mix of fp16, bf16 and fp32 is
    reconciled by its casts, as autocast reconciles it; float64 is left alone by both, so a mix
    with float64 is still refused."""
    if func not in SAME_DTYPE_OPS or _autocast_on():
        return None
    dtypes = {
        a.dtype
        for a in (*args, *kwargs.values())
        if isinstance(a, torch.Tensor) and a.dtype.is_floating_point
    }
    if len(dtypes) < 2 or (amp and torch.float64 not in dtypes):
        return None
    return tuple(sorted(str(d).replace("torch.", "") for d in dtypes))


def _autocast_on() -> bool:
    # under the user's own torch.autocast the ops cast their inputs and mixed dtypes are fine
    return any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
