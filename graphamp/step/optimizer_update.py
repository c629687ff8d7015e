"""The optimizer update, traced into the step: torch's SGD and Adam/AdamW on values.

The math follows torch's single-tensor implementations (``torch/optim/sgd.py``, ``adam.py``) in
their capturable form, op for op, written as multi-tensor ``torch._foreach_*`` ops over each
param group: each op is one node for the whole group, so the graph's size no longer grows with
the parameter count and inductor can fuse the chain and the masks horizontally (combo kernels on
the GPU) instead of emitting one kernel per parameter. Element by element the arithmetic is the single-tensor
one, so results are bitwise those of the per-parameter form. As there, the learning rate and the
other float hyperparameters are graph inputs (0-dim fp32 tensors), so a scheduler changing them
never recompiles, and the bias corrections use the step tensor on the device, so nothing syncs
with the host. Every write is masked by the
overflow flag: a skipped step leaves parameters and state bitwise unchanged. The update stays
one multi-tensor run per group when repeated blocks are outlined: split per block and outlined,
its writes into the state could not fuse with its math (one copy kernel per tensor), which made
the steady step 3-8% slower (issue 40).

An Adam/AdamW built with ``fused=True`` runs torch's fused kernel instead, as eager does
(``fused_adam_update``, ``torchkit/fused_update.py``): bitwise the eager fused optimizer, and
nothing for the compiler to generate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..errors import CaptureError, UnsupportedOptimizerError
from ..records.optimizers import GroupPlan, OptimizerPlan, starts_from_gradient
from .traced_optimizer import traced_update


@dataclass
class GroupTensors:
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]]
    hyper: dict[str, torch.Tensor]


def sgd_update(t: GroupTensors, flags: dict, fresh: list[torch.Tensor] | None = None):
    """torch.optim.SGD's update on the whole group. Returns (new params, new state).

    ``fresh`` (with dampening): per parameter, True where its momentum buffer has not started
    (``records.optimizers.starts_from_gradient``)."""
    lr, grads = t.hyper["lr"], t.grads
    if flags["maximize"]:
        grads = torch._foreach_neg(grads)
    if flags["weight_decay"]:
        grads = torch._foreach_add(grads, torch._foreach_mul(t.params, t.hyper["weight_decay"]))
    state = {}
    if flags["momentum"]:
        momentum = t.hyper["momentum"]
        new_bufs = torch._foreach_add(
            torch._foreach_mul(t.state["momentum_buffer"], momentum),
            torch._foreach_mul(grads, 1 - t.hyper["dampening"]),
        )
        if fresh is not None:
            # torch starts a buffer as a copy of the parameter's first gradient (no dampening)
            new_bufs = [torch.where(f, g, b) for f, g, b in zip(fresh, grads, new_bufs)]
        state["momentum_buffer"] = new_bufs
        grads = (
            torch._foreach_add(grads, torch._foreach_mul(new_bufs, momentum))
            if flags["nesterov"]
            else new_bufs
        )
    return torch._foreach_sub(t.params, torch._foreach_mul(grads, lr)), state


def adam_update(t: GroupTensors, flags: dict):
    """torch.optim.Adam / AdamW's update on the whole group (capturable form). Returns (new
    params, new state). Bias corrections stay per parameter, from each one's own step."""
    lr, beta1, beta2 = t.hyper["lr"], t.hyper["beta1"], t.hyper["beta2"]
    eps, wd = t.hyper["eps"], t.hyper["weight_decay"]
    params, grads, n = t.params, t.grads, len(t.params)
    if flags["maximize"]:
        grads = torch._foreach_neg(grads)
    steps = torch._foreach_add(t.state["step"], 1)
    if flags["weight_decay"]:
        if flags["decoupled"]:
            params = torch._foreach_mul(params, 1 - lr * wd)
        else:
            grads = torch._foreach_add(grads, torch._foreach_mul(params, wd))
    # lerp per tensor: inductor has no lowering for _foreach_lerp with tensor weights (an ATen
    # fallback outside the fused kernels); it decomposes torch.lerp into them
    weight = 1 - beta1
    exp_avg = [m.lerp(g, weight) for m, g in zip(t.state["exp_avg"], grads)]
    exp_avg_sq = torch._foreach_add(
        torch._foreach_mul(t.state["exp_avg_sq"], beta2),
        torch._foreach_mul(torch._foreach_mul(grads, 1 - beta2), grads),
    )
    step_size = torch._foreach_div([lr] * n, _one_minus(torch._foreach_pow([beta1] * n, steps)))
    bias_correction2_sqrt = torch._foreach_sqrt(_one_minus(torch._foreach_pow([beta2] * n, steps)))
    out = {"step": steps, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if flags["amsgrad"]:
        second = out["max_exp_avg_sq"] = torch._foreach_maximum(
            t.state["max_exp_avg_sq"], exp_avg_sq
        )
    # a list of eps: _foreach_add with one tensor reads its value on the host (.item())
    denom = torch._foreach_add(
        torch._foreach_div(torch._foreach_sqrt(second), bias_correction2_sqrt), [eps] * n
    )
    new_params = torch._foreach_sub(
        params, torch._foreach_div(torch._foreach_mul(exp_avg, step_size), denom)
    )
    return new_params, out


def fused_adam_update(t: GroupTensors, flags: dict, options: dict, skip: torch.Tensor | None):
    """Adam/AdamW with ``fused=True``: torch's fused kernel, in place, as the eager optimizer
    runs it (``torchkit.fused_update``). As there, the steps are counted first and a skipped step
    (``found_inf``) leaves parameters, state and steps as they were. ``options``: the group's
    float hyperparameters, which the kernel takes as numbers (baked in, part of the key)."""
    steps = t.state["step"]
    for s in steps:
        s.copy_(masked(skip, s, s + 1))
    beta1, beta2 = (float(b) for b in options["betas"])
    found_inf = None if skip is None else skip.to(torch.float32)
    second = t.state.get("max_exp_avg_sq")
    # one call per device and dtype, as eager groups its tensors for the kernel
    calls: dict[tuple, list[int]] = {}
    for i, p in enumerate(t.params):
        calls.setdefault((p.device, p.dtype), []).append(i)
    for idx in calls.values():
        torch.ops.graphamp.fused_adam_(
            [t.params[i] for i in idx],
            [t.grads[i] for i in idx],
            [t.state["exp_avg"][i] for i in idx],
            [t.state["exp_avg_sq"][i] for i in idx],
            [second[i] for i in idx] if second is not None else [],
            [steps[i] for i in idx],
            t.hyper["lr"],
            beta1,
            beta2,
            float(options["weight_decay"]),
            float(options["eps"]),
            flags["amsgrad"],
            flags["maximize"],
            flags["decoupled"],
            found_inf,
        )


def _one_minus(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``1 - v`` for each value: ``-v + 1``, the same IEEE result (a - b is a + (-b))."""
    return torch._foreach_add(torch._foreach_neg(values), 1)


def apply_update(
    plan: OptimizerPlan, group: GroupPlan, tensors: GroupTensors, fresh: list[torch.Tensor] | None
):
    flags = dict(group.flags)
    if plan.kind == "sgd":
        return sgd_update(tensors, flags, fresh)
    return adam_update(tensors, flags)


def densify_sparse_grads(opt: OptimizerPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sparse gradients (``nn.Embedding(sparse=True)``) as dense ones, where torch's optimizer
    accepts them: plain SGD with or without momentum, where a dense update with zero rows equals
    eager's sparse one. Adam and weight decay refuse them in eager PyTorch, and here."""
    if not any(g.is_sparse for g in grads):
        return grads
    decays = any(dict(g.flags).get("weight_decay") for g in opt.groups)
    if opt.kind != "sgd" or decays:
        what = "weight decay" if opt.kind == "sgd" else type(opt.optimizer).__name__
        raise CaptureError(
            f"optimizer {opt.index} ({type(opt.optimizer).__name__}) gets sparse gradients "
            f"(nn.Embedding(sparse=True) or F.embedding(sparse=True)), which {what} does not "
            "support in eager PyTorch either: use sparse=False, or plain SGD for those "
            "parameters"
        )
    return [g.to_dense() if g.is_sparse else g for g in grads]


def masked(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where the step is skipped (no mask without a scaler)."""
    return new if skip is None else torch.where(skip, old, new)


def update_optimizer(
    opt: OptimizerPlan,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: Iterator[torch.Tensor],
    hypers: Iterator[torch.Tensor],
    counter: torch.Tensor,
    skip: torch.Tensor | None,
    fresh_flags: Iterator[torch.Tensor],
) -> None:
    """Trace one optimizer's masked update in place. ``params`` and ``grads`` are this
    optimizer's, in ``opt.forward_positions`` order; its state, hyperparameter and
    momentum-start tensors are taken from the shared iterators (in the layout's order)."""
    offset = 0
    for g, group in enumerate(opt.groups):
        idx = range(offset, offset + len(group.params))
        offset += len(group.params)
        hyper = {name: next(hypers) for name in opt.hyper_names}
        if group.param_keys is not None:  # a traced optimizer: parameter by parameter
            own = [{key: next(states) for key in keys} for keys in group.param_keys]
            if idx:
                mine = [params[i] for i in idx]
                _traced(opt, g, mine, [grads[i] for i in idx], own, hyper["lr"], skip)
            continue
        state = {key: [next(states) for _ in idx] for key in group.state_keys}
        starts = starts_from_gradient(opt.kind, dict(group.flags))
        fresh = [next(fresh_flags) for _ in idx] if starts else None
        if not idx:
            continue
        tensors = GroupTensors([params[i] for i in idx], [grads[i] for i in idx], state, hyper)
        if group.fused:
            fused_adam_update(tensors, dict(group.flags), opt.optimizer.param_groups[g], skip)
            continue
        new_params, new_state = apply_update(opt, group, tensors, fresh)
        for old, new in zip(tensors.params, new_params):
            old.copy_(masked(skip, old, new))
        for key, values in new_state.items():
            for old, new in zip(tensors.state[key], values):
                old.copy_(masked(skip, old, new))
        for flag in fresh or ():  # the buffer has started, unless the step is skipped
            flag.copy_(masked(skip, flag, torch.zeros_like(flag)))
    counter.copy_(masked(skip, counter, counter + 1))


def _traced(opt, g, params, grads, states, lr, skip) -> None:
    """A traced optimizer's step on one group, masked and written like the others."""
    name = type(opt.optimizer).__name__
    try:
        new_params, new_states = traced_update(opt.optimizer, g, params, grads, states, lr)
    except (GuardOnDataDependentSymNode, DataDependentOutputException) as e:
        raise UnsupportedOptimizerError(
            f"optimizer {opt.index} ({name}): its step() reads the values of its tensors on "
            f"the host ({str(e).splitlines()[0][:120]}), so it cannot be one traced update "
            "inside the step (on a GPU each read would be a sync). Train it eagerly, or use "
            "an optimizer whose step is tensor arithmetic"
        ) from None
    for old, new in zip(params, new_params):
        old.copy_(masked(skip, old, new))
    for olds, news in zip(states, new_states):
        for key, old in olds.items():
            new = news.get(key)
            if new is None or new.shape != old.shape or new.dtype != old.dtype:
                raise CaptureError(
                    f"optimizer {opt.index} ({type(opt.optimizer).__name__}): its step left "
                    f"state[{key!r}] {'unset' if new is None else f'as {tuple(new.shape)} {new.dtype}'}"
                    f", where its first step made {tuple(old.shape)} {old.dtype}"
                )
            old.copy_(masked(skip, old, new))
