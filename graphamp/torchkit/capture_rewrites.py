"""What user-level calls become while ``build()`` is captured (``CAPTURE_REWRITES``, read by
``capture/intercept.py``).

Composite ops that autocast decides for as a whole (an RNN cell, ``linalg_vecdot``, ``l1_loss``)
are split by capture into pieces no precision list can classify (``addmm``, ``sigmoid``, ``mul``,
``sum``...). Their capture forms tag every node the call appends with ``meta["part_of"]``, the
aten op the pieces belong to; the AMP passes classify the pieces as that op
(``WHOLE_OP_FUNCTIONS``). Functions on autocast's promote list whose kernels reject mixed
floating dtypes already at capture (``dot``, ``tensordot``...) cast their inputs to the widest
floating dtype among them first, as autocast does (``PROMOTE_AT_CAPTURE``). Attention and the
recurrent layers become graphamp's ops (``ops.py``), whose kernel is chosen once the AMP passes
have set the dtypes; ops fake tensors cannot run take their repaired forms (``op_repairs.py``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C._nn, torch._VF, torch.utils._pytree
import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from .fxutil import NodeTagger
from .op_math import RNN_MODES
from .op_repairs import REPAIRED_OPS
from .ops import full_precision, low_precision

aten = torch.ops.aten


def capture_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> Tensor:
    """What F.scaled_dot_product_attention becomes while build() is captured."""
    return torch.ops.graphamp.scaled_dot_product_attention(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa)
    )


def capture_rnn(mode: str):
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
        for t in pytree.tree_leaves((args, kwargs))
        if isinstance(t, Tensor) and t.dtype.is_floating_point and t.dtype != torch.float64
    ]
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) < 2:
        return args, kwargs
    widest = functools.reduce(torch.promote_types, dtypes)
    return pytree.tree_map_only(
        Tensor, lambda t: t.to(widest) if t.dtype in dtypes else t, (args, kwargs)
    )


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
    **{getattr(torch._VF, mode): capture_rnn(mode) for mode in RNN_MODES},
    **{func: _capture_form(func) for func in [*WHOLE_OP_FUNCTIONS, *PROMOTE_AT_CAPTURE]},
    **REPAIRED_OPS,  # ops whose own form fake tensors cannot run, or autograd gets wrong
}
