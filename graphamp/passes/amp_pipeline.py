"""The AMP pipeline: its order is this literal tuple, and nowhere else.

Passes edit ``gm.graph`` and leave regenerating Python code to the pipeline, which does it once
at the end (regenerating a 100k-node module costs seconds).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.fx as fx

from ..errors import GraphampError
from ..records.settings import ConfigSnapshot
from ..torchkit.fxutil import gc_paused
from .base import AmpContext, CheckPaths, SettingsOf
from .colour import colour_by_lists
from .fold_casts import fold_cast_chains
from .fp8_matmuls import fp8_settings, use_fp8_matmuls
from .fp32_where_faster import keep_fp32_where_faster, speed_settings
from .hoist_param_casts import hoist_parameter_casts
from .insert_casts import insert_casts
from .lint import check_amp_invariants
from .remove_hints import remove_hints

AMP_PIPELINE = (
    keep_fp32_where_faster,
    colour_by_lists,
    hoist_parameter_casts,
    insert_casts,
    remove_hints,
    fold_cast_chains,
    use_fp8_matmuls,
)

# The passes with settings beyond the precision lists: each checks its own before anything
# is traced and names the AmpContext fields it reads (``base.SettingsOf``).
PASS_SETTINGS: tuple[SettingsOf, ...] = (fp8_settings, speed_settings)

AfterPass = Callable[[str, fx.GraphModule, bool, float], None]


def run_amp_passes(
    gm: fx.GraphModule,
    ctx: AmpContext,
    *,
    after_pass: AfterPass | None = None,
    check: bool = True,
    recompile: bool = True,
) -> fx.GraphModule:
    """Run AMP_PIPELINE on ``gm`` in place; lint after each pass, check invariants at the end,
    then regenerate the module's code once."""
    timings = ctx.stats.setdefault("pass_seconds", {})
    with gc_paused():
        gm = _run(gm, ctx, after_pass, check, timings)
    if check:
        check_amp_invariants(gm, ctx)
    if recompile:
        gm.recompile()
    ctx.stats["casts"] = sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
    ctx.stats["casts_with_parameters"] = ctx.stats["casts"] + len(ctx.hoisted)
    return gm


def pass_settings(
    config: ConfigSnapshot,
    device: torch.device,
    name: str,
    training: bool,
    check_paths: CheckPaths,
) -> dict[str, Any]:
    """The AmpContext fields of every pass with settings of its own (``PASS_SETTINGS``),
    checked: ConfigError where a setting cannot run on this graph."""
    fields: dict[str, Any] = {}
    for settings_of in PASS_SETTINGS:
        fields.update(settings_of(config, device, name, training, check_paths))
    return fields


class AmpPassError(GraphampError, RuntimeError):
    """An AMP pass raised: names the pass and the passes that ran before it (a graphamp bug, or
    a graph the passes do not handle; the original error is the cause)."""


def _run(gm, ctx, after_pass, check, timings):
    for i, amp_pass in enumerate(AMP_PIPELINE):
        name = amp_pass.__name__
        start = time.perf_counter()
        try:
            result = amp_pass(gm, ctx)
            if check:
                result.graph_module.graph.lint()
        except Exception as e:
            before = ", ".join(p.__name__ for p in AMP_PIPELINE[:i]) or "none"
            raise AmpPassError(
                f"AMP pass {name} failed (passes run before it: {before}): {type(e).__name__}: {e}"
            ) from e
        gm = result.graph_module
        seconds = time.perf_counter() - start
        timings[name] = seconds
        if after_pass is not None:
            after_pass(name, gm, result.modified, seconds)
    return gm
