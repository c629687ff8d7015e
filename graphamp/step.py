"""Step assembly: the AMP-rewritten forward, traced again inside one functional training step.

    forward → loss × scale → grads (vjp) → unscale + found_inf → clip → optimizer update masked
    by found_inf → BatchNorm statistics masked → scale update → history row

The whole step becomes one FX graph (make_fx over torch.func.functionalize, fake tensors). Its
inputs are the state tensors and the batch (see ``StepLayout``); it writes every state tensor in
place (``copy_`` into its inputs, which the compiler keeps in place) and returns build()'s
tensors. Nodes carry ``meta["graphamp_subgraph"]``: forward, backward, grad_scaler, clip_grad,
optimizer, history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .capture import CapturedForward
from .errors import CaptureError
from .fxutil import NodeTagger, last_node, nodes_after, rename_placeholders, tracing_graph
from .ops import EXPANSIONS
from .optim import GroupTensors, OptimizerPlan, apply_update
from .scaler import GradScaler, clip_grad_norm, unscale_and_check

HISTORY_COLUMNS = ("step", "loss", "scale", "skipped", "grad_norm")
_COPY_META = ("amp_colour", "amp_list", "amp_reason", "nn_module_stack", "user_frame", "amp_cast")


@dataclass
class StepLayout:
    """The step's flat inputs: named groups of tensors, in this order."""

    groups: list[tuple[str, int]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # one per tensor, for placeholders

    def add(self, group: str, names: list[str]) -> None:
        self.groups.append((group, len(names)))
        self.names.extend(names)

    def split(self, flat: tuple) -> dict[str, list]:
        out, i = {}, 0
        for group, n in self.groups:
            out[group] = list(flat[i : i + n])
            i += n
        return out

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class StepPlan:
    captured: CapturedForward
    training: bool
    trainable: list[int]  # forward-parameter positions that get gradients
    optimizers: list[OptimizerPlan]
    scaler: GradScaler | None
    history_capacity: int
    layout: StepLayout = field(default_factory=StepLayout)
    # low-precision parameter copies the forward reads (hoist_parameter_casts): (position, dtype)
    shadows: list[tuple[int, torch.dtype]] = field(default_factory=list)
    # parameters the forward also reads directly (in their own dtype)
    direct_use: set[int] = field(default_factory=set)
    acc_steps: int = 1  # gradient accumulation: micro-batches per step
    process_group: Any = None  # data parallel: gradients averaged over this group


class _ForwardRunner(fx.Interpreter):
    """Runs the AMP forward graph while make_fx records; tags the nodes it produces."""

    def run_node(self, n: fx.Node) -> Any:
        graph = tracing_graph()
        marker = last_node(graph) if graph is not None else None
        out = super().run_node(n)
        if marker is not None and n.op == "call_function":
            for new in nodes_after(graph, marker):
                new.meta.setdefault("fwd_node", n.name)
                for key in _COPY_META:
                    if key in n.meta and key not in new.meta:
                        new.meta[key] = n.meta[key]
        return out

    def call_function(self, target, args, kwargs):
        expansion = EXPANSIONS.get(target)
        if expansion is not None:
            return expansion(*args, **kwargs)
        if target is torch.ops.aten.copy.default:
            return _functional_copy(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _functional_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    """``aten.copy`` (functionalization's form of ``copy_``) has no autograd formula; its value
    is ``src`` in ``dst``'s dtype and shape, which autograd can differentiate."""
    out = src.to(dtype=dst.dtype, device=dst.device)
    return out if out.shape == dst.shape else out.expand(dst.shape)


def _run_forward(fwd_gm: fx.GraphModule, inputs: list) -> list:
    with NodeTagger({"graphamp_subgraph": "forward"}):
        return list(_ForwardRunner(fwd_gm).run(*inputs, enable_io_processing=False))


def _where(skip: torch.Tensor | None, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new if skip is None else torch.where(skip, old, new)


def make_step_function(plan: StepPlan, fwd_gm: fx.GraphModule):
    """The functional training step over the flat inputs of ``plan.layout``."""
    cap = plan.captured
    n_out, n_loss = cap.num_user_outputs, cap.num_losses
    n_grad = sum(cap.loss_grad_given)

    def split_outputs(outs: list):
        user = outs[:n_out]
        losses = outs[n_out : n_out + n_loss]
        grads = outs[n_out + n_loss : n_out + n_loss + n_grad]
        buffers = outs[n_out + n_loss + n_grad :]
        return user, losses, grads, buffers

    trainable = set(plan.trainable)
    direct = [i for i in plan.trainable if i in plan.direct_use]
    shadowed = [j for j, (i, _) in enumerate(plan.shadows) if i in trainable]

    def step(*flat):
        s = plan.layout.split(flat)
        params, buffers, inputs = s["params"], s["buffers"], s["inputs"]
        shadows = s.get("shadows", [])

        if not plan.training:
            user, _, _, new_buffers = split_outputs(_run_forward(fwd_gm, [*params, *buffers,
                                                                         *inputs, *shadows]))
            for i, value in zip(cap.mutated_buffers, new_buffers):
                buffers[i].copy_(value)
            return tuple(user)

        scaler = plan.scaler
        scale = s["scaler"][0] if scaler is not None else None
        n_micro = plan.acc_steps
        total: dict[int, torch.Tensor] = {}
        users, micro_losses = [], []
        current = list(buffers)
        for micro in _micro_batches(inputs, n_micro):
            def forward(direct_values, shadow_values, micro=micro, bufs=tuple(current)):
                ps, sh = list(params), list(shadows)
                for pos, value in zip(direct, direct_values):
                    ps[pos] = value
                for j, value in zip(shadowed, shadow_values):
                    sh[j] = value
                user, losses, grads, new_buffers = split_outputs(
                    _run_forward(fwd_gm, [*ps, *bufs, *micro, *sh]))
                return tuple(losses), (user, grads, new_buffers)

            losses, vjp_fn, (user, loss_grads, new_buffers) = torch.func.vjp(
                forward, [params[i] for i in direct], [shadows[j] for j in shadowed],
                has_aux=True)
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                explicit = iter(loss_grads)
                cotangents = []
                for loss, given in zip(losses, cap.loss_grad_given):
                    seed = next(explicit) if given else torch.ones_like(loss)
                    if n_micro > 1:  # the micro-batch gradients average to the batch's
                        seed = seed / n_micro
                    cotangents.append(seed * scale.to(seed.dtype) if scale is not None else seed)
            with NodeTagger({"graphamp_subgraph": "backward"}):
                _accumulate_grads(plan, vjp_fn, cotangents, direct, shadowed, params, total)
            users.append(user)
            micro_losses.append(losses)
            for i, value in zip(cap.mutated_buffers, new_buffers):
                current[i] = value  # BatchNorm statistics carry from one micro-batch to the next
        grads = [total[i] if i in total else torch.zeros_like(params[i]) for i in plan.trainable]
        user = _combine_micro_outputs(users)
        losses = [torch.stack([m[i].float() for m in micro_losses]).mean(0)
                  for i in range(len(micro_losses[0]))] if n_micro > 1 else list(micro_losses[0])
        new_buffers = [current[i] for i in cap.mutated_buffers]

        if plan.process_group is not None:
            with NodeTagger({"graphamp_subgraph": "data_parallel"}):
                grads = _average_over_ranks(grads, plan.process_group)
        position = {p: j for j, p in enumerate(plan.trainable)}
        per_optimizer = []
        norms = []
        for k, opt in enumerate(plan.optimizers):
            slots = [position[i] for i in opt.forward_positions]
            opt_grads = [grads[j] for j in slots]
            found = None
            if scaler is not None:
                with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                    opt_grads, found = unscale_and_check(opt_grads, scale)
            if opt.clip_max_norm is not None:
                with NodeTagger({"graphamp_subgraph": "clip_grad"}):
                    opt_grads, total_norm = clip_grad_norm(opt_grads, opt.clip_max_norm,
                                                           opt.clip_norm_type)
                    if total_norm is not None:
                        norms.append(total_norm)
                        if found is not None:  # a non-finite norm counts as an overflow
                            found = torch.where(torch.isfinite(total_norm), found,
                                                torch.ones_like(found))
            per_optimizer.append((opt, slots, opt_grads, found))
        found_infs = [f for *_, f in per_optimizer if f is not None]
        if found_infs and plan.process_group is not None:
            with NodeTagger({"graphamp_subgraph": "data_parallel"}):
                found_infs = _agree_on_overflow(found_infs, plan.process_group)
            it = iter(found_infs)
            per_optimizer = [(o, sl, g, next(it) if f is not None else None)
                             for o, sl, g, f in per_optimizer]
        states = iter(s["opt_state"])
        hypers = iter(s["hyper"])
        counters = s["counters"]
        any_skip = None
        for k, (opt, slots, opt_grads, found) in enumerate(per_optimizer):
            skip = found > 0 if found is not None else None
            with NodeTagger({"graphamp_subgraph": "optimizer"}):
                _update_optimizer(opt, slots, params, plan.trainable, opt_grads, states, hypers,
                                  counters[k], skip)
        with NodeTagger({"graphamp_subgraph": "optimizer"}):
            for j in shadowed:  # the optimizer refreshes the low-precision copies it feeds
                i, dtype = plan.shadows[j]
                shadows[j].copy_(params[i].to(dtype))
        if scaler is not None:
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                found_total = found_infs[0]
                for f in found_infs[1:]:
                    found_total = found_total + f
                any_skip = found_total > 0
        with NodeTagger({"graphamp_subgraph": "history"}):
            # before the scaler state is written: a read after copy_ sees the new value
            _record_history(s["history"], losses, cap, scale, any_skip, norms)
        if scaler is not None:
            with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
                scale_t, growth_t, hysteresis_t, found_t = s["scaler"]
                new_scale, new_growth, new_hysteresis = scaler.update_scale(
                    scale_t, growth_t, hysteresis_t, found_total)
                scale_t.copy_(new_scale)
                growth_t.copy_(new_growth)
                hysteresis_t.copy_(new_hysteresis)
                found_t.copy_(any_skip.to(found_t.dtype))
        for i, value in zip(cap.mutated_buffers, new_buffers):
            buffers[i].copy_(_where(any_skip, buffers[i], value))
        return tuple(user)

    return step


def _average_over_ranks(grads: list, group) -> list:
    """DDP's gradient averaging, as one coalesced functional all-reduce inside the step."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    world = dist.get_world_size(group)
    reduced = funcol.all_reduce_coalesced(list(grads), "sum", group)
    return [g / world for g in reduced]


def _agree_on_overflow(found_infs: list, group) -> list:
    """Every rank skips a step if any rank overflowed (all-reduce max of the flags)."""
    import torch.distributed._functional_collectives as funcol

    agreed = funcol.all_reduce(torch.stack(found_infs), "max", group)
    return list(agreed.unbind(0))


def _micro_batches(inputs: list, n: int) -> list[list]:
    """Every input split into n equal slices along dim 0 (checked on the host beforehand)."""
    if n == 1:
        return [inputs]
    out = []
    for k in range(n):
        micro = []
        for t in inputs:
            size = t.shape[0] // n
            micro.append(t.narrow(0, k * size, size))
        out.append(micro)
    return out


def _accumulate_grads(plan, vjp_fn, cotangents, direct, shadowed, params, total) -> None:
    """Add this micro-batch's parameter gradients to ``total``.

    Losses that called backward(inputs=...) send gradients only to those parameters: one vjp
    per distinct restriction (they share the forward), each keeping its own parameters.
    """
    groups: dict = {}
    for index, restrict in enumerate(plan.captured.loss_inputs or [None] * len(cotangents)):
        groups.setdefault(restrict, []).append(index)
    for restrict, members in groups.items():
        seeds = tuple(c if i in members else torch.zeros_like(c)
                      for i, c in enumerate(cotangents)) if len(groups) > 1 else tuple(cotangents)
        direct_grads, shadow_grads = vjp_fn(seeds)
        parts = list(zip(direct, direct_grads))
        for j, g in zip(shadowed, shadow_grads):
            i = plan.shadows[j][0]
            parts.append((i, g.to(params[i].dtype)))  # what the cast's backward does
        for i, g in parts:
            if restrict is not None and i not in restrict:
                continue
            total[i] = total[i] + g if i in total else g


def _combine_micro_outputs(users: list[list]) -> list:
    """build()'s tensors over micro-batches: batched ones concatenated, scalars averaged."""
    if len(users) == 1:
        return list(users[0])
    out = []
    for values in zip(*users):
        first = values[0]
        if first.dim() == 0:
            out.append(torch.stack(values).float().mean().to(first.dtype)
                       if first.dtype.is_floating_point else values[-1])
        else:
            out.append(torch.cat(values, dim=0))
    return out


def _update_optimizer(opt, slots, params, trainable, grads, states, hypers, counter, skip):
    """Trace one optimizer's masked update; consumes its tensors from the shared iterators."""
    first_step = counter == 0
    offset = 0
    for group in opt.groups:
        idx = list(range(offset, offset + len(group.params)))
        offset += len(group.params)
        hyper = {name: next(hypers) for name in opt.hyper_names}
        state = {key: [next(states) for _ in idx] for key in group.state_keys}
        if not idx:
            continue
        tensors = GroupTensors(
            params=[params[trainable[slots[i]]] for i in idx],
            grads=[grads[i] for i in idx],
            state=state,
            hyper=hyper,
        )
        new_params, new_state = apply_update(opt, group, tensors, first_step)
        for old, new in zip(tensors.params, new_params):
            old.copy_(_where(skip, old, new))
        for key, values in new_state.items():
            for old, new in zip(tensors.state[key], values):
                old.copy_(_where(skip, old, new))
    applied = counter + 1
    counter.copy_(_where(skip, counter, applied))


def _record_history(history: list, losses, cap: CapturedForward, scale, any_skip, norms) -> None:
    step, table = history
    scalar_losses = [l for l in losses if l.numel() == 1]
    loss = (torch.stack([l.reshape(()).float() for l in scalar_losses]).sum()
            if scalar_losses else torch.full((), float("nan"), device=step.device))
    nan = torch.full((), float("nan"), device=step.device)
    if norms:
        grad_norm = norms[0].float() if len(norms) == 1 else torch.linalg.vector_norm(
            torch.stack([n.float() for n in norms]))
    else:
        grad_norm = nan
    row = torch.stack([
        step.float(),
        loss.detach(),
        scale.float() if scale is not None else torch.ones((), device=step.device),
        any_skip.float() if any_skip is not None else torch.zeros((), device=step.device),
        grad_norm.detach(),
    ])
    index = torch.remainder(step, table.shape[0]).reshape(1)
    table.index_copy_(0, index, row.reshape(1, -1))
    step.copy_(step + 1)


def assemble_step(plan: StepPlan, fwd_gm: fx.GraphModule, example: list[torch.Tensor],
                  graph_name: str) -> fx.GraphModule:
    """Trace the step into one FX graph over fake copies of ``example`` (nothing runs)."""
    step = make_step_function(plan, fwd_gm)
    try:
        gm = make_fx(torch.func.functionalize(step, remove="mutations"),
                     tracing_mode="fake")(*example)
    except Exception as e:
        raise CaptureError(
            f"assembling the training step of {graph_name} failed: {type(e).__name__}: {e}. "
            "This is a graphamp bug if build() runs eagerly; please report it with the graph "
            "dump (g.dump(path))"
        ) from e
    rename_placeholders(gm, plan.layout.names)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
