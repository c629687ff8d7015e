"""Optimizers whose step() takes a closure (LBFGS): the step runs in Python after the compiled
one, and each evaluation of the loss it asks for runs the compiled step again
(``graphamp/runner/closure.py``).

The oracle is eager PyTorch's loop: ``opt.step(closure)`` with a closure that zeroes the
gradients, runs the forward and backward and returns the loss. The model has BatchNorm, whose
running statistics every evaluation updates, so the count of evaluations shows in the state.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_unchanged, import_torch_testing, make_graph, snapshot

import graphamp
from graphamp import UnsupportedOptimizerError

try:
    common_optimizers = import_torch_testing("common_optimizers")
except ModuleNotFoundError as e:  # expecttest, a test extra, missing
    pytest.skip(f"torch's optimizer database does not import: {e}", allow_module_level=True)


def _lbfgs_settings():
    """LBFGS's sample settings in torch's optimizer database (``optim_db``)."""
    info = next(i for i in common_optimizers.optim_db if i.optim_cls is torch.optim.LBFGS)
    samples = info.optim_inputs_func(device="cpu", dtype=torch.float32)
    return [pytest.param(dict(s.kwargs), id=s.desc) for s in samples]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def _batches(n: int = 3):
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)) for _ in range(n)
    ]


def _eager_losses(model, opt, batches, amp=None, sch=None) -> list[float]:
    """The eager loop: ``opt.step(closure)`` per batch; the losses it returns."""
    losses = []
    for x, y in batches:

        def closure(x=x, y=y):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                loss = F.mse_loss(model(x), y)
            loss = loss.float()
            loss.backward()
            return loss

        losses.append(float(opt.step(closure).detach()))
        if sch is not None:
            sch.step()
    return losses


def _graph_losses(g, batches) -> list[float]:
    return [float(g(x, y)) for x, y in batches]


def _assert_same_state(model, twin, opt, eager_opt, **tol) -> None:
    for (name, p), q in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m, name=name: f"{name}: {m}")
    ours, theirs = opt.state_dict()["state"][0], eager_opt.state_dict()["state"][0]
    assert (ours["func_evals"], ours["n_iter"]) == (theirs["func_evals"], theirs["n_iter"])


@pytest.mark.parametrize("kwargs", _lbfgs_settings())
def test_lbfgs_trains_as_eagers_closure_loop_bitwise(kwargs):
    """fp32: the same losses, parameters, running statistics, and count of evaluations."""
    model, twin = _model(), _model()
    opt = torch.optim.LBFGS(model.parameters(), **copy.deepcopy(kwargs))
    eager_opt = torch.optim.LBFGS(twin.parameters(), **copy.deepcopy(kwargs))
    g = make_graph(model, F.mse_loss, opt)
    batches = _batches()
    # maximize climbs the loss without bound, to NaN, in both
    exact = dict(rtol=0, atol=0, equal_nan=True)
    losses = _graph_losses(g, batches)
    torch.testing.assert_close(losses, _eager_losses(twin, eager_opt, batches), **exact)
    _assert_same_state(model, twin, opt, eager_opt, **exact)
    # a call counts once: one history row per call, with the loss the call returned
    rows = g.history.fetch()
    assert rows["step"] == [0.0, 1.0, 2.0] and g.step_count == len(batches)
    torch.testing.assert_close(rows["loss"], losses, **exact)
    # more than one evaluation per call: the closure ran the step again
    assert opt.state_dict()["state"][0]["func_evals"] > len(batches)
    assert "its own step(closure) in Python after the compiled step" in str(g)
    assert all(p.grad is None for p in model.parameters())


def test_lbfgs_in_bf16_trains_as_eager_autocast_and_steps_the_scheduler_once_a_call():
    """bf16 AMP against eager autocast, with strong Wolfe line search; a scheduler steps once
    per call, after the optimizer, not once per evaluation."""
    model, twin = _model(), _model()
    kwargs = dict(lr=0.5, max_iter=4, line_search_fn="strong_wolfe")
    opt = torch.optim.LBFGS(model.parameters(), **kwargs)
    eager_opt = torch.optim.LBFGS(twin.parameters(), **kwargs)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    eager_sch = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=1, gamma=0.5)
    g = make_graph(model, F.mse_loss, opt, amp=torch.bfloat16, lr_sch=sch)
    batches = _batches()
    ours = _graph_losses(g, batches)
    theirs = _eager_losses(twin, eager_opt, batches, amp=torch.bfloat16, sch=eager_sch)
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=0)
    _assert_same_state(model, twin, opt, eager_opt, rtol=2e-3, atol=2e-4)
    assert opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"] == 0.5 * 0.5**3


def _two_optimizers(model):
    body, head = list(model[:3].parameters()), list(model[3].parameters())
    return torch.optim.LBFGS(body), torch.optim.SGD(head, lr=0.1)


@pytest.mark.parametrize(
    "configure, build, words",
    [
        (lambda g: g.set_grad_scaler(graphamp.GradScaler()), None, "grad scaler"),
        (lambda g: g.config.set_gradient_accumulation_steps(2), None, "accumulation"),
        (None, lambda g, x, y: (_loss(g, x, y), x), "return the loss alone"),
    ],
    ids=["scaler", "accumulation", "tuple"],
)
def test_what_a_closure_cannot_run_again_is_refused_at_the_first_call(configure, build, words):
    model = _model()
    opt = torch.optim.LBFGS(model.parameters())
    before = snapshot(model, opt)
    amp = torch.float16 if configure is not None and "scaler" in words else None
    g = make_graph(model, F.mse_loss, opt, amp=amp, configure=configure, build=build)
    with pytest.raises(UnsupportedOptimizerError, match=words):
        g(*_batches(1)[0])
    assert_unchanged(before, model, opt)


def _loss(g, x, y):
    loss = F.mse_loss(g.model(x), y)
    loss.backward()
    return loss


def test_a_closure_optimizer_beside_another_is_refused_by_name():
    model = _model()
    lbfgs, sgd = _two_optimizers(model)
    before = snapshot(model)

    class TwoOptimizers(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(lbfgs)
            self.add_optimizer(sgd)
            self.config.set_backend("aot_eager")

        def build(self, x, y):
            return _loss(self, x, y)

    with pytest.raises(UnsupportedOptimizerError, match="update the other optimizers again"):
        TwoOptimizers()(*_batches(1)[0])
    assert_unchanged(before, model)


@pytest.mark.inductor
def test_lbfgs_compiled_by_inductor_trains_as_eager():
    model, twin = _model(), _model()
    kwargs = dict(max_iter=5, line_search_fn="strong_wolfe")
    opt = torch.optim.LBFGS(model.parameters(), **kwargs)
    eager_opt = torch.optim.LBFGS(twin.parameters(), **kwargs)
    g = make_graph(model, F.mse_loss, opt, backend="inductor")
    batches = _batches()
    ours, theirs = _graph_losses(g, batches), _eager_losses(twin, eager_opt, batches)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    _assert_same_state(model, twin, opt, eager_opt, rtol=1e-4, atol=1e-5)


def test_an_optimizer_that_raises_without_a_closure_is_given_one():
    """pytorch_optimizer's AliG takes ``closure=None`` but raises without one; eager code
    passes ``lambda: float(loss)`` after backward(). Its trial step raised, a trial with a
    closure ran: it gets the call's loss, and trains as eager bitwise."""
    po = pytest.importorskip("pytorch_optimizer")
    model, twin = _model(), _model()
    opt = po.AliG(model.parameters(), max_lr=0.1, momentum=0.9)
    eager_opt = po.AliG(twin.parameters(), max_lr=0.1, momentum=0.9)
    g = make_graph(model, F.mse_loss, opt)
    for x, y in _batches():
        eager_opt.zero_grad()
        loss = F.mse_loss(twin(x), y)
        loss.backward()
        eager_opt.step(lambda loss=loss: float(loss))
        assert float(g(x, y)) == float(loss)
    for p, q in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(p, q)
    assert "its own step(closure)" in str(g)


def test_an_optimizer_that_moves_before_it_evaluates_its_closure_is_refused_by_name():
    """BSAM perturbs the parameters before its first evaluation: the call's own forward and
    backward cannot stand in for it. Refused at add_optimizer, on a trial copy: nothing of the
    user's changed."""
    po = pytest.importorskip("pytorch_optimizer")
    model = _model()
    opt = po.BSAM(model.parameters(), num_data=16)
    before = snapshot(model, opt)
    with pytest.raises(UnsupportedOptimizerError, match="changes the parameters before it first"):
        make_graph(model, F.mse_loss, opt)
    assert_unchanged(before, model, opt)
