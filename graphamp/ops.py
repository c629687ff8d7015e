"""graphamp's own ops: precision hints for model code, and attention kept whole in the graph.

``low_precision(x)`` / ``full_precision(x)`` are OneFlow's ``amp_white_identity`` /
``amp_black_identity``: identities in eager mode (no cost), and in a captured graph a node the AMP
passes colour allow / deny, so the decision spreads to neighbouring infer and clear ops. The pass
``remove_hints`` deletes them after casts are placed.

A custom ``torch.autograd.Function`` is captured as one ``graphamp.autograd_function`` node
(``FunctionCall``): its backward is the user's, which only a call of the Function under autograd
at step assembly can give.

``scaled_dot_product_attention`` is captured as one ``graphamp.scaled_dot_product_attention``
node instead of the backend kernel torch picks for fp32 inputs: the kernel (flash, efficient,
math) depends on the dtype, which is known only after the AMP passes. Step assembly expands it
back to ``F.scaled_dot_product_attention`` on the final dtypes.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
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
    """An op packet from ``torch.ops.aten.gelu``, an overload, ``"aten.gelu"``, ``"gelu"`` or
    ``"mylib.my_op"``; a custom ``torch.autograd.Function`` subclass stands for itself."""
    if isinstance(op, type) and issubclass(op, torch.autograd.Function):
        return op
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
        f"no such op {op!r}: name an op as torch.ops.aten.gelu, 'aten.gelu', 'gelu' or "
        "'mylib.my_op', or pass a torch.autograd.Function subclass (the precision report's "
        "'op' column shows the names in your graph)"
    )


# -- custom autograd Functions, kept whole in the captured forward --------------------------------

class FunctionCall:
    """One ``MyFunction.apply(...)`` call seen at capture: the class and its non-tensor arguments.

    The captured forward holds it as one ``graphamp.autograd_function`` node (the AMP passes see
    one op, kept fp32 unless the user lists the class); step assembly calls ``MyFunction.apply``
    again under autograd, so the user's own backward is what differentiates it.
    """

    def __init__(self, cls: type, args: tuple, kwargs: dict):
        self.cls = cls
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.template = [None if isinstance(x, Tensor) else x for x in leaves]
        self.key = next(_KEYS)
        self.out_spec: Any = None  # set when the forward first runs
        self.out_template: list[Any] = []
        _CALLS[self.key] = self

    def tensor_args(self, args: tuple, kwargs: dict) -> list[Tensor]:
        return [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)]

    def apply(self, tensors: list[Tensor]) -> list[Tensor]:
        """``cls.apply`` on these tensor arguments; its tensor outputs, flattened."""
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten(
            [next(it) if x is None else x for x in self.template], self.spec)
        out = _ORIGINAL_APPLY.__get__(None, self.cls)(*args, **kwargs)
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_template = [None if isinstance(x, Tensor) else x for x in leaves]
        return [x for x in leaves if isinstance(x, Tensor)]

    def rebuild_outputs(self, tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if x is None else x for x in self.out_template],
                                     self.out_spec)


_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_KEYS = itertools.count()
# Captured forwards keep their calls alive (CapturedForward.function_calls); the op finds them here.
_CALLS: "weakref.WeakValueDictionary[int, FunctionCall]" = weakref.WeakValueDictionary()


@torch.library.custom_op("graphamp::autograd_function", mutates_args=())
def _autograd_function_op(inputs: list[Tensor], key: int) -> list[Tensor]:
    with torch.no_grad():
        return [t.clone() for t in _CALLS[key].apply(list(inputs))]


@_autograd_function_op.register_fake
def _(inputs, key):
    with torch.no_grad():  # the outputs' metadata; a custom op's outputs never alias its inputs
        return [torch.empty_like(t) for t in _CALLS[key].apply(list(inputs))]


AUTOGRAD_FUNCTION = torch.ops.graphamp.autograd_function.default
EXPANSIONS[AUTOGRAD_FUNCTION] = lambda inputs, key: _CALLS[key].apply(list(inputs))
