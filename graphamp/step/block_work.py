"""How much work a model's repeated blocks do: whether outlining them pays on a steady step.

Outlining makes each distinct repeated block one shared subgraph of the step, so the compiler
compiles it once (a faster first call). Each call of a shared subgraph costs the steady step a
fixed amount, whatever the block does: about 0.57 ms a block on the CPU, one thread (issue 64:
transformers' GPT-2, 6 layers of width 128, 2 x 64 tokens, a vocabulary of 512: 23.2 ms outlined
against 19.8 ms inlined, 1.17x), at that step's 48 GFLOP/s some 27 MFLOP of step work, or 9 MFLOP
of forward work (the backward does about twice the forward's). To stay within 2% of the
inlined step, the whole step's forward must do at least 50 times that per outlined block:
``OUTLINE_MIN_FLOPS_PER_BLOCK``. The same GPT-2 with GPT-2's vocabulary and batch 8 does
1.3 GFLOP per block, most of it the output layer, and measured 1.004x outlined. So the CPU's
default outlines a model only where that holds; ``config.set_outline_blocks(True)`` outlines
any (the fastest first call), ``False`` none.

The work is counted on the captured forward, before assembly: 2 x the multiply-adds of every
matmul, batched matmul, convolution and attention op; the blocks are the outermost numbered
modules on the ops' paths (``outline.numbered_on``: ``h.3`` of ``transformer.h.3.mlp.c_fc``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from ..torchkit.fxutil import module_path
from ..torchkit.shapes import size_hint
from .outline import numbered_on

aten = torch.ops.aten

# the forward FLOPs of the whole step per outlined block from which outlining keeps the steady
# step within 2% of the inlined one on the CPU (module docstring)
OUTLINE_MIN_FLOPS_PER_BLOCK = 450e6


def flops_per_block(gm: fx.GraphModule) -> float:
    """The forward FLOPs of ``gm`` divided by its numbered blocks (inf: no block)."""
    total, blocks = 0.0, set()
    for node in gm.graph.nodes:
        flops = _flops(node)
        total += flops
        block = _block_of(module_path(node) or "") if flops else None
        if block is not None:
            blocks.add(block)
    return total / len(blocks) if blocks else math.inf


def outlining_pays(gm: fx.GraphModule) -> bool:
    """Does the step do enough work per repeated block for outlining to cost it under 2%?"""
    return flops_per_block(gm) >= OUTLINE_MIN_FLOPS_PER_BLOCK


def _block_of(path: str) -> str | None:
    parts = path.split(".") if path else []
    found = numbered_on(parts)
    return ".".join(parts[: found[0][0] + 1]) if found else None


def _shape(value: Any) -> list[int]:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return [size_hint(s) for s in val.shape] if isinstance(val, torch.Tensor) else []


def _flops(node: fx.Node) -> float:
    """2 x the multiply-adds of a matmul, batched matmul, convolution or attention node."""
    if node.op != "call_function":
        return 0.0
    packet = getattr(node.target, "overloadpacket", None)
    out = _shape(node)
    if packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
        a = _shape(node.args[1] if packet in (aten.addmm, aten.baddbmm) else node.args[0])
        return 2.0 * math.prod(out) * (a[-1] if a else 0)
    if packet is aten.convolution:
        w = _shape(node.args[1])
        return 2.0 * math.prod(out) * math.prod(w[1:]) if w else 0.0
    if packet in (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_flash_attention,
        aten.scaled_dot_product_attention,
    ):
        q, k = _shape(node.args[0]), _shape(node.args[1])
        return 4.0 * math.prod(q) * k[-2] if q and k else 0.0
    return 0.0


def outlining_cost_words(gm: fx.GraphModule) -> str:
    """Why outlining does not pay here, in words."""
    return (
        f"the step does {flops_per_block(gm) / 1e6:.0f} MFLOP of forward work per block, "
        f"under the {OUTLINE_MIN_FLOPS_PER_BLOCK / 1e6:.0f} MFLOP at which outlining costs the "
        "steady step less than 2%"
    )
