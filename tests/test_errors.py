"""Bad input raises an error naming the problem and the fix; nothing is lost."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from helpers import assert_unchanged, make_graph, snapshot
from models import seed_mlp

import graphamp
from graphamp import (
    CaptureError,
    ConfigError,
    GraphDefinitionError,
    InputError,
    UnsupportedOptimizerError,
)


def _xy(batch=8):
    return torch.randn(batch, 256), torch.randint(0, 10, (batch,))


def _step_once_eagerly_to_create_state(model, opt):
    opt.zero_grad()
    nn.functional.cross_entropy(model(_xy()[0]), _xy()[1]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.fixture
def trained():
    """A model and optimizer that already have state, so 'nothing lost' means something."""
    model = seed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step_once_eagerly_to_create_state(model, opt)
    return model, opt


def test_build_without_backward_while_an_optimizer_is_added(trained):
    model, opt = trained
    before = snapshot(model, opt)

    def build(self, x, y):
        return nn.functional.cross_entropy(self.model(x), y)

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(CaptureError, match=r"never calls backward\(\).*loss\.backward\(\)"):
        g(*_xy())
    assert_unchanged(before, model, opt)


def test_backward_twice_on_the_same_loss(trained):
    model, opt = trained
    before = snapshot(model, opt)

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        loss.backward()  # the line the error must name
        return loss

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(CaptureError, match=r"twice.*test_errors\.py:\d+.*retain_graph=True"):
        g(*_xy())
    assert_unchanged(before, model, opt)


def test_optimizer_over_parameters_of_no_registered_module(trained):
    model, _ = trained
    stranger = nn.Linear(3, 3)
    opt = torch.optim.SGD(list(model.parameters()) + list(stranger.parameters()), lr=0.1)
    before = snapshot(model, opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    with pytest.raises(CaptureError, match=r"belongs to no module registered.*self\.model = model"):
        g(*_xy())
    assert_unchanged(before, model, opt)


def test_wrong_number_of_arguments(trained):
    model, opt = trained
    before = snapshot(model, opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    x, y = _xy()
    with pytest.raises(InputError, match=r"build\(x, y\)"):
        g(x)
    with pytest.raises(InputError, match=r"build\(x, y\)"):
        g(x, y, y)
    assert_unchanged(before, model, opt)


def test_wrong_argument_types(trained):
    model, opt = trained
    before = snapshot(model, opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    x, y = _xy()
    with pytest.raises(InputError, match=r"ndarray.*torch\.as_tensor"):
        g(x.numpy(), y)
    with pytest.raises(InputError, match=r"type object"):
        g(x, object())
    assert isinstance(np.zeros(1), np.ndarray)
    assert_unchanged(before, model, opt)


def test_input_on_another_device_than_the_model(trained):
    model, opt = trained
    before = snapshot(model, opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    x, y = _xy()
    with pytest.raises(InputError, match=r"on meta but the graph runs on cpu"):
        g(x.to("meta"), y)
    assert_unchanged(before, model, opt)


def test_data_dependent_control_flow_names_the_users_line(trained):
    model, opt = trained
    before = snapshot(model, opt)

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        if loss > 1.0:  # data-dependent: the line the error must name
            loss = loss * 2
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(CaptureError, match=r"bool\(\).*test_errors\.py:\d+.*if loss > 1\.0"):
        g(*_xy())
    assert_unchanged(before, model, opt)


def test_item_in_build_is_explained(trained):
    model, opt = trained
    before = snapshot(model, opt)

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss.item()

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(CaptureError, match=r"\.item\(\).*return loss\.item\(\).*torch\.where"):
        g(*_xy())
    assert_unchanged(before, model, opt)


def test_init_that_forgot_super_init():
    class Forgetful(graphamp.Graph):
        def __init__(self):
            self.model = seed_mlp()

        def build(self, x):
            return self.model(x)

    with pytest.raises(GraphDefinitionError, match=r"super\(\)\.__init__\(\)"):
        Forgetful()

    class Lazy(graphamp.Graph):
        def __init__(self):
            pass

        def build(self, x):
            return x

    with pytest.raises(GraphDefinitionError, match=r"super\(\)\.__init__\(\)"):
        Lazy()(torch.randn(2))


@pytest.mark.parametrize(
    "make_opt, words",
    [
        (lambda p: torch.optim.LBFGS(p), r"step\(closure\)"),
        (lambda p: torch.optim.SparseAdam(p), "sparse gradients"),
    ],
)
def test_unsupported_optimizer_class(make_opt, words):
    """Refused at add_optimizer, nothing changed (every other optimizer's step is traced:
    tests/test_optimizers.py)."""
    model = seed_mlp()
    opt = make_opt(model.parameters())
    before = snapshot(model, opt)
    with pytest.raises(UnsupportedOptimizerError, match=words):
        make_graph(model, nn.CrossEntropyLoss(), opt)
    assert_unchanged(before, model, opt)


def test_backward_without_optimizer_is_an_error(trained):
    model, _ = trained
    before = snapshot(model)
    g = make_graph(model, nn.CrossEntropyLoss(), None)
    with pytest.raises(CaptureError, match=r"no optimizer is added.*add_optimizer"):
        g(*_xy())
    assert_unchanged(before, model)


def test_parameter_in_two_optimizers(trained):
    model, _ = trained
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model[2].parameters(), lr=0.1)

    def configure(self):
        self.add_optimizer(b)

    g = make_graph(model, nn.CrossEntropyLoss(), a, configure=configure)
    with pytest.raises(CaptureError, match=r"is in optimizers 0 and 1"):
        g(*_xy())


def test_model_on_two_devices():
    model = seed_mlp()
    model[2].to("meta")
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model[0].parameters(), lr=0.1))
    with pytest.raises(InputError, match=r"one device"):
        g(*_xy())


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda g: g.config.enable_amp(True, dtype=torch.int8), r"float16 or torch\.bfloat16"),
        (lambda g: g.config.set_backend("tvm"), r"unknown backend 'tvm'"),
        (lambda g: g.config.set_amp_opt_level("O4"), r"unknown AMP opt level 'O4'"),
        (lambda g: g.config.set_gradient_accumulation_steps(0), r">= 1"),
        (lambda g: g.add_optimizer("adam"), r"torch\.optim\.Optimizer"),
        (lambda g: g.set_grad_scaler(2.0), r"graphamp\.GradScaler"),
        (
            lambda g: g.add_optimizer(
                torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), clip_grad_max_norm=-1.0
            ),
            r"positive",
        ),
    ],
)
def test_config_errors(call, message):
    g = make_graph(seed_mlp(), nn.CrossEntropyLoss(), None)
    with pytest.raises((ConfigError, UnsupportedOptimizerError), match=message):
        call(g)


def test_build_not_defined():
    class NoBuild(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = seed_mlp()

    with pytest.raises(CaptureError, match=r"must define build"):
        NoBuild()(torch.randn(2, 256))
