"""Errors that are not faults of one training step: a Graph subclass defined wrong, a bad
configuration call, a backend that cannot compile (a CompileError), and Ctrl-C, which is never
wrapped. The catalogue of the user's faults in a step, each checked to change nothing, is
tests/test_error_catalogue.py."""

from __future__ import annotations

import re

import models
import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from helpers import make_graph, sgd_with_state
from models import seed_mlp

import graphamp
from graphamp import CaptureError, ConfigError, GraphDefinitionError, UnsupportedOptimizerError


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


def _broken_backend_compiler(gm, example):
    raise RuntimeError("this backend cannot compile anything")


def _model_and_optimizer():
    """tests/test_error_catalogue.py's model, and SGD with momentum after one step."""
    model = models.mlp(8, 16, 4, norm=nn.BatchNorm1d)
    return model, sgd_with_state(model, torch.randn(6, 8), torch.randint(0, 4, (6,)))


def test_the_compile_stage_failure_is_a_compile_error(monkeypatch):
    monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: _broken_backend_compiler)
    model, opt = _model_and_optimizer()
    g = make_graph(model, F.cross_entropy, opt)
    with pytest.raises(graphamp.CompileError, match=r"aot_eager.*set_backend") as info:
        g(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    assert re.search("cannot compile anything", str(info.value.__cause__))


def test_ctrl_c_during_the_build_is_not_wrapped():
    model, opt = _model_and_optimizer()

    def build(self, x, y):
        raise KeyboardInterrupt

    g = make_graph(model, None, opt, build=build)
    with pytest.raises(KeyboardInterrupt):
        g(torch.randn(6, 8), torch.randint(0, 4, (6,)))


def test_packed_sequences_are_refused_naming_them_and_the_fix():
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.rnn = nn.Embedding(20, 8), nn.LSTM(8, 16, batch_first=True)
            self.out = nn.Linear(16, 20)

        def forward(self, x, lengths):
            packed = pack_padded_sequence(self.emb(x), lengths, batch_first=True)
            h, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=5)
            return self.out(h)

    def build(self, x, y):
        logits = self.model(x, torch.tensor([5, 3, 2]))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        return loss

    model = LM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = make_graph(model, None, torch.optim.SGD(model.parameters(), lr=0.1), build=build)
    x, y = torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 5))
    with pytest.raises(CaptureError, match="pack_padded_sequence.*mask") as raised:
        g(x, y)
    assert "docs/refusals.md#capture" in str(raised.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_every_refusal_family_has_its_section_in_the_refusals_page():
    import os

    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "refusals.md")).read()
    families = {c.family for c in _subclasses(graphamp.GraphampError) if c.family}
    assert families == {
        "capture",
        "optimizers",
        "settings",
        "inputs",
        "recompiles",
        "compile",
        "graph-definition",
        "data-parallel",
    }
    for family in families:
        assert f"\n## {family.replace('-', ' ')}\n" in page, family


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
