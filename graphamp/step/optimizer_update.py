"""The optimizer update, traced into the step: torch's SGD and Adam/AdamW on values.

The math follows torch's single-tensor implementations (``torch/optim/sgd.py``, ``adam.py``) in
their capturable form: the learning rate and the other float hyperparameters are graph inputs
(0-dim fp32 tensors), so a scheduler changing them never recompiles, and the bias corrections use
the step tensor on the device, so nothing syncs with the host. Every write is masked by the
overflow flag: a skipped step leaves parameters and state bitwise unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import CaptureError
from ..optimizers import GroupPlan, OptimizerPlan


@dataclass
class GroupTensors:
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]]
    hyper: dict[str, torch.Tensor]


def sgd_update(t: GroupTensors, flags: dict, first_step: torch.Tensor | None):
    """torch.optim.SGD's update. Returns (new params, new state)."""
    lr = t.hyper["lr"]
    new_params, new_bufs = [], []
    for i, (p, g) in enumerate(zip(t.params, t.grads)):
        if flags["maximize"]:
            g = -g
        if flags["weight_decay"]:
            g = g + t.hyper["weight_decay"] * p
        if flags["momentum"]:
            buf = t.state["momentum_buffer"][i]
            momentum = t.hyper["momentum"]
            new_buf = momentum * buf + (1 - t.hyper["dampening"]) * g
            if flags["dampening"] and first_step is not None:
                # torch starts the buffer as a copy of the first gradient (no dampening)
                new_buf = torch.where(first_step, g, new_buf)
            new_bufs.append(new_buf)
            g = g + momentum * new_buf if flags["nesterov"] else new_buf
        new_params.append(p - lr * g)
    state = {"momentum_buffer": new_bufs} if flags["momentum"] else {}
    return new_params, state


def adam_update(t: GroupTensors, flags: dict):
    """torch.optim.Adam / AdamW's update (capturable form). Returns (new params, new state)."""
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
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2.sqrt()
        if flags["amsgrad"]:
            max_sq = torch.maximum(t.state["max_exp_avg_sq"][i], exp_avg_sq)
            out["max_exp_avg_sq"].append(max_sq)
            denom = max_sq.sqrt() / bias_correction2_sqrt + eps
        else:
            denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
        new_params.append(p - step_size * exp_avg / denom)
        out["step"].append(step)
        out["exp_avg"].append(exp_avg)
        out["exp_avg_sq"].append(exp_avg_sq)
    return new_params, out


def apply_update(plan: OptimizerPlan, group: GroupPlan, tensors: GroupTensors,
                 first_step: torch.Tensor | None):
    flags = dict(group.flags)
    if plan.kind == "sgd":
        return sgd_update(tensors, flags, first_step)
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
            "parameters")
    return [g.to_dense() if g.is_sparse else g for g in grads]


def masked(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where the step is skipped (no mask without a scaler)."""
    return new if skip is None else torch.where(skip, old, new)


def update_optimizer(opt: OptimizerPlan, params: list[torch.Tensor], grads: list[torch.Tensor],
                     states: Iterator[torch.Tensor], hypers: Iterator[torch.Tensor],
                     counter: torch.Tensor, skip: torch.Tensor | None) -> None:
    """Trace one optimizer's masked update in place. ``params`` and ``grads`` are this
    optimizer's, in ``opt.forward_positions`` order; its state and hyperparameter tensors are
    taken from the shared iterators (in the layout's order)."""
    first_step = counter == 0
    offset = 0
    for group in opt.groups:
        idx = range(offset, offset + len(group.params))
        offset += len(group.params)
        hyper = {name: next(hypers) for name in opt.hyper_names}
        state = {key: [next(states) for _ in idx] for key in group.state_keys}
        if not idx:
            continue
        tensors = GroupTensors([params[i] for i in idx], [grads[i] for i in idx], state, hyper)
        new_params, new_state = apply_update(opt, group, tensors, first_step)
        for old, new in zip(tensors.params, new_params):
            old.copy_(masked(skip, old, new))
        for key, values in new_state.items():
            for old, new in zip(tensors.state[key], values):
                old.copy_(masked(skip, old, new))
    counter.copy_(masked(skip, counter, counter + 1))
