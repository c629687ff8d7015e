"""What torch.autocast does on the same forward, measured with a dispatch mode.

build() runs eagerly, once, on fake copies of the graph's state (nothing real is computed or
changed) under ``torch.autocast`` for the graph's device and AMP dtype. A TorchDispatchMode below
autocast records every aten op with its floating dtypes, so autocast's casts (``_to_copy`` that
change a floating dtype; its cache of parameter casts works as in real training) and the dtype
every op ran in are measured, not guessed. ``backward()`` is recorded, not run, as in capture;
BatchNorm and dropout take the same functional routes as in capture (autocast does not list them,
so this changes no decision) and ``scaled_dot_product_attention`` follows autocast's
``lower_precision_fp`` policy for it (inputs cast to the AMP dtype), without the device-specific
kernel choice, so the rows line up with graphamp's captured graph.

The CUDA policy can be measured on a machine without a GPU: fake CUDA tensors dispatch through
autocast's CUDA kernels.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses, torch.utils._python_dispatch, torch.utils._pytree
import contextlib
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..records.inputs import FlatInputs
from ..records.spec import STRUCTURAL_OPS, AutocastTrace, OracleOp
from .intercept import CaptureMode
from .root import BuildRoot, fake_copy, quiet_fake_data_pointers
from .state_writes import StateWatch, watched_objects


def _canonical(func: Any) -> str:
    name = str(getattr(func, "overloadpacket", func))
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _float_dtypes(tree: Any) -> list[torch.dtype]:
    return [
        t.dtype
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point
    ]


class _Recorder(TorchDispatchMode):
    def __init__(self, modules: CaptureMode):
        super().__init__()
        self.modules = modules
        self.ops: list[OracleOp] = []
        self.casts: list[OracleOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _canonical(func)
        where = self.modules._stack[-1][0] if self.modules._stack else ""
        ins, outs = _float_dtypes((args, kwargs)), _float_dtypes(out)
        if name == "aten._to_copy" and ins and outs and ins[0] != outs[0]:
            self.casts.append(OracleOp(name, where, outs[0]))
        elif name not in STRUCTURAL_OPS:
            self.ops.append(OracleOp(name, where, outs[0] if outs else (ins[0] if ins else None)))
        return out


@contextlib.contextmanager
def autocast_enabled(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """torch.autocast, also for CUDA on a machine without one (fake CUDA tensors)."""
    if device_type != "cuda" or torch.cuda.is_available():
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
        return
    enabled, old = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", old)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


def autocast_forward(
    root: BuildRoot, inputs: FlatInputs, dtype: torch.dtype, device: torch.device | None = None
) -> AutocastTrace:
    """Run build() under torch.autocast on fake tensors and record what autocast did."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    target = (
        device
        if device is not None
        else next((t.device for t in [*root.parameters(), *inputs.tensors]), torch.device("cpu"))
    )
    state = {n: fake_copy(mode, p, target) for n, p in root.named_parameters()}
    state.update({n: fake_copy(mode, b, target) for n, b in root.named_buffers()})
    devices = inputs.devices or [t.device for t in inputs.tensors]
    fake_inputs = [
        fake_copy(mode, t, device if device is not None else d)
        for t, d in zip(inputs.tensors, devices)
    ]
    args, kwargs = inputs.rebuild(fake_inputs)
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    # gradients build() reads are taken as in capture, seeded with a scale of one
    params = tuple(state[n] for n, _ in root.named_parameters())
    one = fake_copy(mode, torch.ones(()), target)
    real = [*root.named_parameters(), *root.named_buffers()]
    aliases = {id(t): state[n] for n, t in real}
    capture = CaptureMode(names, sdpa_policy=dtype, loss_scale=one, params=params, aliases=aliases)
    recorder = _Recorder(capture)
    buffer_names = [n for n, _ in root.named_buffers()]
    with (
        StateWatch(watched_objects(root)).recording(),  # what build() writes is put back
        mode,
        autocast_enabled(target.type, dtype),
        capture.tracking_modules(),
        capture,
        recorder,
        quiet_fake_data_pointers(),
    ):
        torch.func.functional_call(
            root, state, (args, kwargs, buffer_names), tie_weights=True, strict=True
        )
    return AutocastTrace(target.type, dtype, recorder.ops, len(recorder.casts), recorder.casts)
