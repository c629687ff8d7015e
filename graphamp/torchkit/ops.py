"""graphamp's own ops, and the only module that changes torch's op registry (``torch.library``).

``low_precision(x)`` / ``full_precision(x)`` are OneFlow's ``amp_white_identity`` /
``amp_black_identity``: identities in eager mode (no cost), and in a captured graph a node the AMP
passes colour allow / deny, so the decision spreads to neighbouring infer and clear ops. The pass
``remove_hints`` deletes them after casts are placed.

``scaled_dot_product_attention`` is captured as one ``graphamp::scaled_dot_product_attention``
node instead of the backend kernel torch picks for fp32 inputs: the kernel (flash, efficient,
math) depends on the dtype, which is known only after the AMP passes. Step assembly expands it
back to ``F.scaled_dot_product_attention`` on the final dtypes (``EXPANSIONS``). Recurrent layers
(``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) are kept whole the same way, as ``graphamp::rnn``: the
kernel torch picks for them (cuDNN, oneDNN, or a loop of matmuls) also depends on the dtype. A
custom ``torch.autograd.Function`` is captured as one ``graphamp::autograd_function`` node
(``function_calls.py``): its backward is the user's, which only a call of the Function under
autograd at step assembly can give.

The ops' math lives beside it: ``op_math.py`` (attention, recurrent layers), ``fused_update.py``,
``op_repairs.py``, ``fp8_numerics.py``; what user code becomes at capture is
``capture_rewrites.py``'s. Registered here, when this module is imported.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C, torch._C._ExcludeDispatchKeyGuard, torch._C._dispatch_key_for_device, torch._ops
from typing import Any, Callable

import torch
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_unary

from ..errors import ConfigError
from . import fp8_numerics, fused_update, op_repairs
from .fp8_numerics import fp8_matmul, fp8_matmul_delayed
from .function_calls import function_call
from .op_math import RNN_MODES, expand_rnn, rnn_reference, sdpa_as_matmuls, sdpa_reference

aten = torch.ops.aten


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


def _attention_op(name: str, attention: Callable[..., Tensor]) -> None:
    """Registers ``graphamp::name``, an op with F.scaled_dot_product_attention's arguments
    that runs ``attention`` (graphamp's attention ops share the schema, so the AMP pass can
    retarget a node from one to the other)."""

    def run(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> Tensor:
        return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def shape(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ARG001 - the op's schema
        return query.new_empty((*query.shape[:-1], value.shape[-1]))

    torch.library.custom_op(f"graphamp::{name}", mutates_args=())(run).register_fake(shape)


_attention_op("scaled_dot_product_attention", sdpa_reference)
_attention_op("sdpa_as_matmuls", sdpa_as_matmuls)


LOW_PRECISION_HINT = torch.ops.graphamp.low_precision.default
FULL_PRECISION_HINT = torch.ops.graphamp.full_precision.default
SDPA = torch.ops.graphamp.scaled_dot_product_attention.default
SDPA_AS_MATMULS = torch.ops.graphamp.sdpa_as_matmuls.default


# -- recurrent layers, kept whole -----------------------------------------------------------------


# the kernel is the reference itself (its signature is the op's schema); the fake runs it on
# the fake tensors, for the shapes torch's own kernel gives (nothing runs)
_rnn_op = torch.library.custom_op("graphamp::rnn", rnn_reference, mutates_args=())


@_rnn_op.register_fake
def _(*args: Any) -> list[Tensor]:
    with torch.no_grad():
        return rnn_reference(*args)


def _register_rnn_autocast() -> None:
    """Under torch.autocast a graphamp.rnn node does what autocast does with the layer it stands
    for (the autocast oracle measures it): on CUDA cuDNN's RNN runs in the autocast dtype; on CPU
    LSTM and plain RNNs do (oneDNN and the CPU list's matmuls) and GRU stays fp32 (torch 2.14)."""
    lowered = {"cuda": set(RNN_MODES), "cpu": {"lstm", "rnn_tanh", "rnn_relu"}}
    for device_type, modes in lowered.items():
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, mode, *args, _device=device_type, _modes=modes, _exclude=keyset):
            dtype = torch.get_autocast_dtype(_device)

            def low(t):
                if isinstance(t, (list, tuple)):
                    return [low(x) for x in t]
                if isinstance(t, Tensor) and t.dtype == torch.float32 and mode in _modes:
                    return t.to(dtype)
                return t

            with torch._C._ExcludeDispatchKeyGuard(_exclude):
                return torch.ops.graphamp.rnn(mode, *[low(a) for a in args])

        _LIBRARY.impl("rnn", kernel, key, with_keyset=True)


_LIBRARY = torch.library.Library("graphamp", "FRAGMENT")
_register_rnn_autocast()


# -- the ops whose kernels live beside their math -------------------------------------------------
# Their kernels and fake kernels are in the modules that hold the math (fused_update.py,
# op_repairs.py, fp8_numerics.py; step/block_update.py); they are registered here, so that this
# module is the only one that changes torch's op registry.

_fused_adam_op = torch.library.custom_op(
    "graphamp::fused_adam_",
    fused_update.fused_adam_,
    mutates_args=("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"),
)
_fused_adam_op.register_fake(fused_update.fused_adam_fake)

_ctc_loss_op = torch.library.custom_op(
    "graphamp::ctc_loss", op_repairs.ctc_loss_kernel, mutates_args=()
)
_ctc_loss_op.register_fake(op_repairs.ctc_loss_fake)
_ctc_loss_op.register_autograd(op_repairs.ctc_backward, setup_context=op_repairs.ctc_setup_context)
_ctc_loss_backward_op = torch.library.custom_op(
    "graphamp::ctc_loss_backward", op_repairs.ctc_loss_backward_kernel, mutates_args=()
)
_ctc_loss_backward_op.register_fake(op_repairs.ctc_loss_backward_fake)

_fp8_mm_delayed_op = torch.library.custom_op(
    "graphamp::fp8_mm_delayed", fp8_numerics.fp8_mm_delayed_kernel, mutates_args=("history",)
)
_fp8_mm_delayed_op.register_fake(fp8_numerics.fp8_mm_fake)
_fp8_mm_op = torch.library.custom_op(
    "graphamp::fp8_mm", fp8_numerics.fp8_mm_kernel, mutates_args=()
)
_fp8_mm_op.register_fake(fp8_numerics.fp8_mm_fake)
FP8_MM_DELAYED = torch.ops.graphamp.fp8_mm_delayed.default
FP8_MM = torch.ops.graphamp.fp8_mm.default

# ``graphamp::update_block_``: one block's optimizer update, in place (step/block_update.py).
# Defined on torch's dispatcher directly, not with ``torch.library.custom_op``: that wraps every
# call in an autograd Function whose pytree flattening of a block's ~50 tensors cost 340 us a
# call on the CPU, twice the kernel's own time (a block of the 6-layer GPT-2, AdamW). Here the
# autograd key falls through to torch's C++ fallback. The step never differentiates the update.
_LIBRARY.define(
    "update_block_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, "
    "Tensor(c!)[] fresh, Tensor[] hypers, Tensor? skip, str spec) -> ()"
)
# Its kernel compiles the step layer's update math, which torchkit does not import: the step
# layer provides it when imported (``provide_block_update``; graphamp/__init__.py imports it),
# and the kernel registered here calls it. One Python call more per op call, no pytree work.
_block_update_kernel: list[Callable[..., None]] = []  # process_state.PROCESS_STATE declares it


def provide_block_update(kernel: Callable[..., None]) -> None:
    """``kernel(params, grads, states, fresh, hypers, skip, spec)`` runs every
    ``graphamp::update_block_`` call from now on (``step/block_update.py``'s, set at its import)."""
    _block_update_kernel[:] = [kernel]


def _update_block(params, grads, states, fresh, hypers, skip, spec) -> None:
    try:
        kernel = _block_update_kernel[0]
    except IndexError:
        raise RuntimeError(
            "graphamp::update_block_ has no kernel: import graphamp (graphamp.step.block_update "
            "provides it)"
        ) from None
    kernel(params, grads, states, fresh, hypers, skip, spec)


def _no_values(params, grads, states, fresh, hypers, skip, spec) -> None:  # noqa: ARG001 - the op's schema
    return None


_LIBRARY.impl("update_block_", _update_block, "CompositeExplicitAutograd")
torch.library.register_fake("graphamp::update_block_", _no_values, lib=_LIBRARY)


# How step assembly expands graphamp's ops back into torch (hints left by a graph without AMP
# are identities).
EXPANSIONS = {
    SDPA: sdpa_reference,
    SDPA_AS_MATMULS: sdpa_as_matmuls,
    LOW_PRECISION_HINT: lambda x: x,
    FULL_PRECISION_HINT: lambda x: x,
    torch.ops.graphamp.rnn.default: expand_rnn,
    FP8_MM: fp8_matmul,
    FP8_MM_DELAYED: fp8_matmul_delayed,
}


def resolve_op(op: Any) -> Any:
    """An op packet from ``torch.ops.aten.gelu``, an overload, ``"aten.gelu"``, ``"gelu"`` or
    ``"mylib.my_op"``; a custom ``torch.autograd.Function`` subclass stands for itself."""
    if isinstance(op, type) and issubclass(op, torch.autograd.Function):
        return op
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op
    if isinstance(op, str):
        ns, _, name = op.rpartition(".")
        namespace = getattr(torch.ops, ns or "aten", None)
        if namespace is not None and name and hasattr(namespace, name):
            packet = getattr(namespace, name)
            if isinstance(packet, torch._ops.OpOverloadPacket):
                return packet
    raise ConfigError(
        f"no such op {op!r}: name an op as torch.ops.aten.gelu, 'aten.gelu', 'gelu' or "
        "'mylib.my_op', or pass a torch.autograd.Function subclass (the precision report's "
        "'op' column shows the names in your graph)"
    )


# -- custom autograd Functions, kept whole in the captured forward (function_calls.py) ------------


@torch.library.custom_op("graphamp::autograd_function", mutates_args=())
def _autograd_function_op(inputs: list[Tensor], key: int) -> list[Tensor]:
    with torch.no_grad():
        return [t.clone() for t in function_call(key).apply(list(inputs))]


@_autograd_function_op.register_fake
def _(inputs, key):
    with torch.no_grad():  # the outputs' metadata; a custom op's outputs never alias its inputs
        return [torch.empty_like(t) for t in function_call(key).apply(list(inputs))]


AUTOGRAD_FUNCTION = torch.ops.graphamp.autograd_function.default
EXPANSIONS[AUTOGRAD_FUNCTION] = lambda inputs, key: function_call(key).apply(list(inputs))
