"""Gradient code in build(): reading and writing .grad after backward(), and a second
forward/backward on perturbed weights (SAM), against the same code run eagerly."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_state_close, assert_unchanged, make_graph, snapshot

import graphamp
from graphamp.errors import CaptureError


def _model(batch_norm: bool = True) -> nn.Module:
    return models.mlp(8, 16, 4, norm=nn.BatchNorm1d if batch_norm else nn.Identity, seed=0)


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return models.batches(n, 32, 8, 4, seed=seed)


# -- the user's gradient code, written once and run both ways ------------------------------------


def agc(params, clipping: float = 0.01, eps: float = 1e-3) -> None:
    """Adaptive gradient clipping (NFNets), per tensor: .grad scaled to at most clipping x the
    parameter's norm."""
    for p in params:
        if p.grad is None:
            continue
        max_norm = p.detach().norm().clamp(min=eps) * clipping
        grad_norm = p.grad.detach().norm()
        factor = torch.where(grad_norm > max_norm, max_norm / grad_norm.clamp(min=1e-6), 1.0)
        p.grad.mul_(factor)


def sam_first_step(params, rho: float = 0.05) -> list[torch.Tensor]:
    """SAM's ascent: each parameter moved along its gradient, the steps returned."""
    with torch.no_grad():
        norm = torch.norm(torch.stack([p.grad.norm(2) for p in params]), 2)
        steps = []
        for p in params:
            e = p.grad * (rho / (norm + 1e-12))
            p.add_(e)
            steps.append(e)
    return steps


def sam_restore(params, steps) -> None:
    with torch.no_grad():
        for p, e in zip(params, steps):
            p.sub_(e)


def sam(model: nn.Module, x, y, loss) -> None:
    """After loss.backward(): perturb, a second forward and backward there, restore."""
    params = list(model.parameters())
    steps = sam_first_step(params)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    sam_restore(params, steps)


def half_and_clip_first_layer(model: nn.Module, x, y, loss) -> None:
    """.grad written (a new tensor), then clip_grad_norm_ on a subset of the parameters."""
    for p in model.parameters():
        p.grad = p.grad * 0.5
    torch.nn.utils.clip_grad_norm_(model[0].parameters(), 0.05)


def run_agc(model, x, y, loss):
    agc(model.parameters())


CODE = {"agc": run_agc, "sam": sam, "write_and_clip": half_and_clip_first_layer}


def _graph(model, opt, code, **kwargs):
    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        code(self.model, x, y, loss)
        return loss

    return make_graph(model, None, opt, build=build, **kwargs)


def _eager_step(model, opt, code, x, y) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    code(model, x, y, loss)
    opt.step()
    return loss.detach()


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _trains_like_eager(step, model, ref, opt, ref_opt, graph_arg=None, ref_arg=None):
    """``step(model, arg, x, y) -> loss`` (its backward and gradient code inside) as build() of
    a Graph over ``model`` and ``opt``, and eagerly on ``ref`` between ``ref_opt.zero_grad()``
    and ``ref_opt.step()``: every loss and the final state agree at rtol 1e-5."""
    g = make_graph(model, None, opt, build=lambda self, x, y: step(self.model, graph_arg, x, y))
    for x, y in _batches(3):
        loss = g(x, y)
        ref_opt.zero_grad()
        ref_loss = step(ref, ref_arg, x, y)
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(CODE))
@pytest.mark.parametrize("batch_norm", [False, True])
def test_gradient_code_trains_like_eager_in_fp32(name, batch_norm):
    model = _model(batch_norm)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    g = _graph(model, opt, CODE[name])
    for x, y in _batches(4):
        loss = g(x, y)
        ref_loss = _eager_step(ref, ref_opt, CODE[name], x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_state_close(model, ref, rtol=1e-5, atol=1e-6)
    assert "build() took" not in str(g)  # the print stays about the graph


def test_build_sees_true_gradients_under_a_loss_scale():
    """The gradients build() reads are unscaled (as after GradScaler.unscale_ in eager), so the
    same AGC threshold means the same thing with and without fp16's scaler."""
    seen = {}

    def record(model, x, y, loss):
        seen["norm"] = torch.stack([p.grad.norm() for p in model.parameters()]).norm()

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        record(self.model, x, y, loss)
        return loss, seen["norm"]

    x, y = _batches(1)[0]
    model = _model(batch_norm=False)
    ref = copy.deepcopy(model)
    g = make_graph(
        model,
        None,
        _optimizer(model),
        build=build,
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**12),
    )
    _, norm = g(x, y)
    F.cross_entropy(ref(x), y).backward()
    expected = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=0)  # fp16 forward, true scale


def _eager_fp16_step(model, opt, code, x, y, scale: float) -> tuple[torch.Tensor, bool]:
    """The eager recipe with a constant loss scale: each backward scaled and unscaled at once
    (GradScaler.unscale_'s kernel), the user's code on true gradients, the step skipped when
    the final gradients are not finite."""

    def backward(loss):
        grads = torch.autograd.grad(loss * scale, list(model.parameters()))
        found = torch.zeros(())
        inv = torch.full((), scale).double().reciprocal().float()
        grads = [g.detach().clone() for g in grads]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        for p, g in zip(model.parameters(), grads):
            p.grad = g if p.grad is None else p.grad + g

    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    model_backward = backward
    original = torch.Tensor.backward
    try:  # the user's code calls loss.backward(): route it through the scaled backward
        torch.Tensor.backward = lambda t, *a, **k: model_backward(t)
        loss.backward()
        with torch.autocast("cpu", dtype=torch.float16):
            code(model, x, y, loss)
    finally:
        torch.Tensor.backward = original
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
    if finite:
        opt.step()
    return loss.detach().float(), not finite


@pytest.mark.parametrize("name", ["agc", "sam"])
def test_gradient_code_in_fp16_with_a_scaler_follows_eager_autocast(name):
    model = _model(batch_norm=True)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    scale = 2.0**10
    g = _graph(
        model,
        opt,
        CODE[name],
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=scale, growth_interval=1000),
    )
    for x, y in _batches(4):
        loss = g(x, y)
        ref_loss, skipped = _eager_fp16_step(ref, ref_opt, CODE[name], x, y, scale)
        assert not skipped
        torch.testing.assert_close(loss.float(), ref_loss, rtol=5e-3, atol=5e-3)
    assert_state_close(model, ref, rtol=2e-2, atol=2e-3)
    assert g.grad_scaler.get_scale() == scale


@pytest.mark.parametrize("name", ["agc", "sam"])
def test_an_overflow_in_gradient_code_skips_the_whole_step(name):
    """An inf in the batch: SAM's perturbation turns every weight NaN before its restore; the
    skipped step still leaves parameters, momentum and BatchNorm statistics as they were."""
    model = _model(batch_norm=True)
    opt = _optimizer(model)
    g = _graph(model, opt, CODE[name], amp=torch.float16, scaler=graphamp.GradScaler(2.0**10))
    for x, y in _batches(2):
        g(x, y)
    before = snapshot(model, opt)
    x, y = _batches(1, seed=5)[0]
    x[0, 0] = float("inf")
    g(x, y)
    assert_unchanged(before, model, opt)
    assert g.grad_scaler.get_scale() == 2.0**9


def test_an_adversarial_input_gradient_fgsm():
    """x.requires_grad_() in build(), then x.grad: the fast gradient sign method's input."""

    def fgsm(model, x, y):
        x = x.clone().requires_grad_(True)
        F.cross_entropy(model(x), y).backward()
        x_adv = (x + 0.1 * x.grad.sign()).detach()
        model.zero_grad()
        loss = F.cross_entropy(model(x_adv), y)
        loss.backward()
        return loss

    model = _model(batch_norm=False)
    ref = copy.deepcopy(model)
    _trains_like_eager(
        lambda model, _, x, y: fgsm(model, x, y), model, ref, _optimizer(model), _optimizer(ref)
    )


def test_a_parameter_clamped_in_place_in_build_trains_like_eager():
    """WGAN's weight clipping written before the forward: the forward and the optimizer see
    the clamped weight, and its gradient is the clamped weight's, as in eager."""

    def clamp(model):
        with torch.no_grad():
            model[0].weight.clamp_(-0.1, 0.1)

    def step(model, _, x, y):
        clamp(model)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    model = _model(batch_norm=False)
    ref = copy.deepcopy(model)
    _trains_like_eager(step, model, ref, _optimizer(model), _optimizer(ref))


def test_gradient_code_with_accumulation_is_refused_by_name():
    model = _model(batch_norm=False)
    opt = _optimizer(model)
    before = snapshot(model, opt)
    g = _graph(model, opt, run_agc, configure=lambda g: g.config.set_gradient_accumulation_steps(2))
    with pytest.raises(CaptureError, match=r"reads or writes \.grad.*gradient accumulation"):
        g(*_batches(1)[0])
    assert_unchanged(before, model, opt)


def test_a_grad_of_the_wrong_shape_is_refused_as_eager_does():
    def wrong(model, x, y, loss):
        model[0].weight.grad = torch.zeros(3)

    model = _model(False)
    g = _graph(model, _optimizer(model), wrong)
    with pytest.raises(CaptureError, match=r"assigns a \.grad of shape \(3,\)"):
        g(*_batches(1)[0])


def test_optimizer_zero_grad_in_build_clears_the_first_gradients(caplog):
    """optimizer.zero_grad() between two backward passes (as a SAM loop written with its
    optimizer does): the step trains on the second loss's gradients only, and the profiler
    marker zero_grad() records does not keep the step out of the step cache."""
    model = _model(batch_norm=False)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer(model), _optimizer(ref)

    def two_losses(model, opt, x, y):
        first = F.cross_entropy(model(x), y)
        first.backward()
        opt.zero_grad()
        second = F.cross_entropy(model(x * 2), y)
        second.backward()
        return second

    with caplog.at_level("INFO", logger="graphamp"):
        _trains_like_eager(two_losses, model, ref, opt, ref_opt, opt, ref_opt)
    assert "profiler" not in caplog.text


class SAMOptimizer(torch.optim.Optimizer):
    """SAM written as the popular implementations write it: an optimizer over the base one's
    parameters, reaching them through its own ``param_groups`` and ``state``, restoring with
    ``p.data = ...``."""

    def __init__(self, params, rho: float = 0.05):
        super().__init__(params, {"rho": rho})

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * scale.to(p))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def restore(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.data = self.state[p]["old_p"]


def test_a_sam_optimizer_class_trains_like_eager():
    """The SAM object is not added to the Graph (the base optimizer is): its first step and
    restore run inside build() on the traced parameters it reaches through param_groups."""

    def step(model, sam, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        sam.first_step(zero_grad=True)
        F.cross_entropy(model(x), y).backward()
        sam.restore()
        return loss

    model = _model(batch_norm=True)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    sam_opt, ref_sam = SAMOptimizer(model.parameters()), SAMOptimizer(ref.parameters())
    _trains_like_eager(step, model, ref, opt, ref_opt, sam_opt, ref_sam)


def _functional_step(model, _, x, y):
    """Gradients without backward(): torch.autograd.grad, then clipped per element and
    assigned to .grad (a port of functional or meta-learning code)."""
    loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        p.grad = g.clamp(-0.05, 0.05)
    return loss


def test_gradients_assigned_from_autograd_grad_without_backward_train_like_eager():
    model = _model(batch_norm=True)
    ref = copy.deepcopy(model)
    _trains_like_eager(_functional_step, model, ref, _optimizer(model), _optimizer(ref))


def test_gradients_assigned_from_autograd_grad_are_unscaled_and_checked_as_backward_s():
    """fp16 with a scaler: torch.autograd.grad in build() runs on the scaled loss and returns the
    true gradients, as after backward(); an inf batch skips the whole step."""
    model = _model(batch_norm=True)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    g = make_graph(
        model,
        None,
        opt,
        build=lambda self, x, y: _functional_step(self.model, None, x, y),
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**10),
    )
    for x, y in _batches(3):
        loss = g(x, y)
        ref_opt.zero_grad()
        ref_loss = _functional_step(ref, None, x, y)
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=5e-3, atol=5e-3)
    assert_state_close(model, ref, rtol=2e-2, atol=2e-3)
    before = snapshot(model, opt)
    x, y = _batches(1, seed=5)[0]
    x[0, 0] = float("inf")
    g(x, y)
    assert_unchanged(before, model, opt)
    assert g.grad_scaler.get_scale() == 2.0**9


def test_a_build_that_neither_calls_backward_nor_sets_grad_is_refused_by_name():
    model = _model(batch_norm=False)

    def build(self, x, y):
        return F.cross_entropy(self.model(x), y)

    g = make_graph(model, None, _optimizer(model), build=build)
    with pytest.raises(CaptureError, match=r"never calls backward\(\) nor sets"):
        g(*_batches(1)[0])
