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
back to ``F.scaled_dot_product_attention`` on the final dtypes. Recurrent layers
(``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) are kept whole the same way, as ``graphamp.rnn``: the
kernel torch picks for them (cuDNN, oneDNN, or a loop of matmuls) also depends on the dtype.

Composite ops that autocast decides for as a whole (an RNN cell, ``linalg_vecdot``, ``l1_loss``)
are split by capture into pieces no precision list can classify (``addmm``, ``sigmoid``, ``mul``,
``sum``...). Their capture forms tag every node the call appends with ``meta["part_of"]``, the
aten op the pieces belong to; the AMP passes classify the pieces as that op
(``WHOLE_OP_FUNCTIONS``). Functions on autocast's promote list whose kernels reject mixed
floating dtypes already at capture (``dot``, ``tensordot``...) cast their inputs to the widest
floating dtype among them first, as autocast does (``PROMOTE_AT_CAPTURE``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C, torch._C._ExcludeDispatchKeyGuard, torch._C._dispatch_key_for_device,
#   torch._C._get_mkldnn_enabled, torch._C._nn, torch._C._set_mkldnn_enabled, torch._VF,
#   torch._ops, torch.utils._pytree
import functools
import itertools
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_unary

from ..errors import ConfigError, GraphampError
from . import fp8_numerics, fused_update, op_repairs
from .fp8_numerics import fp8_matmul, fp8_matmul_delayed
from .fxutil import NodeTagger
from .op_repairs import REPAIRED_OPS

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


def sdpa_reference(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Tensor:
    """F.scaled_dot_product_attention with the captured arguments (what the node stands for)."""
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        **kwargs,
    )


def capture_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Tensor:
    """What F.scaled_dot_product_attention becomes while build() is captured."""
    return torch.ops.graphamp.scaled_dot_product_attention(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa)
    )


def sdpa_as_matmuls(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Tensor:
    """Attention written as two matmuls in the inputs' dtype around an fp32 softmax: what
    ``passes/fp32_where_faster.py`` picks where it measured faster than either attention
    kernel (small sizes on the CPU). Without a mask only (the pass's rule), so no row is
    wholly masked; ``is_causal`` masks the upper triangle, aligned top-left as torch's does."""
    if attn_mask is not None:
        raise GraphampError("graphamp.sdpa_as_matmuls takes no attention mask")
    if enable_gqa:
        key, value = repeat_kv_heads(query, key, value)
    scale = query.size(-1) ** -0.5 if scale is None else scale
    scores = (query @ key.transpose(-2, -1)).float() * scale  # scaled in fp32: no overflow
    if is_causal:
        length, keys = scores.shape[-2:]
        visible = torch.ones(length, keys, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return probs.to(value.dtype) @ value


def repeat_kv_heads(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """``key`` and ``value`` with their heads repeated to ``query``'s (grouped-query
    attention); as they are where the head counts already agree."""
    if key.size(-3) == query.size(-3):
        return key, value
    repeats = query.size(-3) // key.size(-3)
    return key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)


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

RNN_MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")


@torch.library.custom_op("graphamp::rnn", mutates_args=())
def _rnn_op(
    mode: str,
    input: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> list[Tensor]:
    return rnn_reference(
        mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first
    )


@_rnn_op.register_fake
def _(mode, input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    # the shapes torch's own kernel gives, computed on the fake tensors (nothing runs)
    with torch.no_grad():
        return rnn_reference(
            mode,
            input,
            hx,
            params,
            has_biases,
            num_layers,
            dropout,
            train,
            bidirectional,
            batch_first,
        )


def rnn_reference(
    mode: str,
    input: Tensor,
    hx: list[Tensor],
    params: list[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> list[Tensor]:
    """torch._VF.<mode> on a dense batch (what a graphamp.rnn node stands for): the outputs as a
    list, ``[output, h_n]`` (``[output, h_n, c_n]`` for an LSTM)."""
    state = list(hx) if mode == "lstm" else hx[0]
    out = getattr(torch._VF, mode)(
        input,
        state,
        list(params),
        has_biases,
        num_layers,
        dropout,
        train,
        bidirectional,
        batch_first,
    )
    return list(out)


def _expand_rnn(*args: Any) -> list[Tensor]:
    """A graphamp.rnn node in the traced step. oneDNN's CPU kernel (bf16) is left out: make_fx
    records its backward without the workspace tensor the forward saved (torch 2.14), so the
    compiled step would fail; the matmul loop torch uses otherwise differentiates cleanly."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)  # mkldnn.flags() would also touch TF32 and warn
    try:
        return rnn_reference(*args)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _capture_rnn(mode: str):
    vf = getattr(torch._VF, mode)

    def capture(*args: Any, **kwargs: Any) -> Any:
        # dense: (input, hx, params, ...); packed sequences pass batch_sizes second and are
        # traced as torch dispatches them
        dense = (
            not kwargs
            and len(args) == 9
            and isinstance(args[2], (list, tuple))
            and (mode != "lstm" or isinstance(args[1], (list, tuple)))
        )
        if not dense:
            return vf(*args, **kwargs)
        input, hx, params, *flags = args
        hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        with NodeTagger({"part_of": getattr(aten, mode)}):
            out = torch.ops.graphamp.rnn(
                mode,
                input,
                hx,
                list(params),
                bool(flags[0]),
                int(flags[1]),
                float(flags[2]),
                bool(flags[3]),
                bool(flags[4]),
                bool(flags[5]),
            )
        return tuple(out)

    return capture


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


# -- composite ops classified as a whole, and autocast's promote policy at capture ---------------


def _capture_form(func: Any):
    """What ``func`` becomes at capture: mixed floating inputs cast to the widest first (ops in
    PROMOTE_AT_CAPTURE), and every node its decomposition appends tagged ``part_of`` (ops in
    WHOLE_OP_FUNCTIONS)."""
    promote = func in PROMOTE_AT_CAPTURE
    tag = {"part_of": WHOLE_OP_FUNCTIONS[func]} if func in WHOLE_OP_FUNCTIONS else {}

    def capture(*args: Any, **kwargs: Any) -> Any:
        if promote:
            args, kwargs = promote_floating_inputs(args, kwargs)
        with NodeTagger(tag):
            return func(*args, **kwargs)

    return capture


def promote_floating_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their floating tensors cast to the widest floating dtype among
    them (fp64 ignored, as autocast's promote policy does)."""
    tensors = [
        t
        for t in _tensor_leaves((args, kwargs))
        if t.dtype.is_floating_point and t.dtype != torch.float64
    ]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) < 2:
        return args, kwargs
    widest = functools.reduce(torch.promote_types, dtypes)

    def cast(x: Any) -> Any:
        if isinstance(x, Tensor):
            return x.to(widest) if x.dtype in dtypes else x
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v) for v in x)
        return x

    return cast(args), {k: cast(v) for k, v in kwargs.items()}


def _tensor_leaves(x: Any):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensor_leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensor_leaves(v)


# Functions on autocast's promote list whose kernels or fake kernels reject mixed floating dtypes
# at capture. (addcmul, addcdiv, atan2, cat and stack promote in their kernels; cross,
# grid_sampler and index_put are traced with mixed dtypes and cast by the AMP passes.)
PROMOTE_AT_CAPTURE = frozenset(
    {
        torch.dot,
        torch.Tensor.dot,
        torch.vdot,
        torch.Tensor.vdot,
        torch.tensordot,
        torch.bilinear,
        torch.scatter_add,
        torch.Tensor.scatter_add,
    }
)

# Composite functions (as user code reaches them) -> the aten op whose list decides for their
# pieces. Autocast casts once, for the whole call; capture splits the call into pieces that, one
# by one, would be classified differently (an LSTM cell's sigmoid and tanh, l1_loss's sub and
# abs, linalg_vecdot's mul and sum, tensordot's mm).
WHOLE_OP_FUNCTIONS = {
    torch.lstm_cell: aten.lstm_cell,
    torch.gru_cell: aten.gru_cell,
    torch.rnn_tanh_cell: aten.rnn_tanh_cell,
    torch.rnn_relu_cell: aten.rnn_relu_cell,
    torch.linalg.vecdot: aten.linalg_vecdot,
    torch.tensordot: aten.tensordot,
    torch.bilinear: aten.bilinear,
    F.l1_loss: aten.l1_loss,
    torch._C._nn.l1_loss: aten.l1_loss,
    F.margin_ranking_loss: aten.margin_ranking_loss,
    torch.margin_ranking_loss: aten.margin_ranking_loss,
    F.hinge_embedding_loss: aten.hinge_embedding_loss,
    torch.hinge_embedding_loss: aten.hinge_embedding_loss,
    F.poisson_nll_loss: aten.poisson_nll_loss,
    torch.poisson_nll_loss: aten.poisson_nll_loss,
    F.cosine_embedding_loss: aten.cosine_embedding_loss,
    torch.cosine_embedding_loss: aten.cosine_embedding_loss,
    F.kl_div: aten.kl_div,
    torch.kl_div: aten.kl_div,
    F.triplet_margin_loss: aten.triplet_margin_loss,
    torch.triplet_margin_loss: aten.triplet_margin_loss,
    torch.cosine_similarity: aten.cosine_similarity,
    torch.cdist: aten.cdist,
    F.rms_norm: aten.rms_norm,
    torch.rms_norm: aten.rms_norm,
}


def _int64_class_indices(func: Callable) -> Callable:
    """``func`` (a loss taking class indices) with a uint8 target read as int64: eager's kernels
    take int64 or uint8 class indices, the decompositions fake tensors run (a gather) int64
    only. The values, and the loss, are the same."""

    def call(input: torch.Tensor, target: Any = None, *args: Any, **kwargs: Any) -> Any:
        if target is None:
            target = kwargs.pop("target")
        if isinstance(target, torch.Tensor) and target.dtype == torch.uint8:
            target = target.long()
        return func(input, target, *args, **kwargs)

    return call


# What the capture mode turns user-level calls into.
CAPTURE_REWRITES = {
    F.cross_entropy: _int64_class_indices(F.cross_entropy),
    F.nll_loss: _int64_class_indices(F.nll_loss),
    low_precision: lambda x: torch.ops.graphamp.low_precision(x),
    full_precision: lambda x: torch.ops.graphamp.full_precision(x),
    F.scaled_dot_product_attention: capture_sdpa,
    **{getattr(torch._VF, mode): _capture_rnn(mode) for mode in RNN_MODES},
    **{func: _capture_form(func) for func in [*WHOLE_OP_FUNCTIONS, *PROMOTE_AT_CAPTURE]},
    **REPAIRED_OPS,  # ops whose own form fake tensors cannot run, or autograd gets wrong
}
# How step assembly expands graphamp's ops back into torch (hints left by a graph without AMP
# are identities).
EXPANSIONS = {
    SDPA: sdpa_reference,
    SDPA_AS_MATMULS: sdpa_as_matmuls,
    LOW_PRECISION_HINT: lambda x: x,
    FULL_PRECISION_HINT: lambda x: x,
    torch.ops.graphamp.rnn.default: _expand_rnn,
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
            [next(it) if x is None else x for x in self.template], self.spec
        )
        out = _ORIGINAL_APPLY.__get__(None, self.cls)(*args, **kwargs)
        leaves, self.out_spec = pytree.tree_flatten(out)
        self.out_template = [None if isinstance(x, Tensor) else x for x in leaves]
        return [x for x in leaves if isinstance(x, Tensor)]

    def rebuild_outputs(self, tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten(
            [next(it) if x is None else x for x in self.out_template], self.out_spec
        )


_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
_KEYS = itertools.count()
# Captured forwards keep their calls alive (CapturedForward.function_calls); the op finds them here.
_CALLS: weakref.WeakValueDictionary[int, FunctionCall] = weakref.WeakValueDictionary()


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
