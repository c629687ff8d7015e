"""The optimizer update, traced into the step: torch's SGD and Adam/AdamW on values.

Each param group's update is the multi-tensor math of ``update_math.py`` (torch's capturable
single-tensor form, op for op), every write masked by the overflow flag. With
``config.set_block_updates``, each outlined block's parameters are updated by one call of a
kernel compiled once per distinct block (``block_update.py``), and the rest inline; either way
the values are the same.

An Adam/AdamW built with ``fused=True`` runs torch's fused kernel instead, as eager does
(``fused_adam_update``, ``torchkit/fused_update.py``): bitwise the eager fused optimizer, and
nothing for the compiler to generate. Any other optimizer's ``step()`` is traced parameter by
parameter (``traced_optimizer.py``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ..errors import CaptureError, UnsupportedOptimizerError
from ..records.optimizers import OptimizerPlan
from ..records.update_paths import SGD
from .block_update import update_repeated_blocks
from .traced_optimizer import traced_update
from .update_math import GroupTensors, masked, write_masked


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


def densify_sparse_grads(opt: OptimizerPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sparse gradients (``nn.Embedding(sparse=True)``) as dense ones, where torch's optimizer
    accepts them: plain SGD with or without momentum, where a dense update with zero rows equals
    eager's sparse one. Adam and weight decay refuse them in eager PyTorch, and here."""
    if not any(g.is_sparse for g in grads):
        return grads
    decays = any(dict(g.flags).get("weight_decay") for g in opt.groups)
    if opt.path is not SGD or decays:
        what = "weight decay" if opt.path is SGD else type(opt.optimizer).__name__
        raise CaptureError(
            f"optimizer {opt.index} ({type(opt.optimizer).__name__}) gets sparse gradients "
            f"(nn.Embedding(sparse=True) or F.embedding(sparse=True)), which {what} does not "
            "support in eager PyTorch either: use sparse=False, or plain SGD for those "
            "parameters"
        )
    return [g.to_dense() if g.is_sparse else g for g in grads]


def update_optimizer(
    opt: OptimizerPlan,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: Iterator[torch.Tensor],
    hypers: Iterator[torch.Tensor],
    counter: torch.Tensor,
    skip: torch.Tensor | None,
    fresh_flags: Iterator[torch.Tensor],
    names: list[str] | None = None,
    repeats: int = 2,
) -> None:
    """Trace one optimizer's masked update in place. ``params`` and ``grads`` are this
    optimizer's, in ``opt.forward_positions`` order; its state, hyperparameter and
    momentum-start tensors are taken from the shared iterators (in the layout's order).
    ``names``: the parameters' qualified names, where blocks repeated at least ``repeats``
    times are updated by one kernel each (``block_update.py``); None: the whole update inline."""
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
        starts = opt.path.starts_from_gradient(dict(group.flags))
        fresh = [next(fresh_flags) for _ in idx] if starts else None
        if not idx:
            continue
        tensors = GroupTensors([params[i] for i in idx], [grads[i] for i in idx], state, hyper)
        if group.fused:
            fused_adam_update(tensors, dict(group.flags), opt.optimizer.param_groups[g], skip)
            continue
        flags = dict(group.flags)
        if names is not None:
            args = (opt.kind, flags, group.state_keys, opt.hyper_names, tensors, fresh, skip)
            inline = update_repeated_blocks(*args, [names[i] for i in idx], repeats)
            tensors, fresh = _subset(tensors, inline), _pick(fresh, inline)
        if tensors.params:
            write_masked(opt.kind, flags, tensors, fresh, skip)
    counter.copy_(masked(skip, counter, counter + 1))


def _subset(t: GroupTensors, keep: list[int]) -> GroupTensors:
    state = {key: [values[j] for j in keep] for key, values in t.state.items()}
    return GroupTensors([t.params[j] for j in keep], [t.grads[j] for j in keep], state, t.hyper)


def _pick(values: list[torch.Tensor] | None, keep: list[int]) -> list[torch.Tensor] | None:
    return None if values is None else [values[j] for j in keep]


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
            value = news.get(key)
            if value is None or value.shape != old.shape or value.dtype != old.dtype:
                raise CaptureError(
                    f"optimizer {opt.index} ({type(opt.optimizer).__name__}): its step left "
                    f"state[{key!r}] {'unset' if value is None else f'as {tuple(value.shape)} {value.dtype}'}"
                    f", where its first step made {tuple(old.shape)} {old.dtype}"
                )
            old.copy_(masked(skip, old, value))
