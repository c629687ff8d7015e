"""The optimizer tail is multi-tensor work (one node per op for a whole param group)."""

from __future__ import annotations

import models
import pytest
import torch
import torch.nn as nn
from helpers import make_graph

import graphamp


def _mlp(layers: int) -> nn.Module:
    return models.mlp(*[16] * (layers + 1), act_last=True)


def _optimizer_ops(make_opt, layers: int) -> dict[str, int]:
    """Per op name, how many nodes the optimizer subgraph of an fp16 step has (repeated
    blocks inlined: outlined, each equal block's update is one shared subgraph instead,
    tests/test_outline.py)."""
    model = _mlp(layers)
    g = make_graph(
        model,
        nn.functional.mse_loss,
        make_opt(model),
        backend="eager",
        amp=torch.float16,
        scaler=graphamp.GradScaler(),
        configure=lambda g: g.config.set_outline_blocks(False),
    )
    g(torch.randn(4, 16), torch.randn(4, 16))
    counts: dict[str, int] = {}
    for node in g.compiled_steps[-1].step_graph.graph.nodes:
        if node.meta.get("graphamp_subgraph") == "optimizer" and node.op == "call_function":
            name = str(getattr(node.target, "overloadpacket", node.target))
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4
        ),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, amsgrad=True),
    ],
    ids=["sgd", "adamw"],
)
def test_update_math_is_one_foreach_node_per_op_whatever_the_parameter_count(make_opt):
    small, large = _optimizer_ops(make_opt, 2), _optimizer_ops(make_opt, 4)
    foreach = {k: v for k, v in small.items() if "_foreach_" in k}
    assert foreach, small
    assert foreach == {k: v for k, v in large.items() if "_foreach_" in k}


# -- bitwise equality with the per-parameter form ------------------------------------------------
# The reference below is the per-parameter update graphamp traced before the multi-tensor form
# (torch's single-tensor math, capturable): the multi-tensor form must give the same bits.


def _sgd_per_param(t, flags, fresh):
    lr = t.hyper["lr"]
    new_params, new_bufs = [], []
    for i, (p, g) in enumerate(zip(t.params, t.grads)):
        if flags["maximize"]:
            g = -g
        if flags["weight_decay"]:
            g = g + t.hyper["weight_decay"] * p
        if flags["momentum"]:
            momentum = t.hyper["momentum"]
            buf = momentum * t.state["momentum_buffer"][i] + (1 - t.hyper["dampening"]) * g
            if fresh is not None:
                buf = torch.where(fresh[i], g, buf)
            new_bufs.append(buf)
            g = g + momentum * buf if flags["nesterov"] else buf
        new_params.append(p - lr * g)
    return new_params, ({"momentum_buffer": new_bufs} if flags["momentum"] else {})


def _adam_per_param(t, flags):
    lr, beta1, beta2 = t.hyper["lr"], t.hyper["beta1"], t.hyper["beta2"]
    eps, wd = t.hyper["eps"], t.hyper["weight_decay"]
    out = {k: [] for k in t.state}
    new_params = []
    for i, (p, g) in enumerate(zip(t.params, t.grads)):
        if flags["maximize"]:
            g = -g
        step = t.state["step"][i] + 1
        if flags["weight_decay"]:
            if flags["decoupled"]:
                p = p * (1 - lr * wd)
            else:
                g = g + wd * p
        exp_avg = t.state["exp_avg"][i].lerp(g, 1 - beta1)
        exp_avg_sq = t.state["exp_avg_sq"][i] * beta2 + (1 - beta2) * g * g
        step_size = lr / (1 - torch.pow(beta1, step))
        bc2_sqrt = (1 - torch.pow(beta2, step)).sqrt()
        second = exp_avg_sq
        if flags["amsgrad"]:
            second = torch.maximum(t.state["max_exp_avg_sq"][i], exp_avg_sq)
            out["max_exp_avg_sq"].append(second)
        denom = second.sqrt() / bc2_sqrt + eps
        new_params.append(p - step_size * exp_avg / denom)
        out["step"].append(step)
        out["exp_avg"].append(exp_avg)
        out["exp_avg_sq"].append(exp_avg_sq)
    return new_params, out


def _group(kind: str, amsgrad: bool, gen: torch.Generator):
    from graphamp.step.update_math import GroupTensors

    shapes = [(7, 5), (5,), (3, 4, 2), ()]
    rand = lambda s, scale=1.0: torch.randn(s, generator=gen) * scale  # noqa: E731
    params, grads = [rand(s) for s in shapes], [rand(s, 1e-2) for s in shapes]
    if kind == "sgd":
        state = {"momentum_buffer": [rand(s, 1e-2) for s in shapes]}
        hyper = {"lr": 0.1, "momentum": 0.9, "dampening": 0.3, "weight_decay": 1e-2}
    else:
        state = {
            "step": [torch.tensor(float(i + 1)) for i in range(len(shapes))],
            "exp_avg": [rand(s, 1e-2) for s in shapes],
            "exp_avg_sq": [rand(s, 1e-3).abs() for s in shapes],
        }
        if amsgrad:
            state["max_exp_avg_sq"] = [rand(s, 1e-3).abs() for s in shapes]
        hyper = {"lr": 3e-3, "beta1": 0.85, "beta2": 0.997, "eps": 1e-7, "weight_decay": 0.05}
    hyper = {k: torch.tensor(v, dtype=torch.float32) for k, v in hyper.items()}
    return GroupTensors(params, grads, state, hyper)


@pytest.mark.parametrize(
    "flags",
    [
        dict(maximize=False, weight_decay=False, momentum=False, dampening=False, nesterov=False),
        dict(maximize=True, weight_decay=True, momentum=True, dampening=True, nesterov=False),
        dict(maximize=False, weight_decay=True, momentum=True, dampening=False, nesterov=True),
    ],
)
@pytest.mark.parametrize("fresh", [None, (True, False, True, False)])
def test_sgd_multi_tensor_is_bitwise_the_per_parameter_update(flags, fresh):
    from graphamp.step.update_math import sgd_update

    t = _group("sgd", False, torch.Generator().manual_seed(1))
    fresh = [torch.tensor(f) for f in fresh] if fresh and flags["dampening"] else None
    got, ref = sgd_update(t, flags, fresh), _sgd_per_param(t, flags, fresh)
    _assert_bitwise(got, ref)


@pytest.mark.parametrize(
    "flags",
    [
        dict(maximize=False, weight_decay=False, decoupled=False, amsgrad=False),
        dict(maximize=True, weight_decay=True, decoupled=False, amsgrad=True),
        dict(maximize=False, weight_decay=True, decoupled=True, amsgrad=False),
    ],
)
def test_adam_multi_tensor_is_bitwise_the_per_parameter_update(flags):
    from graphamp.step.update_math import adam_update

    t = _group("adam", flags["amsgrad"], torch.Generator().manual_seed(2))
    _assert_bitwise(adam_update(t, flags), _adam_per_param(t, flags))


def _assert_bitwise(got, ref):
    (got_p, got_s), (ref_p, ref_s) = got, ref
    assert len(got_p) == len(ref_p) and set(got_s) == set(ref_s)
    for a, b in zip(got_p, ref_p):
        assert torch.equal(a, b), (a - b).abs().max()
    for key in ref_s:
        assert len(got_s[key]) == len(ref_s[key])
        for a, b in zip(got_s[key], ref_s[key]):
            assert torch.equal(a, b), (key, (a - b).abs().max())


def _train_state(per_param: bool, backend: str, monkeypatch) -> list[torch.Tensor]:
    """Five fp16 steps (clipping, a grad scaler, one overflow) of an MLP with AdamW and
    SGD-momentum param groups; every parameter and optimizer state tensor afterwards."""
    import graphamp.step.update_math as um

    if per_param:
        monkeypatch.setattr(
            um,
            "apply_update",
            lambda kind, t, flags, first: (
                _sgd_per_param(t, flags, first) if kind == "sgd" else _adam_per_param(t, flags)
            ),
        )
    torch.manual_seed(0)
    model = _mlp(3)
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "amsgrad": True}],
        lr=1e-2,
        weight_decay=0.1,
    )
    g = make_graph(
        model,
        nn.functional.mse_loss,
        opt,
        backend=backend,
        amp=torch.float16,
        scaler=graphamp.GradScaler(init_scale=2.0**8),
        clip=1.0,
    )
    gen = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(8, 16, generator=gen)
        if step == 2:
            x[0, 0] = float("inf")
        g(x, torch.randn(8, 16, generator=gen))
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values()]
    return tensors


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_training_is_bitwise_the_per_parameter_update(backend, monkeypatch):
    ref = _train_state(True, backend, monkeypatch)
    monkeypatch.undo()
    got = _train_state(False, backend, monkeypatch)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), (a - b).abs().max()
