"""Every optimizer in the step: graphamp's own updates for SGD, Adam and AdamW, and any other
optimizer's own step() traced into the step (``step/traced_optimizer.py``).

The oracle is torch's own optimizer database (``optim_db`` in
``torch.testing._internal.common_optimizers``): each optimizer on each of its sample settings
trains a small model through a Graph and eagerly, from the same weights and batches; the
parameters and the optimizer state must agree. Then what a step inside a graph adds: a skipped
fp16 step leaves everything as it was, a scheduler changing the lr compiles nothing, a
third-party optimizer written in plain torch trains, and what cannot be traced is refused by name.
"""

from __future__ import annotations

import copy
import inspect

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import eager_steps, import_torch_testing, make_graph, regression_batches

import graphamp
from graphamp import UnsupportedOptimizerError

try:
    common_optimizers = import_torch_testing("common_optimizers")
except ModuleNotFoundError as e:  # expecttest, a test extra, missing
    pytest.skip(f"torch's optimizer database does not import: {e}", allow_module_level=True)

# not in this sweep: a closure (LBFGS: tests/test_closure_optimizers.py), sparse gradients
# only (SparseAdam, refused below), host reads in every step (Adafactor: its own test below)
NOT_SWEPT = {"LBFGS", "SparseAdam", "Adafactor"}
BUILT_IN = {"SGD", "Adam", "AdamW"}  # graphamp's multi-tensor updates (tested elsewhere too)


def _settings():
    """(optimizer class, its sample kwargs, description) for every optim_db entry on the CPU."""
    out = []
    for info in common_optimizers.optim_db:
        cls = info.optim_cls
        if cls.__name__ in NOT_SWEPT:
            continue
        func = info.optim_inputs_func
        takes_dtype = "dtype" in inspect.signature(func).parameters
        inputs = func(device="cpu", dtype=torch.float32) if takes_dtype else func(device="cpu")
        for sample in inputs:
            kwargs = dict(sample.kwargs)
            if kwargs.get("differentiable"):
                continue  # refused by name
            marks = () if sample.desc == "default" else (pytest.mark.slow,)
            out.append(pytest.param(cls, kwargs, id=f"{cls.__name__}-{sample.desc}", marks=marks))
    return out


def _model(cls) -> nn.Module:
    bias = cls is not torch.optim.Muon  # Muon updates matrices only
    return models.mlp(8, 16, 4, act=nn.Tanh, bias=bias, seed=0)


def _graph(model, optimizer, amp=None, scaler=None, lr_sch=None):
    return make_graph(model, F.mse_loss, optimizer, amp=amp, scaler=scaler, lr_sch=lr_sch)


def _close(cls, kwargs=None):
    # Muon orthogonalises in bfloat16 (Newton-Schulz): the traced norm and matmuls round
    # differently from eager's kernels there
    if cls is torch.optim.Muon:
        return dict(rtol=2e-2, atol=2e-3)
    # centered RMSprop divides by sqrt(square_avg - grad_avg**2), a difference of close numbers
    # that magnifies the gradients' float32 rounding: on some CPUs a weight was 7.8e-6 (1.6e-5
    # relative) from eager's after four steps, on the tree before this check changed too
    if cls is torch.optim.RMSprop and (kwargs or {}).get("centered"):
        return dict(rtol=1e-4, atol=1e-5)
    return dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls, kwargs", _settings())
def test_every_optimizer_in_torchs_database_trains_likeeager_steps(cls, kwargs):
    model, twin = _model(cls), _model(cls)
    optimizer, eager_optimizer = cls(model.parameters(), **kwargs), cls(twin.parameters(), **kwargs)
    g = _graph(model, optimizer)
    batches = regression_batches()
    for x, y in batches:
        g(x, y)
    eager_steps(twin, eager_optimizer, batches)
    close = _close(cls, kwargs)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **close)
    for p, q in zip(model.parameters(), twin.parameters()):
        mine, theirs = optimizer.state[p], eager_optimizer.state[q]
        assert sorted(mine) == sorted(theirs)
        for key in theirs:
            torch.testing.assert_close(
                torch.as_tensor(mine[key]).cpu(), torch.as_tensor(theirs[key]).cpu(), **close
            )
    assert len(g.compiled_steps) == 1
    path = "multi-tensor update" if cls.__name__ in BUILT_IN else "its step() traced"
    if kwargs.get("fused") and cls in (torch.optim.Adam, torch.optim.AdamW):
        path = "torch's fused kernel"  # the eager fused optimizer's kernel, in the step
    assert path in repr(g)


@pytest.mark.parametrize(
    "cls, kwargs",
    [(torch.optim.RMSprop, {"momentum": 0.9, "centered": True}), (torch.optim.NAdam, {})],
    ids=["RMSprop", "NAdam"],
)
def test_a_skipped_fp16_step_leaves_a_traced_optimizer_as_it_was(cls, kwargs):
    """An overflow in the first step (a scale far past fp16's range) skips it: the parameters
    and the state the optimizer's first step would make stay bitwise as they were; the next
    steps train."""
    model = _model(cls)
    before = copy.deepcopy(model)
    optimizer = cls(model.parameters(), lr=1e-2, **kwargs)
    g = _graph(model, optimizer, torch.float16, graphamp.GradScaler(init_scale=2.0**24))
    x, y = regression_batches(1)[0]
    g(x, y)
    assert bool(g.history.latest()["skipped"])
    for p, q in zip(model.parameters(), before.parameters()):
        assert torch.equal(p, q)
    for state in optimizer.state.values():
        assert all(
            float(torch.as_tensor(v).abs().sum()) == 0
            for k, v in state.items()
            if k != "mu_product"
        )
    for _ in range(12):  # the scale backs off until the steps are finite
        g(x, y)
    assert not bool(g.history.latest()["skipped"])
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))


def test_a_scheduler_changing_a_traced_optimizers_lr_compiles_once():
    """The lr is a step input: ExponentialLR changes it every step, one program serves all,
    and the run equals eager."""
    model, twin = _model(torch.optim.RMSprop), _model(torch.optim.RMSprop)
    opt, eager_opt = (
        torch.optim.RMSprop(model.parameters(), lr=1e-2),
        torch.optim.RMSprop(twin.parameters(), lr=1e-2),
    )
    sch = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
    eager_sch = torch.optim.lr_scheduler.ExponentialLR(eager_opt, gamma=0.7)
    g = _graph(model, opt, lr_sch=sch)
    batches = regression_batches(6)
    for x, y in batches:
        g(x, y)
    eager_steps(twin, eager_opt, batches, sch=eager_sch)
    assert (
        len(g.compiled_steps) == 1 and opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"]
    )
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cls, kwargs, option, value",
    [
        (torch.optim.Adagrad, {"lr": 0.1}, "lr_decay", 0.5),
        (torch.optim.RMSprop, {"lr": 1e-2}, "alpha", 0.5),
        (torch.optim.SGD, {"lr": 0.1}, "momentum", 0.9),
    ],
    ids=["Adagrad-lr_decay", "RMSprop-alpha", "SGD-momentum-on"],
)
def test_an_option_baked_into_the_step_changed_mid_run_builds_again(cls, kwargs, option, value):
    """Options other than the float hyperparameters the step takes as inputs are baked into it
    (a traced optimizer's every option but its lr; SGD's momentum on or off). Changed between
    calls, the step is built again and trains like eager: never the old value, silently."""
    model, twin = _model(cls), _model(cls)
    opt, eager_opt = cls(model.parameters(), **kwargs), cls(twin.parameters(), **kwargs)
    g = _graph(model, opt)
    batches = regression_batches(4)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            opt.param_groups[0][option] = eager_opt.param_groups[0][option] = value
        g(x, y)
        eager_steps(twin, eager_opt, [(x, y)])
    assert len(g.compiled_steps) == 2
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_tensor_option_written_in_place_builds_again():
    """A tensor-valued option is watched by identity and version (no read of its values each
    call): written in place, the step is built again with its new value."""
    model, twin = _model(torch.optim.Adagrad), _model(torch.optim.Adagrad)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    eager_opt = torch.optim.Adagrad(twin.parameters(), lr=0.1)
    decay, eager_decay = torch.tensor(0.0), torch.tensor(0.0)
    opt.param_groups[0]["lr_decay"], eager_opt.param_groups[0]["lr_decay"] = decay, eager_decay
    g = _graph(model, opt)
    for i, (x, y) in enumerate(regression_batches(4)):
        if i == 2:
            decay.fill_(0.5)
            eager_decay.fill_(0.5)
        g(x, y)
        eager_steps(twin, eager_opt, [(x, y)])
    assert len(g.compiled_steps) == 2
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), written as a
    third-party package writes it: plain torch, in-place updates, lr passed as ``alpha``."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg * beta1 + p.grad * (1 - beta1)
                p.add_(update.sign(), alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"): Adam's step scaled
    per tensor by the trust ratio ||w|| / ||step||, one where a norm is zero. Written in plain
    torch with the step count as a tensor and the zero-norm case with torch.where, as timm's
    ``Lamb`` writes it, so it has no host read."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = exp_avg / (1 - beta1 ** state["step"])
                v_hat = exp_avg_sq / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(2), update.norm(2)
                one = torch.ones_like(w_norm)
                trust = torch.where(w_norm > 0, torch.where(u_norm > 0, w_norm / u_norm, one), one)
                p.sub_(update * (group["lr"] * trust))


# third-party optimizers written in plain torch: (class, settings, the state compared)
THIRD_PARTY = {
    "lion": (Lion, {"lr": 1e-3, "weight_decay": 0.1}, ("exp_avg",)),
    "lamb": (Lamb, {"lr": 1e-2}, ("step", "exp_avg", "exp_avg_sq")),
}


@pytest.mark.parametrize("name", sorted(THIRD_PARTY))
def test_a_third_party_optimizer_in_plain_torch_trains_likeeager_steps(name):
    cls, settings, state_keys = THIRD_PARTY[name]
    model, twin = _model(cls), _model(cls)
    opt, eager_opt = cls(model.parameters(), **settings), cls(twin.parameters(), **settings)
    g = _graph(model, opt)
    batches = regression_batches(5)
    for x, y in batches:
        g(x, y)
    eager_steps(twin, eager_opt, batches)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in state_keys:
            torch.testing.assert_close(opt.state[p][key], eager_opt.state[q][key])


class CountsInPython(Lion):
    """Keeps its step count as a Python int: it would be baked into a traced step."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                p.add_(p.grad, alpha=-group["lr"] / state["step"])


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda ps: torch.optim.SparseAdam(ps), "SparseAdam updates sparse gradients"),
        (lambda ps: torch.optim.RMSprop(ps, differentiable=True), "differentiable=True"),
    ],
    ids=["SparseAdam", "differentiable"],
)
def test_what_cannot_be_one_traced_update_is_refused_by_name(make, words):
    model = _model(torch.optim.RMSprop)
    with pytest.raises(UnsupportedOptimizerError, match=words):
        g = _graph(model, make(model.parameters()))
        g(*regression_batches(1)[0])


def test_python_state_and_host_reads_run_the_optimizers_own_step_like_eager():
    """A Python step count in its state, or a host read (Adafactor's step.item()): a trace
    would bake them in, so the optimizer's own step() runs after the compiled step."""
    for make in (lambda ps: CountsInPython(ps, lr=0.1), lambda ps: torch.optim.Adafactor(ps)):
        model, twin = _model(torch.optim.RMSprop), _model(torch.optim.RMSprop)
        opt, eager_opt = make(model.parameters()), make(twin.parameters())
        g = _graph(model, opt)
        assert "its own step() in Python" in str(g)
        eager_steps(twin, eager_opt, regression_batches(4))
        for x, y in regression_batches(4):
            g(x, y)
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            assert opt.state[p]["step"] == eager_opt.state[q]["step"]


@pytest.mark.inductor
def test_a_traced_optimizer_with_scalar_state_under_inductor_and_fp16():
    """NAdam keeps 0-dim state (mu_product, step) beside parameter-shaped state: the
    inductor-compiled step with fp16 AMP and a GradScaler trains like eager autocast +
    GradScaler, in one compile."""
    model, twin = _model(torch.optim.NAdam), _model(torch.optim.NAdam)
    opt = torch.optim.NAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    eager_opt = torch.optim.NAdam(twin.parameters(), lr=1e-2, weight_decay=0.01)
    g = _graph(model, opt, torch.float16, graphamp.GradScaler())
    g.config.set_backend("inductor")
    scaler = torch.amp.GradScaler("cpu")
    for x, y in regression_batches(6):
        g(x, y)
        eager_opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(twin(x), y)
        scaler.scale(loss).backward()
        scaler.step(eager_opt)
        scaler.update()
    assert len(g.compiled_steps) == 1
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-4)
        assert opt.state[p]["mu_product"].shape == ()
