"""The AMP pipeline: its order is this literal tuple, and nowhere else."""

from __future__ import annotations

import time
from typing import Callable

import torch.fx as fx

from .base import AmpContext
from .colour import colour_by_lists
from .fold_casts import fold_cast_chains
from .hoist_param_casts import hoist_parameter_casts
from .insert_casts import insert_casts
from .lint import check_amp_invariants
from .remove_hints import remove_hints

AMP_PIPELINE = (colour_by_lists, insert_casts, remove_hints, fold_cast_chains,
                hoist_parameter_casts)

AfterPass = Callable[[str, fx.GraphModule, bool, float], None]


def run_amp_passes(gm: fx.GraphModule, ctx: AmpContext, *, after_pass: AfterPass | None = None,
                   check: bool = True) -> fx.GraphModule:
    """Run AMP_PIPELINE on ``gm`` in place; lint after each pass, check invariants at the end."""
    timings = ctx.stats.setdefault("pass_seconds", {})
    for amp_pass in AMP_PIPELINE:
        start = time.perf_counter()
        result = amp_pass(gm, ctx)
        gm = result.graph_module
        seconds = time.perf_counter() - start
        timings[amp_pass.__name__] = seconds
        if check:
            gm.graph.lint()
        if after_pass is not None:
            after_pass(amp_pass.__name__, gm, result.modified, seconds)
    if check:
        check_amp_invariants(gm, ctx)
    ctx.stats["casts"] = sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
    ctx.stats["casts_with_parameters"] = ctx.stats["casts"] + len(ctx.hoisted)
    return gm
