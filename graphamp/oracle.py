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

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from .capture import BuildRoot
from .fxutil import module_path, op_name
from .intercept import CaptureMode
from .passes.base import is_compute_node
from .passes.insert_casts import dtype_after_amp
from .signature import FlatInputs

if TYPE_CHECKING:
    from .graph import Graph
    from .program import Program

aten = torch.ops.aten
# Ops that move or alias data without computing: not compared op by op.
_STRUCTURAL = {"aten._to_copy", "aten.detach", "aten.alias", "aten.lift_fresh", "aten.lift_fresh_copy",
               "aten.empty", "aten.copy", "prim.device", "aten.empty_strided"}


@dataclass
class OracleOp:
    op: str
    module: str
    dtype: torch.dtype | None  # the floating dtype it computed in (output, else first input)


@dataclass
class AutocastTrace:
    device_type: str
    dtype: torch.dtype
    ops: list[OracleOp]
    casts: int
    cast_ops: list[OracleOp] = field(default_factory=list)

    @property
    def ops_low(self) -> int:
        return sum(op.dtype == self.dtype for op in self.ops)


def _canonical(func: Any) -> str:
    name = str(getattr(func, "overloadpacket", func))
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _float_dtypes(tree: Any) -> list[torch.dtype]:
    return [t.dtype for t in pytree.tree_leaves(tree)
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]


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
        elif name not in _STRUCTURAL:
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


def fake_copy(mode: FakeTensorMode, t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A fake tensor like ``t`` (on ``device`` if given), keeping requires_grad and leafness."""
    with mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                  device=device if device is not None else t.device)
    return out.requires_grad_(t.requires_grad) if t.dtype.is_floating_point else out


def autocast_forward(root: BuildRoot, inputs: FlatInputs, dtype: torch.dtype,
                     device: torch.device | None = None) -> AutocastTrace:
    """Run build() under torch.autocast on fake tensors and record what autocast did."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    target = device if device is not None else next(
        (t.device for t in [*root.parameters(), *inputs.tensors]), torch.device("cpu"))
    state = {n: fake_copy(mode, p, target) for n, p in root.named_parameters()}
    state.update({n: fake_copy(mode, b, target) for n, b in root.named_buffers()})
    devices = inputs.devices or [t.device for t in inputs.tensors]
    fake_inputs = [fake_copy(mode, t, device if device is not None else d)
                   for t, d in zip(inputs.tensors, devices)]
    args, kwargs = inputs.rebuild(fake_inputs)
    names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
    capture = CaptureMode(names, sdpa_policy=dtype)
    recorder = _Recorder(capture)
    buffer_names = [n for n, _ in root.named_buffers()]
    with mode, autocast_enabled(target.type, dtype), capture.tracking_modules(), capture, recorder:
        torch.func.functional_call(root, state, (args, kwargs, buffer_names), tie_weights=True,
                                   strict=True)
    return AutocastTrace(target.type, dtype, recorder.ops, len(recorder.casts), recorder.casts)


@dataclass
class OpComparison:
    op: str
    module: str
    ordinal: int
    graphamp_node: str
    graphamp_low: bool
    autocast_low: bool
    reason: str  # graphamp's amp_reason

    @property
    def agrees(self) -> bool:
        return self.graphamp_low == self.autocast_low


@dataclass
class Comparison:
    pairs: list[OpComparison]
    unmatched_graphamp: list[str]
    unmatched_autocast: list[str]
    graphamp_casts: int
    autocast_casts: int

    @property
    def differences(self) -> list[OpComparison]:
        return [p for p in self.pairs if not p.agrees]


def compare(forward: fx.GraphModule, trace: AutocastTrace) -> Comparison:
    """Pair graphamp's compute ops with autocast's by (module, op, occurrence) and compare."""
    ours: dict[tuple[str, str], list[fx.Node]] = defaultdict(list)
    for node in forward.graph.nodes:
        if not is_compute_node(node) or node.meta.get("amp_cast"):
            continue
        name = op_name(node)
        if name in _STRUCTURAL or node.meta.get("amp_colour") in (None, "fixed"):
            continue
        ours[(module_path(node), name)].append(node)
    theirs: dict[tuple[str, str], list[OracleOp]] = defaultdict(list)
    for op in trace.ops:
        if op.dtype is not None:
            theirs[(op.module, op.op)].append(op)
    pairs, lone_ours, lone_theirs = [], [], []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, []), theirs.get(key, [])
        for i, (node, op) in enumerate(zip(a, b)):
            low = _low(dtype_after_amp(node), node, trace.dtype)
            pairs.append(OpComparison(key[1], key[0], i, node.name, low, op.dtype == trace.dtype,
                                      str(node.meta.get("amp_reason", ""))))
        lone_ours += [n.name for n in a[len(b):]]
        lone_theirs += [f"{key[0]}:{key[1]}" for _ in b[len(a):]]
    casts = sum(1 for n in forward.graph.nodes if n.meta.get("amp_cast"))
    return Comparison(pairs, lone_ours, lone_theirs, casts, trace.casts)


def _low(dtype: Any, node: fx.Node, low: torch.dtype) -> bool:
    if isinstance(dtype, tuple):
        dtype = dtype[0]
    if dtype is None:  # a non-float result (argmax, comparisons): the dtype it read
        inputs = [dtype_after_amp(n) for n in node.all_input_nodes]
        dtype = next((d for d in inputs if isinstance(d, torch.dtype)), None)
    return dtype == low


def autocast_counts_for_program(graph: "Graph", program: "Program") -> dict[str, int]:
    """Autocast's op and cast counts on the program's forward (for the precision report)."""
    inputs = program.example_inputs
    root = BuildRoot(graph._registered_modules, graph.build)
    trace = autocast_forward(root, inputs, program.amp.dtype, program.device)
    cmp = compare(program.forward, trace)
    return {"ops_low": trace.ops_low, "ops": len(trace.ops), "casts": trace.casts,
            "agree": sum(p.agrees for p in cmp.pairs), "compared": len(cmp.pairs)}

