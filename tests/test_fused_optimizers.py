"""Adam/AdamW(fused=True): torch's fused kernel as one op of the step (torchkit/fused_update.py).

Against eager's fused optimizer, bitwise where the step runs eager kernels (aot_eager). In the
compatibility subset (.ci/compat_tests): the kernel's signature and the custom op's
re-inplacing are the parts most likely to change between torch releases.
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import eager_steps, make_graph, regression_batches

import graphamp


def _model() -> nn.Module:
    return models.mlp(8, 16, 4, act=nn.Tanh, bias=True, seed=0)


FUSED = [
    pytest.param(torch.optim.AdamW, {"weight_decay": 0.1}, id="AdamW"),
    pytest.param(torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.05}, id="Adam-amsgrad"),
    pytest.param(
        torch.optim.Adam,
        {"maximize": True, "decoupled_weight_decay": True, "weight_decay": 0.1},
        id="Adam-decoupled-maximize",
    ),
]


def _fused_pair(cls, kwargs, lr=1e-2):
    model, twin = _model(), _model()
    return (
        model,
        twin,
        cls(model.parameters(), lr=lr, fused=True, **kwargs),
        cls(twin.parameters(), lr=lr, fused=True, **kwargs),
    )


def _assert_bitwise_like(model, twin, opt, eager_opt):
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert sorted(opt.state[p]) == sorted(eager_opt.state[q])
        for key, value in eager_opt.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("cls, kwargs", FUSED)
def test_fused_adam_runs_torchs_fused_kernel_bitwise_likeeager_steps(cls, kwargs):
    """Adam/AdamW(fused=True): the step calls torch's fused kernel, so parameters and state are
    bitwise those of the eager fused optimizer (graphamp's multi-tensor math is not: it is
    torch's capturable form, 1e-8 apart), with an lr scheduler changing the lr every step
    (one program: the lr stays a step input)."""
    model, twin, opt, eager_opt = _fused_pair(cls, kwargs)
    sch = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
    eager_sch = torch.optim.lr_scheduler.ExponentialLR(eager_opt, gamma=0.7)
    g = make_graph(model, F.mse_loss, opt, lr_sch=sch)
    batches = regression_batches(5)
    for x, y in batches:
        g(x, y)
    eager_steps(twin, eager_opt, batches, sch=eager_sch)
    _assert_bitwise_like(model, twin, opt, eager_opt)
    assert len(g.compiled_steps) == 1
    assert "torch's fused kernel (fused=True)" in repr(g)


def test_a_fused_adamw_over_float32_and_bfloat16_parameters_matcheseager_steps():
    """One group holding float32 and bfloat16 parameters: the kernel is called once per dtype,
    as eager groups them (its CUDA kernel takes one dtype a call), bitwise eager's run."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4).to(torch.bfloat16)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)).to(torch.bfloat16)).float()

    model = Mixed()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    eager_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    g = make_graph(model, F.mse_loss, opt)
    batches = regression_batches(3)
    for x, y in batches:
        g(x, y)
    eager_steps(twin, eager_opt, batches)
    _assert_bitwise_like(model, twin, opt, eager_opt)


def test_fused_adamw_under_inductor_trains_likeeager_steps():
    """Under inductor the fused op writes the step's parameters and state in place (inductor
    re-inplaces it); the run matches eager's fused AdamW (the forward and backward are
    inductor's kernels, so not bitwise)."""
    model, twin, opt, eager_opt = _fused_pair(torch.optim.AdamW, {"weight_decay": 0.1})
    g = make_graph(model, F.mse_loss, opt, backend="inductor")
    batches = regression_batches(4)
    for x, y in batches:
        g(x, y)
    eager_steps(twin, eager_opt, batches)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], eager_opt.state[q][key])
    assert len(g.compiled_steps) == 1


def test_a_skipped_fp16_step_leaves_a_fused_adamw_as_it_was():
    """fp16 with a scale past fp16's range: the first step overflows and the fused kernel is
    told so (found_inf), so parameters, moments and steps stay bitwise as they were; once the
    scale has backed off, the steps train."""
    model = _model()
    before = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = make_graph(
        model, F.mse_loss, opt, amp=torch.float16, scaler=graphamp.GradScaler(init_scale=2.0**24)
    )
    x, y = regression_batches(1)[0]
    g(x, y)
    assert bool(g.history.latest()["skipped"])
    for p, q in zip(model.parameters(), before.parameters()):
        assert torch.equal(p, q)
        state = opt.state[p]
        assert float(state["step"]) == 0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    for _ in range(12):
        g(x, y)
    assert not bool(g.history.latest()["skipped"])
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))


def test_a_fused_adams_betas_changed_mid_run_build_the_step_again():
    """The fused kernel takes beta1, beta2, eps and the weight decay as numbers, baked into the
    step: changed between calls, the step is built again (never the old value) and the run
    stays bitwise eager's."""
    model, twin, opt, eager_opt = _fused_pair(torch.optim.AdamW, {"weight_decay": 0.1})
    g = make_graph(model, F.mse_loss, opt)
    for i, (x, y) in enumerate(regression_batches(4)):
        if i == 2:
            for o in (opt, eager_opt):
                o.param_groups[0]["betas"] = (0.8, 0.99)
                o.param_groups[0]["weight_decay"] = 0.2
        g(x, y)
        eager_steps(twin, eager_opt, [(x, y)])
    _assert_bitwise_like(model, twin, opt, eager_opt)
    assert len(g.compiled_steps) == 2
