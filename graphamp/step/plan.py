"""Stage 3, plan: what the training step does, decided on the host before it is traced.

Which parameters each optimizer updates (and which get no gradient), which optimizer state and
hyperparameters the step reads, which parameters the AMP forward reads in low precision, and the
layout of the step's inputs (spec.StepLayout).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..errors import CaptureError, UnsupportedOptimizerError
from ..records.layouts import PassState
from ..records.optimizers import GroupPlan, OptimizerPlan
from ..records.spec import CapturedForward, GraphSpec, StepLayout, StepPlan
from ..records.update_paths import checked_path
from ..torchkit.fxutil import warn_at_user_line
from .components import (
    Planning,
    check_optimizer_for_components,
    component_inputs,
    component_plan_fields,
)
from .traced_optimizer import initial_state_by_eager_step


def build_plan(
    spec: GraphSpec,
    captured: CapturedForward,
    forward: fx.GraphModule,
    param_ids: list[int],
    hoisted: list[tuple[str, torch.dtype]],
    pass_state: list[PassState],
    process_group=None,
    shard_group=None,
    regions: frozenset[str] = frozenset(),
) -> StepPlan:
    """The StepPlan for ``captured`` (``forward``: the graph after the AMP passes).

    ``param_ids`` are ``id()`` of the forward's parameters in placeholder order (to find each
    optimizer's parameters among them); ``hoisted``: the parameter placeholders the AMP passes
    read in low precision, by name, with the dtype (``AmpContext.hoisted``); ``pass_state``: the
    state inputs the AMP passes gave the forward (``AmpContext.pass_state``).
    ``process_group``: data parallel's group;
    ``shard_group``: the group the parameters are shards over (any graph that reads them, a
    training one or an eval one, gathers them: the plan is a sharded one); ``regions``:
    the modules activation checkpointing recomputes."""
    layout = captured.layout.with_param_copies(len(hoisted)).with_pass_state(len(pass_state))
    params = layout.split([n for n in forward.graph.nodes if n.op == "placeholder"]).params
    index = {node.name: i for i, node in enumerate(params)}
    param_casts = [(index[name], dtype) for name, dtype in hoisted]
    direct_use = {i for i, node in enumerate(params) if node.users}
    _check_losses(spec, captured)
    plans = _optimizer_plans(spec, captured, {pid: i for i, pid in enumerate(param_ids)})
    trainable = [i for opt in plans for i in opt.forward_positions]
    if spec.training and not trainable:
        raise CaptureError(
            f"{spec.name}: no parameter of the optimizers requires grad and "
            "reaches a loss; there is nothing to train"
        )
    scaler = spec.scaler if spec.training else None
    _warn_about_scaler_dtype(spec, scaler)
    planning = Planning(
        spec, captured, forward, plans, trainable, param_casts, process_group, shard_group, regions
    )
    fields = {
        "process_group": process_group if spec.training else None,
        **component_plan_fields(planning),  # a sharding component may name another group
    }
    plan = StepPlan(
        captured=captured,
        training=spec.training,
        trainable=trainable,
        optimizers=plans,
        scaler=scaler,
        layout=StepLayout({}),  # named below, once the plan says which components it uses
        param_casts=param_casts,
        direct_use=direct_use,
        pass_state=list(pass_state),
        **fields,
    )
    return dataclasses.replace(plan, layout=_layout(plan))


def _check_losses(spec: GraphSpec, captured: CapturedForward) -> None:
    # gradients build() assigned to .grad itself (from torch.autograd.grad) are stepped as
    # backward()'s are: such a build() needs no backward()
    assigned = bool(captured.gradient_code.grad_params)
    if spec.training and captured.num_losses == 0 and not assigned:
        raise CaptureError(
            f"{spec.name}.build() never calls backward() nor sets any parameter's .grad, but an "
            "optimizer is added: call loss.backward() in build(), or assign the gradients "
            "torch.autograd.grad computed to .grad (or remove add_optimizer for an eval graph)"
        )
    if not spec.training and captured.num_losses:
        where = captured.loss_frames[0]
        raise CaptureError(
            f"{spec.name}.build() calls backward(){' at ' + str(where) if where else ''} but no "
            "optimizer is added: call self.add_optimizer(optimizer) in __init__"
        )


def _check_closure_optimizer(spec: GraphSpec, captured: CapturedForward, opt) -> None:
    """An optimizer whose step() takes a closure (LBFGS) has the compiled step run again for
    each evaluation of the loss (``runner/closure.py``): nothing else in the step may happen
    once per call only, and the closure returns build()'s loss."""
    name = f"{spec.name}: {type(opt).__name__}.step(closure) evaluates the loss again"
    if len(spec.optimizers) > 1:
        raise UnsupportedOptimizerError(
            f"{name} by running the step again, which would update the other optimizers "
            "again: give it a Graph of its own"
        )
    if spec.scaler is not None:
        raise UnsupportedOptimizerError(
            f"{name}, but a grad scaler decides once per step whether to skip it (torch's "
            "GradScaler refuses closures too): train it in bf16 or fp32, without a grad scaler"
        )
    if spec.config.grad_acc_steps > 1:
        raise UnsupportedOptimizerError(
            f"{name} on the whole batch; with gradient accumulation each evaluation would be "
            "one micro-batch's: set_gradient_accumulation_steps(1)"
        )
    if captured.num_user_outputs - captured.num_written != 1 or not captured.output_spec.is_leaf():
        raise UnsupportedOptimizerError(
            f"{name} and reads it from what the closure returns, which is what build() "
            "returns: return the loss alone (one tensor)"
        )


def _optimizer_plans(
    spec: GraphSpec, captured: CapturedForward, position: dict[int, int]
) -> list[OptimizerPlan]:
    owner: dict[int, int] = {}
    plans = []
    for k, slot in enumerate(spec.optimizers):
        opt = slot.optimizer
        path = checked_path(opt, slot.eager)
        if path.given_closure:
            _check_closure_optimizer(spec, captured, opt)
        # the components' refusals before the eager step below: nothing is run for nothing
        check_optimizer_for_components(spec, opt, path)
        groups, updated = [], []
        for g, group in enumerate(opt.param_groups):
            positions, mine = [], []
            for p in group["params"]:
                i = _forward_position(spec, captured, position, owner, k, opt, p)
                if p.requires_grad and i not in captured.unused_params:
                    positions.append(i)
                    mine.append(p)
            updated += mine
            flags = path.flags(opt, group)
            plan = GroupPlan(positions, flags, path.state_keys(dict(flags)))
            if path.traced:  # its state, found by one eager step on copies
                plan.initial = initial_state_by_eager_step(opt, g, mine)
                plan.param_keys = [tuple(first) for first in plan.initial]
            groups.append(plan)
        plans.append(
            OptimizerPlan(
                index=k,
                optimizer=opt,
                kind=path.name,
                groups=groups,
                clip_max_norm=slot.clip_max_norm,
                clip_norm_type=slot.clip_norm_type,
                params=updated,
            )
        )
    return plans


def _forward_position(spec, captured, position, owner, k, opt, p) -> int:
    """Where optimizer ``k``'s parameter ``p`` sits among the forward's parameters."""
    if id(p) not in position:
        raise CaptureError(
            f"{spec.name}: optimizer {k} ({type(opt).__name__}) holds a parameter of shape "
            f"{tuple(p.shape)} that belongs to no module registered on the graph. Register its "
            "module as an attribute in __init__ (self.model = model), or build the optimizer "
            "from that module's parameters"
        )
    i = position[id(p)]
    if i in owner and owner[i] != k:
        raise CaptureError(
            f"{spec.name}: parameter {captured.param_names[i]!r} is in optimizers {owner[i]} "
            f"and {k}; give each parameter to one optimizer"
        )
    owner[i] = k
    return i


def _layout(plan: StepPlan) -> StepLayout:
    """Placeholder names of the step's inputs, group by group (``STEP_INPUT_GROUPS``): the
    state of the forward, the optimizers and the components (``components.component_inputs``),
    then the batch."""
    cap, state, hyper, fresh = plan.captured, [], [], []
    for opt in plan.optimizers:
        name_of = dict(
            zip(map(id, opt.params), (cap.param_names[i] for i in opt.forward_positions))
        )
        state += [f"opt{opt.index}_{key}_{name_of[id(p)]}" for p, key in opt.state_slots()]
        fresh += [f"opt{opt.index}_momentum_fresh_{name_of[id(p)]}" for p in opt.fresh_params()]
        for g in range(len(opt.groups)):
            hyper += [f"opt{opt.index}_group{g}_{h}" for h in opt.hyper_names]
    return StepLayout(
        {
            "params": [f"p_{n}" for n in cap.param_names],
            "buffers": [f"b_{n}" for n in cap.buffer_names],
            "opt_state": state,
            "hyper": hyper,
            "counters": [f"opt{opt.index}_applied_steps" for opt in plan.optimizers],
            "momentum_fresh": fresh,
            "pass_state": [entry.name for entry in plan.pass_state],
            **component_inputs(plan),
            "constants": [f"c_{n}" for n in cap.constant_names],
            "inputs": [f"in_{n}" for n in cap.input_names],
        }
    )


def _warn_about_scaler_dtype(spec: GraphSpec, scaler) -> None:
    config = spec.config
    if (
        scaler is not None
        and scaler.enabled
        and (not config.amp_active or config.amp_dtype == torch.bfloat16)
    ):
        what = "bf16" if config.amp_active else "fp32"
        warn_at_user_line(
            f"{spec.name}: a grad scaler is set for a {what} step, where gradients do not "
            "underflow as in fp16; loss scaling is unnecessary (it still works and still skips "
            "non-finite steps)"
        )
    if spec.training and scaler is None and config.amp_active and config.amp_dtype == torch.float16:
        warn_at_user_line(
            f"{spec.name}: fp16 AMP without a grad scaler: small gradients underflow to zero "
            "in fp16. Add self.set_grad_scaler(graphamp.GradScaler()) or use bf16"
        )
