"""PyTorch's own grad-scaling scenarios (the ``test_grad_scaling_*`` tests of torch's
test_cuda.py / test_torch.py) written as whole-step graphs.

Each scenario runs twice: as a graphamp Graph, and eagerly as torch's test writes it, with a
``torch.amp.GradScaler("cpu")``: the eager run is the oracle. As in torch's tests the case is two
``Linear(8, 8)`` layers, MSE, SGD/Adam/AdamW at lr 1.0, four batches, a scaler starting at 128
that doubles after every clean step, and an overflow injected at step 2. torch injects it by
filling ``model[1].weight.grad`` with inf after backward; a graph has no ``.grad`` to write, so
build() adds ``(model[1].weight * poison).sum()`` to the loss, with ``poison`` an input that is
0 (adds exactly nothing) or inf (that weight's gradient, and only it, becomes inf).

What is compared: the scale used at every step and the final scale, exactly (and the final scale
is torch's own assertion, 128 · 2^clean · 0.5^skipped); parameters and optimizer state at
torch's tolerances where both runs are fp32. graphamp's AMP decisions differ from CPU autocast's
in places (passes/lists.py), so the autocast scenario compares graphamp fp16 with eager CPU
autocast fp16 to a looser tolerance, measured and stated beside it.

Every scenario runs with graphamp's GradScaler and with a torch.amp.GradScaler handed to
set_grad_scaler, enabled and disabled (a disabled scaler is "no scaler", as in torch).
Scenarios a whole-step graph cannot express raise a graphamp error, tested at the end.
"""

from __future__ import annotations

import copy
import math
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_optimizer_close, autocast_step

import graphamp
from graphamp import CaptureError, UnsupportedOptimizerError

# fp32 steps with a scaler are the point of most scenarios here; graphamp rightly says so.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*loss scaling is unnecessary", "ignore:.*fp16 AMP without a grad scaler"
)

INIT_SCALE, GROWTH = 128.0, 2.0
SKIP_ITER = 2
INF = float("inf")
KINDS = ["graphamp_scaler", "torch_scaler"]
ENABLED = [True, False]


# -- the case: torch's _create_scaling_case, twice (graph and eager) -----------------------------


@dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer


def two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def twin_runs(
    make_model=two_linears, opt_ctor=torch.optim.SGD, opt_kwargs=None, ref_opt_kwargs=None
) -> tuple[Run, Run]:
    """The same model and optimizer twice: one for the graph, one for the eager oracle."""
    model = make_model()
    ref = copy.deepcopy(model)
    kwargs = {"lr": 1.0, **(opt_kwargs or {})}
    ref_kwargs = {"lr": 1.0, **(ref_opt_kwargs if ref_opt_kwargs is not None else opt_kwargs or {})}
    return (
        Run(model, opt_ctor(model.parameters(), **kwargs)),
        Run(ref, opt_ctor(ref.parameters(), **ref_kwargs)),
    )


def batches(n=4):
    return [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(n)]


def poisons(enabled: bool, n=4) -> list[torch.Tensor]:
    """torch injects an overflow only when the scaler is enabled (nothing would skip it else)."""
    return [torch.tensor(INF if enabled and i == SKIP_ITER else 0.0) for i in range(n)]


def graph_scaler(kind: str, enabled: bool, **settings):
    settings = {"init_scale": INIT_SCALE, "growth_factor": GROWTH, "growth_interval": 1, **settings}
    if kind == "torch_scaler":
        return torch.amp.GradScaler("cpu", enabled=enabled, **settings)
    # graphamp's default min_scale=1 / max_scale=2**24 are not reached from 128 in 4 steps
    return graphamp.GradScaler(enabled=enabled, **settings)


def eager_scaler(enabled: bool, **settings):
    settings = {"init_scale": INIT_SCALE, "growth_factor": GROWTH, "growth_interval": 1, **settings}
    return torch.amp.GradScaler("cpu", enabled=enabled, **settings)


def make_graph(modules: dict, optimizers: list, scaler, build, *, amp=None, clip=None, acc_steps=1):
    class ScalingGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            for name, module in modules.items():
                setattr(self, name, module)
            for opt in optimizers:
                self.add_optimizer(opt, clip_grad_max_norm=clip)
            self.config.set_backend("aot_eager")
            if amp is not None:
                self.config.enable_amp(True, dtype=amp)
            if acc_steps > 1:
                self.config.set_gradient_accumulation_steps(acc_steps)
            self.set_grad_scaler(scaler)

        def build(self, *args):
            return build(self, *args)

    return ScalingGraph()


def poison_term(layer: nn.Linear, poison: torch.Tensor) -> torch.Tensor:
    return (layer.weight * poison).sum()


def mse_build(self, x, y, poison):
    loss = F.mse_loss(self.model(x), y) + poison_term(self.model[1], poison)
    loss.backward()
    return loss


def poison_grad(model: nn.Module, step: int, scaler) -> None:
    """torch's injection: after backward, one weight's gradient becomes inf."""
    if step == SKIP_ITER and scaler.is_enabled():
        with torch.no_grad():
            model[1].weight.grad.fill_(INF)


def run_graph(g, data, enabled) -> None:
    for (x, y), poison in zip(data, poisons(enabled, len(data))):
        g(x, y, poison)


def assert_same_run(
    g, ref_scales, ref_scaler, pairs, *, enabled, clean, skipped, atol=1e-7, rtol=1e-5
):
    """The scale exactly (step by step, and torch's own closed form); parameters and optimizer
    state within the scenario's tolerance."""
    if enabled:
        expected = INIT_SCALE * GROWTH**clean * ref_scaler.get_backoff_factor() ** skipped
        assert g.history.fetch()["scale"] == ref_scales
        assert g.grad_scaler.get_scale() == ref_scaler.get_scale() == expected
        assert (
            g.grad_scaler.state_dict()["_growth_tracker"]
            == ref_scaler.state_dict()["_growth_tracker"]
        )
    else:
        assert g.grad_scaler.get_scale() == ref_scaler.get_scale() == 1.0
        assert not any(g.history.fetch()["skipped"])
    for ours, ref in pairs:
        for (name, p), q in zip(ours.model.named_parameters(), ref.model.parameters()):
            torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=name)
        assert_optimizer_close(ours.opt, ref.opt, atol=atol, rtol=rtol)


# graphamp's Adam is torch's capturable form: bias corrections computed from fp32 tensors, where
# torch's CPU Adam takes Python doubles. After one step the parameters differ by a few ulps
# (measured 3.6e-7); lr 1.0 magnifies that to 4.6e-5 after four steps (measured, no scaler).
ADAM_ATOL = 1e-4


# -- test_grad_scaling_autocast (+ _foreach, _fused) --------------------------------------------


def eager_autocast(run: Run, data, scaler, amp, start=0):
    return [
        autocast_step(
            lambda: F.mse_loss(run.model(x), y),
            run.opt,
            amp,
            scaler,
            after_backward=lambda: poison_grad(run.model, i, scaler),
        ).scale
        for i, (x, y) in enumerate(data, start)
    ]


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
FLAGS = {"plain": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
# The optimizer variants run with the scaler as torch's test writes it (a torch scaler, enabled);
# the scaler kinds and enabled=False run on SGD. graphamp ignores foreach/fused (it runs its own
# update), so after one fused and the plain Adam/AdamW runs the other flag variants are slow.
_FAST_VARIANTS = {("sgd", "plain"), ("sgd", "fused"), ("adam", "plain"), ("adamw", "plain")}
AUTOCAST_CASES = [
    pytest.param(
        o, f, "torch_scaler", True, marks=() if (o, f) in _FAST_VARIANTS else pytest.mark.slow
    )
    for o in OPTIMIZERS
    for f in FLAGS
] + [
    ("sgd", "plain", "graphamp_scaler", True),
    ("sgd", "plain", "graphamp_scaler", False),
    ("sgd", "plain", "torch_scaler", False),
]


@pytest.mark.parametrize("opt_name, flags, kind, enabled", AUTOCAST_CASES)
def test_grad_scaling_autocast(opt_name, flags, kind, enabled):
    ours, ref = twin_runs(opt_ctor=OPTIMIZERS[opt_name], opt_kwargs=FLAGS[flags])
    data = batches()
    g = make_graph(
        {"model": ours.model}, [ours.opt], graph_scaler(kind, enabled), mse_build, amp=torch.float16
    )
    run_graph(g, data, enabled)
    ref_scaler = eager_scaler(enabled)
    ref_scales = eager_autocast(ref, data, ref_scaler, torch.float16)
    # graphamp fp16 against CPU autocast fp16: both run the Linears in fp16 and MSE in fp32.
    # Measured after 4 steps at lr 1.0: SGD bitwise equal; Adam 1.1e-3 and AdamW 4.8e-4 max
    # abs difference (graphamp's Adam rounding, ADAM_ATOL, magnified through fp16 forwards;
    # torch's own test expects Adam to miss 1e-3 between fp32 and autocast runs).
    atol, rtol = (1e-7, 1e-5) if opt_name == "sgd" else (5e-3, 1e-2)
    assert_same_run(
        g,
        ref_scales,
        ref_scaler,
        [(ours, ref)],
        enabled=enabled,
        clean=3,
        skipped=1,
        atol=atol,
        rtol=rtol,
    )


# -- test_grad_scaling_autocast_fused_optimizers: fused against unfused, fp32 -------------------


@pytest.mark.parametrize(
    "opt_name, amsgrad",
    [
        ("adamw", False),
        pytest.param("adam", False, marks=pytest.mark.slow),
        pytest.param("adam", True, marks=pytest.mark.slow),
        pytest.param("adamw", True, marks=pytest.mark.slow),
    ],
)
def test_grad_scaling_fused_optimizer_equals_unfused(opt_name, amsgrad):
    """torch checks that a fused Adam (which unscales inside its kernel) steps as the unfused
    one does. A graph accepts the flag and runs its own update: it must step as eager's
    unfused optimizer (to ADAM_ATOL), and leave the state in torch's format."""
    ours, ref = twin_runs(
        opt_ctor=OPTIMIZERS[opt_name],
        opt_kwargs={"fused": True, "amsgrad": amsgrad},
        ref_opt_kwargs={"fused": False, "amsgrad": amsgrad},
    )
    data = batches()
    g = make_graph({"model": ours.model}, [ours.opt], graph_scaler("torch_scaler", True), mse_build)
    run_graph(g, data, True)
    ref_scaler = eager_scaler(True)
    ref_scales = eager_autocast(ref, data, ref_scaler, None)
    assert_same_run(
        g, ref_scales, ref_scaler, [(ours, ref)], enabled=True, clean=3, skipped=1, atol=ADAM_ATOL
    )


# -- test_grad_scaling_clipping and _clipping_separate_unscale ----------------------------------

MAX_NORM = 0.2


def eager_clipping(run: Run, data, scaler, separate_unscale: bool):
    scales = []
    for i, (x, y) in enumerate(data):
        scales.append(scaler.get_scale())
        run.opt.zero_grad()
        loss = F.mse_loss(run.model(x), y)
        scaler.scale(loss).backward()
        if separate_unscale:  # unscale_, poison, clip the true gradients
            poison_grad(run.model, i, scaler)
            scaler.unscale_(run.opt)
            nn.utils.clip_grad_norm_(run.model.parameters(), MAX_NORM, error_if_nonfinite=False)
        else:  # clip the scaled gradients at the scaled norm, then poison
            nn.utils.clip_grad_norm_(run.model.parameters(), MAX_NORM * scaler.get_scale())
            poison_grad(run.model, i, scaler)
        scaler.step(run.opt)
        scaler.update()
    return scales


@pytest.mark.parametrize("enabled", ENABLED)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_clipping(kind, enabled):
    """Both of torch's clipping recipes are one graph: add_optimizer(clip_grad_max_norm=0.2)
    clips after unscaling. The graph is compared with each recipe, at torch's tolerances."""
    ours, _ = twin_runs()
    start = copy.deepcopy(ours.model)  # each eager recipe starts from the same weights
    data = batches()
    g = make_graph(
        {"model": ours.model}, [ours.opt], graph_scaler(kind, enabled), mse_build, clip=MAX_NORM
    )
    run_graph(g, data, enabled)
    for separate_unscale, atol in ((False, 1e-5), (True, 1e-7)):  # torch's tolerances
        model = copy.deepcopy(start)
        ref = Run(model, torch.optim.SGD(model.parameters(), lr=1.0))
        ref_scaler = eager_scaler(enabled)
        ref_scales = eager_clipping(ref, data, ref_scaler, separate_unscale)
        assert_same_run(
            g, ref_scales, ref_scaler, [(ours, ref)], enabled=enabled, clean=3, skipped=1, atol=atol
        )


# -- test_grad_scaling_penalty -------------------------------------------------------------------


def penalty_build(self, x, y, poison):
    loss = F.mse_loss(self.model(x), y)
    # graphamp seeds this grad with the loss scale and unscales its results (torch's recipe)
    grads = torch.autograd.grad(loss, list(self.model.parameters()), create_graph=True)
    norm = sum(g.pow(2).sum() for g in grads).sqrt()
    loss = loss + norm + poison_term(self.model[1], poison)
    loss.backward()
    return loss


def eager_penalty(run: Run, data, scaler):
    scales = []
    for i, (x, y) in enumerate(data):
        scales.append(scaler.get_scale())
        run.opt.zero_grad()
        loss = F.mse_loss(run.model(x), y)
        scaled = torch.autograd.grad(
            scaler.scale(loss), list(run.model.parameters()), create_graph=True
        )
        grads = [s * (1.0 / scaler.get_scale()) for s in scaled]
        loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
        scaler.scale(loss).backward()
        poison_grad(run.model, i, scaler)
        scaler.step(run.opt)
        scaler.update()
    return scales


@pytest.mark.parametrize("enabled", ENABLED)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_penalty(kind, enabled):
    ours, ref = twin_runs()
    data = batches()
    g = make_graph({"model": ours.model}, [ours.opt], graph_scaler(kind, enabled), penalty_build)
    run_graph(g, data, enabled)
    ref_scaler = eager_scaler(enabled)
    ref_scales = eager_penalty(ref, data, ref_scaler)
    # torch's tolerance is atol 1e-7: here the penalty's gradients are divided by a scale
    # tensor where torch multiplies by the float 1/scale, one rounding apart
    assert_same_run(
        g, ref_scales, ref_scaler, [(ours, ref)], enabled=enabled, clean=3, skipped=1, atol=1e-6
    )


# -- test_grad_scaling_accumulation --------------------------------------------------------------


def accumulation_build(self, x, y):
    loss = F.mse_loss(self.model(x), y)
    loss.backward()
    return loss


def eager_accumulation(run: Run, data, scaler, steps=2):
    scales = []
    for i, (x, y) in enumerate(data):
        if i % steps == 0:
            scales.append(scaler.get_scale())
        loss = F.mse_loss(run.model(x), y) / steps
        scaler.scale(loss).backward()
        if (i + 1) % steps == 0:
            scaler.step(run.opt)
            scaler.update()
            run.opt.zero_grad()
    return scales


@pytest.mark.parametrize("enabled", ENABLED)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_accumulation(kind, enabled):
    """torch accumulates 2 batches per step, dividing each loss by 2; graphamp takes the 2
    batches as one call split into 2 micro-batches, whose losses it averages: the same."""
    ours, ref = twin_runs()
    data = batches()
    g = make_graph(
        {"model": ours.model},
        [ours.opt],
        graph_scaler(kind, enabled),
        accumulation_build,
        acc_steps=2,
    )
    for k in range(0, len(data), 2):
        g(torch.cat([data[k][0], data[k + 1][0]]), torch.cat([data[k][1], data[k + 1][1]]))
    ref_scaler = eager_scaler(enabled)
    ref_scales = eager_accumulation(ref, data, ref_scaler)
    assert_same_run(g, ref_scales, ref_scaler, [(ours, ref)], enabled=enabled, clean=2, skipped=0)


# -- test_grad_scaling_multiple: two models, two optimizers, two losses, one scaler ---------------


def two_model_build(self, x, y, poison):
    out0, out1 = self.model0(x), self.model1(x)
    loss0 = F.mse_loss(0.3 * out0 + 0.7 * out1, y)
    loss1 = F.mse_loss(0.6 * out0 - 0.4 * out1, y) + poison_term(self.model1[1], poison)
    loss0.backward()
    loss1.backward()
    return loss0, loss1


def eager_two_models(run0: Run, run1: Run, data, scaler):
    scales = []
    for i, (x, y) in enumerate(data):
        scales.append(scaler.get_scale())
        run0.opt.zero_grad()
        run1.opt.zero_grad()
        out0, out1 = run0.model(x), run1.model(x)
        loss0 = F.mse_loss(0.3 * out0 + 0.7 * out1, y)
        loss1 = F.mse_loss(0.6 * out0 - 0.4 * out1, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        poison_grad(run1.model, i, scaler)
        scaler.unscale_(run0.opt)  # torch's extra stress: one optimizer unscaled separately
        scaler.step(run0.opt)
        scaler.step(run1.opt)
        scaler.update()
    return scales


@pytest.mark.parametrize("enabled", ENABLED)
@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_multiple(kind, enabled):
    """Only model1's gradients overflow: optimizer 1 skips the step, optimizer 0 takes it, and
    the one scale backs off once."""
    ours0, ref0 = twin_runs()
    ours1, ref1 = twin_runs()
    data = batches()
    g = make_graph(
        {"model0": ours0.model, "model1": ours1.model},
        [ours0.opt, ours1.opt],
        graph_scaler(kind, enabled),
        two_model_build,
    )
    run_graph(g, data, enabled)
    ref_scaler = eager_scaler(enabled)
    ref_scales = eager_two_models(ref0, ref1, data, ref_scaler)
    assert_same_run(
        g,
        ref_scales,
        ref_scaler,
        [(ours0, ref0), (ours1, ref1)],
        enabled=enabled,
        clean=3,
        skipped=1,
    )


# -- test_grad_scaling_update_scale and test_grad_scale_will_not_overflow ------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_update_scale(kind):
    """torch's sequence for _amp_update_scale_ (growth 2, backoff 0.25, interval 2, from 4): two
    clean steps grow once, an overflow backs off; the graph's scale and growth tracker follow
    the op applied to the same overflow flags, step by step."""
    settings = {
        "init_scale": 4.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.25,
        "growth_interval": 2,
    }
    scaler = (
        torch.amp.GradScaler("cpu", **settings)
        if kind == "torch_scaler"
        else graphamp.GradScaler(**settings)
    )
    ours, _ = twin_runs()
    g = make_graph({"model": ours.model}, [ours.opt], scaler, mse_build)
    seen = []
    for (x, y), poison in zip(batches(3), poisons(True, 3)):
        g(x, y, poison)
        state = g.grad_scaler.state_dict()
        seen.append((state["scale"], state["_growth_tracker"]))
    scale = torch.full((1,), 4.0)
    tracker = torch.zeros((1,), dtype=torch.int32)
    expected = []
    for found in (0.0, 0.0, 1.0):
        torch._amp_update_scale_(scale, tracker, torch.full((1,), found), 2.0, 0.25, 2)
        expected.append((scale.item(), int(tracker.item())))
    assert seen == expected == [(4.0, 1), (8.0, 0), (2.0, 0)]  # the last: torch's assertions


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scale_will_not_overflow(kind):
    """From 1e38 with growth 16 every step, the grown scale would be inf: it must stay finite,
    as torch's does."""
    settings = {"init_scale": 1e38, "growth_factor": 2.0**4, "growth_interval": 1}
    if kind == "torch_scaler":
        scaler = torch.amp.GradScaler("cpu", **settings)
    else:  # graphamp's default cap (2**24) refuses an init_scale of 1e38: lift it
        scaler = graphamp.GradScaler(**settings, max_scale=math.inf)
    model = nn.Linear(5, 1)
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.Adam(model.parameters()), torch.optim.Adam(ref.parameters())
    x, y = torch.randn(1, 5), 1e-30 * torch.randn(1, 1)

    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    g = make_graph({"model": model}, [opt], scaler, build)
    g(x, y)
    ref_scaler = torch.amp.GradScaler("cpu", **settings)
    ref_scaler.scale(((ref(x) - y) ** 2).mean()).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    assert math.isfinite(g.grad_scaler.get_scale())
    assert g.grad_scaler.get_scale() == ref_scaler.get_scale()
    assert g.history.fetch()["skipped"] == [float(ref_opt.state_dict()["state"] == {})]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# -- test_grad_scaling_unscale_sparse: sparse gradients through the scaler ----------------------


def sparse_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(16, 8, sparse=True), nn.Linear(8, 8))


def sparse_batches(n=4):
    return [(torch.randint(0, 16, (8,)), torch.randn(8, 8)) for _ in range(n)]


def nan_in_sparse_grad(weight: nn.Parameter) -> None:
    grad = weight.grad.coalesce()
    values = grad.values().clone()
    values[0, 0] = float("nan")
    weight.grad = torch.sparse_coo_tensor(grad.indices(), values, grad.shape, check_invariants=True)


def eager_sparse(run: Run, data, scaler, target):
    scales = []
    for i, (idx, y) in enumerate(data):
        scales.append(scaler.get_scale())
        run.opt.zero_grad()
        scaler.scale(F.mse_loss(run.model(idx), y)).backward()
        assert run.model[0].weight.grad.is_sparse
        if target == "embedding_nan" and i == SKIP_ITER and scaler.is_enabled():
            nan_in_sparse_grad(run.model[0].weight)
        elif target == "linear_inf":
            poison_grad(run.model, i, scaler)
        scaler.step(run.opt)
        scaler.update()
    return scales


@pytest.mark.parametrize(
    "kind, enabled, target",
    [
        ("graphamp_scaler", True, "linear_inf"),
        ("torch_scaler", True, "embedding_nan"),
        ("graphamp_scaler", False, "linear_inf"),
        ("torch_scaler", False, "linear_inf"),
    ],
)
def test_grad_scaling_sparse(kind, enabled, target):
    """An Embedding with sparse gradients: a nan in its sparse gradient (torch's unscale_sparse
    case) or an inf elsewhere skips the step; otherwise the update equals eager SGD's on the
    sparse gradient (graphamp densifies it inside the step)."""
    ours, ref = twin_runs(make_model=sparse_model)
    data = sparse_batches()
    layer = 0 if target == "embedding_nan" else 1

    def build(self, idx, y, poison):
        value = float("nan") if target == "embedding_nan" else INF
        loss = (
            F.mse_loss(self.model(idx), y)
            + (self.model[layer].weight * torch.where(poison > 0, value, 0.0)).sum()
        )
        loss.backward()
        return loss

    g = make_graph({"model": ours.model}, [ours.opt], graph_scaler(kind, enabled), build)
    run_graph(g, data, enabled)
    ref_scaler = eager_scaler(enabled)
    ref_scales = eager_sparse(ref, data, ref_scaler, target)
    assert_same_run(g, ref_scales, ref_scaler, [(ours, ref)], enabled=enabled, clean=3, skipped=1)


# -- test_grad_scaling_state_dict, both ways, before and during use (+ torch's pickling) ---------

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def torch_part(state: dict) -> dict:
    return {k: state[k] for k in TORCH_KEYS}


def test_grad_scaling_state_dict_before_first_use():
    """torch's test: a state saved by one scaler loads into another with other settings (and
    an _init_growth_tracker the load must overwrite); here torch → graphamp → torch."""
    theirs = torch.amp.GradScaler(
        "cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2
    )
    ours = graphamp.GradScaler(
        init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1
    )
    ours.load_state_dict(theirs.state_dict())
    assert torch_part(ours.state_dict()) == theirs.state_dict()
    back = torch.amp.GradScaler(
        "cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1
    )
    back._init_growth_tracker = 7
    back.load_state_dict(ours.state_dict())
    assert (
        back.get_scale(),
        back.get_growth_factor(),
        back.get_backoff_factor(),
        back.get_growth_interval(),
        back._init_growth_tracker,
    ) == (3.0, 4.0, 0.5, 2, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_grad_scaling_state_dict_during_use(kind):
    """Mid-run the scaler's state goes out to a torch scaler (and survives pickling, as torch's
    autocast test checks), and a state with a new schedule comes in through the object the user
    holds (for a taken-over torch scaler: that torch scaler); both runs go on identically."""
    ours, ref = twin_runs()
    data = batches()
    scaler = graph_scaler(kind, True)
    g = make_graph({"model": ours.model}, [ours.opt], scaler, mse_build)
    ref_scaler = eager_scaler(True)
    run_graph(g, data[:2], True)
    ref_scales = eager_autocast(ref, data[:2], ref_scaler, None)

    for state in (scaler.state_dict(), pickle.loads(pickle.dumps(scaler)).state_dict()):
        assert torch_part(state) == ref_scaler.state_dict()
    out = torch.amp.GradScaler("cpu")
    out.load_state_dict(scaler.state_dict())
    assert out.state_dict() == ref_scaler.state_dict()

    schedule = {
        **ref_scaler.state_dict(),
        "scale": 64.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "_growth_tracker": 0,
    }
    scaler.load_state_dict(schedule)
    ref_scaler.load_state_dict(schedule)
    for i, ((x, y), poison) in enumerate(zip(data, poisons(True)), 0):
        if i >= 2:
            g(x, y, poison)
    ref_scales += eager_autocast(ref, data[2:], ref_scaler, None, start=2)
    assert ref_scales == [128.0, 256.0, 64.0, 16.0]  # the new schedule took effect
    assert g.history.fetch()["scale"] == ref_scales
    assert torch_part(scaler.state_dict()) == ref_scaler.state_dict()
    for p, q in zip(ours.model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=1e-5)


# -- what a whole-step graph cannot express: refused with a graphamp error ----------------------


def test_unscale_by_hand_inside_build_is_refused():
    """test_grad_scaling_clipping_separate_unscale, written literally inside build(): the
    scaler's calls belong to set_grad_scaler, and clipping to add_optimizer."""
    ours, _ = twin_runs()
    theirs = torch.amp.GradScaler("cpu")

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        theirs.scale(loss).backward()
        theirs.unscale_(ours.opt)
        return loss

    g = make_graph({"model": ours.model}, [ours.opt], None, build)
    with pytest.raises(CaptureError, match="set_grad_scaler"):
        g(*batches(1)[0])


def test_gradients_made_inf_by_build_skip_the_step():
    """test_params_invalidated_with_grads_invalidated_between_unscale_and_step: build() edits
    .grad after the unscale (graphamp unscales before the user's gradient code sees .grad).
    torch's scaler checks before that edit, steps on inf gradients and leaves inf/NaN
    parameters (what torch's test asserts); graphamp checks the gradients the optimizer
    gets, after the edit, so the step is skipped and the parameters stay as they were."""
    ours, _ = twin_runs(opt_ctor=torch.optim.Adam)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        for p in self.model.parameters():
            p.grad.copy_(torch.full_like(p, INF))
        return loss

    scaler = graph_scaler("torch_scaler", True)
    g = make_graph({"model": ours.model}, [ours.opt], scaler, build)
    before = [p.detach().clone() for p in ours.model.parameters()]
    g(*batches(1)[0])
    for old, p in zip(before, ours.model.parameters()):
        assert torch.equal(old, p)
    assert scaler.get_scale() == INIT_SCALE * 0.5


def test_an_optimizer_that_takes_the_scaler_itself_is_refused():
    """test_grad_scaler_pass_itself: optimizers with _step_supports_amp_scaling get the scaler
    in step() and unscale and skip there; graphamp's step does both itself."""

    class TakesScaler(torch.optim.Optimizer):
        _step_supports_amp_scaling = True

        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None, *, grad_scaler=None):
            pass

    model = two_linears()

    class G(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(TakesScaler(model.parameters()))

    with pytest.raises(UnsupportedOptimizerError, match="takes the grad scaler"):
        G()
