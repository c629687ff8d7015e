"""The catalogue of user faults: each raises graphamp's error and changes nothing.

1. build() bodies and model patterns that fail somewhere in the pipeline (capture, assembly,
   compilation). For each: the exception is a GraphampError, it names the line of this file
   where the failure is (marked ``# fails: <case>``) when there is one, torch's exception is kept
   as ``__cause__`` where torch raised, and the user's model, optimizer and scaler are exactly as
   before (the same Python objects, the same values).
2. Faults found at the first call (a build() without backward, bad inputs, optimizers over the
   wrong parameters): the error type and words that name the fault, the model and optimizer
   (which already have state) unchanged.
3. Bad states loaded: a ConfigError, the graph's own state unchanged.

Errors that are not a step's faults (a Graph subclass defined wrong, bad configuration calls,
a failing backend, Ctrl-C) are in tests/test_errors.py.
"""

from __future__ import annotations

import copy
import pathlib
import random
import re

import models
import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_unchanged, eager_step, make_graph, sgd_with_state, snapshot
from models import seed_mlp

import graphamp
from graphamp import CaptureError, InputError, UnsupportedOptimizerError

THIS_FILE = pathlib.Path(__file__)


# -- 1. build() bodies and model patterns that fail in the pipeline --------------------------------


def _line_of(case: str) -> int:
    """The line of this file marked ``# fails: case``."""
    for number, text in enumerate(THIS_FILE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# fails: {case}"):
            return number
    raise LookupError(case)


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


class RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("this backward is broken")  # fails: function backward


class RaisingForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.reshape(3, -1, 7)  # fails: function forward

    @staticmethod
    def backward(ctx, grad):
        return grad


def _unsupported_numpy(m, x, y):
    return _ce(m, torch.from_numpy(x.numpy()), y)  # fails: numpy


def _shape_mismatch(m, x, y):
    return F.cross_entropy(m(x[:, :5]), y)  # fails: shape


def _dtype_mismatch(m, x, y):
    return F.cross_entropy(m(x.double()), y)  # fails: dtype


def _inplace_on_leaf(m, x, y):
    w = torch.zeros(4, requires_grad=True)
    w.add_(1)  # fails: in-place leaf
    return _ce(m, x, y) + w.sum()


def _item(m, x, y):
    loss = _ce(m, x, y)
    return loss * loss.item()  # fails: item


def _control_flow(m, x, y):
    loss = _ce(m, x, y)
    if loss > 1:  # fails: control flow
        loss = loss * 2
    return loss


def _backward_raises(m, x, y):
    return F.cross_entropy(RaisingBackward.apply(m(x)), y)


def _forward_raises(m, x, y):
    return F.cross_entropy(RaisingForward.apply(m(x)), y)


def _index_out_of_range(m, x, y):
    return _ce(m, x, y) + x[:, 40].sum()  # fails: index


def _bad_view(m, x, y):
    return _ce(m, x.view(-1, 5), y)  # fails: view


def _bad_target(m, x, y):
    return F.cross_entropy(m(x), y[:3])  # fails: target


def _grad_of_a_constant(m, x, y):
    loss = _ce(m, x, y)
    (g,) = torch.autograd.grad(x.sum(), x)  # fails: grad of constant
    return loss + g.sum()


def _raise_in_forward_hook(module, args, out):
    raise RuntimeError("a forward hook refused")  # fails: forward hook


def _raise_in_tensor_hook(grad):
    raise RuntimeError("a gradient hook refused")


def _tensor_hook(m, x, y):
    h = m(x)
    h.register_hook(_raise_in_tensor_hook)  # fails: tensor hook
    return F.cross_entropy(h, y)


def _no_fake_kernel_op(m, x, y):
    return _ce(m, x, y) + torch.ops.graphamp_catalogue.opaque(x).sum()  # fails: custom op


@torch.library.custom_op("graphamp_catalogue::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _opaque_fake_refuses(x):
    raise NotImplementedError("no shape rule for this op")  # fails: custom op fake


_opaque.register_fake(_opaque_fake_refuses)


def _no_shape_rule_op(m, x, y):
    return _ce(m, x, y) + torch.ops.graphamp_catalogue.unshaped(x).sum()  # fails: no fake kernel


@torch.library.custom_op("graphamp_catalogue::unshaped", mutates_args=())
def _unshaped(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _value_dependent_shape(m, x, y):
    return _ce(m, x, y) + F.one_hot(y).sum()  # fails: value-dependent shape


def _python_random(m, x, y):
    return _ce(m, x * random.uniform(0.5, 1.5), y)  # fails: python random


def _numpy_random(m, x, y):
    return _ce(m, x * float(np.random.beta(0.4, 0.4)), y)  # fails: numpy random


def _counter(m, x, y):
    m.calls = getattr(m, "calls", 0) + 1  # fails: counter
    return _ce(m, x, y)


def _hook_registered_in_build(m, x, y):
    m[0].register_forward_hook(lambda mod, args, out: out * 2)
    return _ce(m, x, y)


def _parameter_made_in_build(m, x, y):
    m.extra = nn.Parameter(torch.ones(4))  # fails: parameter made in build
    return _ce(m, x, y) + m.extra.sum()


def _broken_backend_compiler(gm, example):
    raise RuntimeError("this backend cannot compile anything")  # fails: backend


# case -> (build body, install on the model, needs a line, torch's exception kept as cause)
CASES = {
    # graphamp's own refusals: found before torch raises anything
    "numpy": (_unsupported_numpy, None, True, False),
    "item": (_item, None, True, False),
    "control flow": (_control_flow, None, True, False),
    "tensor hook": (_tensor_hook, None, True, False),
    "dtype": (_dtype_mismatch, None, True, False),  # fake tensors would let it through
    # torch raised: kept as the cause
    "shape": (_shape_mismatch, None, True, True),
    "in-place leaf": (_inplace_on_leaf, None, True, True),
    "function backward": (_backward_raises, None, True, True),
    "function forward": (_forward_raises, None, True, True),
    "index": (_index_out_of_range, None, True, True),
    "view": (_bad_view, None, True, True),
    "target": (_bad_target, None, True, True),
    "grad of constant": (_grad_of_a_constant, None, True, True),
    # module hooks are refused by name before they run (tests/test_context.py checks the name
    # and where the hook is defined), so neither a line of the hook's body nor a cause
    "forward hook": (
        _ce,
        lambda m: m[0].register_forward_hook(_raise_in_forward_hook),
        False,
        False,
    ),
    "custom op fake": (_no_fake_kernel_op, None, True, True),
    # ops fake tensors cannot run: named as such, torch's exception kept
    "no fake kernel": (_no_shape_rule_op, None, True, True),
    "value-dependent shape": (_value_dependent_shape, None, True, True),
    # host randomness: refused before anything is drawn
    "python random": (_python_random, None, True, False),
    "numpy random": (_numpy_random, None, True, False),
    # Python state build() writes that cannot be replayed; a hook registered in build() is
    # named with where it is defined, not by a line of build()
    "counter": (_counter, None, True, False),
    "hook registered in build": (_hook_registered_in_build, None, False, False),
    "parameter made in build": (_parameter_made_in_build, None, True, False),
    "backend": (_ce, None, True, True),
}

# case -> (the error's type, words its message must have), where a case checks more than
# GraphampError and the line
WORDS = {
    "control flow": (CaptureError, r"bool\(\).*if loss > 1:"),
    "item": (CaptureError, r"\.item\(\).*return loss \* loss\.item\(\).*torch\.where"),
}


def _model_and_optimizer():
    model = models.mlp(8, 16, 4, norm=nn.BatchNorm1d)
    return model, sgd_with_state(model, torch.randn(6, 8), torch.randint(0, 4, (6,)))


def _snapshot(model, opt, scaler):
    tensors = {
        n: (t, t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]
    }
    return tensors, copy.deepcopy(opt.state_dict()), dict(scaler.state_dict())


def _assert_unchanged(before, model, opt, scaler):
    tensors, opt_state, scaler_state = before
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == tensors.keys()
    for name, (obj, value) in tensors.items():
        assert now[name] is obj, f"{name} was replaced"
        assert torch.equal(obj.detach(), value), f"{name} changed"
    after = opt.state_dict()
    assert after["param_groups"] == opt_state["param_groups"]
    for i, state in opt_state["state"].items():
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(after["state"][i][k]), torch.as_tensor(v)), (i, k)
    assert scaler.state_dict() == scaler_state


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_failure_is_a_graphamp_error_naming_the_line(case, monkeypatch):
    body, install, names_line, has_cause = CASES[case]
    model, opt = _model_and_optimizer()
    if install is not None:
        install(model)
    if case == "backend":
        monkeypatch.setattr(torch._dynamo, "lookup_backend", lambda name: _broken_backend_compiler)
    scaler = graphamp.GradScaler(init_scale=1024.0)

    def build(self, x, y):
        loss = body(self.model, x, y)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build, amp=torch.float16, scaler=scaler)
    before = _snapshot(model, opt, scaler)
    with pytest.raises(Exception) as info:
        g(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    err = info.value
    assert isinstance(err, graphamp.GraphampError), (type(err), err)
    if names_line:
        where = f"{THIS_FILE.name}:{_line_of(case)}"
        assert where in str(err), (where, str(err))
    if has_cause:
        assert err.__cause__ is not None and not isinstance(err.__cause__, graphamp.GraphampError)
    if case in WORDS:
        kind, words = WORDS[case]
        assert isinstance(err, kind), (type(err), err)
        assert re.search(words, str(err)), (words, str(err))
    _assert_unchanged(before, model, opt, scaler)
    assert g.step_count == 0


# -- 2. faults found at the first call -------------------------------------------------------------


def _xy(batch=8):
    return torch.randn(batch, 256), torch.randint(0, 10, (batch,))


@pytest.fixture
def trained():
    """A model and optimizer that already have state, so 'nothing lost' means something."""
    model = seed_mlp()
    return model, sgd_with_state(model, _xy()[0], _xy()[1])


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
    with pytest.raises(
        CaptureError, match=r"twice.*test_error_catalogue\.py:\d+.*retain_graph=True"
    ):
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


def test_unsupported_optimizer_class():
    """Refused at add_optimizer, nothing changed (every other optimizer trains:
    tests/test_optimizers.py, tests/test_closure_optimizers.py)."""
    model = seed_mlp()
    opt = torch.optim.SparseAdam(model.parameters())
    before = snapshot(model, opt)
    with pytest.raises(UnsupportedOptimizerError, match="sparse gradients"):
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
    before = snapshot(model, a)

    def configure(self):
        self.add_optimizer(b)

    g = make_graph(model, nn.CrossEntropyLoss(), a, configure=configure)
    with pytest.raises(CaptureError, match=r"is in optimizers 0 and 1"):
        g(*_xy())
    assert_unchanged(before, model, a)


def test_model_on_two_devices():
    model = seed_mlp()
    model[2].to("meta")
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    before = snapshot(model[0], opt)  # meta tensors have no values to compare
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    with pytest.raises(InputError, match=r"one device"):
        g(*_xy())
    assert_unchanged(before, model[0], opt)


def test_a_lazy_module_not_yet_run_names_the_eager_forward_that_makes_its_parameters():
    """Its parameters come from its first forward's input shape: refused before capture, with
    the way through, which then trains."""
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    x, y = _xy()
    with pytest.raises(CaptureError, match=r"'model.0' \(LazyLinear\) makes its parameters"):
        g(x, y)
    assert torch.nn.parameter.is_lazy(model[0].weight)  # nothing was made
    with torch.no_grad():
        model(x)  # the way through the message names
    before = model[0].weight.clone()
    g(x, y)
    assert not torch.equal(before, model[0].weight)


def test_batchnorm_with_a_cumulative_average_names_its_momentum():
    model = nn.Sequential(nn.Linear(256, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    with pytest.raises(CaptureError, match=r"momentum=None.*give it a momentum"):
        g(*_xy())
    assert_unchanged(before, model, opt)


class _WithConstant(nn.Module):
    """A model whose forward gives a tensor attribute to an op: F.batch_norm's running
    statistics, or F.cosine_similarity's second argument (which it normalises in place)."""

    def __init__(self, op: str, as_buffer: bool):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(256, 10)
        value = torch.zeros(10) if op == "batch_norm" else torch.randn(8, 10)
        if as_buffer:
            self.register_buffer("held", value, persistent=False)
        else:
            self.held = value

    def forward(self, x):
        y = self.lin(x)
        if self.op == "batch_norm":
            return F.batch_norm(y, self.held, torch.ones(10), training=True)
        return y * F.cosine_similarity(y, self.held).unsqueeze(1)


@pytest.mark.parametrize("op", ["batch_norm", "cosine_similarity"])
def test_a_plain_tensor_attribute_an_op_changes_in_place_names_the_buffer_to_make(op):
    """Functionalization cannot trace an op changing a constant of the step in place (its
    message was an INTERNAL ASSERT of torch's); as a buffer, the same model trains as eager."""
    model = _WithConstant(op, as_buffer=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    with pytest.raises(CaptureError, match=r"passes the tensor 'model.held' \(a plain attribute"):
        g(*_xy())
    assert_unchanged(before, model, opt)
    torch.manual_seed(0)
    model = _WithConstant(op, as_buffer=True)
    twin = copy.deepcopy(model)
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    g = make_graph(model, nn.CrossEntropyLoss(), opt)
    for _ in range(2):
        x, y = _xy()
        ours = g(x, y)
        theirs = eager_step(twin, F.cross_entropy, eager_opt, x, y)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.held, twin.held)


class _Propagate(nn.Module):
    """One graph-convolution step: the adjacency times the features' projection."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, adj, x):
        return torch.sparse.mm(adj, self.lin(x))


def _adjacency() -> torch.Tensor:
    edges = torch.tensor([[0, 1, 2, 2], [1, 0, 2, 1]])
    return torch.sparse_coo_tensor(edges, torch.ones(4), (3, 3)).coalesce()


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_input_is_refused_by_name_with_the_way_that_traces(layout):
    model = _Propagate()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)

    def build(g, adj, x):
        loss = g.model(adj, x).square().sum()
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    adj = _adjacency() if layout == "coo" else _adjacency().to_sparse_csr()
    with pytest.raises(InputError, match=r"the input x is a torch.sparse_\w+ tensor.*inside build"):
        g(adj, torch.randn(3, 4))
    assert_unchanged(before, model, opt)


def test_a_sparse_tensor_made_inside_build_trains_as_eager():
    """The way the refusal names: the indices and values passed, the tensor made in build()."""
    torch.manual_seed(0)
    model, twin = _Propagate(), _Propagate()
    twin.load_state_dict(model.state_dict())
    opt, eager_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))

    def loss_of(m, indices, values, x):
        adj = torch.sparse_coo_tensor(indices, values, (3, 3))
        return m(adj, x).square().sum()

    def build(g, batch, x):
        loss = loss_of(g.model, *batch, x)
        loss.backward()
        return loss

    g = make_graph(model, None, opt, build=build)
    adj = _adjacency()
    for _ in range(3):
        x = torch.randn(3, 4)
        ours = g((adj.indices(), adj.values()), x)
        eager_opt.zero_grad()
        theirs = loss_of(twin, adj.indices(), adj.values(), x)
        theirs.backward()
        eager_opt.step()
        torch.testing.assert_close(ours, theirs.detach())
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


# -- 3. loading a state: every part checked as its constructor checks it ---------------------------


def _pin(**fields):
    return [
        {"module": "model.3", "op": "aten.addmm", "index": 0, "reason": "", "step": 1, **fields}
    ]


# case -> (the part of g.state_dict() replaced, its bad value (from the good state), the message)
LOAD_CASES = {
    "not a dict": (None, lambda good: [good], "a Graph state dict is a dict"),
    "a part missing": (None, lambda good: {"step": 1}, "lacks"),
    "step": ("step", lambda good: -1, "saved step must be an int >= 0"),
    "scale out of bounds": (
        "grad_scaler",
        lambda good: {**good, "scale": 2.0**30},
        r"outside \[min_scale, max_scale\]",
    ),
    "hysteresis tracker": (
        "grad_scaler",
        lambda good: {**good, "_hysteresis_tracker": 5},
        "greater than its hysteresis",
    ),
    "growth factor": ("grad_scaler", lambda good: {**good, "growth_factor": 0.5}, "growth_factor"),
    "optimizer counter": ("optimizer_steps", lambda good: {3: 1}, "optimizer 3"),
    "history": (
        "history",
        lambda good: {**good, "table": torch.zeros(3, 2)},
        "history's table",
    ),
    "pin step": ("amp_pins", lambda good: _pin(step=-1), r"AmpPin\(step=...\)"),
    "pin reason": ("amp_pins", lambda good: _pin(reason=3), r"AmpPin\(reason=...\)"),
    "pin index": ("amp_pins", lambda good: _pin(index=True), r"AmpPin\(index=...\)"),
    "autofix count": (
        "autofix_counts",
        lambda good: [{"pins": _pin(), "count": 0}],
        "autofix count must be a positive int",
    ),
    "momentum start": ("momentum_fresh", lambda good: {0: [99]}, "names parameter 99"),
}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def trained_graph():
    """An AMP graph with a scaler, SGD momentum with dampening and autofix, after two steps."""
    model, _ = _model_and_optimizer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    scaler = graphamp.GradScaler(init_scale=256.0, hysteresis=2)
    g = make_graph(
        model,
        F.cross_entropy,
        opt,
        amp=torch.float16,
        scaler=scaler,
        configure=lambda g: g.config.enable_amp_autofix(after=3),
    )
    for _ in range(2):
        g(torch.randn(6, 8), torch.randint(0, 4, (6,)))
    return g, model, opt, scaler


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_every_bad_state_load_is_a_config_error_that_changes_nothing(case, trained_graph):
    g, model, opt, scaler = trained_graph
    part, bad, message = LOAD_CASES[case]
    good = g.state_dict()
    state = bad(good) if part is None else {**good, part: bad(good[part])}
    before = _snapshot(model, opt, scaler)
    with pytest.raises(graphamp.ConfigError, match=message) as info:
        g.load_state_dict(state)
    assert isinstance(info.value, graphamp.GraphampError)
    _assert_unchanged(before, model, opt, scaler)
    assert _same(g.state_dict(), good), "the graph's own state changed"
    assert g.config.amp_pins == ()
