"""Stages 3 and 4: plan the training step on the host, then trace it into one FX graph.

``build_plan`` makes the StepPlan (with the StepLayout of the step's inputs); ``assemble_step``
traces the forward and gradients (``gradients.py``), each optimizer's update
(``optimizer_update.py``) and every feature around them, each one component
(``components/``, which lists them), into one graph.
"""

from .assemble import assemble_step
from .block_update import (
    block_devices,
    block_example,
    block_specs,
    compile_block_kernels,
    count_block_updates,
    set_kernel_backend,
    unmade_specs,
)
from .block_work import block_updates_pay, outlining_cost_words, outlining_pays
from .components import (
    StepComponent,
    component_examples,
    prepare_model_for_components,
    step_rewrites,
)
from .examples import example_inputs
from .outline import OutlineResult, outline_blocks
from .plan import build_plan
from .recompute import RecomputeResult, recompute_checkpointed

__all__ = [
    "OutlineResult",
    "RecomputeResult",
    "StepComponent",
    "assemble_step",
    "block_devices",
    "block_example",
    "block_specs",
    "build_plan",
    "compile_block_kernels",
    "component_examples",
    "count_block_updates",
    "example_inputs",
    "outline_blocks",
    "block_updates_pay",
    "outlining_cost_words",
    "outlining_pays",
    "prepare_model_for_components",
    "recompute_checkpointed",
    "set_kernel_backend",
    "step_rewrites",
    "unmade_specs",
]
