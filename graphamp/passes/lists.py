"""Precision lists as data: which aten ops run in low precision, which stay fp32, which follow.

Four disjoint sets of aten op packets (overloads do not matter):

- ALLOW: run in fp16/bf16 (matrix units): torch.autocast's CUDA ``lower_precision_fp`` list as it
  appears at aten level after capture. Their floating inputs (fp32, and fp16/bf16 in the other
  low precision) are cast to the AMP dtype, as autocast does.
- DENY: run in fp32: autocast's ``fp32`` and ``fp32_set_opt_dtype`` lists, plus the statistics
  ops (var, std) whose fp16 result can overflow. Deny spreads downstream through infer ops, and
  the ops it reaches *widen*: low-precision inputs, whatever made them low (an explicit
  ``.half()``, an fp16 graph input or parameter), are cast up to fp32, autocast's rule.
- INFER: compute ops that follow their neighbours: low precision only between allow ops.
- CLEAR: dtype-blind ops (views, data movement, exact selections, comparisons): take their
  neighbours' colour in both directions.

Everything else is *unknown*: kept in its captured dtype (fp32 in an fp32 model) and listed in
the precision report. ``op_dtypes.PROMOTE`` ops (autocast's promote list) run in the widest
floating dtype among their inputs as they arrive; ``op_dtypes.py`` holds the other facts of how
ops treat dtypes that the cast passes work from. Composite ops that capture splits into pieces
(an RNN cell, ``l1_loss``, ``linalg_vecdot``) are classified as the whole op: ``graphamp.ops``
tags each piece with ``meta["part_of"]``.

Deliberate differences from torch.autocast (tested against the autocast oracle in
tests/test_amp.py):

1. Infer ops run in low precision only *between* allow ops (or from an allow op to an output),
   after OneFlow and TF's grappler; autocast runs them in whatever dtype arrives. An
   elementwise op whose result only feeds fp32 ops (e.g. the scale-multiply before a softmax)
   therefore runs in fp32 here, in fp16 under autocast: same cast count, one fewer rounding.
   The same holds the other way for the elementwise ops of autocast's promote list (addcmul,
   addcdiv, atan2: infer here) and for clear ops that need equal input dtypes (index_put):
   between allow ops they run in low precision, where autocast promotes a mixed fp16/fp32 pair
   to fp32.
2. ``mean`` is infer (autocast leaves it unlisted, which is the same in effect): a mean cannot
   overflow and its fp32 accumulation happens inside the kernel; when it sits between allow ops
   (global average pooling before the classifier) an fp32 mean would cost two casts and gain
   nothing, as its result is rounded to fp16 by the next op anyway.
3. ``var``/``std`` are deny (autocast leaves them unlisted): the variance of fp16 values of
   magnitude 300 already overflows fp16.
4. Nearest-neighbour upsampling stays fp32 as in autocast (its backward accumulates with atomics).
5. BatchNorm is infer with its weight, bias and running statistics kept fp32 (the mixed kernels
   take low-precision activations and fp32 parameters); autocast does the same on CUDA.
6. ``cross_entropy``'s ``log_softmax`` runs in fp32. Under CUDA autocast it runs in the logits'
   low precision: ``cross_entropy`` passes the input's dtype to ``log_softmax`` explicitly and
   autocast's ``fp32_set_opt_dtype`` policy respects an explicit dtype; ``nll_loss`` then casts
   the low-precision log-probabilities to fp32. Same number of casts, one fewer rounding of the
   log-probabilities (measured by ``graphamp.oracle``, tested in tests/test_amp.py).
7. softmax, log_softmax and layer_norm stay deny, as in autocast; OneFlow treats them as infer.
   ``benchmarks/list_choice.py`` measures both choices (error against fp64 on a GPT block, casts)
   and ``benchmarks/results/list_choice.md`` records why deny is the default; the
   ``override_amp_lists(infer=[...])`` setter selects OneFlow's behaviour.
8. ``binary_cross_entropy`` is deny: it runs in fp32 where autocast raises (autocast bans it as
   unsafe in fp16). A compiled step has no good place for that error, and computing it in fp32
   is the remedy autocast's message itself offers; ``binary_cross_entropy_with_logits`` remains
   the better op.
9. Recurrent layers and cells (``nn.LSTM``/``GRU``/``RNN``, their cells) run in low precision on
   every device, as CUDA autocast runs them (cuDNN RNN, ``lstm_cell``...). CPU autocast keeps
   GRU and the LSTM/GRU cells in fp32. Packed sequences are not kept whole: their CPU/CUDA
   kernels (``mkldnn_rnn_layer``, ``_cudnn_rnn``) are in no list and stay fp32.
10. A deny op with no low-precision input keeps what it was captured with; graphamp never widens
   fp64. There is no exception for ``graphamp.low_precision``: the hint lowers its producer and
   the infer/clear ops next to it, never a deny op that reads it (to run a deny op in low
   precision, move it with ``override_amp_lists``).
11. On the CPU, scaled-dot-product attention stays fp32 where its fp32 kernel measured faster
   than its low-precision one at the op's sizes (``fp32_where_faster.py``: torch's bf16 CPU
   attention backward is several times slower than fp32 at small sequence lengths), and is
   written as low-precision matmuls around an fp32 softmax (``graphamp.sdpa_as_matmuls``, an
   allow op) where that measured faster than both. Matrix products and convolutions stay fp32
   where their fp32 kernel measured faster (``dense_ops.py``: on a CPU without bf16 or fp16
   instructions the low-precision kernels run on a slow path). Autocast always runs the
   low-precision kernels; ``config.set_fp32_where_faster(False)`` does the same here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..torchkit import ops as _graphamp_ops  # noqa: F401 - registers torch.ops.graphamp.*
from ..torchkit.ops import resolve_op  # noqa: F401 - re-exported: graphamp.passes.resolve_op
from .op_dtypes import packets

aten = torch.ops.aten


ALLOW = packets(
    # matrix products
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "addr",
    "matmul",
    "linear",
    "_addmm_activation",
    "linalg_vecdot",
    "einsum",
    "chain_matmul",
    "linalg_multi_dot",
    # convolutions
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "mkldnn_convolution",
    "prelu",
    "_prelu_kernel",
    # recurrent cells and layers (layers are kept whole as graphamp.rnn, tagged with these;
    # the cells' pieces are tagged with the cell)
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    # attention (graphamp keeps SDPA whole; the raw kernels in case user code calls them)
    "graphamp.scaled_dot_product_attention",
    "graphamp.sdpa_as_matmuls",  # its low-precision form (fp32_where_faster.py)
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    # OneFlow's amp_white_identity
    "graphamp.low_precision",
)

DENY = packets(
    # transcendental and reciprocal functions (autocast fp32)
    "exp",
    "expm1",
    "exp2",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    "erfinv",
    "pow",
    "softplus",
    "xlogy",
    "special_xlog1py",
    # normalisations (autocast fp32)
    "native_layer_norm",
    "layer_norm",
    "native_group_norm",
    "group_norm",
    "rms_norm",
    "_fused_rms_norm",
    # softmax family (autocast fp32_set_opt_dtype)
    "_softmax",
    "softmax",
    "_log_softmax",
    "log_softmax",
    "_safe_softmax",
    "logsumexp",
    # reductions that can overflow (autocast fp32_set_opt_dtype) and statistics
    "sum",
    "prod",
    "cumsum",
    "cumprod",
    "var",
    "var_mean",
    "std",
    "std_mean",
    "nansum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "norm",
    "frobenius_norm",
    "nuclear_norm",
    "_foreach_norm",
    # distances
    "dist",
    "cdist",
    "_cdist_forward",
    "pdist",
    "_pdist_forward",
    "renorm",
    "cosine_similarity",
    # losses
    "nll_loss",
    "nll_loss_forward",
    "nll_loss2d",
    "nll_loss2d_forward",
    "nll_loss_nd",
    "cross_entropy_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "soft_margin_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "multilabel_margin_loss_forward",
    "margin_ranking_loss",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "triplet_margin_loss",
    "ctc_loss",
    "_ctc_loss",
    "graphamp.ctc_loss",
    # interpolation (autocast fp32)
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
    # OneFlow's amp_black_identity
    "graphamp.full_precision",
    # backward ops of the gradients build() takes itself (gradient code, penalties): the
    # backward of an fp32 op stays fp32, and the loss scale's check reads fp32 gradients
    "_log_softmax_backward_data",
    "_softmax_backward_data",
    "nll_loss_backward",
    "native_batch_norm_backward",
    "native_layer_norm_backward",
    "native_group_norm_backward",
    "_amp_foreach_non_finite_check_and_unscale",
)

INFER = packets(
    # arithmetic
    "add",
    "sub",
    "rsub",
    "mul",
    "div",
    "neg",
    "abs",
    "sqrt",
    "square",
    "addcmul",
    "addcdiv",
    "lerp",
    "remainder",
    "fmod",
    "floor",
    "ceil",
    "round",
    "trunc",
    "frac",
    "sign",
    "sgn",
    "atan2",
    "hypot",
    "sin",
    "cos",
    "atan",
    "erf",
    "erfc",
    "clamp",
    "clip",
    "fill",
    # activations
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "hardtanh",
    "hardswish",
    "hardsigmoid",
    "elu",
    "selu",
    "celu",
    "leaky_relu",
    "mish",
    "softshrink",
    "hardshrink",
    "glu",
    "logit",
    # dropout, pooling by averaging, mean
    "native_dropout",
    "dropout",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "mean",
    "nanmean",
    # BatchNorm: low-precision activations, fp32 parameters and statistics
    # (see op_dtypes.MIXED_ARGS)
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "native_batch_norm",
    "batch_norm",
    "cudnn_batch_norm",
    "instance_norm",
    "embedding_bag",
    "_embedding_bag",
)

CLEAR = packets(
    # views and layout
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "expand_as",
    "permute",
    "transpose",
    "t",
    "squeeze",
    "unsqueeze",
    "flatten",
    "unflatten",
    "alias",
    "detach",
    "clone",
    "contiguous",
    "as_strided",
    "diagonal",
    "movedim",
    "view_as",
    "unfold",
    "pixel_shuffle",
    "pixel_unshuffle",
    "channel_shuffle",
    "lift_fresh_copy",
    # slicing, joining and gathering: exact in any dtype
    "slice",
    "select",
    "narrow",
    "index_select",
    "gather",
    "index",
    "take",
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "cat",
    "stack",
    "roll",
    "flip",
    "repeat",
    "tile",
    "constant_pad_nd",
    "pad",
    "reflection_pad1d",
    "reflection_pad2d",
    "replication_pad1d",
    "replication_pad2d",
    "replication_pad3d",
    "tril",
    "triu",
    "embedding",
    "masked_fill",
    "where",
    "index_put",
    "scatter",
    "slice_scatter",
    "select_scatter",
    "diagonal_scatter",
    "masked_scatter",
    # exact selections, orderings and comparisons
    "relu",
    "relu6",
    "threshold",
    "threshold_backward",
    "clamp_min",
    "clamp_max",
    "maximum",
    "minimum",
    "max",
    "min",
    "amax",
    "amin",
    "argmax",
    "argmin",
    "sort",
    "topk",
    "max_pool1d",
    "max_pool2d_with_indices",
    "max_pool3d_with_indices",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "isnan",
    "isinf",
    "isfinite",
    "isposinf",
    "isneginf",
    "nan_to_num",
    "heaviside",
    # factories: their dtype is rewritten instead of casting their result
    "zeros",
    "ones",
    "full",
    "empty",
    "empty_strided",
    "scalar_tensor",
    "zeros_like",
    "ones_like",
    "full_like",
    "empty_like",
    "rand_like",
    "randn_like",
    "new_zeros",
    "new_ones",
    "new_full",
    "new_empty",
    "rand",
    "randn",
)


@dataclass(frozen=True)
class PrecisionLists:
    allow: frozenset = ALLOW
    deny: frozenset = DENY
    infer: frozenset = INFER
    clear: frozenset = CLEAR
    # ops the user moved between lists (for the report's "why" column)
    overridden: frozenset = field(default=frozenset())

    def __post_init__(self) -> None:
        names = ("allow", "deny", "infer", "clear")
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                both = getattr(self, a) & getattr(self, b)
                if both:
                    ops = ", ".join(sorted(str(op) for op in both))
                    raise ValueError(f"precision lists {a!r} and {b!r} overlap: {ops}")

    def category(self, packet: Any) -> str:
        if packet in self.allow:
            return "allow"
        if packet in self.deny:
            return "deny"
        if packet in self.infer:
            return "infer"
        if packet in self.clear:
            return "clear"
        return "unknown"

    def with_overrides(self, overrides: Any) -> PrecisionLists:
        """These lists with a config's ListOverrides applied (later lists win)."""
        sets = {k: set(getattr(self, k)) for k in ("allow", "deny", "infer", "clear")}
        moved = set()
        for kind in ("allow", "deny", "infer", "clear", "remove"):
            for op in getattr(overrides, kind):
                for s in sets.values():
                    s.discard(op)
                if kind != "remove":
                    sets[kind].add(op)
                moved.add(op)
        return PrecisionLists(
            **{k: frozenset(v) for k, v in sets.items()}, overridden=frozenset(moved)
        )


DEFAULT_LISTS = PrecisionLists()


def describe(ops: Iterable[Any]) -> list[str]:
    return sorted(str(op) for op in ops)
