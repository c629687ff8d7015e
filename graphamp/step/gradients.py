"""Forward, loss scaling and gradients inside the step (the forward and backward subgraphs).

The AMP-rewritten forward graph runs under an ``fx.Interpreter`` while make_fx records; its
losses are seeded with the loss scale and differentiated with ``torch.autograd.grad``, one
micro-batch at a time under gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx

from ..records.layouts import StepInputs
from ..records.spec import StepPlan
from ..records.subgraphs import Subgraph
from ..torchkit.compat import preserve_backward_stack_traces
from ..torchkit.fxutil import NodeTagger, last_node, nodes_after, tracing_graph
from ..torchkit.ops import EXPANSIONS

# forward-node metadata the step's nodes inherit (dumps and reports read it)
MICRO_BATCH = "micro_batch"  # meta key: which micro-batch's forward made a node
_COPY_META = ("amp_colour", "amp_list", "amp_reason", "nn_module_stack", "user_frame", "amp_cast")


class ValueObserver(Protocol):
    """Sees every value the forward makes (``StepContext.observer``: overflow tracing's)."""

    def observe(self, node: fx.Node, value: object) -> None: ...


class _ForwardRunner(fx.Interpreter):
    """Runs the AMP forward graph while make_fx records; tags the nodes it produces and shows
    each value to the step's observer, if any."""

    def __init__(
        self,
        gm: fx.GraphModule,
        recorder: ValueObserver | None,
        versions: list[tuple[int, torch.Tensor]] | None = None,
    ):
        super().__init__(gm)
        self.recorder = recorder
        # (parameter position, leaf) for each value build() gave a parameter in place: with
        # ``versions``, each is a fresh gradient leaf, as the parameter itself is in eager
        self.versions = versions

    def run_node(self, n: fx.Node) -> Any:
        graph = tracing_graph()
        marker = last_node(graph) if graph is not None else None
        out = super().run_node(n)
        if graph is not None and marker is not None and n.op == "call_function":
            for new in nodes_after(graph, marker):
                new.meta.setdefault("fwd_node", n.name)
                for key in _COPY_META:
                    if key in n.meta and key not in new.meta:
                        new.meta[key] = n.meta[key]
        if self.recorder is not None:
            self.recorder.observe(n, out)
        if self.versions is not None and "param_version" in n.meta:
            out = out.detach().requires_grad_(True)
            self.versions.append((n.meta["param_version"], out))
        return out

    def call_function(self, target, args, kwargs):
        expansion = EXPANSIONS.get(target)
        if expansion is not None:
            return expansion(*args, **kwargs)
        if target is torch.ops.aten.copy.default:
            return _functional_copy(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def _functional_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):  # noqa: ARG001 - aten.copy's signature
    """``aten.copy`` (functionalization's form of ``copy_``) has no autograd formula; its value
    is ``src`` in ``dst``'s dtype and shape, which autograd can differentiate."""
    out = src.to(dtype=dst.dtype, device=dst.device)
    return out if out.shape == dst.shape else out.expand(dst.shape)


def run_forward(
    fwd_gm: fx.GraphModule,
    inputs: list,
    recorder: ValueObserver | None = None,
    versions: list[tuple[int, torch.Tensor]] | None = None,
) -> list:
    """The forward graph's outputs for ``inputs`` (``StepPlan.forward_layout``); its nodes are
    traced into the step tagged ``forward``. ``versions`` collects the parameters' in-place
    values as gradient leaves (``_ForwardRunner``)."""
    runner = _ForwardRunner(fwd_gm, recorder, versions)
    with NodeTagger(Subgraph.FORWARD.tag()):
        return list(runner.run(*inputs, enable_io_processing=False))


@dataclass
class ForwardResult:
    """One step's forward and gradients (summed over micro-batches)."""

    user: list[torch.Tensor]  # build()'s tensors (micro-batches combined)
    losses: list[torch.Tensor]  # one per backward() call (averaged over micro-batches)
    grads: list[torch.Tensor]  # one per plan.trainable position, in the parameter's dtype
    new_buffers: list[torch.Tensor]  # new values of captured.mutated_buffers
    # build()'s own gradient code (GradientCode): the .grad it left, by parameter position
    # (unscaled already), the positions the other losses reached, the parameters' new values
    explicit: dict[int, torch.Tensor] = field(default_factory=dict)
    reached: set[int] = field(default_factory=set)
    new_params: list[torch.Tensor] = field(default_factory=list)


def parameter_casts(plan: StepPlan, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The low-precision copies the AMP forward reads (``plan.param_casts``), made from the
    current parameters at the start of the step: once per step whatever the number of
    consumers or micro-batches, and always from the values the user's tensors hold now.
    Convolution weights on CUDA come out channels-last: cuDNN's fast kernels are NHWC, and the
    copy's layout saves a transpose in every forward and backward convolution."""
    with NodeTagger(Subgraph.PARAMETER_CASTS.tag()):
        return [cast_for_forward(params[i], dtype) for i, dtype in plan.param_casts]


def cast_for_forward(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One low-precision copy (``parameter_casts``), channels-last for a CUDA convolution."""
    layout = torch.channels_last if p.dim() == 4 and p.is_cuda else torch.preserve_format
    return p.to(dtype=dtype, memory_format=layout)


def forward_and_gradients(
    plan: StepPlan,
    fwd_gm: fx.GraphModule,
    s: StepInputs,
    scale: torch.Tensor | None,
    reduce_each: Callable[[list], list] | None = None,
    recorder: ValueObserver | None = None,
    record_origins: bool = False,
    copies: list[torch.Tensor] | None = None,
) -> ForwardResult:
    """Run the forward on each micro-batch, seed each loss with ``scale`` (None: 1) and add the
    parameter gradients up; BatchNorm statistics carry from one micro-batch to the next.
    Plain autograd differentiates the traced forward (``torch.autograd.grad``): the forward's
    ops record their backward as in eager mode, custom autograd Functions included. Gradients
    with respect to a parameter's low-precision copy are cast back, as a cast's backward does.
    ``reduce_each`` (``StepContext.reduce_each``) maps each micro-batch's gradients, in
    ``plan.trainable`` order, to what is summed over micro-batches (the rank's shards). A
    ``recorder`` (overflow tracing) measures every value it observes and its gradient.
    ``copies``: the low-precision copies when they are made elsewhere (from gathered shards),
    else cast from ``s.params``."""
    cap = plan.captured
    params = s.params
    copies = copies if copies is not None else parameter_casts(plan, params)
    total: dict[int, torch.Tensor] = {}
    users, micro_losses, current = [], [], list(s.buffers)
    for k, micro in enumerate(_micro_batches(s.inputs, plan.acc_steps)):
        leaves = _GradientLeaves.of(plan, params, copies)
        # each micro-batch's forward is its own instance of every checkpointed region
        with torch.enable_grad(), NodeTagger({MICRO_BATCH: k}):
            inputs = _forward_inputs(plan, s, leaves, current, micro, scale)
            versions: list[tuple[int, torch.Tensor]] = []
            outs = run_forward(fwd_gm, inputs, recorder, versions)
            user, losses, loss_grads, new_buffers = cap.split_outputs(outs)
        seeds = _seeds(plan, losses, loss_grads, scale)
        micro_grads: dict[int, torch.Tensor] = total if reduce_each is None else {}
        wrt = leaves.wrt + [(i, v) for i, v in versions if i in leaves.trainable]
        with NodeTagger(Subgraph.BACKWARD.tag()):
            _accumulate_grads(plan, losses, seeds, wrt, params, micro_grads, record_origins)
        if reduce_each is not None:
            reduced = reduce_each(_in_trainable_order(plan, micro_grads, params))
            for i, g in zip(plan.trainable, reduced):
                total[i] = total[i] + g if i in total else g
        users.append([u.detach() for u in user])
        micro_losses.append([loss.detach() for loss in losses])
        for i, value in zip(cap.mutated_buffers, new_buffers):
            current[i] = value.detach()
    left, new_params = cap.gradient_code_outputs(outs)  # one micro-batch (plan.py)
    return ForwardResult(
        _combine_micro_outputs(users, cap.num_written),
        _mean_losses(micro_losses),
        _in_trainable_order(plan, total, params),
        [current[i] for i in cap.mutated_buffers],
        {i: g.detach() for i, g in zip(cap.gradient_code.grad_params, left)},
        set(total),
        [v.detach() for v in new_params],
    )


def _forward_inputs(plan: StepPlan, s: StepInputs, leaves, buffers, micro, scale) -> list:
    """One micro-batch's forward inputs (``StepPlan.forward_layout``)."""
    return plan.forward_layout.flatten(
        params=leaves.params,
        buffers=buffers,
        inputs=micro,
        loss_scale=_loss_scale(scale, s.params),
        constants=s.constants,
        param_copies=leaves.copies,
        pass_state=s.pass_state,
    )


@dataclass
class _GradientLeaves:
    """One micro-batch's forward inputs that gradients are taken with respect to."""

    params: list[torch.Tensor]  # the parameters, trainable ones read directly as fresh leaves
    copies: list[torch.Tensor]  # the low-precision copies, trainable ones as fresh leaves
    trainable: set[int]  # forward positions of the parameters that get gradients
    # (forward position, leaf): the parameters read in their own dtype, then the copies (whose
    # gradient is cast back, as a cast's backward does)
    wrt: list[tuple[int, torch.Tensor]]

    @classmethod
    def of(cls, plan: StepPlan, params: list, copies: list) -> _GradientLeaves:
        trainable = set(plan.trainable)
        ps, cs, wrt = list(params), list(copies), []
        for i in plan.trainable:
            if i in plan.direct_use:
                ps[i] = params[i].detach().requires_grad_(True)
                wrt.append((i, ps[i]))
        for j, (i, _) in enumerate(plan.param_casts):
            if i in trainable:
                cs[j] = copies[j].detach().requires_grad_(True)
                wrt.append((i, cs[j]))
        return cls(ps, cs, trainable, wrt)


def _in_trainable_order(plan: StepPlan, grads: dict, params: list) -> list[torch.Tensor]:
    """One gradient per trainable parameter (zeros for those no loss reached)."""
    return [grads[i] if i in grads else torch.zeros_like(params[i]) for i in plan.trainable]


def _loss_scale(scale: torch.Tensor | None, like: list[torch.Tensor]) -> torch.Tensor:
    """The forward's loss_scale input: the scaler's scale, or 1."""
    if scale is not None:
        return scale
    return torch.ones((), dtype=torch.float32, device=like[0].device if like else None)


def _seeds(plan: StepPlan, losses, loss_grads, scale) -> list[torch.Tensor]:
    """Each loss's backward seed: ones (or its explicit gradient), averaged over micro-batches,
    times the loss scale (the loss-scaling subgraph)."""
    with NodeTagger((Subgraph.GRAD_SCALER if scale is not None else Subgraph.BACKWARD).tag()):
        explicit = iter(loss_grads)
        seeds = []
        for loss, given in zip(losses, plan.captured.loss_grad_given):
            seed = next(explicit).detach() if given else torch.ones_like(loss)
            if plan.acc_steps > 1:  # the micro-batch gradients average to the batch's
                seed = seed / plan.acc_steps
            seeds.append(seed * scale.to(seed.dtype) if scale is not None else seed)
        return seeds


def _micro_batches(inputs: list, n: int) -> list[list]:
    """Every input split into n equal slices along dim 0 (checked on the host beforehand)."""
    if n == 1:
        return [inputs]
    return [[t.narrow(0, k * (t.shape[0] // n), t.shape[0] // n) for t in inputs] for k in range(n)]


def _accumulate_grads(
    plan: StepPlan,
    losses: list,
    seeds: list,
    wrt: list,
    params: list,
    total: dict,
    record_origins: bool,
) -> None:
    """Add this micro-batch's parameter gradients to ``total``.

    ``wrt`` are (forward position, leaf) pairs (``_GradientLeaves.wrt``); a copy's gradient is
    cast back to its parameter's dtype.
    Losses that called backward(inputs=...) send gradients only to those parameters: one
    ``autograd.grad`` per distinct restriction, over the parameters it names.
    """
    if record_origins:  # backward nodes get their forward op's seq_nr (assemble_step)
        preserve_backward_stack_traces(losses)
    groups: dict = {}
    taken = plan.captured.gradient_code.losses_taken  # build() took their gradients itself
    for index, restrict in enumerate(plan.captured.loss_inputs or [None] * len(losses)):
        # a loss that reaches no parameter in the traced graph, though eager's autograd kept an
        # edge (matrix_power(w, 0) copies an identity): eager's gradients there are zeros
        if index >= taken and losses[index].requires_grad:
            groups.setdefault(restrict, []).append(index)
    for n, (restrict, members) in enumerate(groups.items()):
        chosen = [(i, leaf) for i, leaf in wrt if restrict is None or i in restrict]
        grads = torch.autograd.grad(
            [losses[k] for k in members],
            [leaf for _, leaf in chosen],
            [seeds[k] for k in members],
            allow_unused=True,
            retain_graph=n + 1 < len(groups),
        )
        for (i, _), g in zip(chosen, grads):
            if g is None:
                continue
            g = _parameter_shaped(g.to(params[i].dtype), params[i])
            total[i] = total[i] + g if i in total else g


def _parameter_shaped(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` with its parameter's sizes. Under symbolic batch sizes a gradient's size can be
    an expression of them that equals the parameter's only for the sizes traced (a model that
    reshapes by ``T // 2``: ``8 * (s0 // 2) * (s0 // (s0 // 2)) // s0``): reshaped, the step
    assumes that equality (a guard of the program), and the optimizer gets concrete sizes."""
    if all(type(s) is int for s in grad.shape):
        return grad
    # a view to sizes equal to its own keeps the expressions: through a column of the
    # parameter's element count (never the gradient's own shape) they become numbers
    return grad.reshape(-1).view(param.numel(), 1).view(param.shape)


def _combine_micro_outputs(users: list[list], written: int) -> list:
    """build()'s tensors over micro-batches: batched ones concatenated, scalars averaged; the
    last ``written`` (tensors build() writes on the user's objects) from the last micro-batch,
    as the last of eager's forwards leaves them."""
    if len(users) == 1:
        return list(users[0])
    own = [u[: len(u) - written] for u in users]
    return _combine_returned(own) + list(users[-1][len(users[-1]) - written :])


def _combine_returned(users: list[list]) -> list:
    out = []
    for values in zip(*users):
        first = values[0]
        if first.dim() == 0:
            out.append(
                torch.stack(values).float().mean().to(first.dtype)
                if first.dtype.is_floating_point
                else values[-1]
            )
        else:
            out.append(torch.cat(values, dim=0))
    return out


def _mean_losses(micro_losses: list) -> list:
    if len(micro_losses) == 1:
        return list(micro_losses[0])
    return [
        torch.stack([m[i].float() for m in micro_losses]).mean(0)
        for i in range(len(micro_losses[0]))
    ]
