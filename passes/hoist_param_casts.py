"""hoist_parameter_casts: parameters come in already cast; the optimizer keeps the copies.

OneFlow fuses the cast of each model weight into the model-update op, which writes a
low-precision copy of the weight next to the fp32 master. The same here: every
``cast(parameter, low)`` node becomes a new placeholder (a *shadow*), fed by a persistent
low-precision copy that step assembly refreshes inside the optimizer update (fused there, so the
forward never re-reads the fp32 weight). Numerically nothing changes: the shadow always equals
``parameter.to(low)``. The forward graph's inputs become ``(*params, *buffers, *inputs,
*shadows)``; each shadow placeholder carries ``meta["shadow_of"]`` (the parameter placeholder's
name) and ``meta["amp_dtype"]``.

Only placeholders named in ``ctx.parameters`` are hoisted (buffers and inputs change every step
or are not the optimizer's to refresh).
"""

from __future__ import annotations

import torch.fx as fx

from .base import AmpContext, PassResult
from .fold_casts import cast_target_dtype


def hoist_parameter_casts(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    hoisted = []
    for param in placeholders:
        if param.name not in ctx.parameters:
            continue
        for cast in list(param.users):
            dtype = cast_target_dtype(cast)
            if dtype is None or not cast.meta.get("amp_cast"):
                continue
            with graph.inserting_after(last):
                shadow = graph.placeholder(f"{param.name}_{str(dtype).replace('torch.', '')}")
            last = shadow
            shadow.meta.update(
                val=param.meta.get("val"), amp_dtype=dtype, amp_colour="cast", amp_cast=False,
                shadow_of=param.name,
                amp_reason=f"low-precision copy of {param.name}, refreshed by the optimizer",
            )
            cast.replace_all_uses_with(shadow)
            graph.erase_node(cast)
            hoisted.append((param.name, dtype))
    ctx.stats["parameter_casts_hoisted"] = len(hoisted)
    ctx.hoisted = hoisted
    if hoisted:
        gm.recompile()
    return PassResult(gm, bool(hoisted))
