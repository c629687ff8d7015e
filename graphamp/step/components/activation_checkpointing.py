"""Activation checkpointing (``config.enable_activation_checkpointing``): the backward recomputes
each checkpointed module's forward values instead of keeping them alive.

Capture finds the regions (``capture.checkpointed_paths``); this component puts them in the
plan (``StepPlan.checkpointed``) and rewrites the assembled, still inlined step with the pass of
``step/recompute.py`` (copies of each region's nodes placed before the first backward node
that reads them), so that outlining sees the copies inside their block. It keeps no state and
adds nothing at the step's phases.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ...records.spec import StepPlan
from ...records.stage_names import Stage
from ..recompute import recompute_checkpointed
from .component import Planning, StepComponent


class ActivationCheckpointing(StepComponent):
    name = "activation_checkpointing"
    part = "activation checkpointing"
    on_skip = "nothing: the recomputed values live within the step"
    across_ranks = "nothing: each rank recomputes its own regions"
    rewrite_stage = Stage.RECOMPUTE  # before outlining: a block's copies are outlined with it

    def active(self, plan: StepPlan) -> bool:
        return plan.recomputes

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        if not (planning.spec.training and planning.regions):
            return {}
        return {"checkpointed": tuple(sorted(planning.regions))}

    def rewrites(self, plan: StepPlan) -> bool:  # noqa: ARG002 - whenever it is active
        return True

    def rewrite_step(self, plan: StepPlan, gm: fx.GraphModule) -> str:
        done = recompute_checkpointed(gm, frozenset(plan.checkpointed))
        return f"recomputes {done.copies} ops in {len(done.regions)} regions"
