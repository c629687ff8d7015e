"""Capture: trace build() into a functional aten-level forward graph (a CapturedForward).

Tracing runs on fake tensors (nothing real is computed or mutated), functionalized, with the
parameters and buffers lifted to inputs: their traced values are swapped into the user's modules
for the length of the trace (``swap.py``), and the user's own tensors are always put back.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses, torch.ops.aten._local_scalar_dense, torch.utils._pytree
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch._subclasses.fake_tensor as fake_tensor
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..errors import CaptureError, GraphampError
from ..records.guards import AttributeRead, LiftedValue
from ..records.inputs import FlatInputs
from ..records.layouts import ForwardLayout
from ..records.spec import TENSOR, CapturedForward, GradientCode, LiftedOutput
from ..torchkit.function_calls import FunctionCall
from ..torchkit.fxutil import (
    drop_profiler_markers,
    rename_placeholders,
    trace_functional,
    user_frame_of_exception,
)
from ..torchkit.process_state import compiling
from ..torchkit.shapes import is_symbolic, scratch_batch
from .cleanup import (
    check_input_mutations,
    detach_no_grad_values,
    drop_autograd_detaches,
    keep_changed_buffers,
    lift_constants,
    mutated_inputs,
    params_without_path_to_losses,
)
from .fold import values_without_batch
from .functions import capturing_autograd_functions
from .host_randomness import refusing_host_randomness
from .intercept import CaptureMode, RecordedLoss, parameter_positions
from .op_errors import VALUE_DEPENDENT, fake_kernel_error
from .reads import recording_attribute_reads
from .reads import watched_objects as objects_read
from .root import BuildRoot, fake_copy, quiet_fake_data_pointers, refuse_compiled_submodules
from .scaler_refusal import raised_in_torch_grad_scaler, torch_grad_scaler_error
from .scope_reads import ScopeReads
from .side_effects import refuse_hooks
from .state_writes import StateWatch, watched_objects
from .steady_state import WrittenValue, settle, written_values
from .swap import state_slots, swapped

log = logging.getLogger("graphamp")


def capture_forward(
    root: BuildRoot,
    inputs: FlatInputs,
    graph_name: str,
    device: torch.device | None = None,
    amp: bool = False,
    lifted: tuple[AttributeRead, ...] = (),
    lifted_inputs: frozenset[int] = frozenset(),
    grad_group: Any = None,
    may_move: bool = False,
) -> CapturedForward:
    """Trace ``root``'s build() on fake copies of its state and ``inputs``.

    ``lifted``: Python floats build() reads that are traced as inputs of the step instead of
    constants (``records.guards.LiftedValue``; their tensors lead ``CapturedForward.constants``).
    ``lifted_inputs``: the tensor inputs that are g(...)'s float arguments made tensors; like
    ``lifted`` values, refused where an op needs them as Python numbers. ``grad_group``: data
    parallel's group, over which the gradients build() reads are averaged.

    ``amp``: graphamp's AMP will decide the dtypes, so ops given tensors of several floating
    dtypes (which eager PyTorch refuses without autocast) are left for its casts to reconcile.

    ``device`` traces as if everything lived there (fake tensors): the CUDA graph of a model can
    be captured and inspected on a machine without a GPU.

    When build() changes Python state on the user's objects, that state is settled as eager's
    first call leaves it and build() is traced again on it (``steady_state.py``); the settled
    state stays (``CapturedForward.undo_writes`` removes it). Sizes symbolic: ``_first_trace``.
    """
    once = (graph_name, device, amp, lifted, lifted_inputs, grad_group)
    captured, written = _first_trace(root, inputs, once, may_move)
    if not written:
        return captured
    params, buffers = list(root.parameters()), list(root.buffers())
    settled = settle(
        graph_name,
        written,
        _extra_nodes(captured),
        lambda nodes: values_without_batch(captured, params, buffers, nodes),
    )
    try:
        captured, again = _capture_once(root, inputs, *once)
        captured.replays = settled.steady_replays(captured, again)
        captured.attribute_reads = _reads_not_written(captured.attribute_reads, again)
    except BaseException:
        settled.undo()
        raise
    captured.undo_writes = settled.undo
    log.info(
        "%s: build() changes Python state on its first call (%s): captured again on the state "
        "it leaves",
        graph_name,
        ", ".join(w.place.describe() for w in written[:3]) + (", ..." if len(written) > 3 else ""),
    )
    return captured


def _first_trace(
    root: BuildRoot, inputs: FlatInputs, once: tuple, may_move: bool
) -> tuple[CapturedForward, list[WrittenValue]]:
    """build()'s first trace, and what it wrote. Sizes symbolic: what a trace of the state
    before the first call assumes of them must not become the build's guards, so it runs on a
    copy of the batch in a fake mode of its own. Where build() wrote nothing, that trace is the
    one kept: with ``may_move`` as it is, ``CapturedForward.moved_to`` holding the copy, whose
    fake mode the caller takes for the rest of the build (one symbolic trace instead of two);
    without it, build() is traced again on ``inputs``."""
    if not any(is_symbolic(t) for t in inputs.tensors):
        return _capture_once(root, inputs, *once)
    copy = inputs.with_tensors(scratch_batch(inputs.tensors))
    captured, written = _capture_once(root, copy, *once)
    if written:
        return captured, written
    if may_move:
        captured.moved_to = copy
        return captured, written
    return _capture_once(root, inputs, *once)[0], []


def _reads_not_written(
    reads: tuple[AttributeRead, ...], again: list[WrittenValue]
) -> tuple[AttributeRead, ...]:
    """The reads that are guards: an attribute build() writes on every call is replayed after
    each step (or checked to be rewritten with the value it had), and what the trace read of it
    is its own value, not an assumption about the user's objects."""
    written = {(id(w.place.holder()), w.place.name) for w in again}
    return tuple(r for r in reads if (id(r.namespace), r.name) not in written)


def _extra_nodes(captured: CapturedForward) -> list[fx.Node]:
    """The forward's outputs that are tensors build() wrote on the user's objects."""
    output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
    n_build = captured.num_user_outputs - captured.num_written
    return list(output.args[0][n_build : captured.num_user_outputs])


def _capture_once(
    root: BuildRoot,
    inputs: FlatInputs,
    graph_name: str,
    device: torch.device | None,
    amp: bool,
    lifted: tuple[AttributeRead, ...],
    lifted_inputs: frozenset[int],
    grad_group: Any = None,
) -> tuple[CapturedForward, list[WrittenValue]]:
    """One trace of build(), cleaned up; and what build() changed on the user's objects."""
    param_names = [n for n, _ in root.named_parameters()]
    buffer_names = [n for n, _ in root.named_buffers()]
    input_names = inputs.names(root._build)
    layout = ForwardLayout(len(param_names), len(buffer_names), len(input_names))
    traced = _trace(root, inputs, layout, graph_name, device, amp, lifted, grad_group)
    gm = traced.gm
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholders = layout.split(nodes[: len(layout)])
    value_names = [f"value_{i}" for i in range(len(lifted))]
    names = layout.flatten(
        params=[f"p_{n}" for n in param_names],
        buffers=[f"b_{n}" for n in buffer_names],
        inputs=[f"in_{n}" for n in input_names],
        loss_scale="loss_scale",
    )
    rename_placeholders(gm, names + [f"c_{n}" for n in value_names])
    values = [(read.label, node) for read, node in zip(lifted, nodes[len(layout) :])]
    values += [(f"argument {input_names[i]}", placeholders.inputs[i]) for i in lifted_inputs]
    refuse_values_read_on_the_host(values, graph_name)
    mutated = check_input_mutations(traced.mutated, layout, input_names, graph_name)
    # the lifted values' placeholders are the last ones: constants, read live at every call
    constants, constant_names = lift_constants(gm, _tensor_attributes(root))
    constants = [*traced.value_holders, *constants]
    constant_names = [*value_names, *constant_names]
    code = traced.gradient_code
    changed = _cleaned_up(gm, placeholders.buffers, traced.num_results, mutated, code.num_outputs)
    captured = CapturedForward(
        gm=gm,
        param_names=param_names,
        buffer_names=buffer_names,
        input_names=input_names,
        num_user_outputs=traced.num_user_outputs,
        output_spec=traced.output_spec,
        output_template=traced.output_template,
        loss_frames=[r.where for r in traced.losses],
        loss_grad_given=[r.gradient is not None for r in traced.losses],
        mutated_buffers=changed,
        loss_inputs=traced.loss_inputs,
        function_calls=traced.function_calls,
        constants=constants,
        constant_names=constant_names,
        num_written=len(traced.written_outputs),
        attribute_reads=tuple(traced.attribute_reads),
        lifted=tuple(map(LiftedValue, lifted, traced.value_holders)),
        gradient_code=code,
    )
    captured.unused_params = params_without_path_to_losses(captured)
    log.debug("captured %s.build(): %d nodes", graph_name, len(gm.graph.nodes))
    return captured, traced.written


def _cleaned_up(
    gm: fx.GraphModule, buffers: list, num_results: int, mutated: Any, trailing: int
) -> Any:
    """The captured graph without autograd's detaches, its no-grad values detached and only
    the buffers build() changes written; returns those buffers (``keep_changed_buffers``)."""
    drop_autograd_detaches(gm)
    drop_profiler_markers(gm.graph)  # zero_grad() in build()
    detach_no_grad_values(gm)
    changed = keep_changed_buffers(gm, buffers, num_results, mutated, trailing)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return changed


@dataclass
class TracedBuild:
    """build() traced once: the graph, and what build() did while it ran (filled by the trace).

    The graph's outputs are ``(*build()'s tensors, *tensors build() wrote on the user's
    objects, *losses, *explicit loss gradients, *every buffer's value after build(), *the
    parameters' .grad build() left, *the parameters' values build() changed)``
    (``GradientCode``)."""

    function_calls: list[FunctionCall] = field(default_factory=list)  # custom Functions applied
    attribute_reads: list[AttributeRead] = field(default_factory=list)  # what build() read
    losses: list[RecordedLoss] = field(default_factory=list)  # one per backward() call
    loss_inputs: list[frozenset[int] | None] = field(default_factory=list)  # backward(inputs=)
    output_template: list[Any] = field(default_factory=list)  # TENSOR where a tensor goes
    mutated: list[int] = field(default_factory=list)  # flat inputs build() changed in place
    written: list[WrittenValue] = field(default_factory=list)  # Python state build() changed
    written_outputs: list[torch.Tensor] = field(default_factory=list)  # the tensors among it
    value_holders: list[torch.Tensor] = field(default_factory=list)  # one per lifted value
    gradient_code: GradientCode = field(default_factory=GradientCode)
    output_spec: pytree.TreeSpec = field(init=False)  # build()'s return structure
    gm: fx.GraphModule = field(init=False)

    @property
    def num_user_outputs(self) -> int:
        """build()'s tensors and the tensors it wrote on the user's objects."""
        return sum(1 for x in self.output_template if x is TENSOR) + len(self.written_outputs)

    @property
    def num_results(self) -> int:
        """Outputs before the buffers' values: build()'s tensors, losses, loss gradients."""
        explicit = sum(r.gradient is not None for r in self.losses)
        return self.num_user_outputs + len(self.losses) + explicit


def _trace(
    root: BuildRoot,
    inputs: FlatInputs,
    layout: ForwardLayout,
    graph_name: str,
    device: torch.device | None,
    amp: bool,
    lifted: tuple[AttributeRead, ...] = (),
    grad_group: Any = None,
) -> TracedBuild:
    """make_fx over the functionalized forward, with torch's errors turned into CaptureErrors.
    Each lifted value is an input after the layout's (its holder, the value as a 0-dim float32
    tensor, is the example)."""
    user_modules = [(n, m) for n, m in root.named_modules() if m is not root]
    refuse_hooks(graph_name, user_modules)
    refuse_compiled_submodules(graph_name, root)
    traced = TracedBuild()
    forward = _traced_function(root, inputs, layout, graph_name, amp, traced, lifted, grad_group)
    at = _device_of([*root.parameters(), *root.buffers(), *inputs.tensors])
    traced.value_holders = [
        torch.tensor(read.current(), dtype=torch.float32, device=at) for read in lifted
    ]
    example = _example_inputs(root, inputs, layout, device, traced.value_holders)
    try:
        # is_compiling() True, as under torch.compile: libraries skip host-side checks that read
        # tensor values (transformers' padding warning, for one), which a step cannot run anyway
        with compiling(), quiet_fake_data_pointers():
            traced.gm = trace_functional(
                forward, example, propagate_input_mutations=False, allow_constants=True
            )
    except GraphampError:
        raise
    except VALUE_DEPENDENT as e:  # an op fake tensors cannot run is named (op_errors.py)
        raise fake_kernel_error(graph_name, e, _at(e)) or _host_read_error(graph_name, e) from e
    except Exception as e:  # anything else is worded once, by the pipeline's capture stage
        if raised_in_torch_grad_scaler(e):
            raise torch_grad_scaler_error(user_frame_of_exception(e), graph_name) from e
        raise
    return traced


def _traced_function(
    root: BuildRoot,
    inputs: FlatInputs,
    layout: ForwardLayout,
    graph_name: str,
    amp: bool,
    traced: TracedBuild,
    lifted: tuple[AttributeRead, ...],
    grad_group: Any = None,
) -> Callable[..., tuple]:
    """build() as a function of the forward's flat inputs (``layout``, no constants yet): the
    traced values are swapped into the user's modules while it runs; ``traced`` is filled."""
    module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    watched = watched_objects(root)
    user_modules = [(n, m) for n, m in root.named_modules() if m is not root]
    reading, classes = objects_read(user_modules, root.owner, root.own)
    state = [*root.parameters(), *root.buffers()]
    buffer_names = [n for n, _ in root.named_buffers()]
    slots = state_slots(root)

    def forward(*every: torch.Tensor) -> tuple:
        flat, values = every[: len(layout)], every[len(layout) :]
        parts = layout.split(flat)
        replacement = {id(t): v for t, v in zip(state, [*parts.params, *parts.buffers])}
        real_of = {id(v): t for t, v in zip(state, [*parts.params, *parts.buffers])}
        args, kwargs = inputs.rebuild(parts.inputs)
        mode = CaptureMode(
            module_names,
            loss_scale=parts.loss_scale,
            mixed_dtypes_ok=amp,
            params=tuple(parts.params),
            aliases=replacement,
            grad_group=grad_group,
        )
        scope = ScopeReads(graph_name, skip={read.place() for read in lifted})
        with (
            refusing_host_randomness(graph_name, watched),
            recording_attribute_reads(reading, classes) as reads,
            torch.enable_grad(),
            swapped(slots, replacement),
            lifting(lifted, values),  # before the state's snapshot: not a write of build()'s
            StateWatch(watched).recording() as watch,
            scope.restoring(),
            mode.tracking_modules(),
            mode,
            capturing_autograd_functions(traced.function_calls),
        ):
            with scope.tracing():
                out = root._build(*args, **kwargs)
            new_buffers = [root.get_buffer(n) for n in buffer_names]  # the updated values
            changes = watch.changes() + scope.state_changes()
            written = written_values(graph_name, changes, real_of)
        traced.written, traced.written_outputs = written
        traced.attribute_reads = reads + scope.recorded()
        traced.mutated = mutated_inputs(every)
        return _outputs(traced, mode, out, parts.params, layout, new_buffers, values)

    return forward


def _outputs(
    traced: TracedBuild,
    mode: CaptureMode,
    out: Any,
    params: list[torch.Tensor],
    layout: ForwardLayout,
    new_buffers: list[torch.Tensor],
    values: Sequence[torch.Tensor] = (),
) -> tuple:
    """The traced function's outputs (``TracedBuild``'s order) after build() returned
    ``out``; what build() did is recorded in ``traced``. A lifted value returned as it was
    read (``values``: their traced inputs) is returned as the Python float it is."""
    leaves, traced.output_spec = pytree.tree_flatten(out)
    position = {id(t): i for i, t in enumerate(params)}
    traced.losses = mode.losses
    lifted = {id(v): LiftedOutput(i) for i, v in enumerate(values)}
    traced.output_template = [
        lifted.get(id(x), TENSOR) if isinstance(x, torch.Tensor) else x for x in leaves
    ]
    traced.loss_inputs = [parameter_positions(r, position) for r in mode.losses]
    traced.gradient_code, explicit = _gradient_code(mode, layout, traced.mutated)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and id(x) not in lifted]
    losses = [r.tensor for r in mode.losses]
    grads = [r.gradient for r in mode.losses if r.gradient is not None]
    new_params = [params[i] for i in traced.gradient_code.changed_params]
    return (
        *tensors,
        *traced.written_outputs,
        *losses,
        *grads,
        *new_buffers,
        *explicit,
        *new_params,
    )


def _gradient_code(
    mode: CaptureMode, layout: ForwardLayout, mutated: list[int]
) -> tuple[GradientCode, list[torch.Tensor]]:
    """What build()'s own gradient code leaves for the step (``gradient_book.py``), and the
    parameters' .grad it left."""
    changed = [i for i in mutated if i < layout.params]
    if mode.book is None:
        return GradientCode(0, (), tuple(changed)), []
    explicit = mode.book.explicit()
    positions = tuple(i for i, _ in explicit)
    return GradientCode(mode.book.taken, positions, tuple(changed)), [g for _, g in explicit]


def _example_inputs(
    root: BuildRoot,
    inputs: FlatInputs,
    layout: ForwardLayout,
    device: torch.device | None,
    values: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The traced function's inputs (the layout's, then the lifted ``values``). Parameters
    require grad as the user's do: build() may differentiate (torch.autograd.grad)."""
    params = [p.detach().requires_grad_(p.requires_grad) for p in root.parameters()]
    buffers = list(root.buffers())
    at = _device_of([*params, *buffers, *inputs.tensors])
    example = layout.flatten(
        params=params,
        buffers=buffers,
        inputs=list(inputs.tensors),
        loss_scale=torch.ones((), dtype=torch.float32, device=at),
    ) + list(values)
    if device is not None:
        mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        example = [fake_copy(mode, t, device) for t in example]
    return example


def refuse_values_read_on_the_host(values: list[tuple[str, fx.Node]], graph_name: str) -> None:
    """A lifted value (label, placeholder) that an op takes as a Python number
    (``leaky_relu``'s slope, a size) is read back from its tensor in the step
    (``aten._local_scalar_dense``): a host read at every step, a sync on a GPU. Such a value is
    not lifted (the runtime bakes it in again): the error's ``needs_numbers`` names each."""
    needed = []
    for label, placeholder in values:
        todo, seen = [placeholder], set()
        while todo:
            node = todo.pop()
            if node.target is torch.ops.aten._local_scalar_dense.default:
                needed.append((label, ", ".join(str(u.target) for u in node.users)))
                break
            if node not in seen:
                seen.add(node)
                todo.extend(node.users)
    if needed:
        error = CaptureError(
            f"{graph_name}.build() uses "
            + "; ".join(f"{label} where a Python number is needed ({ops})" for label, ops in needed)
        )
        error.needs_numbers = [label for label, _ in needed]  # type: ignore[attr-defined]
        raise error


@contextlib.contextmanager
def lifting(reads: tuple[AttributeRead, ...], values: Sequence[torch.Tensor]) -> Iterator[None]:
    """While build() is traced, each lifted Python value reads as its traced input."""
    originals = [read.current() for read in reads]
    try:
        for read, value in zip(reads, values, strict=True):
            read.write(value)
        yield
    finally:
        for read, value in zip(reads, originals):
            read.write(value)


def _tensor_attributes(root: BuildRoot) -> dict[int, str]:
    """id -> path of the plain tensor attributes of the registered modules (not parameters
    or buffers): the names lifted constants get."""
    return {
        id(v): f"{path}.{k}" if path else k
        for path, m in root.named_modules()
        for k, v in vars(m).items()
        if isinstance(v, torch.Tensor)
    }


def _host_read_error(graph_name: str, e: BaseException) -> CaptureError:
    return CaptureError(
        f"{graph_name}.build() uses the value of a tensor in Python{_at(e)}. graphamp captures "
        "build() once on shapes alone, so Python control flow and .item()/float()/bool() on "
        "tensors cannot be recorded. Compute both branches and select with torch.where, "
        "or return the tensor from build() and decide outside the graph"
    )


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return next((t.device for t in tensors), torch.device("cpu"))


def _at(e: BaseException) -> str:
    frame = user_frame_of_exception(e)
    return f" at {frame}" if frame else ""
