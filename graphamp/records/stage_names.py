"""The names of the build's stages: one enum, read by the pipeline that runs them, the errors
worded for each (``pipeline/stage_errors.py``), the timings a Program keeps and the INFO lines.

A ``StrEnum``: a stage compares and prints as its name (the log lines), and code names it only
through a member. ``Program.timings`` keys are the plain names (``Stage.X.value``): users read
them from ``CompiledStep.timings`` and save them with ``torch.save``, whose ``weights_only`` load
refuses graphamp's classes.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    """The stages of one build, in the order they run (``pipeline/build.py``)."""

    CAPTURE = "capture"
    AMP_PASSES = "amp_passes"
    PLAN = "plan"
    EXAMPLES = "examples"
    STEP_CACHE = "step_cache"
    ASSEMBLE = "assemble"
    RECOMPUTE = "recompute"
    OUTLINE = "outline"
    PLACE_COLLECTIVES = "place_collectives"  # ZeRO-3's rewrite of the step (its component's)
    SAVE_STEP = "save_step"
    COMPILE = "compile"
