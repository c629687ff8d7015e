"""A CPU training step keeps the layout it was traced in (backend/compile.default_inductor_options).

Inductor lays out every CPU graph with a convolution channels-last; a whole step holds the
backward too, where that was slower on every convolution network measured
(benchmarks/results/conv_layout_cpu.md). The step keeps the model's and the batch's layout
instead: NCHW by default, channels-last where the user made them so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import graphamp
from graphamp.backend.compile import default_inductor_options


def _conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def test_a_cpu_step_with_a_convolutions_backward_turns_layout_optimization_off():
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)

    def train(w, x):
        out = F.conv2d(x, w)
        return torch.autograd.grad(out.sum(), w)

    def infer(w, x):
        return F.conv2d(x, w)

    w = conv.weight.detach().requires_grad_()
    train_gm = make_fx(train)(w, x)
    assert train_gm.graph.find_nodes(
        op="call_function", target=torch.ops.aten.convolution_backward.default
    )
    assert default_inductor_options(train_gm, [w, x]) == {"layout_optimization": False}
    # no backward: an inference graph keeps inductor's own decision
    assert default_inductor_options(make_fx(infer)(w, x), [w, x]) == {}


class _ConvLayouts(TorchDispatchMode):
    """The memory format of every convolution's input the compiled step runs."""

    def __init__(self):
        super().__init__()
        self.formats: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            x = args[0]
            self.formats.append(
                "nchw"
                if x.is_contiguous()
                else "channels_last"
                if x.is_contiguous(memory_format=torch.channels_last)
                else "other"
            )
        return func(*args, **(kwargs or {}))


def _conv_layouts_of_a_step(channels_last: bool, options: dict | None = None) -> list[str]:
    model = _conv_net()
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_backend("inductor")
            if options:
                self.config.set_inductor_options(**options)

        def build(self, x, y):
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    step = Step()
    step(x, y)  # compiled here
    with _ConvLayouts() as seen:
        loss = step(x, y)
    assert torch.isfinite(loss)
    assert len(seen.formats) == 2, seen.formats  # both forward convolutions ran as extern calls
    return seen.formats


def test_a_cpu_training_step_runs_its_convolutions_in_the_traced_layout():
    assert _conv_layouts_of_a_step(channels_last=False) == ["nchw", "nchw"]


def test_a_model_the_user_made_channels_last_stays_channels_last():
    assert _conv_layouts_of_a_step(channels_last=True) == ["channels_last", "channels_last"]


@pytest.mark.slow
def test_the_users_inductor_option_brings_inductors_channels_last_rule_back():
    formats = _conv_layouts_of_a_step(False, {"layout_optimization": True})
    assert formats == ["channels_last", "channels_last"]
