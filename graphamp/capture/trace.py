"""Capture: trace build() into a functional aten-level forward graph (a CapturedForward).

Tracing runs on fake tensors (nothing real is computed or mutated), functionalized, with the
parameters and buffers lifted to inputs: their traced values are swapped into the user's modules
for the length of the trace (``swap.py``), and the user's own tensors are always put back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import torch
import torch._subclasses.fake_tensor as fake_tensor
import torch.fx as fx
import torch.fx.experimental.symbolic_shapes as symbolic_shapes
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..errors import CaptureError, GraphampError
from ..records.fxutil import rename_placeholders, trace_functional, user_frame_of_exception
from ..records.inputs import FlatInputs
from ..records.spec import TENSOR, CapturedForward
from .cleanup import (
    check_input_mutations,
    detach_no_grad_values,
    drop_autograd_detaches,
    keep_changed_buffers,
    lift_constants,
    mutated_inputs,
    params_without_path_to_losses,
)
from .functions import capturing_autograd_functions
from .intercept import CaptureMode, parameter_positions
from .root import BuildRoot, fake_copy, quiet_fake_data_pointers, refuse_compiled_submodules
from .side_effects import refuse_hooks, refusing_attribute_writes
from .swap import state_slots, swapped

log = logging.getLogger("graphamp")

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
    amp: bool = False,
) -> CapturedForward:
    """Trace ``root``'s build() on fake copies of its state and ``inputs``.

    ``amp``: graphamp's AMP will decide the dtypes, so ops given tensors of several floating
    dtypes (which eager PyTorch refuses without autocast) are left for its casts to reconcile.

    ``device`` traces as if everything lived there (fake tensors): the CUDA graph of a model can
    be captured and inspected on a machine without a GPU.
    """
    param_names = [n for n, _ in root.named_parameters()]
    buffer_names = [n for n, _ in root.named_buffers()]
    gm, traced = _trace(root, inputs, param_names, buffer_names, graph_name, device, amp)
    input_names = inputs.names(root._build)
    n_losses, n_grads = len(traced["losses"]), sum(r.gradient is not None for r in traced["losses"])
    n_outputs = sum(1 for x in traced["template"] if x is TENSOR)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rename_placeholders(
        gm,
        [f"p_{n}" for n in param_names]
        + [f"b_{n}" for n in buffer_names]
        + [f"in_{n}" for n in input_names]
        + ["loss_scale"],
    )
    mutated = check_input_mutations(
        traced["mutated"], param_names, buffer_names, input_names, graph_name
    )
    constants, constant_names = lift_constants(gm, _tensor_attributes(root))
    drop_autograd_detaches(gm)
    detach_no_grad_values(gm)
    changed = keep_changed_buffers(
        gm, placeholders, len(param_names), n_outputs + n_losses + n_grads, mutated
    )
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    captured = CapturedForward(
        gm=gm,
        param_names=param_names,
        buffer_names=buffer_names,
        input_names=input_names,
        num_user_outputs=n_outputs,
        output_spec=traced["spec"],
        output_template=traced["template"],
        loss_frames=[r.where for r in traced["losses"]],
        loss_grad_given=[r.gradient is not None for r in traced["losses"]],
        mutated_buffers=changed,
        loss_inputs=traced["loss_inputs"],
        function_calls=traced["function_calls"],
        constants=constants,
        constant_names=constant_names,
    )
    captured.unused_params = params_without_path_to_losses(captured)
    log.debug("captured %s.build(): %d nodes", graph_name, len(gm.graph.nodes))
    return captured


def _trace(
    root: BuildRoot,
    inputs: FlatInputs,
    param_names: list[str],
    buffer_names: list[str],
    graph_name: str,
    device: torch.device | None,
    amp: bool,
) -> tuple[fx.GraphModule, dict[str, Any]]:
    """make_fx over the functionalized forward; returns the graph and what build() reported
    (losses, return structure), with torch's errors turned into CaptureErrors."""
    module_names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    user_modules = [(n, m) for n, m in root.named_modules() if m is not root]
    refuse_hooks(graph_name, user_modules)
    refuse_compiled_submodules(graph_name, root)
    watched = [(f"self.{n}", m) for n, m in user_modules]
    owner = getattr(root._build, "__self__", None)  # the Graph (build is its bound method)
    watched += [("self", owner)] if owner is not None and hasattr(owner, "__dict__") else []
    params, buffers = list(root.parameters()), list(root.buffers())
    slots = state_slots(root)
    n_state = len(params) + len(buffers)
    traced: dict[str, Any] = {"function_calls": []}

    def forward(*flat: torch.Tensor):
        replacement = {id(t): v for t, v in zip([*params, *buffers], flat[:n_state])}
        args, kwargs = inputs.rebuild(list(flat[n_state:-1]))
        mode = CaptureMode(module_names, loss_scale=flat[-1], mixed_dtypes_ok=amp)
        with (
            refusing_attribute_writes(graph_name, watched),
            torch.enable_grad(),
            swapped(slots, replacement),
            mode.tracking_modules(),
            mode,
            capturing_autograd_functions(traced["function_calls"]),
        ):
            out = root._build(*args, **kwargs)
            new_buffers = [root.get_buffer(n) for n in buffer_names]  # the updated values
        leaves, spec = pytree.tree_flatten(out)
        position = {id(t): i for i, t in enumerate(flat[: len(params)])}
        traced.update(
            spec=spec,
            losses=mode.losses,
            template=[TENSOR if isinstance(x, torch.Tensor) else x for x in leaves],
            loss_inputs=[parameter_positions(r, position) for r in mode.losses],
        )
        traced["mutated"] = mutated_inputs(flat)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        losses = [r.tensor for r in mode.losses]
        grads = [r.gradient for r in mode.losses if r.gradient is not None]
        return (*tensors, *losses, *grads, *new_buffers)

    # parameters require grad as the user's do: build() may differentiate (torch.autograd.grad)
    example = [p.detach().requires_grad_(p.requires_grad) for p in params] + buffers
    example += list(inputs.tensors)
    example.append(
        torch.ones((), dtype=torch.float32, device=_device_of(example))
    )  # the loss scale
    if device is not None:
        mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        example = [fake_copy(mode, t, device) for t in example]
    try:
        with _compiling_flag(), quiet_fake_data_pointers():
            gm = trace_functional(
                forward, example, propagate_input_mutations=False, allow_constants=True
            )
    except GraphampError:
        raise
    except _DATA_DEPENDENT as e:
        raise CaptureError(
            f"{graph_name}.build() uses the value of a tensor in Python{_at(e)}. graphamp captures "
            "build() once on shapes alone, so Python control flow and .item()/float()/bool() on "
            "tensors cannot be recorded. Compute both branches and select with torch.where, "
            "or return the tensor from build() and decide outside the graph"
        ) from e
    except Exception as e:
        if _raised_in(e, _TORCH_GRAD_SCALER):
            raise CaptureError(
                f"{graph_name}.build() uses a torch.amp.GradScaler{_at(e)}: graphamp scales, "
                "unscales, skips and updates inside the step. Call set_grad_scaler(scaler) in "
                "__init__ and remove scaler.scale/step/update from build()"
            ) from e
        raise CaptureError(
            f"capturing {graph_name}.build() failed{_at(e)}: {type(e).__name__}: {e}"
        ) from e
    return gm, traced


_TORCH_GRAD_SCALER = os.path.join("torch", "amp", "grad_scaler.py")


def _raised_in(e: BaseException, filename_end: str) -> bool:
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(filename_end):
            return True
        tb = tb.tb_next
    return False


def _tensor_attributes(root: BuildRoot) -> dict[int, str]:
    """id -> path of the plain tensor attributes of the registered modules (not parameters
    or buffers): the names lifted constants get."""
    return {
        id(v): f"{path}.{k}" if path else k
        for path, m in root.named_modules()
        for k, v in vars(m).items()
        if isinstance(v, torch.Tensor)
    }


def _device_of(tensors: list[torch.Tensor]) -> torch.device:
    return next((t.device for t in tensors), torch.device("cpu"))


def _at(e: BaseException) -> str:
    frame = user_frame_of_exception(e)
    return f" at {frame}" if frame else ""


_flag_lock = threading.Lock()
_flag_users = [0, False]  # captures running in any thread; the flag's value before the first


@contextlib.contextmanager
def _compiling_flag():
    """``torch.compiler.is_compiling()`` is True while build() is captured, as under
    torch.compile and torch.export: libraries then skip host-side checks that read tensor values
    (transformers' padding warning, for one), which a compiled step cannot run anyway. The flag
    is process-wide: it is set when the first capture (in any thread) starts and put back when
    the last one ends, on every path."""
    compiler = torch.compiler
    if not hasattr(compiler, "_is_compiling_flag"):
        yield
        return
    with _flag_lock:
        if _flag_users[0] == 0:
            _flag_users[1] = compiler._is_compiling_flag
        _flag_users[0] += 1
        compiler._is_compiling_flag = True
    try:
        yield
    finally:
        with _flag_lock:
            _flag_users[0] -= 1
            if _flag_users[0] == 0:
                compiler._is_compiling_flag = _flag_users[1]
