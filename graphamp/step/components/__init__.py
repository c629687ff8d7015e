"""The step's components: each feature around the forward, backward and update, in one module.

``COMPONENTS`` is the one registration: the order in which components add their part within a
phase (``base.Phase``). A new feature of the step is a new module here with a ``StepComponent``
subclass and one line below; where in this order it goes decides what it sees (the overflow
probes observe the whole gradients before ZeRO scatters them; the scaler unscales before
build()'s own ``.grad`` is added, which is before clipping, and decides the skip before
build()'s changed parameters are put back; the history row reads the scale before
the scaler writes the next one, at a later phase).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ...records.spec import GraphSpec, StepPlan
from ...records.state import SharedState
from ...records.update_paths import UpdatePath
from .accumulation import Accumulation
from .activation_checkpointing import ActivationCheckpointing
from .clipping import Clipping
from .component import OptimizerUpdate, Phase, Planning, StepComponent, StepContext
from .data_parallel import DataParallel
from .fp8 import Fp8Histories
from .gradient_code import GradientCode
from .history_row import History
from .loss_scaling import LossScaling
from .overflow_probes import OverflowProbes
from .zero import Zero

COMPONENTS: tuple[StepComponent, ...] = (
    OverflowProbes(),
    Zero(),
    DataParallel(),
    LossScaling(),
    GradientCode(),
    Clipping(),
    History(),
    Fp8Histories(),
    Accumulation(),
    ActivationCheckpointing(),
)


def component_plan_fields(planning: Planning) -> dict[str, Any]:
    """The StepPlan fields the components decide (``StepComponent.plan_fields``)."""
    fields: dict[str, Any] = {}
    for c in COMPONENTS:
        mine = c.plan_fields(planning)
        twice = fields.keys() & mine.keys()
        if twice:
            raise ValueError(f"StepPlan fields {sorted(twice)} are set by two components")
        fields.update(mine)
    return fields


def check_optimizer_for_components(spec: GraphSpec, optimizer: Any, path: UpdatePath) -> None:
    """Every component's refusal of ``optimizer`` (``StepComponent.check_optimizer``)."""
    for c in COMPONENTS:
        c.check_optimizer(spec, optimizer, path)


def prepare_model_for_components(spec: GraphSpec, root: nn.Module, group: Any) -> None:
    """Every component's change to how the model holds its state, made on every rank of a
    data-parallel build before capture (``StepComponent.prepare_model``)."""
    for c in COMPONENTS:
        c.prepare_model(spec, root, group)


def step_rewrites(plan: StepPlan) -> list[StepComponent]:
    """The active components that rewrite the assembled step, in registration order."""
    return [c for c in active_components(plan) if c.rewrites(plan)]


def active_components(plan: StepPlan) -> list[StepComponent]:
    """The components ``plan`` uses, in registration order."""
    return [c for c in COMPONENTS if c.active(plan)]


def component_inputs(plan: StepPlan) -> dict[str, list[str]]:
    """The placeholder names of each component-owned group of the step's inputs (empty where
    the plan does not use the component)."""
    return {
        c.group: (c.input_names(plan) if c.active(plan) else [])
        for c in COMPONENTS
        if c.group is not None
    }


def component_examples(
    plan: StepPlan, state: SharedState, device: torch.device
) -> dict[str, list[torch.Tensor]]:
    """Each component-owned input group's example tensors (``step/examples.py``)."""
    return {
        c.group: (c.example_inputs(plan, state, device) if c.active(plan) else [])
        for c in COMPONENTS
        if c.group is not None
    }


def saved_component_state(state: SharedState) -> dict[str, Any]:
    """Each component's saved state, by its key in ``Graph.state_dict()``."""
    return {c.saved_key: c.saved_state(state) for c in COMPONENTS if c.saved_key is not None}


def checked_component_state(saved: dict[str, Any]) -> dict[str, Any]:
    """The components' parts of a saved graph state, each checked (ConfigError where one does
    not load); a part the state lacks (saved before the component kept state) is left out."""
    return {
        c.saved_key: c.checked_saved(saved[c.saved_key])
        for c in COMPONENTS
        if c.saved_key is not None and c.saved_key in saved
    }


def load_component_state(state: SharedState, checked: dict[str, Any]) -> None:
    """Load what ``checked_component_state`` returned."""
    for c in COMPONENTS:
        if c.saved_key is not None and c.saved_key in checked:
            c.load_saved(state, checked[c.saved_key])


__all__ = [
    "COMPONENTS",
    "OptimizerUpdate",
    "Phase",
    "Planning",
    "StepComponent",
    "StepContext",
    "active_components",
    "check_optimizer_for_components",
    "checked_component_state",
    "component_examples",
    "component_inputs",
    "component_plan_fields",
    "load_component_state",
    "prepare_model_for_components",
    "saved_component_state",
    "step_rewrites",
]
