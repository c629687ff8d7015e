"""Small FX helpers shared by capture, the AMP passes, step assembly and inspection: user
frames, node tagging while tracing, and the metadata accessors every stage reads."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._decomp, torch._guards, torch._ops, torch._subclasses
import contextlib
import gc
import operator
import os
import sys
import types
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..records.frames import UserFrame
from .compat import dispatch_functionalize
from .effects import effects_as_plain_ops

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPHAMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = (_TORCH_DIR, _GRAPHAMP_DIR)
_is_library_cache: dict[str, bool] = {}


def is_library_file(filename: str) -> bool:
    """Is this file torch's or graphamp's (not the user's)?"""
    hit = _is_library_cache.get(filename)
    if hit is None:
        absolute = os.path.abspath(filename)
        hit = absolute.startswith(_LIBRARY_DIRS) or filename.startswith("<")
        _is_library_cache[filename] = hit
    return hit


def user_frame_of(frame: types.FrameType | None) -> UserFrame | None:
    """The innermost frame at or above ``frame`` that is not torch's or graphamp's."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not is_library_file(filename):
            return UserFrame(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def current_user_frame() -> UserFrame | None:
    return user_frame_of(sys._getframe(1))


def warn_at_user_line(message: str) -> None:
    """``warnings.warn(message)`` attributed to the innermost frame outside torch and graphamp
    (the user's line that called into graphamp), however deep graphamp's own frames go."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and is_library_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1)


def user_frame_of_exception(exc: BaseException) -> UserFrame | None:
    """The innermost user frame in an exception's traceback (where the user's code failed)."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not is_library_file(filename):
            found = UserFrame(filename, tb.tb_lineno, tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    cause = exc.__cause__ or exc.__context__
    if found is None and cause is not None and cause is not exc:
        return user_frame_of_exception(cause)
    return found


def trace_functional(
    fn: Callable[..., Any],
    example: list[Any],
    propagate_input_mutations: bool,
    allow_constants: bool = False,
) -> fx.GraphModule:
    """``fn`` traced with make_fx on fake copies of ``example``, functionalized in Python
    (FunctionalTensorMode, below autograd: custom autograd Functions, ``requires_grad_`` and
    ``torch.autograd.grad`` work as in eager mode, which functorch transforms refuse).

    In-place writes to ``fn``'s inputs come out as trailing ``copy_`` nodes into the
    placeholders when ``propagate_input_mutations``; everything else is pure. The explicit (empty)
    decomposition table keeps ``detach`` as ``detach``: make_fx's default turns it into
    ``alias``, and a graph that is differentiated again would then let gradients through a
    user's ``.detach()``. With ``allow_constants``, real tensors ``fn`` reads that are not among
    its inputs become ``get_attr`` constants holding those very objects.
    Sizes that depend on values (boolean-mask indexing, ``nonzero``) become unbacked symbols of
    the fake mode's ShapeEnv; the sizes of fakes given in ``example`` stay what they are (static,
    or symbolic: ``torchkit.shapes``), and tensors are faked with static sizes. Where a symbolic
    size reaches an op whose meta kernel would specialise it to its traced value (reading sizes
    as plain integers), the op is decomposed into ops that keep it symbolic
    (``SYMBOLIC_DECOMPOSITIONS``). Ops torch marks effectful (the error checks of
    ``torch.linalg.solve``, ``inv``...) are traced as plain nodes (``effects.py``).
    """
    mode = detect_fake_mode(example) or FakeTensorMode(
        shape_env=ShapeEnv(), allow_non_fake_inputs=allow_constants
    )
    symbolic = any(isinstance(t, FakeTensor) and t._has_symbolic_sizes_strides for t in example)
    fakes = [_fake_like(mode, t) if isinstance(t, torch.Tensor) else t for t in example]
    functional = dispatch_functionalize(
        fn, FunctionalTensorMode(), propagate_input_mutations=propagate_input_mutations
    )
    with mode, effects_as_plain_ops(), gc_paused():
        return make_fx(
            functional,
            tracing_mode="real",
            decomposition_table=symbolic_decompositions() if symbolic else {},
            _allow_non_fake_inputs=allow_constants,
        )(*fakes)


@contextlib.contextmanager
def gc_paused():
    """The cycle collector paused while a graph is traced or rewritten. Both allocate many small
    objects, and each full collection rescans everything alive, so the collections grow with
    the model: a quarter of the AMP passes' time on a 100k-node graph; in assembling a 12-layer
    GPT-2's step, one full collection took 0.21 s of 2.4 (none on 6 layers, 0.9 s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Ops whose meta kernels read sizes as plain integers, which specialises a symbolic size to the
# value it was traced with (found on real models: transformers' causal-LM loss pads its labels
# with F.pad). torch's own decompositions of them keep sizes symbolic.
SYMBOLIC_DECOMPOSITIONS = ("constant_pad_nd",)


def symbolic_decompositions() -> dict:
    return get_decompositions([getattr(torch.ops.aten, name) for name in SYMBOLIC_DECOMPOSITIONS])


def _fake_like(mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a fake tensor of ``mode`` with static sizes, keeping ``requires_grad``."""
    if isinstance(t, FakeTensor):
        return t
    if is_dtensor(t):  # a sharded parameter: traced as the whole parameter the step gathers
        with mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return fake.requires_grad_(t.requires_grad)
    fake = mode.from_tensor(t, static_shapes=True)
    if t.requires_grad and not fake.requires_grad:
        fake.requires_grad_(True)
    return fake


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch has none)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def tracing_graph() -> fx.Graph | None:
    """The FX graph make_fx is appending to right now, or None outside a trace."""
    mode = get_proxy_mode()
    return None if mode is None else mode.tracer.graph


def last_node(graph: fx.Graph) -> fx.Node:
    # fx.Graph keeps its nodes in a circular list closed by a sentinel root node.
    return graph._root.prev  # the only O(1) way to find the tail


def nodes_after(graph: fx.Graph, marker: fx.Node) -> Iterator[fx.Node]:
    """Nodes appended after ``marker`` (the value of last_node() taken earlier)."""
    node = marker.next
    root = graph._root
    while node is not root:
        yield node
        node = node.next


class NodeTagger:
    """Writes ``meta[key] = value`` on every node a block of traced code appends.

    Used as ``with NodeTagger(Subgraph.GRAD_SCALER.tag()):`` (``records/subgraphs.py``) around
    part of a traced function; nodes that already carry a key keep it (inner tags win). ``custom`` tags go into
    ``meta["custom"]`` as well: the one field of a node's metadata that torch's own retracing
    (AOTAutograd, make_fx) copies to the nodes it makes, so a pass inside inductor can read it.
    """

    def __init__(self, meta: dict[str, Any], custom: dict[str, Any] | None = None):
        self.meta = meta
        self.custom = custom or {}
        self.graph: fx.Graph | None = None
        self.marker: fx.Node | None = None

    def __enter__(self) -> NodeTagger:
        self.graph = tracing_graph()
        if self.graph is not None:
            self.marker = last_node(self.graph)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.graph is None or self.marker is None:
            return
        for node in nodes_after(self.graph, self.marker):
            for k, v in self.meta.items():
                node.meta.setdefault(k, v)
            if self.custom:
                node.meta["custom"] = {**self.custom, **(node.meta.get("custom") or {})}


def region_boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """(inputs, outputs) of a region of a graph: the outer values its nodes read, in order of
    first use, and its nodes read outside it, in graph order."""
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    return inputs, [n for n in nodes if any(u not in inside for u in n.users)]


def rename_placeholders(gm: fx.GraphModule, names: list[str]) -> None:
    """Give placeholders readable names (``p_model_0_weight``) so dumps read like code.
    The caller recompiles once it has finished editing the graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        raise ValueError(f"{len(placeholders)} placeholders but {len(names)} names")
    taken = {n.name for n in gm.graph.nodes if n.op != "placeholder"}
    for node, name in zip(placeholders, names):
        candidate = "".join(c if c.isalnum() else "_" for c in name)
        while candidate in taken:
            candidate += "_"
        taken.add(candidate)
        node.target = candidate
        node._rename(candidate)  # public API has no rename for nodes


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the graph modules under it (outlined regions, block updates)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose nodes can be rewritten without touching ``gm``'s graph (each node's
    metadata copied shallowly)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)


def float_dtype(value: Any) -> torch.dtype | None:
    """The floating dtype of a fake tensor, or None for anything else."""
    if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
        return value.dtype
    return None


_UNSET = object()  # a metadata key not set (None is a value: "not floating")


def captured_dtype(node: fx.Node) -> Any:
    """The floating dtype a value had when captured (a tuple for tuple outputs; None if not
    floating). Read from ``meta["val"]`` once and cached in ``meta["captured_dtype"]``."""
    meta = node.meta
    dtype = meta.get("captured_dtype", _UNSET)
    if dtype is _UNSET:
        val = meta.get("val")
        if isinstance(val, (tuple, list)):
            dtype = tuple(float_dtype(v) for v in val)
        else:
            dtype = float_dtype(val)
        meta["captured_dtype"] = dtype
    return dtype


def dtype_after_amp(node: fx.Node) -> Any:
    """A value's floating dtype after the AMP passes (its captured dtype if they left it)."""
    dtype = node.meta.get("amp_dtype", _UNSET)
    return captured_dtype(node) if dtype is _UNSET else dtype


_SIZES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def is_compute_node(node: fx.Node) -> bool:
    """A call that computes tensor data: getitem only unpacks a tuple, and size arithmetic on
    symbolic shapes (``sym_size``, ``s0 * s1``) computes a size, not data."""
    return (
        node.op == "call_function"
        and node.target is not operator.getitem
        and not isinstance(node.meta.get("val"), _SIZES)
    )


def module_path(node: fx.Node) -> str:
    """The innermost module that produced a node ('' for code outside any module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return path


def op_name(node: fx.Node) -> str:
    """``aten.addmm`` for an aten op node, ``autograd.Function MyFn`` for a custom Function;
    the target's name otherwise."""
    function = node.meta.get("autograd_function")
    if function is not None:
        return f"autograd.Function {function.__qualname__}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target.overloadpacket)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target)
    return getattr(target, "__name__", str(target))


def drop_profiler_markers(graph: fx.Graph) -> None:
    """Remove torch's profiler markers (``record_function`` around ``Optimizer.step()`` and
    ``zero_grad()``): they time nothing inside a compiled step, and their custom ops would keep
    the step out of the step cache."""
    for node in [n for n in graph.nodes if str(n.target).startswith("profiler.")][::-1]:
        graph.erase_node(node)  # an exit marker first, then the enter marker it uses
