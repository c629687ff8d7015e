"""The multi-tensor math of torch's SGD and Adam/AdamW on values, and its masked writes.

The math follows torch's single-tensor implementations (``torch/optim/sgd.py``, ``adam.py``) in
their capturable form, op for op, written as multi-tensor ``torch._foreach_*`` ops over a list
of parameters: each op is one node for the whole list, so the graph's size no longer grows with
the parameter count and inductor can fuse the chain and the masks horizontally (combo kernels on
the GPU) instead of emitting one kernel per parameter. Element by element the arithmetic is the
single-tensor one, so results are bitwise those of the per-parameter form, on any subset of a
group's parameters. As there, the learning rate and the other float hyperparameters are 0-dim
fp32 tensors (step inputs: a scheduler changing them never recompiles), and the bias
corrections use the step tensor on the device, so nothing syncs with the host. Every write is
masked by the overflow flag: a skipped step leaves parameters and state bitwise unchanged.

The step traces it inline (``optimizer_update.py``) or, for repeated blocks, as one call of a
kernel compiled once per distinct block (``block_update.py``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._foreach_add, torch._foreach_div, torch._foreach_maximum, torch._foreach_mul,
#   torch._foreach_neg, torch._foreach_pow, torch._foreach_sqrt, torch._foreach_sub
from dataclasses import dataclass

import torch

from ..records.update_paths import PATHS, SGD


@dataclass
class GroupTensors:
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: dict[str, list[torch.Tensor]]
    hyper: dict[str, torch.Tensor]


def sgd_update(t: GroupTensors, flags: dict, fresh: list[torch.Tensor] | None = None):
    """torch.optim.SGD's update on the whole group. Returns (new params, new state).

    ``fresh`` (with dampening): per parameter, True where its momentum buffer has not started
    (``records.update_paths.UpdatePath.starts_from_gradient``)."""
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


def _one_minus(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``1 - v`` for each value: ``-v + 1``, the same IEEE result (a - b is a + (-b))."""
    return torch._foreach_add(torch._foreach_neg(values), 1)


def apply_update(
    kind: str, tensors: GroupTensors, flags: dict, fresh: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """(new params, new state) of the multi-tensor path named ``kind`` on ``tensors``."""
    if PATHS[kind] is SGD:
        return sgd_update(tensors, flags, fresh)
    return adam_update(tensors, flags)


def masked(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``, or ``old`` where the step is skipped (no mask without a scaler)."""
    return new if skip is None else torch.where(skip, old, new)


def write_masked(
    kind: str,
    flags: dict,
    tensors: GroupTensors,
    fresh: list[torch.Tensor] | None,
    skip: torch.Tensor | None,
) -> None:
    """The update of ``tensors`` written into its parameters, state and momentum-start flags in
    place, each write masked by ``skip``."""
    new_params, new_state = apply_update(kind, tensors, flags, fresh)
    for old, new in zip(tensors.params, new_params):
        old.copy_(masked(skip, old, new))
    for key, values in new_state.items():
        for old, new in zip(tensors.state[key], values):
            old.copy_(masked(skip, old, new))
    for flag in fresh or ():  # the buffer has started, unless the step is skipped
        flag.copy_(masked(skip, flag, torch.zeros_like(flag)))
