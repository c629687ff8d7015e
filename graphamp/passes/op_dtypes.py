"""How aten ops treat dtypes, as data: the facts the cast passes work from.

The precision lists (``lists.py``) say which precision an op should run in; these sets say how
an op's kernel handles the dtypes it is given, which decides where ``base.py``, ``colour.py``,
``insert_casts.py``, ``hoist_param_casts.py`` and ``lint.py`` put (or leave out) a cast:
boundaries that convert by themselves, mixed-precision argument positions, ops that promote,
ops that need equal dtypes, factories, and which outputs of a tuple-returning op follow its
compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch

# registers torch.ops.graphamp.*, which ALL_OUTPUTS_FOLLOW names (graphamp.rnn)
from ..torchkit import ops as _graphamp_ops  # noqa: F401


def packets(*names: str) -> frozenset:
    """aten op packets by name; names missing from this torch build are skipped."""
    out = []
    for name in names:
        ns, _, op = name.rpartition(".")
        namespace = getattr(torch.ops, ns or "aten")
        if hasattr(namespace, op):
            out.append(getattr(namespace, op))
    return frozenset(out)


# Ops whose output dtype is fixed by an argument or by a destination: never coloured, never
# given input casts (they convert internally). The AMP passes treat them as boundaries.
FIXED_DTYPE = packets("_to_copy", "to", "copy", "prims.convert_element_type", "type_as")

# Mixed-precision kernels: these argument positions stay fp32 even when the op runs low.
MIXED_ARGS: dict[Any, tuple[int, ...]] = {
    op: (1, 2, 3, 4)
    for op in packets(
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
        "native_batch_norm",
        "batch_norm",
        "cudnn_batch_norm",
    )
}

# autocast's promote list (and the aten ops it reaches): run in the widest floating dtype among
# the inputs as they arrive (fp64 aside); mixed inputs are cast to it. Not coloured: they follow
# whatever their producers give. A user override that lists one of them wins.
PROMOTE = packets(
    "dot",
    "vdot",
    "tensordot",
    "bilinear",
    "_trilinear",
    "cross",
    "linalg_cross",
    "grid_sampler",
    "grid_sampler_2d",
    "grid_sampler_3d",
    "_grid_sampler_2d_cpu_fallback",
    "cudnn_grid_sampler",
    "scatter_add",
)

# Ops whose kernels need their floating inputs in one dtype: when the AMP passes would leave
# them mixed, all are cast to the widest. (cat, stack and where promote in their kernels.)
EQUAL_DTYPES = packets(
    "index_put",
    "_unsafe_index_put",
    "index_add",
    "index_copy",
    "masked_scatter",
    "scatter",
    "lerp",
)

# Elementwise ops that promote mixed float inputs themselves: when they run in fp32 a
# low-precision input needs no cast node (the kernel reads it and widens, as eager does).
PROMOTING = packets(
    "add",
    "sub",
    "rsub",
    "mul",
    "div",
    "where",
    "maximum",
    "minimum",
    "atan2",
    "addcmul",
    "addcdiv",
    "hypot",
    "remainder",
    "fmod",
)

FACTORIES = packets(
    "zeros",
    "ones",
    "full",
    "empty",
    "empty_strided",
    "scalar_tensor",
    "rand",
    "randn",
)

# Factories that take their shape from a tensor: under allow their dtype is set, no input cast.
LIKE_FACTORIES = packets(
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
)

# Tuple-returning ops whose every float output is data in the op's compute dtype. For all other
# tuple-returning ops only output 0 follows the compute dtype; the rest are statistics kept in
# fp32 by the kernels (BatchNorm's mean and rstd, attention's logsumexp).
ALL_OUTPUTS_FOLLOW = packets(
    "split",
    "split_with_sizes",
    "unbind",
    "chunk",
    "tensor_split",
    "unsafe_split",
    "unsafe_split_with_sizes",
    # recurrent states are data: an LSTM's cell state, the cells'
    # gate workspaces, graphamp.rnn's h_n and c_n
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "graphamp.rnn",
    "_cudnn_rnn",
    "mkldnn_rnn_layer",
)
