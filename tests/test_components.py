"""A new step feature is one StepComponent and one registration (docs/architecture.md, "Step
components"): nothing else in graphamp changes for it. Checked end to end with a component
written here, which owns an input group (its live tensor, fed to every call) and adds at one
phase, against eager PyTorch doing the same by hand."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphamp
import graphamp.step.components as components
from graphamp.step.components import OptimizerUpdate, StepComponent, StepContext


class GradientFactor(StepComponent):
    """Multiplies every optimizer's gradients by a factor the user may change between calls
    (the tensor it owns): a feature no list names, written as a newcomer would."""

    name = "gradient_factor"
    part = "the gradient factor"
    group = "gradient_factor"
    inputs = ("factor",)
    on_skip = "nothing"
    across_ranks = "nothing"

    def __init__(self, factor: torch.Tensor):
        self.factor = factor

    def active(self, plan) -> bool:
        return plan.training

    def example_inputs(self, plan, state, device) -> list[torch.Tensor]:  # noqa: ARG002
        return [self.factor]

    def optimizer_gradients(self, ctx: StepContext, u: OptimizerUpdate) -> None:
        (factor,) = self.own(ctx)
        u.grads = [g * factor for g in u.grads]


def test_a_component_in_one_module_and_one_registration_trains_as_eager_does_by_hand(
    monkeypatch,
):
    factor = torch.tensor(0.5)
    monkeypatch.setattr(components, "COMPONENTS", (*components.COMPONENTS, GradientFactor(factor)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")
            self.config.set_step_cache(False)  # the registry is this test's own

        def build(self, x, y):
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    step = Train()
    for k, value in enumerate((0.5, 0.5, 2.0, 0.0)):
        factor.fill_(value)  # the live tensor: read by every call, never baked in
        x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
        step(x, y)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            p.grad.mul_(value)
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=f"step {k}")
    assert len(step.compiled_steps) == 1  # one program: the factor is an input, not a constant
