"""Every module in torch's own module database (``module_db`` in
``torch.testing._internal.common_modules``) that has parameters trains through a Graph as it
does eagerly: its sample constructor and forward inputs, the sum of its floating outputs as
the loss, two SGD steps, losses and parameters against the same module trained eagerly.

fp32 (the default lane: each module's first sample): within float32 rounding. bf16 (the slow
lane): graphamp decides precision over the whole graph and autocast op by op, so the two
differ by design (graphamp keeps ops fp32 where autocast's CPU list does, runs a composite
such as ``bilinear`` or ``lstm_cell`` through the low-precision products it is made of); the
oracle is fp32 eager: graphamp's parameters are no further from it than twice autocast's.
Lazy modules are run once eagerly first, as the refusal of a lazy module not yet run advises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import import_torch_testing

import graphamp
from graphamp import CaptureError

try:
    common_modules = import_torch_testing("common_modules")
except ModuleNotFoundError as e:  # expecttest, a test extra, missing
    pytest.skip(f"torch's module database does not import: {e}", allow_module_level=True)


def _leaves(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _leaves(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _leaves(o)]
    return []


def _loss(out) -> torch.Tensor:
    floats = [t for t in _leaves(out) if t.is_floating_point() or t.is_complex()]
    return sum((t.real if t.is_complex() else t).float().sum() for t in floats)


def _cases():
    """(module info, sample index) for every module with parameters, first samples in the
    default lane."""
    out = []
    for info in common_modules.module_db:
        samples = info.module_inputs_func(
            info, device="cpu", dtype=torch.float32, requires_grad=True, training=True
        )
        for k, sample in enumerate(samples[:2]):
            c = sample.constructor_input
            if not list(info.module_cls(*c.args, **c.kwargs).parameters()):
                continue
            marks = () if k == 0 else (pytest.mark.slow,)
            out.append(pytest.param(info, k, id=f"{info.name}-{k}", marks=marks))
    return out


def _setup(info, k):
    """(module, its eager twin, forward args, forward kwargs), lazy modules made."""
    sample = info.module_inputs_func(
        info, device="cpu", dtype=torch.float32, requires_grad=True, training=True
    )[k]
    torch.manual_seed(0)
    c, f = sample.constructor_input, sample.forward_input
    module = info.module_cls(*c.args, **c.kwargs)
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in f.args]
    kwargs = {n: v.detach() if isinstance(v, torch.Tensor) else v for n, v in f.kwargs.items()}
    if any(torch.nn.parameter.is_lazy(p) for p in module.parameters()):
        with torch.no_grad():
            module(*args, **kwargs)
    return module, copy.deepcopy(module), args, kwargs


def _train(module, args, kwargs, amp: torch.dtype | None, graph: bool) -> list[float]:
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    if graph:

        class ModuleGraph(graphamp.Graph):
            def __init__(self):
                super().__init__()
                self.model = module
                self.add_optimizer(opt)
                self.config.set_backend("aot_eager")
                if amp is not None:
                    self.config.enable_amp(True, dtype=amp)

            def build(self, *batch):
                loss = _loss(self.model(*batch, **kwargs))
                loss.backward()
                return loss

        g = ModuleGraph()
        return [float(g(*args)) for _ in range(2)]
    losses = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = _loss(module(*args, **kwargs))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _distance(a, b) -> float:
    return max(
        ((p - q).abs().max() / (q.abs().max() + 1e-6)).item()
        for p, q in zip(a.parameters(), b.parameters())
    )


def _momentum_none(module) -> bool:
    norms = (torch.nn.modules.batchnorm._BatchNorm,)
    return any(isinstance(m, norms) and m.momentum is None for m in module.modules())


@pytest.mark.parametrize("info, k", _cases())
def test_torchs_modules_train_as_eager_in_fp32(info, k):
    module, twin, args, kwargs = _setup(info, k)
    if _momentum_none(module):  # its cumulative average reads a count on the host
        with pytest.raises(CaptureError, match="give it a momentum"):
            _train(module, args, kwargs, None, graph=True)
        return
    ours = _train(module, args, kwargs, None, graph=True)
    theirs = _train(twin, args, kwargs, None, graph=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert _distance(module, twin) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("info, k", _cases())
def test_torchs_modules_train_in_bf16_as_close_to_fp32_as_autocast(info, k):
    module, autocast_twin, args, kwargs = _setup(info, k)
    if _momentum_none(module):
        pytest.skip("refused by name: tests/test_error_catalogue.py")
    fp32_twin = copy.deepcopy(autocast_twin)
    _train(module, args, kwargs, torch.bfloat16, graph=True)
    _train(autocast_twin, args, kwargs, torch.bfloat16, graph=False)
    _train(fp32_twin, args, kwargs, None, graph=False)
    assert _distance(module, fp32_twin) <= 2 * _distance(autocast_twin, fp32_twin) + 1e-3
