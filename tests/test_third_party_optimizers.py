"""Optimizers users train with, from the packages they install beside torch, trained through
graphamp against the same optimizer in eager PyTorch.

A trial step on a copy (``step/trial_step.py``) decides how each one updates: traced into the
step where its ``step()`` is tensor arithmetic on tensor state, else in Python after the
compiled step on the gradients the step computed. Either way it must train as eager does:
parameters and the optimizer's own state (Python step counts in its param groups and state
included) after 10 steps, fp32, within 1e-5; with fp16 AMP and a scaler, a step that
overflows skips the optimizer as ``torch.amp.GradScaler.step`` does.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import make_graph

import graphamp
from graphamp.step.trial_step import trial_step

po = pytest.importorskip("pytorch_optimizer")
to = pytest.importorskip("torch_optimizer")
prodigyopt = pytest.importorskip("prodigyopt")
schedulefree = pytest.importorskip("schedulefree")
timm_optim = pytest.importorskip("timm.optim")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _muon_groups(m: nn.Module) -> list[dict]:
    matrices = [p for p in m.parameters() if p.ndim == 2]
    others = [p for p in m.parameters() if p.ndim != 2]
    return [{"params": matrices, "use_muon": True}, {"params": others, "use_muon": False}]


def _schedule_free(m: nn.Module):
    opt = schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2)
    opt.train()  # its documented use: train() before training steps, eval() before evaluation
    return opt


# name -> (factory, how it updates: "eager" (its own step() after the step) or "traced")
OPTIMIZERS = {
    "pytorch_optimizer.AdaBelief": (lambda m: po.AdaBelief(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.AdEMAMix": (lambda m: po.AdEMAMix(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.Ranger": (lambda m: po.Ranger(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.Lamb": (lambda m: po.Lamb(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.Muon": (lambda m: po.Muon(_muon_groups(m), lr=1e-2), "eager"),
    "pytorch_optimizer.Prodigy": (lambda m: po.Prodigy(m.parameters(), lr=1.0), "eager"),
    "pytorch_optimizer.CAME": (lambda m: po.CAME(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.Adan": (lambda m: po.Adan(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.SOAP": (lambda m: po.SOAP(m.parameters(), lr=1e-2), "eager"),
    "pytorch_optimizer.Lookahead(Adam)": (
        lambda m: po.Lookahead(torch.optim.Adam(m.parameters(), lr=1e-2), k=3),
        "eager",
    ),
    "timm.Lamb": (lambda m: timm_optim.create_optimizer_v2(m, "lamb", lr=1e-2), "eager"),
    "timm.Lion": (lambda m: timm_optim.create_optimizer_v2(m, "lion", lr=1e-3), "traced"),
    "torch_optimizer.Lamb": (lambda m: to.Lamb(m.parameters(), lr=1e-2), "eager"),
    "torch_optimizer.Yogi": (lambda m: to.Yogi(m.parameters(), lr=1e-2), "eager"),
    "torch_optimizer.Lookahead(Adam)": (
        lambda m: to.Lookahead(torch.optim.Adam(m.parameters(), lr=1e-2), k=3),
        "eager",
    ),
    "prodigyopt.Prodigy": (lambda m: prodigyopt.Prodigy(m.parameters(), lr=1.0), "eager"),
    "schedulefree.AdamWScheduleFree": (_schedule_free, "eager"),
    "torch.optim.Adafactor": (lambda m: torch.optim.Adafactor(m.parameters(), lr=1e-2), "eager"),
    "torch.optim.RMSprop": (lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2), "traced"),
}


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)) for _ in range(n)]


def _assert_state_close(ours, theirs, params, eager_params) -> None:
    """Both optimizers' state, parameter by parameter, and their param groups, value by value
    (Python numbers too), within 1e-5 (read directly: torch_optimizer's Lookahead has no
    working state_dict(), in eager either)."""
    for p, q in zip(params, eager_params):
        _assert_close(dict(ours.state.get(p, {})), dict(theirs.state.get(q, {})), "state")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in ours.param_groups]
    eager_groups = [{k: v for k, v in g.items() if k != "params"} for g in theirs.param_groups]
    _assert_close(groups, eager_groups, "param_groups")


def _assert_close(a, b, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} against {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} against {sorted(b)}"
        for k in a:
            _assert_close(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, (torch.Tensor, float)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    else:
        assert a == b, f"{where}: {a!r} against {b!r}"


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_optimizer_trains_like_eager_in_fp32(name):
    factory, how = OPTIMIZERS[name]
    model, twin = _mlp(), _mlp()
    opt, eager_opt = factory(model), factory(twin)
    assert (trial_step(opt) is None) == (how == "traced"), trial_step(opt)
    g = make_graph(model, F.mse_loss, opt, backend="eager")
    for x, y in _batches(10):
        loss = g(x, y)
        eager_opt.zero_grad()
        eager_loss = F.mse_loss(twin(x), y)
        eager_loss.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert p.grad is None  # the gradients handed to step() are cleared again
    _assert_state_close(opt, eager_opt, list(model.parameters()), list(twin.parameters()))
    assert len(g.compiled_steps) == 1
    assert ("its own step() in Python" in str(g)) == (how == "eager")


@pytest.mark.parametrize("name", ["Kron", "Gravity"])
def test_an_optimizer_that_draws_random_numbers_draws_what_eager_draws(name):
    # PSGD's Kron draws torch.randn_like and np.random in its step; Gravity its first state.
    # The trial step on a copy drew them too, and the real run then drew other numbers than
    # eager with the same seed; the generators are now put back after it
    import random

    import numpy as np

    def seeded(factory):
        torch.manual_seed(7), np.random.seed(7), random.seed(7)
        return factory()

    model, twin = _mlp(), _mlp()
    opt = seeded(lambda: getattr(po, name)(model.parameters(), lr=1e-2))
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    g = make_graph(model, F.mse_loss, opt, backend="eager")
    assert torch.equal(states[0], torch.get_rng_state())
    assert (states[1] == np.random.get_state()[1]).all() and states[2] == random.getstate()
    for x, y in _batches(5):
        g(x, y)
    eager_opt = seeded(lambda: getattr(po, name)(twin.parameters(), lr=1e-2))
    for x, y in _batches(5):
        eager_opt.zero_grad()
        F.mse_loss(twin(x), y).backward()
        eager_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q), name


class _CountsInGroups(torch.optim.Optimizer):
    """Keeps its step count in its param groups, as every pytorch_optimizer optimizer does, and
    branches on it in Python (Lookahead's sync every k steps)."""

    def __init__(self, params, lr=0.1, k=3):
        super().__init__(params, {"lr": lr, "k": k})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            scale = 1.0 / group["step"] if group["step"] % group["k"] else 2.0
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * scale)


def test_a_python_step_count_advances_and_a_branch_on_it_is_taken_as_in_eager():
    model, twin = _mlp(), _mlp()
    opt, eager_opt = _CountsInGroups(model.parameters()), _CountsInGroups(twin.parameters())
    g = make_graph(model, F.mse_loss, opt, backend="eager")
    for x, y in _batches(7):
        g(x, y)
        eager_opt.zero_grad()
        F.mse_loss(twin(x), y).backward()
        eager_opt.step()
    assert opt.param_groups[0]["step"] == 7
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_fp16_with_a_scaler_skips_the_optimizer_where_eager_gradscaler_does(caplog):
    """An overflowing batch: graphamp's in-graph scaler and torch.amp.GradScaler both skip the
    optimizer's step() (its Python step count does not advance) and back off the same."""
    model, twin = _mlp(), _mlp()
    opt = po.AdaBelief(model.parameters(), lr=1e-2)
    eager_opt = po.AdaBelief(twin.parameters(), lr=1e-2)
    scaler = graphamp.GradScaler(init_scale=2.0**10)
    with caplog.at_level(logging.INFO, logger="graphamp"):
        g = make_graph(model, F.mse_loss, opt, amp=torch.float16, scaler=scaler, backend="eager")
    assert "runs its own step() in Python" in caplog.text
    assert "param_groups[0]['step']" in caplog.text
    eager_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    batches = _batches(6)
    batches[3] = (batches[3][0] * 1e5, batches[3][1])  # overflows fp16
    for x, y in batches:
        g(x, y)
        eager_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(twin(x), y)
        eager_scaler.scale(loss).backward()
        eager_scaler.step(eager_opt)
        eager_scaler.update()
    assert opt.param_groups[0]["step"] == eager_opt.param_groups[0]["step"] == 5
    assert g.grad_scaler.get_scale() == eager_scaler.get_scale()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-4)


def test_a_scheduler_sets_the_lr_the_python_step_reads_as_in_eager():
    model, twin = _mlp(), _mlp()
    opt = po.AdaBelief(model.parameters(), lr=1e-2)
    eager_opt = po.AdaBelief(twin.parameters(), lr=1e-2)
    sch = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    eager_sch = torch.optim.lr_scheduler.StepLR(eager_opt, step_size=2, gamma=0.5)
    g = make_graph(model, F.mse_loss, opt, lr_sch=sch, backend="eager")
    for x, y in _batches(6):
        g(x, y)
        eager_opt.zero_grad()
        F.mse_loss(twin(x), y).backward()
        eager_opt.step()
        eager_sch.step()
        assert opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clipping_is_applied_before_the_python_step_as_after_unscale_in_eager():
    model, twin = _mlp(), _mlp()
    opt, eager_opt = to.Yogi(model.parameters(), lr=1e-2), to.Yogi(twin.parameters(), lr=1e-2)
    g = make_graph(model, F.mse_loss, opt, clip=0.05, backend="eager")
    for x, y in _batches(4):
        g(x, y)
        eager_opt.zero_grad()
        F.mse_loss(twin(x), y).backward()
        nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
        eager_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_python_step_beside_a_traced_one_each_on_its_own_parameters():
    model, twin = _mlp(), _mlp()

    def optimizers(m):
        first, second = m[0], m[2]
        return po.AdaBelief(first.parameters(), lr=1e-2), torch.optim.Adam(
            second.parameters(), lr=1e-2
        )

    (a, b), (ea, eb) = optimizers(model), optimizers(twin)

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(a)
            self.add_optimizer(b)
            self.config.set_backend("eager")

        def build(self, x, y):
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            return loss

    g = G()
    for x, y in _batches(4):
        g(x, y)
        ea.zero_grad()
        eb.zero_grad()
        F.mse_loss(twin(x), y).backward()
        ea.step()
        eb.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_trial_step_leaves_the_users_optimizer_and_model_untouched():
    model = _mlp()
    before = copy.deepcopy(model.state_dict())
    for factory, _ in OPTIMIZERS.values():
        opt = factory(model)
        state = copy.deepcopy([dict(opt.state.get(p, {})) for p in model.parameters()])
        groups = copy.deepcopy(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        )
        trial_step(opt)
        _assert_close([dict(opt.state.get(p, {})) for p in model.parameters()], state, "state")
        _assert_close(
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            groups,
            "groups",
        )
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


class _Boosted(torch.optim.Optimizer):
    """Tensor arithmetic only (traced), reading a setting of its own besides its groups."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.boost = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * self.boost)


def test_a_traced_step_that_reads_an_attribute_of_its_optimizer_sees_it_change():
    model, twin = _mlp(), _mlp()
    opt, eager_opt = _Boosted(model.parameters()), _Boosted(twin.parameters())
    assert trial_step(opt) is None  # traced
    g = make_graph(model, F.mse_loss, opt, backend="eager")
    for step, (x, y) in enumerate(_batches(4)):
        if step == 2:
            opt.boost = eager_opt.boost = 3.0
        g(x, y)
        eager_opt.zero_grad()
        F.mse_loss(twin(x), y).backward()
        eager_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert len(g.compiled_steps) == 2
