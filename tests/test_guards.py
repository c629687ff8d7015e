"""A compiled step runs only while what it assumed still holds: Python attributes build() read,
the aliasing of its inputs, the sizes of parameters. Each change is honoured (a new step,
logged with the old and new value) and compared with eager PyTorch; a value changed back reuses
the first step."""

from __future__ import annotations

import copy
import logging

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_state_close, eager_step, make_graph
from models import SmallCNN, tiny_gpt2

import graphamp

INDUCTOR = pytest.param("inductor", marks=pytest.mark.inductor)


class Net(nn.Module):
    """Settings forward() reads as Python values, one of each kind the guards record."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.LeakyReLU(0.01)
        self.norm = nn.LayerNorm(32, eps=1e-5)
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(32, 5)
        self.residual = True  # a plain flag forward() branches on

    def forward(self, x):
        h = self.norm(self.act(self.fc1(x)))
        if self.residual:
            h = h + self.fc1(x)
        return self.fc2(self.drop(h))


def _data(steps=4):
    return models.batches(steps, 8, 16, 5, seed=0)


def _train(change, backend="aot_eager", change_back=False):
    """Train a Net and its eager twin; ``change(model, loss_fn)`` is applied to both after the
    first step (and undone after the third with ``change_back``)."""
    model, loss_fn = Net(), nn.CrossEntropyLoss()
    twin, twin_loss = copy.deepcopy(model), copy.deepcopy(loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = make_graph(model, loss_fn, opt, backend=backend)
    undo = None
    for step, (x, y) in enumerate(_data()):
        if step == 1:
            undo = change(model, loss_fn), change(twin, twin_loss)
        if step == 3 and change_back:
            for restore in undo:
                restore()
        got = g(x, y)
        want = eager_step(twin, twin_loss, twin_opt, x, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_state_close(model, twin)
    return g


def _setter(path, value):
    """change(model, loss) setting ``path`` ("model.act.negative_slope" / "loss.label_smoothing")
    to ``value``; it returns the function that puts the old value back."""

    def change(model, loss):
        owner, *attrs = path.split(".")
        obj = model if owner == "model" else loss
        for a in attrs[:-1]:
            obj = getattr(obj, a)
        old = getattr(obj, attrs[-1])
        setattr(obj, attrs[-1], value)
        return lambda: setattr(obj, attrs[-1], old)

    return change


CHANGES = {
    "activation slope": ("model.act.negative_slope", 0.3, "self.model.act.negative_slope"),
    "norm eps": ("model.norm.eps", 0.5, "self.model.norm.eps"),
    "dropout p": ("model.drop.p", 1.0, "self.model.drop.p"),
    "loss label smoothing": ("loss.label_smoothing", 0.2, "self.loss_fn.label_smoothing"),
    "loss ignore_index": ("loss.ignore_index", 2, "self.loss_fn.ignore_index"),
    "flag forward branches on": ("model.residual", False, "self.model.residual"),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_an_attribute_build_reads_is_honoured_and_logged(name, caplog):
    path, value, label = CHANGES[name]
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g = _train(_setter(path, value))
    assert len(g.compiled_steps) == 2
    lines = [r.getMessage() for r in caplog.records if "capturing and compiling" in r.getMessage()]
    assert len(lines) == 1 and f"{label} changed from" in lines[0] and repr(value) in lines[0]


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_a_value_changed_back_reuses_the_first_step(backend):
    g = _train(_setter("model.act.negative_slope", 0.3), backend, change_back=True)
    first, second = sorted(g.compiled_steps, key=lambda s: -s.calls)
    assert len(g.compiled_steps) == 2 and (first.calls, second.calls) == (2, 2)


def test_batchnorm_momentum_changed_after_the_first_call_moves_the_statistics_as_eager():
    model = SmallCNN()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        if step == 1:
            for m in (model, twin):
                m.features[1].momentum = 0.9
        g(x, y)
        eager_step(twin, F.cross_entropy, twin_opt, x, y)
    assert_state_close(model, twin)


def test_an_attribute_of_the_graph_that_build_reads_is_honoured():
    model = nn.Linear(16, 5)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)

    class Weighted(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")
            self.weight = 1.0

        def build(self, x, y):
            loss = self.weight * F.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    g = Weighted()
    for step, (x, y) in enumerate(_data()):
        weight = 1.0 if step < 2 else 3.0
        g.weight = weight
        got = g(x, y)
        twin_opt.zero_grad()
        want = weight * F.cross_entropy(twin(x), y)
        want.backward()
        twin_opt.step()
        torch.testing.assert_close(got, want.detach())
    assert_state_close(model, twin)
    assert len(g.compiled_steps) == 2


def test_a_transformers_config_setting_read_in_forward_is_honoured():
    """The attention implementation is a config setting GPT-2 reads in forward()."""
    pytest.importorskip("transformers")
    model = tiny_gpt2(n_layer=1, vocab_size=50, n_positions=16, attn_implementation="sdpa")
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)

    def build(self, ids, labels):
        loss = self.model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        if step == 1:
            for m in (model, twin):
                m.config._attn_implementation = "eager"
        ids = torch.randint(0, 50, (2, 8), generator=gen)
        got = g(ids, ids)
        twin_opt.zero_grad()
        want = twin(input_ids=ids, labels=ids).loss
        want.backward()
        twin_opt.step()
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    attention = {n.target for n in g.compiled_steps[-1].forward_graph.graph.nodes}
    assert len(g.compiled_steps) == 2
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in attention


# -- aliasing ---------------------------------------------------------------------------------


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 16))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_inputs_that_are_the_same_tensor_at_first_are_not_assumed_to_stay_so(backend):
    model = Denoiser()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)

    def build(self, noisy, clean):
        loss = F.mse_loss(self.model(noisy), clean)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, backend=backend, build=build)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        clean = torch.randn(8, 16, generator=gen)
        noisy = clean if step == 0 else clean + 0.5 * torch.randn(8, 16, generator=gen)
        got = g(noisy, clean)
        want = eager_step(twin, F.mse_loss, twin_opt, noisy, clean)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_state_close(model, twin)
    assert len(g.compiled_steps) == 1


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_an_input_that_is_a_slice_of_a_parameter_reads_its_own_values(backend):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        y = torch.randint(0, 4, (4,), generator=gen)
        # the first batch is four rows of the first layer's weight (the same memory)
        x = model[0].weight.detach()[:4] if step == 0 else torch.randn(4, 16, generator=gen)
        x_twin = twin[0].weight.detach()[:4].clone() if step == 0 else x
        got = g(x, y)
        want = eager_step(twin, F.cross_entropy, twin_opt, x_twin, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_state_close(model, twin)


# -- parameter sizes --------------------------------------------------------------------------


def test_a_parameter_grown_in_place_is_traced_again(caplog):
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(32, 3))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        if step == 1:  # two new tokens: the embedding table grows, the parameter stays
            rows = torch.randn(2, 8, generator=gen)
            for m in (model, twin):
                m[0].weight.data = torch.cat([m[0].weight.data, rows])
        ids = torch.randint(0, 12 if step else 10, (5, 4), generator=gen)
        y = torch.randint(0, 3, (5,), generator=gen)
        with caplog.at_level(logging.INFO, logger="graphamp"):
            got = g(ids, y)
        # eager keeps no graph from the step before (it would hold the old shape)
        want = eager_step(twin, F.cross_entropy, twin_opt, ids, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_state_close(model, twin)
    assert any(
        "self.model.0.weight changed shape from (10, 8) to (12, 8)" in r.getMessage()
        for r in caplog.records
    )


def test_the_check_before_each_call_reads_no_tensor_and_no_module_tree():
    """Steady calls check the recorded values only: a model's attributes are looked up, never
    its modules walked (the structure key has its own cache)."""
    model = Net()
    g = make_graph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(1)[0]
    g(x, y)
    guards = g.compiled_steps[-1]
    program = g._programs.last()  # the record behind the public view
    labels = {r.label for r in program.guards.attributes}
    assert {
        "self.model.act.negative_slope",
        "self.model.residual",
        "self.loss_fn.reduction",
    } <= labels
    # a module or tensor that build() reaches through a closure or a global is checked by
    # identity: no tensor is read, no module walked
    assert all(
        not r.by_value
        for r in program.guards.attributes
        if isinstance(r.value, (torch.Tensor, nn.Module))
    )
    assert guards.calls == 1


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_an_input_sharing_memory_with_a_parameter_given_new_memory_reads_its_own_values(backend):
    """``p.data = other`` (same shape) keeps the parameter and moves its memory: a later input
    that is a slice of the new memory is still copied before the step writes the state."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        y = torch.randint(0, 4, (4,), generator=gen)
        if step == 1:
            fresh = torch.randn(16, 16, generator=gen)
            model[0].weight.data, twin[0].weight.data = fresh, fresh.clone()
        x = model[0].weight.detach()[:4] if step else torch.randn(4, 16, generator=gen)
        x_twin = twin[0].weight.detach()[:4].clone() if step else x
        got = g(x, y)
        want = eager_step(twin, F.cross_entropy, twin_opt, x_twin, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_state_close(model, twin)
    assert len(g.compiled_steps) == 1


def test_graphs_made_by_a_factory_are_freed():
    """Issue 36: the patch that records attribute reads was kept per class forever, and with it
    a Graph subclass defined in a function, its closure, the optimizer and the Graph (a sweep,
    a notebook cell run again)."""
    import gc
    import weakref

    refs = []

    def make():
        model = nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = make_graph(model, lambda out, y: out.sum(), opt, backend="eager")
        g(torch.randn(2, 8), None)
        refs.append(weakref.ref(g))

    for _ in range(50):
        make()
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
