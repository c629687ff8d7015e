"""hoist_parameter_casts: parameters come in already cast, once per step.

Where a coloured op wants a parameter in low precision, it reads a new placeholder instead (a
*shadow*). Step assembly feeds it ``parameter.to(low)``, made once at the start of the step: one
cast per parameter per step however many ops and micro-batches read it (a cast inside the
forward would be repeated per micro-batch), from the values the user's tensor holds at that
moment, so edits made outside the step (``p.data``, ``nn.init``, ``load_state_dict``) are always
seen. (An earlier design kept persistent copies refreshed inside the optimizer update, as
OneFlow's fused model-update cast does; an edit through ``p.data`` bumps no version counter,
so nothing could tell those copies were stale.)

Runs after colour_by_lists and before insert_casts. The forward graph's inputs become
``(*params, *buffers, *inputs, loss_scale, *constants, *shadows)``; each shadow placeholder
carries ``meta["shadow_of"]`` (the parameter placeholder's name) and ``meta["amp_dtype"]``.
Only placeholders named in ``ctx.parameters`` are hoisted (buffers and inputs are different
every step).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..records.validate import dtype_name
from .base import AmpContext, PassResult, captured_dtype, packet_of
from .insert_casts import wanted_dtype
from .op_dtypes import MIXED_ARGS


def hoist_parameter_casts(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    hoisted = []
    for param in placeholders:
        # only fp32 values are lowered (fp64 parameters keep their precision)
        if param.name not in ctx.parameters or captured_dtype(param) != torch.float32:
            continue
        users = [
            u
            for u in param.users
            if u.meta.get("amp_colour") == "allow"
            and (
                packet_of(u) not in MIXED_ARGS
                or any(
                    wanted_dtype(u, pos, param, ctx.dtype) == ctx.dtype
                    for pos in _positions(u, param)
                )
            )
        ]
        if not users:
            continue
        with graph.inserting_after(last):
            shadow = graph.placeholder(f"{param.name}_{dtype_name(ctx.dtype)}")
        last = shadow
        shadow.meta.update(
            val=param.meta.get("val"),
            captured_dtype=captured_dtype(param),
            amp_dtype=ctx.dtype,
            amp_colour="cast",
            shadow_of=param.name,
            amp_reason=f"low-precision copy of {param.name}, refreshed by the optimizer",
        )
        for user in users:
            if packet_of(user) in MIXED_ARGS:
                _replace_low_uses(user, param, shadow, ctx)
            else:  # every position of this user wants low precision
                user.replace_input_with(param, shadow)
        hoisted.append((param.name, ctx.dtype))
    ctx.stats["parameter_casts_hoisted"] = len(hoisted)
    ctx.hoisted = hoisted
    return PassResult(gm, bool(hoisted))


def _positions(user: fx.Node, value: fx.Node) -> list:
    out = [i for i, a in enumerate(user.args) if _mentions(a, value)]
    return out + [k for k, a in user.kwargs.items() if _mentions(a, value)]


def _mentions(arg, value: fx.Node) -> bool:
    if arg is value:
        return True
    return isinstance(arg, (list, tuple)) and any(_mentions(a, value) for a in arg)


def _replace_low_uses(user: fx.Node, param: fx.Node, shadow: fx.Node, ctx: AmpContext) -> None:
    """Point the argument positions that want low precision at the shadow (BatchNorm's fp32
    positions keep the parameter)."""

    def swap(arg, pos):
        if arg is param:
            return shadow if wanted_dtype(user, pos, param, ctx.dtype) == ctx.dtype else arg
        if isinstance(arg, (list, tuple)):
            return type(arg)(swap(a, pos) for a in arg)
        return arg

    user.args = tuple(swap(a, i) for i, a in enumerate(user.args))
    user.kwargs = {k: swap(a, k) for k, a in user.kwargs.items()}
