"""Overflow tracing in the step (``config.enable_overflow_tracing()``): probes and the record.

``plan_probes`` decides, before tracing, which values the step measures
(``records.probes.ProbeTable``: floating placeholders, then every op result that is not a view,
in topological order; the gradient arriving at each; each parameter's gradient). While the step is traced,
``ProbeRecorder`` reduces each of them to its largest magnitude (one reduction: NaN and inf
survive it) - forward values as the forward runs, gradients through tensor
hooks as autograd runs the backward. ``record_overflow`` then writes the step's vector into the
ring of overflowing steps and the running ranges, on the device: no host sync.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._foreach_abs, torch._foreach_max, torch._foreach_norm, torch._ops,
#   torch.distributed._functional_collectives, torch.ops.aten._softmax, torch.ops.aten._to_copy,
#   torch.ops.aten._unsafe_view
import functools
import math
import operator
from typing import Any, Callable, cast

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...records.probes import GradParam, Probe, ProbeTable, record_tensors
from ...records.spec import CapturedForward, StepPlan
from ...records.state import SharedState
from ...records.subgraphs import Subgraph
from ...records.validate import dtype_name
from ...torchkit.fxutil import NodeTagger, dtype_after_amp, module_path, op_name
from ...torchkit.pin_match import op_occurrences, pin_identity
from .component import Planning, StepComponent, StepContext

_TAG = Subgraph.FORENSICS.tag()
aten = torch.ops.aten
# ops whose result is another view of their input's memory (OpOverload.is_view says so for the
# others): their values are their input's, already probed
_VIEW_LIKE = frozenset({aten._unsafe_view.default, aten.alias.default})
# ops whose every value is bounded by their floating inputs' largest magnitude (or by 1), given
# finite scalar arguments: a non-finite value there came from an input, and their headroom is
# their inputs'. Not probed: fewer reductions per step, nothing lost. (Widening casts, and
# where/masked_fill/pad with a finite scalar, are checked in _bounded_by_inputs.)
_BOUNDED = frozenset(
    p
    for p in (
        aten.relu,
        aten.gelu,
        aten.silu,
        aten.tanh,
        aten.sigmoid,
        aten.hardtanh,
        aten.clone,
        aten.cat,
        aten.stack,
        aten.embedding,
        aten.index_select,
        aten.gather,
        aten.abs,
        aten.neg,
        aten.max_pool2d_with_indices,
        aten.max_pool1d_with_indices,
        aten.amax,
        aten.amin,
        aten.max,
        aten.min,
        aten._softmax,
        aten.mean,
        aten.where,
        aten.masked_fill,
        aten.constant_pad_nd,
        aten._to_copy,
        aten.lift_fresh_copy,
        aten.copy,
        aten.detach,
    )
)


def plan_probes(
    forward: fx.GraphModule,
    captured: CapturedForward,
    trainable: list[int],
    param_casts: list[tuple[int, torch.dtype]],
) -> ProbeTable:
    """The probes of ``forward`` (the graph after the AMP passes)."""
    kinds, names = _placeholders(captured, param_casts)
    occurrence = op_occurrences(forward.graph.nodes)
    index: dict[fx.Node, int] = {}
    reads: dict[fx.Node, tuple[int, ...]] = {}  # probes a node's value depends on, via views
    probes: list[Probe] = []
    placeholders = []
    for node in forward.graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
        kind = _kind(node, kinds, len(placeholders) - 1)
        inputs = tuple(
            sorted({i for a in node.all_input_nodes for i in _probes_of(a, index, reads)})
        )
        if kind is None:
            reads[node] = inputs
            continue
        index[node] = len(probes)
        # a placeholder's "op" is its kind: a data fault reads "input", not an op
        probes.append(
            Probe(
                node=node.name,
                label=names[len(placeholders) - 1],
                kind=kind,
                op=kind,
                dtype=dtype_after_amp(node),
                module="",
                source=None,
                inputs=(),
                pin=None,
            )
            if node.op == "placeholder"
            else _op_probe(node, kind, inputs, occurrence)
        )
    output = next(n for n in forward.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    losses = outs[captured.num_user_outputs : captured.num_user_outputs + captured.num_losses]
    loss_probes = sorted({i for node in losses for i in _probes_of(node, index, reads)})
    return ProbeTable(
        tuple(probes),
        _grad_params(captured, trainable, param_casts, placeholders, index),
        tuple(loss_probes),
    )


def _placeholders(captured: CapturedForward, param_casts: list[tuple[int, torch.dtype]]):
    """The kind and readable name of each forward placeholder (in ``ForwardLayout`` order, with
    the low-precision parameter copies); the loss scale is not probed."""
    layout = captured.layout.with_param_copies(len(param_casts))
    kinds: list[str | None] = layout.flatten(
        params=["parameter"] * layout.params,
        buffers=["buffer"] * layout.buffers,
        inputs=["input"] * layout.inputs,
        loss_scale=None,
        constants=["constant"] * layout.constants,
        param_copies=["parameter copy"] * layout.param_copies,
    )
    names = layout.flatten(
        params=captured.param_names,
        buffers=captured.buffer_names,
        inputs=captured.input_names,
        loss_scale="loss_scale",
        constants=captured.constant_names,
        param_copies=[
            f"{captured.param_names[i]} ({dtype_name(dt)} copy)" for i, dt in param_casts
        ],
    )
    return kinds, names


def _kind(node: fx.Node, kinds: list[str | None], placeholder_index: int) -> str | None:
    """The probe kind of ``node``, or None when it is not probed: not a floating tensor known
    to be non-empty (the inf norm of an empty tensor is undefined; a symbolic size counts when
    its range excludes 0), or a view (its values are its base's, already probed)."""
    val = node.meta.get("val")
    if not (
        isinstance(val, torch.Tensor)
        and val.dtype.is_floating_point
        and val.layout == torch.strided
        and statically_known_true(val.numel() > 0)
    ):
        return None
    if node.op == "placeholder":
        return kinds[placeholder_index] if placeholder_index < len(kinds) else None
    if node.op != "call_function":
        return None
    if node.target in _VIEW_LIKE or (
        isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
    ):
        return None
    if _bounded_by_inputs(node):
        return None
    return "cast" if node.meta.get("amp_cast") else "op"


def _bounded_by_inputs(node: fx.Node) -> bool:
    """Is ``node`` in _BOUNDED, with finite scalar arguments (``masked_fill(-inf)`` creates an
    infinity), and, for a cast, a result dtype whose range holds its input's (fp32 -> fp16 is
    where activations overflow most often)?"""
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in _BOUNDED:
        return False
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, float) and not math.isfinite(arg):
            return False
    if packet in (aten._to_copy, aten.copy):
        src = node.args[1] if packet is aten.copy else node.args[0]
        before = dtype_after_amp(src) if isinstance(src, fx.Node) else None
        after = dtype_after_amp(node)
        return (
            isinstance(before, torch.dtype)
            and before.is_floating_point
            and isinstance(after, torch.dtype)
            and torch.finfo(after).max >= torch.finfo(before).max
        )
    return True


def _probes_of(node: fx.Node, index: dict, reads: dict) -> tuple[int, ...]:
    """The probe of a value, or, for a value that is not probed, the probes it was made from."""
    if node in index:
        return (index[node],)
    return reads.get(node, ())


def _op_probe(node: fx.Node, kind: str, inputs: tuple[int, ...], occurrence: dict) -> Probe:
    described = node
    op = op_name(node)
    if node.target is operator.getitem:  # one result of a tuple-producing op: name that op
        described = cast(fx.Node, node.args[0])
        op = f"{op_name(described)}[{node.args[1]}]"
    pin = (
        pin_identity(described, occurrence[described.name])
        if described.name in occurrence and kind == "op"
        else None
    )
    return Probe(
        node=node.name,
        label=node.name,
        kind=kind,
        op=op,
        dtype=dtype_after_amp(node),
        module=module_path(described),
        source=described.meta.get("user_frame"),
        inputs=inputs,
        pin=pin,
    )


def _grad_params(
    captured: CapturedForward,
    trainable: list[int],
    param_casts: list[tuple[int, torch.dtype]],
    placeholders: list[fx.Node],
    index: dict,
) -> tuple[GradParam, ...]:
    layout = captured.layout.with_param_copies(len(param_casts))
    # the passes' state inputs follow the copies
    groups = layout.with_pass_state(len(placeholders) - len(layout)).split(placeholders)
    out = []
    for i in trainable:
        nodes = [groups.params[i]] + [
            groups.param_copies[j] for j, (pos, _) in enumerate(param_casts) if pos == i
        ]
        out.append(GradParam(captured.param_names[i], tuple(index[n] for n in nodes if n in index)))
    return tuple(out)


def _largest_magnitude(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-dim fp32 tensor; NaN if t holds a NaN, inf if an inf. On CUDA the inf norm
    is one reduction kernel; on the CPU its kernel is ten times slower than abs + amax (measured
    on 512x512 fp32/bf16/fp16), and a compiler fuses the abs into the reduction anyway."""
    if t.is_cuda:
        return torch.linalg.vector_norm(t, float("inf")).float()
    return t.abs().amax().float()


def _largest_magnitudes(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_largest_magnitude`` of many tensors of one dtype in one multi-tensor op (CUDA: one
    kernel launch for all the parameters, no temporaries)."""
    if any(isinstance(size, torch.SymInt) for t in ts for size in t.shape):
        # a batch of changing size: torch's multi-tensor kernels need static sizes
        return [_largest_magnitude(t) for t in ts]
    if ts[0].is_cuda:
        out = torch._foreach_norm(ts, float("inf"))
    else:
        out = torch._foreach_max(torch._foreach_abs(ts))
    return [m.float() for m in out]


class ProbeRecorder:
    """Collects the largest magnitude of every probe while the step is traced.

    Activations and the gradients arriving at them are reduced where they are made (keeping
    them for later would keep them alive). Placeholders (parameters, their low-precision copies,
    the batch) and parameter gradients live through the whole step anyway: they are reduced
    together at the end, in a few multi-tensor ops instead of one reduction each."""

    def __init__(self, table: ProbeTable):
        self.table = table
        self.index = {p.node: i for i, p in enumerate(table.forward)}
        self.values: list[torch.Tensor | None] = [None] * table.size
        self._deferred: list[tuple[int, torch.Tensor]] = []

    def observe(self, node: fx.Node, value: object) -> None:
        """A forward node ran (once per micro-batch); hook its gradient if it will get one."""
        i = self.index.get(node.name)
        if i is None or not isinstance(value, torch.Tensor):
            return
        if node.op == "placeholder":
            # parameters come once per micro-batch, the same values: measured once
            if self.table.forward[i].kind == "input" or all(j != i for j, _ in self._deferred):
                self._deferred.append((i, value))  # detached in vector(), tagged forensics
            return
        self._put(i, value)
        if value.requires_grad:
            value.register_hook(functools.partial(self._gradient, self.table.backward_slot(i)))

    def observe_param_grads(self, grads: list[torch.Tensor]) -> None:
        """The parameters' gradients (plan.trainable order), as the optimizers get them."""
        for k, grad in enumerate(grads):
            if grad.layout == torch.strided and grad.numel():
                self._deferred.append((self.table.param_slot(k), grad))

    def _gradient(self, slot: int, grad: torch.Tensor | None) -> None:
        # a tensor hook: returning None leaves the gradient as it is
        if isinstance(grad, torch.Tensor) and grad.layout == torch.strided and grad.numel():
            self._put(slot, grad)

    def _put(self, slot: int, t: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        with NodeTagger(_TAG):
            if amax is None:  # (a gradient needs no detach, unless build() differentiates twice)
                amax = _largest_magnitude(t.detach() if t.requires_grad else t)
            old = self.values[slot]
            # maximum propagates NaN, so micro-batches and repeated backwards combine safely
            self.values[slot] = amax if old is None else torch.maximum(old, amax)

    def vector(self, device: torch.device) -> torch.Tensor:
        """The step's probe vector (fp32); reduces the deferred probes first."""
        by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for slot, t in self._deferred:
            by_dtype.setdefault(t.dtype, []).append((slot, t))
        self._deferred = []
        with NodeTagger(_TAG):
            for group in by_dtype.values():
                values = [t.detach() if t.requires_grad else t for _, t in group]
                for (slot, t), amax in zip(group, _largest_magnitudes(values)):
                    self._put(slot, t, amax)
            zero = torch.zeros((), device=device)
            return torch.stack([v if v is not None else zero for v in self.values])


def record_overflow(
    state: list[torch.Tensor],
    recorder: ProbeRecorder,
    step: torch.Tensor,
    scale: torch.Tensor | None,
    any_skip: torch.Tensor | None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Write this step's probe vector into the ring if the step overflowed (a loss or a parameter
    gradient is non-finite, or the scaler skips it), and fold it into the running ranges.

    ``agree`` (data parallel) makes the vector every rank's: then every rank records the same
    overflowing steps with the same rows, so autofix pins the same ops at the same step on every
    rank, even when only one rank's data overflowed."""
    count, ring, ranges = state
    table = recorder.table
    with NodeTagger(_TAG):
        vector = recorder.vector(count.device)
        if agree is not None:
            vector = agree(vector)
        slots = (*table.losses, *(table.param_slot(k) for k in range(len(table.params))))
        sinks = [s for s in slots if recorder.values[s] is not None]
        overflowed = (
            # selected one by one: an index list would be a tensor constant of the step, which
            # the step cache cannot keep
            ~torch.isfinite(torch.stack([vector[s] for s in sinks])).all()
            if sinks
            else torch.zeros((), dtype=torch.bool, device=count.device)
        )
        if any_skip is not None:
            overflowed = overflowed | any_skip
        used = scale.float() if scale is not None else torch.ones((), device=count.device)
        # float64: the step number stays exact (float32 would round it past 2**24 steps)
        row = torch.cat([torch.stack([step.double(), used.double()]), vector.double()])
        row = row.unsqueeze(0)
        slot = torch.remainder(count, ring.shape[0]).reshape(1)
        ring.index_copy_(0, slot, torch.where(overflowed, row, ring.index_select(0, slot)))
        count.copy_(count + overflowed.to(count.dtype))
        finite = torch.where(torch.isfinite(vector), vector, torch.zeros_like(vector))
        ranges.copy_(torch.maximum(ranges, finite))


class OverflowProbes(StepComponent):
    """Overflow tracing in the step: the recorder armed before the forward, the parameters'
    whole gradients observed, and the step's vector written after the skip is known (agreed
    across ranks first)."""

    name = "probes"
    part = "the overflow probes"
    group = "forensics"
    inputs = ("forensics_count", "forensics_ring", "forensics_ranges")
    on_skip = "its record is written: a skipped step is what it records"
    across_ranks = (
        "its probe vector is made the same on every rank (each probe's largest magnitude) before it"
        " is written"
    )

    def active(self, plan: StepPlan) -> bool:
        return plan.probes is not None

    def plan_fields(self, planning: Planning) -> dict[str, Any]:
        if not (planning.spec.training and planning.spec.config.overflow_tracing):
            return {}
        return {
            "probes": plan_probes(
                planning.forward, planning.captured, planning.trainable, planning.param_casts
            )
        }

    def example_inputs(
        self,
        plan: StepPlan,
        state: SharedState,  # noqa: ARG002 - every component's signature
        device: torch.device,
    ) -> list:
        return record_tensors(cast(ProbeTable, plan.probes), device)

    def start(self, ctx: StepContext) -> None:
        if ctx.plan.training and ctx.plan.probes is not None:
            ctx.observer = ProbeRecorder(ctx.plan.probes)

    def gradients(self, ctx: StepContext) -> None:
        if ctx.reduce_each is None:  # whole gradients, before any scatter
            ctx.observer.observe_param_grads(ctx.grads)

    def record(self, ctx: StepContext) -> None:
        """Reads the step counter and the scale before they are written."""
        group = ctx.plan.process_group
        agree = (lambda v: agree_on_probes(v, group)) if group is not None else None
        step = cast(torch.Tensor, ctx.step_number)  # the history is active in training
        record_overflow(self.own(ctx), ctx.observer, step, ctx.scale, ctx.any_skip, agree)


def agree_on_probes(vector: torch.Tensor, group) -> torch.Tensor:
    """Overflow tracing's probe vector (largest magnitudes, NaN or inf where a value was not
    finite) made the same on every rank: per probe, the largest finite magnitude over the ranks,
    or inf/NaN where any rank's was (NaN wins). One all-reduce max; NaN is encoded first, since
    max over NaN is not reliably NaN in every backend's reduction."""
    finite = torch.isfinite(vector)
    magnitude = torch.where(finite, vector, torch.zeros_like(vector))
    code = torch.where(
        finite,
        torch.zeros_like(vector),
        torch.where(torch.isnan(vector), torch.full_like(vector, 2.0), torch.ones_like(vector)),
    )
    agreed = funcol.all_reduce(torch.cat([magnitude, code]), "max", group)
    magnitude, code = agreed.split(vector.shape[0])
    inf, nan = torch.full_like(vector, math.inf), torch.full_like(vector, math.nan)
    return torch.where(code == 0, magnitude, torch.where(code == 2, nan, inf))
