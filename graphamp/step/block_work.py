"""How much work a model's repeated blocks do: whether outlining them pays on a steady step.

Outlining makes each distinct repeated block one shared subgraph of the step, so the compiler
compiles it once (a faster first call). Each call of a shared subgraph costs the steady step a
fixed amount, whatever the block does, so on small blocks outlining costs more than the 2% the
default may spend. Measured on the CPU, one thread, bf16, AdamW (``python
benchmarks/outline_cost.py``, outlined over inlined; forward FLOPs of the step per block):

    transformers' GPT-2, 6 x width 128, vocab 512, batch 2   53 MFLOP    1.055 (issue 64: 1.17)
    the project's GPT, 6 x width 64, vocab 512, batch 2       14 MFLOP    1.026
    torchvision's ResNet-18, 64 x 64, batch 8                297 MFLOP    1.013
    ViT-Ti/16, batch 4                                       836 MFLOP    1.007-1.022
    transformers' GPT-2, 6 x width 128, GPT-2's vocab, b. 8  1.3 GFLOP    1.004

So the CPU's default outlines a model only where the step does at least
``OUTLINE_MIN_FLOPS_PER_BLOCK`` of forward work per block; ``config.set_outline_blocks(True)``
outlines any (the fastest first call: 26 s against 48 s for the first model above), ``False``
none.

A block's optimizer update by one kernel call (``block_update.py``) costs a fixed amount per
call too, and saves inductor compiling the whole update inline. With the blocks inlined
(``python benchmarks/outline_cost.py --kind default``, default with block updates over the
plain inlined step; first calls cold, ``first_call.py``):

    the project's GPT, 6 x width 64, vocab 512, batch 2       14 MFLOP    1.034, 21.9 s vs 35.1
    transformers' GPT-2, 6 x width 128, vocab 512, batch 2   53 MFLOP    0.983, 24.6 s vs 37.3

Those were measured with the attention in bf16. With it fp32 where fp32 is faster
(``config.set_fp32_where_faster``, 2026-12-06) the same GPT-2's step is 19.9 ms instead of
about 30, and its update calls cost it 1.139x (2.8 ms, about 0.46 ms a call): a call's fixed
cost is 2% of a block's share of the step only from about 370 MFLOP a block on such models.
So the CPU's default gives repeated blocks their update calls where the step does at least
``BLOCK_UPDATE_MIN_FLOPS_PER_BLOCK`` of forward work per block.

The work is counted on the captured forward, before assembly: 2 x the multiply-adds of every
matmul, batched matmul, convolution and attention op; the blocks are the outermost numbered
modules on the ops' paths (``outline.numbered_on``: ``h.3`` of ``transformer.h.3.mlp.c_fc``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._scaled_dot_product_efficient_attention,
#   torch.ops.aten._scaled_dot_product_flash_attention,
#   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
import math
from typing import Any

import torch
import torch.fx as fx

from ..torchkit.fxutil import module_path
from ..torchkit.shapes import size_hint
from .outline import numbered_on

aten = torch.ops.aten

# the forward FLOPs of the whole step per outlined block from which outlining keeps the steady
# step within 2% of the inlined one on the CPU (module docstring: between 53 and 297 MFLOP)
OUTLINE_MIN_FLOPS_PER_BLOCK = 200e6


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


# the forward FLOPs per block from which block updates keep the steady step within 2% of the
# plain inlined one on the CPU (module docstring: a call's 0.46 ms against a block's share)
BLOCK_UPDATE_MIN_FLOPS_PER_BLOCK = 400e6


def block_updates_pay(gm: fx.GraphModule) -> bool:
    """Does the step do enough work per repeated block for one update call per block to cost
    it under 2%?"""
    return flops_per_block(gm) >= BLOCK_UPDATE_MIN_FLOPS_PER_BLOCK


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
