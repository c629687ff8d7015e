"""The math graphamp's ops stand for, in torch's own terms: attention as torch's kernel and as
two matmuls around an fp32 softmax, and a recurrent layer run on a dense batch. ``ops.py``
registers these as the kernels of ``graphamp::scaled_dot_product_attention``,
``graphamp::sdpa_as_matmuls`` and ``graphamp::rnn``, and step assembly expands the nodes back
into them (``ops.EXPANSIONS``); the AMP passes time them (``passes/fp32_where_faster.py``)."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C._get_mkldnn_enabled, torch._C._set_mkldnn_enabled, torch._VF
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import GraphampError

# the modes of torch._VF's recurrent layers, each one graphamp::rnn op call
RNN_MODES = ("lstm", "gru", "rnn_tanh", "rnn_relu")


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


def expand_rnn(*args: Any) -> list[Tensor]:
    """A graphamp.rnn node in the traced step. oneDNN's CPU kernel (bf16) is left out: make_fx
    records its backward without the workspace tensor the forward saved (torch 2.14), so the
    compiled step would fail; the matmul loop torch uses otherwise differentiates cleanly."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)  # mkldnn.flags() would also touch TF32 and warn
    try:
        return rnn_reference(*args)
    finally:
        torch._C._set_mkldnn_enabled(enabled)
