"""The example inputs the step is traced and compiled with: tensors like the live ones.

Assembly traces the step on fake copies of them and the backend compiles for them; nothing is
installed in the user's optimizer. Where the live tensor exists already it is the example: the
parameters and buffers, the optimizer state a checkpoint or eager steps left, the scaler's and
the history's device state and the graph's shared step counters (their first call makes them
here). What the runtime makes for each compiled step (hyperparameter tensors, this rank's number,
the overflow record, optimizer state graphamp creates) is made here with the same shape, dtype
and device. Detached: the step runs under no_grad, and a backend that saw an input requiring
grad would compile it for autograd.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..records.spec import StepPlan
from ..records.state import SharedState
from .components import component_examples


def example_inputs(
    plan: StepPlan,
    root: nn.Module,
    state: SharedState,
    inputs: list[torch.Tensor],
    device: torch.device,
) -> list[torch.Tensor]:
    """The step's flat inputs (``plan.layout``) for tracing and compiling."""
    cap = plan.captured
    params, buffers = dict(root.named_parameters()), dict(root.named_buffers())
    hyper = [
        t
        for o in plan.optimizers
        for k in range(len(o.optimizer.param_groups))
        for t in o.hyper_inputs(k, device)
    ]
    return plan.layout.flatten(
        {
            "params": [plan.placement.parameter(params[n]).detach() for n in cap.param_names],
            "buffers": [buffers[n] for n in cap.buffer_names],
            "opt_state": _optimizer_state(plan),
            "hyper": hyper,
            "counters": [state.counter(o.index, device, o.has_state()) for o in plan.optimizers],
            "momentum_fresh": [
                torch.zeros((), dtype=torch.bool, device=p.device)
                for o in plan.optimizers
                for p in o.fresh_params()
            ],
            "pass_state": state.pass_state_tensors(plan.pass_state, device),
            **component_examples(plan, state, device),
            "constants": cap.constants,
            "inputs": [t.detach() for t in inputs],
        }
    )


def _optimizer_state(plan: StepPlan) -> list[Any]:
    """Tensors shaped like the optimizer state, for tracing and compiling; nothing installed."""
    out = []
    for opt in plan.optimizers:
        for p, key in opt.state_slots():
            existing = opt.optimizer.state.get(p, {}).get(key)
            if plan.placement.state_is_row(key):
                out.append(plan.placement.state_row_example(p))
            elif isinstance(existing, torch.Tensor) and (key != "step" or opt.path.traced):
                out.append(existing)
            else:
                out.append(opt.initial_state(p, key))
    return out
