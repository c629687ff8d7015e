"""Forward, loss scaling and gradients inside the step (the forward and backward subgraphs).

The AMP-rewritten forward graph runs under an ``fx.Interpreter`` while make_fx records; its
losses are seeded with the loss scale and differentiated with ``torch.func.vjp``, one
micro-batch at a time under gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..fxutil import NodeTagger, last_node, nodes_after, tracing_graph
from ..ops import EXPANSIONS
from ..spec import StepPlan

# forward-node metadata the step's nodes inherit (dumps and reports read it)
_COPY_META = ("amp_colour", "amp_list", "amp_reason", "nn_module_stack", "user_frame", "amp_cast")


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


def run_forward(fwd_gm: fx.GraphModule, inputs: list) -> list:
    """The forward graph's outputs, its nodes traced into the step tagged ``forward``."""
    with NodeTagger({"graphamp_subgraph": "forward"}):
        return list(_ForwardRunner(fwd_gm).run(*inputs, enable_io_processing=False))


@dataclass
class ForwardResult:
    """One step's forward and gradients (summed over micro-batches)."""

    user: list[torch.Tensor]  # build()'s tensors (micro-batches combined)
    losses: list[torch.Tensor]  # one per backward() call (averaged over micro-batches)
    grads: list[torch.Tensor]  # one per plan.trainable position, in the parameter's dtype
    new_buffers: list[torch.Tensor]  # new values of captured.mutated_buffers


def forward_and_gradients(plan: StepPlan, fwd_gm: fx.GraphModule, s: dict[str, list],
                          scale: torch.Tensor | None) -> ForwardResult:
    """Run the forward on each micro-batch, seed each loss with ``scale`` (None: 1) and add the
    parameter gradients up; BatchNorm statistics carry from one micro-batch to the next."""
    cap = plan.captured
    params, shadows = s["params"], s["shadows"]
    direct = [i for i in plan.trainable if i in plan.direct_use]
    trainable = set(plan.trainable)
    shadowed = [j for j, (i, _) in enumerate(plan.shadows) if i in trainable]
    total: dict[int, torch.Tensor] = {}
    users, micro_losses = [], []
    current = list(s["buffers"])
    for micro in _micro_batches(s["inputs"], plan.acc_steps):
        def forward(direct_values, shadow_values, micro=micro, bufs=tuple(current)):
            ps, sh = list(params), list(shadows)
            for pos, value in zip(direct, direct_values):
                ps[pos] = value
            for j, value in zip(shadowed, shadow_values):
                sh[j] = value
            user, losses, grads, new_buffers = cap.split_outputs(
                run_forward(fwd_gm, [*ps, *bufs, *micro, *sh]))
            return tuple(losses), (user, grads, new_buffers)

        losses, vjp_fn, (user, loss_grads, new_buffers) = torch.func.vjp(
            forward, [params[i] for i in direct], [shadows[j] for j in shadowed], has_aux=True)
        cotangents = _seeds(plan, losses, loss_grads, scale)
        with NodeTagger({"graphamp_subgraph": "backward"}):
            _accumulate_grads(plan, vjp_fn, cotangents, direct, shadowed, params, total)
        users.append(user)
        micro_losses.append(losses)
        for i, value in zip(cap.mutated_buffers, new_buffers):
            current[i] = value
    grads = [total[i] if i in total else torch.zeros_like(params[i]) for i in plan.trainable]
    return ForwardResult(_combine_micro_outputs(users), _mean_losses(micro_losses), grads,
                         [current[i] for i in cap.mutated_buffers])


def _seeds(plan: StepPlan, losses, loss_grads, scale) -> list[torch.Tensor]:
    """Each loss's backward seed: ones (or its explicit gradient), averaged over micro-batches,
    times the loss scale (the loss-scaling subgraph)."""
    with NodeTagger({"graphamp_subgraph": "grad_scaler"}):
        explicit = iter(loss_grads)
        seeds = []
        for loss, given in zip(losses, plan.captured.loss_grad_given):
            seed = next(explicit) if given else torch.ones_like(loss)
            if plan.acc_steps > 1:  # the micro-batch gradients average to the batch's
                seed = seed / plan.acc_steps
            seeds.append(seed * scale.to(seed.dtype) if scale is not None else seed)
        return seeds


def _micro_batches(inputs: list, n: int) -> list[list]:
    """Every input split into n equal slices along dim 0 (checked on the host beforehand)."""
    if n == 1:
        return [inputs]
    return [[t.narrow(0, k * (t.shape[0] // n), t.shape[0] // n) for t in inputs]
            for k in range(n)]


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


def _mean_losses(micro_losses: list) -> list:
    if len(micro_losses) == 1:
        return list(micro_losses[0])
    return [torch.stack([m[i].float() for m in micro_losses]).mean(0)
            for i in range(len(micro_losses[0]))]
