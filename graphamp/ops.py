"""graphamp's own ops: precision hints for model code, and attention kept whole in the graph.

``low_precision(x)`` / ``full_precision(x)`` are OneFlow's ``amp_white_identity`` /
``amp_black_identity``: identities in eager mode (no cost), and in a captured graph a node the AMP
passes colour allow / deny, so the decision spreads to neighbouring infer and clear ops. The pass
``remove_hints`` deletes them after casts are placed.

``scaled_dot_product_attention`` is captured as one ``graphamp.scaled_dot_product_attention``
node instead of the backend kernel torch picks for fp32 inputs: the kernel (flash, efficient,
math) depends on the dtype, which is known only after the AMP passes. Step assembly expands it
back to ``F.scaled_dot_product_attention`` on the final dtypes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_unary

from .errors import ConfigError

@torch.library.custom_op("graphamp::low_precision", mutates_args=())
def _low_precision_op(x: Tensor) -> Tensor:
    return x.clone()


@_low_precision_op.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("graphamp::full_precision", mutates_args=())
def _full_precision_op(x: Tensor) -> Tensor:
    return x.clone()


@_full_precision_op.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def low_precision(x: Tensor) -> Tensor:
    """Hint: compute ``x``'s producer and neighbours in the AMP low precision. Identity in eager."""
    if has_torch_function_unary(x):
        return handle_torch_function(low_precision, (x,), x)
    return x


def full_precision(x: Tensor) -> Tensor:
    """Hint: keep ``x``'s producer and what follows in fp32 (deny). Identity in eager."""
    if has_torch_function_unary(x):
        return handle_torch_function(full_precision, (x,), x)
    return x


@torch.library.custom_op("graphamp::scaled_dot_product_attention", mutates_args=())
def _sdpa_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
) -> Tensor:
    return sdpa_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@_sdpa_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def sdpa_reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False) -> Tensor:
    """F.scaled_dot_product_attention with the captured arguments (what the node stands for)."""
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, **kwargs
    )


def capture_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False) -> Tensor:
    """What F.scaled_dot_product_attention becomes while build() is captured."""
    return torch.ops.graphamp.scaled_dot_product_attention(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa)
    )


LOW_PRECISION_HINT = torch.ops.graphamp.low_precision.default
FULL_PRECISION_HINT = torch.ops.graphamp.full_precision.default
SDPA = torch.ops.graphamp.scaled_dot_product_attention.default

# What the capture mode turns user-level calls into.
CAPTURE_REWRITES = {
    low_precision: lambda x: torch.ops.graphamp.low_precision(x),
    full_precision: lambda x: torch.ops.graphamp.full_precision(x),
    F.scaled_dot_product_attention: capture_sdpa,
}
# How step assembly expands graphamp's ops back into torch (hints left by a graph without AMP
# are identities).
EXPANSIONS = {SDPA: sdpa_reference, LOW_PRECISION_HINT: lambda x: x, FULL_PRECISION_HINT: lambda x: x}


def resolve_op(op: Any) -> Any:
    """An aten op packet from ``torch.ops.aten.gelu``, an overload, ``"aten.gelu"`` or ``"gelu"``."""
    if isinstance(op, torch._ops.OpOverload):  # noqa: SLF001
        return op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):  # noqa: SLF001
        return op
    if isinstance(op, str):
        ns, _, name = op.rpartition(".")
        namespace = getattr(torch.ops, ns or "aten", None)
        if namespace is not None and name and hasattr(namespace, name):
            packet = getattr(namespace, name)
            if isinstance(packet, torch._ops.OpOverloadPacket):  # noqa: SLF001
                return packet
    raise ConfigError(
        f"no such op {op!r}: name an aten op as torch.ops.aten.gelu, 'aten.gelu' or 'gelu' "
        "(the precision report's 'op' column shows the names in your graph)"
    )
