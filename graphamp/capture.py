"""Capture: trace build() into a functional aten-level forward graph.

The forward graph's placeholders are ``(*parameters, *buffers, *input tensors)`` and its outputs
``(*tensors build() returned, *losses, *explicit loss gradients, *new values of mutated buffers)``.
Tracing runs on fake tensors (nothing real is computed or mutated), functionalized, with the
parameters and buffers lifted to inputs through ``torch.func.functional_call``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch._subclasses.fake_tensor as fake_tensor
import torch.fx as fx
import torch.fx.experimental.symbolic_shapes as symbolic_shapes
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from .errors import CaptureError, GraphampError
from .fxutil import UserFrame, rename_placeholders, user_frame_of_exception
from .intercept import CaptureMode
from .signature import FlatInputs

log = logging.getLogger("graphamp")
aten = torch.ops.aten


class BuildRoot(nn.Module):
    """Holds a Graph's registered modules so functional_call can swap in traced tensors."""

    def __init__(self, modules: dict[str, nn.Module], build: Callable[..., Any]):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self._build = build

    def forward(self, args: tuple, kwargs: dict, buffer_names: list[str]):
        out = self._build(*args, **kwargs)
        # Read the buffers while the traced values are swapped in: these are the updated ones.
        return out, [self.get_buffer(n) for n in buffer_names]


@dataclass
class CapturedForward:
    gm: fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    input_names: list[str]
    num_user_outputs: int
    output_spec: pytree.TreeSpec
    output_template: list[Any]  # build()'s return leaves, with None where a tensor goes
    loss_frames: list[UserFrame | None]
    loss_grad_given: list[bool]
    mutated_buffers: list[int]  # indexes into buffer_names, in output order
    # per loss: the parameter positions backward(inputs=...) named, or None for all
    loss_inputs: list[frozenset[int] | None] = field(default_factory=list)
    unused_params: set[int] = field(default_factory=set)  # params no loss sends gradients to

    @property
    def num_losses(self) -> int:
        return len(self.loss_frames)

    @property
    def num_inputs(self) -> int:
        return len(self.input_names)

    def unflatten_outputs(self, tensors: list[Any]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if x is _TENSOR else x for x in self.output_template]
        return pytree.tree_unflatten(leaves, self.output_spec)


_TENSOR = object()  # marks where build()'s return value held a tensor
_DATA_DEPENDENT = tuple(
    e
    for e in (
        getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None),
        getattr(fake_tensor, "DataDependentOutputException", None),
        getattr(fake_tensor, "DynamicOutputShapeException", None),
    )
    if e is not None
)


def capture_forward(
    root: BuildRoot,
    inputs: FlatInputs,
    graph_name: str,
    device: torch.device | None = None,
) -> CapturedForward:
    """Trace ``root``'s build() on fake copies of its state and ``inputs``.

    ``device`` traces as if everything lived there (fake tensors): the CUDA graph of a model can
    be captured and inspected on a machine without a GPU.
    """
    named_params = list(root.named_parameters())
    named_buffers = list(root.named_buffers())
    param_names = [n for n, _ in named_params]
    buffer_names = [n for n, _ in named_buffers]
    module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    n_params, n_buffers = len(param_names), len(buffer_names)
    result: dict[str, Any] = {}

    def forward(*flat: torch.Tensor):
        state = dict(zip(param_names, flat[:n_params]))
        state.update(zip(buffer_names, flat[n_params : n_params + n_buffers]))
        args, kwargs = inputs.rebuild(list(flat[n_params + n_buffers :]))
        mode = CaptureMode(module_names)
        with torch.enable_grad(), mode.tracking_modules(), mode:
            out, new_buffers = torch.func.functional_call(
                root, state, (args, kwargs, buffer_names), tie_weights=True, strict=True
            )
        leaves, spec = pytree.tree_flatten(out)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        result["spec"] = spec
        result["template"] = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        result["losses"] = mode.losses
        position = {id(t): i for i, t in enumerate(flat[:n_params])}
        result["loss_inputs"] = [_parameter_positions(r, position, param_names)
                                 for r in mode.losses]
        losses = [r.tensor for r in mode.losses]
        grads = [r.gradient for r in mode.losses if r.gradient is not None]
        return (*tensors, *losses, *grads, *new_buffers)

    example = [p.detach() for _, p in named_params] + [b for _, b in named_buffers]
    example += list(inputs.tensors)
    if device is not None:
        from .oracle import fake_copy

        mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)
        example = [fake_copy(mode, t, device) for t in example]
    try:
        with _compiling_flag():
            gm = make_fx(
                torch.func.functionalize(forward, remove="mutations"), tracing_mode="fake"
            )(*example)
    except GraphampError:
        raise
    except _DATA_DEPENDENT as e:
        frame = user_frame_of_exception(e)
        where = f" at {frame}" if frame else ""
        raise CaptureError(
            f"{graph_name}.build() uses the value of a tensor in Python{where}. graphamp captures "
            "build() once on shapes alone, so Python control flow and .item()/float()/bool() on "
            "tensors cannot be recorded. Compute both branches and select with torch.where, "
            "or return the tensor from build() and decide outside the graph"
        ) from e
    except Exception as e:
        frame = user_frame_of_exception(e)
        where = f" at {frame}" if frame else ""
        raise CaptureError(
            f"capturing {graph_name}.build() failed{where}: {type(e).__name__}: {e}"
        ) from e

    records = result["losses"]
    n_outputs = sum(1 for x in result["template"] if x is _TENSOR)
    n_grads = sum(r.gradient is not None for r in records)
    input_names = inputs.names(root._build)
    rename_placeholders(
        gm,
        [f"p_{n}" for n in param_names] + [f"b_{n}" for n in buffer_names]
        + [f"in_{n}" for n in input_names],
    )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mutated = _strip_input_mutations(gm, placeholders, param_names, buffer_names, input_names,
                                     graph_name)
    _detach_no_grad_values(gm)
    # Keep only the buffers build() really changed among the outputs.
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output_node.args[0])
    first_buffer = n_outputs + len(records) + n_grads
    buffer_outs = outs[first_buffer:]
    changed = [i for i, node in enumerate(buffer_outs) if node is not placeholders[n_params + i]]
    unexpected = set(mutated) - set(changed)
    if unexpected:  # a copy_ into a buffer that functional_call did not see: keep its value
        raise CaptureError(f"internal: buffer update not visible for {sorted(unexpected)}")
    output_node.args = (tuple(outs[:first_buffer] + [buffer_outs[i] for i in changed]),)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()

    captured = CapturedForward(
        gm=gm,
        param_names=param_names,
        buffer_names=buffer_names,
        input_names=input_names,
        num_user_outputs=n_outputs,
        output_spec=result["spec"],
        output_template=result["template"],
        loss_frames=[r.where for r in records],
        loss_grad_given=[r.gradient is not None for r in records],
        mutated_buffers=changed,
        loss_inputs=result["loss_inputs"],
    )
    captured.unused_params = _params_without_path_to_losses(captured)
    log.debug("captured %s.build(): %d nodes", graph_name, len(gm.graph.nodes))
    return captured


@contextlib.contextmanager
def _compiling_flag():
    """``torch.compiler.is_compiling()`` is True while build() is captured, as under
    torch.compile and torch.export: libraries then skip host-side checks that read tensor values
    (transformers' padding warning, for one), which a compiled step cannot run anyway."""
    compiler = torch.compiler
    if not hasattr(compiler, "_is_compiling_flag"):
        yield
        return
    saved = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = saved


def _strip_input_mutations(
    gm: fx.GraphModule,
    placeholders: list[fx.Node],
    param_names: list[str],
    buffer_names: list[str],
    input_names: list[str],
    graph_name: str,
) -> list[int]:
    """Remove functionalization's trailing ``copy_`` into inputs; the forward graph stays pure.

    Buffer updates are already among the outputs (read back inside functional_call); in-place
    changes to parameters or to g(...)'s arguments are errors.
    """
    n_params, n_buffers = len(param_names), len(buffer_names)
    index = {node: i for i, node in enumerate(placeholders)}
    mutated_buffers = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy_.default:
            continue
        dst = node.args[0]
        i = index.get(dst)
        if i is None:
            continue
        if i < n_params:
            raise CaptureError(
                f"{graph_name}.build() changes parameter {param_names[i]!r} in place. Parameters "
                "are updated only by the optimizer inside the graph; change them outside g(...)"
            )
        if i >= n_params + n_buffers:
            raise CaptureError(
                f"{graph_name}.build() changes its argument {input_names[i - n_params - n_buffers]!r}"
                " in place; work on a copy (x = x.clone()) or return the new value instead"
            )
        mutated_buffers.append(i - n_params)
        gm.graph.erase_node(node)
    return mutated_buffers


def _detach_no_grad_values(gm: fx.GraphModule) -> None:
    """Values computed under torch.no_grad() in build() carry no gradient, as in eager mode."""
    for node in list(gm.graph.nodes):
        if not node.meta.get("no_grad"):
            continue
        users = [u for u in node.users if not u.meta.get("no_grad")]
        val = node.meta.get("val")
        if not users or not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        with gm.graph.inserting_after(node):
            detached = gm.graph.call_function(aten.detach.default, (node,))
        detached.meta.update(val=val, nn_module_stack=node.meta.get("nn_module_stack"),
                             user_frame=node.meta.get("user_frame"), no_grad=False)
        for user in users:
            user.replace_input_with(node, detached)


def _parameter_positions(record, position: dict[int, int], names: list[str]):
    if not record.inputs:
        return None
    out = set()
    for t in record.inputs:
        if id(t) not in position:
            where = f" at {record.where}" if record.where else ""
            raise CaptureError(
                f"backward(inputs=...){where} names a tensor that is not a parameter of a "
                "registered module; graphamp differentiates with respect to parameters only "
                "(pass, e.g., inputs=list(self.generator.parameters()))")
        out.add(position[id(t)])
    return frozenset(out)


def _params_without_path_to_losses(captured: CapturedForward) -> set[int]:
    """Parameters no loss sends gradients to: eager autograd leaves their .grad None and the
    optimizer skips them (no weight decay, no momentum); the step must do the same."""
    graph = captured.gm.graph
    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = output_node.args[0]
    losses = outs[captured.num_user_outputs : captured.num_user_outputs + captured.num_losses]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_params = len(captured.param_names)
    used: set[int] = set()
    for loss, restrict in zip(losses, captured.loss_inputs):
        reached: set[fx.Node] = set()
        stack = [loss] if isinstance(loss, fx.Node) else []
        while stack:
            node = stack.pop()
            if node in reached or node.target is aten.detach.default:
                continue
            reached.add(node)
            stack.extend(node.all_input_nodes)
        reachable = {i for i in range(n_params) if placeholders[i] in reached}
        used |= reachable if restrict is None else reachable & restrict
    return set(range(n_params)) - used
