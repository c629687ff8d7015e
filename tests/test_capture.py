"""Capture of what real PyTorch code does (issues 13 and 21), against the eager oracle.

Each case trains a few steps through graphamp and the same steps eagerly, and compares
parameters (fp32: to rounding noise; AMP: finite and close to eager autocast).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphamp
from helpers import assert_state_close, clone_training, make_graph


def _train_both(model, build_loss, data, make_opt=None, steps=3, rtol=1e-5, atol=1e-6,
                configure=None, **graph_kwargs):
    """Train ``model`` through a Graph and a deepcopy eagerly on the same batches; compare."""
    make_opt = make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    ref, ref_opt, _ = clone_training(model, make_opt)
    opt = make_opt(model)

    def build(self, x, y):
        loss = build_loss(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, configure=configure, **graph_kwargs)
    for x, y in data[:steps]:
        loss = g(x, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = build_loss(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=rtol, atol=atol)
    assert_state_close(model, ref, rtol=rtol, atol=atol)
    return g, ref


def _batches(n=3, shape=(8, 16), classes=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen), torch.randint(0, classes, (shape[0],),
                                                               generator=gen)) for _ in range(n)]


def test_detach_in_build_stops_gradients_like_eager():
    """make_fx's default turns detach into alias; a re-differentiated graph must keep the cut."""
    model = nn.Linear(16, 4)

    def loss_of(m, x, y):
        target = (m(x) * 2).detach()
        return ((m(x) - target) ** 2).mean()

    _train_both(model, loss_of, _batches())


class TwoNames(nn.Module):
    """One module reachable under two names, as public model code often does."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 3, padding=1)
        self.net = nn.Sequential(self.conv1, nn.ReLU(), nn.Conv1d(8, 4, 3, padding=1))

    def forward(self, x):
        return self.net(x).mean(-1)


def test_a_module_under_two_names_trains_like_eager():
    model = TwoNames()
    _train_both(model, lambda m, x, y: F.cross_entropy(m(x), y), _batches(shape=(8, 4, 10)))
    assert model.conv1 is model.net[0]


FAILING_BUILDS = {
    "item": lambda m, x, y: m(x).sum().item(),
    "python branch": lambda m, x, y: m(x).sum() if m(x).sum() > 0 else m(x).mean(),
    "in-place parameter": lambda m, x, y: m.net[2].weight.data.mul_(2),
    "raises": lambda m, x, y: (_ for _ in ()).throw(ValueError("user code raised")),
    "no backward": lambda m, x, y: m(x).sum(),
}


@pytest.mark.parametrize("name", sorted(FAILING_BUILDS))
def test_a_failed_capture_leaves_the_users_model_exactly_as_it_was(name):
    """Every parameter and buffer is the same Python object afterwards, with the same values,
    and the model works eagerly."""
    model = TwoNames()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: (id(t), t.detach().clone()) for n, t in
              [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]}
    objects = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    body = FAILING_BUILDS[name]

    def build(self, x, y):
        out = body(self.model, x, y)
        if name != "no backward" and isinstance(out, torch.Tensor):
            out.backward()
        return out

    g = make_graph(model, None, opt, build=build)
    with pytest.raises((graphamp.GraphampError, ValueError)):
        g(torch.randn(2, 4, 10), torch.randint(0, 4, (2,)))
    for module, params, buffers in objects:
        assert module._parameters == params and module._buffers == buffers
    for n, t in [*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)]:
        assert id(t) == before[n][0], n
        assert torch.equal(t.detach(), before[n][1]), n
    assert all(type(p) is nn.Parameter for p in model.parameters())
    model(torch.randn(2, 4, 10)).sum().backward()  # still an ordinary eager model
