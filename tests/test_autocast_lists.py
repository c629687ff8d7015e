"""PyTorch's own autocast op lists, every entry as a one-op Graph.

``torch.testing._internal.autocast_test_lists.AutocastTestLists`` is what torch's test_cuda.py
checks CUDA autocast against: per list, ops with arguments and the dtype autocast must run them
in. Each entry becomes a one-op eval Graph (AMP on, ``aot_eager``, run on CPU tensors), for
fp16 and bf16, with torch's input dtypes and with every floating input fp32. The test reads the
dtype the op computes in from the compiled forward graph (``dtype_after_amp`` of the value
build() returns, before graphamp casts it back to its captured dtype; for a comparison, the
dtype it compares in) and asserts it is the dtype torch's test expects of autocast.

The lists are used from torch, not copied: they are built with ``dev=cpu`` (the constructor only
places tensors). Run as a script (``python tests/test_autocast_lists.py``) to print the agreement
per list instead of asserting.
"""

from __future__ import annotations

import collections
import sys
import types
import unittest
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from helpers import import_torch_testing
from torch._subclasses.fake_tensor import FakeTensorMode

import graphamp
from graphamp.capture import fake_copy
from graphamp.errors import CaptureError
from graphamp.passes import DEFAULT_LISTS, AmpContext, run_amp_passes, verify_dtypes
from graphamp.torchkit.fxutil import copy_graph_module, dtype_after_amp

LOW = object()  # "the AMP dtype": what torch's lower-precision lists expect


def _autocast_test_lists_module() -> types.ModuleType:
    """torch's list module. It imports ``common_utils`` only for ``TEST_WITH_ROCM`` and
    ``TestCase``; ``common_utils`` needs the ``expecttest`` package, which is not a graphamp
    dependency, so without it a stand-in provides those two names while the module loads."""
    try:
        return import_torch_testing("autocast_test_lists")
    except ModuleNotFoundError as e:
        if e.name != "expecttest":
            raise
    name = "torch.testing._internal.common_utils"
    stand_in = types.ModuleType(name)
    stand_in.TEST_WITH_ROCM = False
    stand_in.TestCase = unittest.TestCase
    sys.modules[name] = stand_in
    try:
        from torch.testing._internal import autocast_test_lists

        return autocast_test_lists
    finally:
        del sys.modules[name]


@dataclass(frozen=True)
class Entry:
    list_name: str
    index: int
    op: str
    args: tuple
    kwargs: dict
    module: Any  # where torch's test looks the op up (None: a Tensor method)
    expected: Any  # torch.dtype, or LOW

    @property
    def id(self) -> str:
        return f"{self.list_name}-{self.index}-{self.op}"

    def function(self) -> Callable:
        if self.module is not None and hasattr(self.module, self.op):
            return getattr(self.module, self.op)
        return lambda first, *rest, **kw: getattr(first, self.op)(*rest, **kw)


# list -> (module torch's test_cuda.py calls the op from, dtype it expects autocast to run in)
RUN_AS = {
    "torch_expect_builtin_promote": (torch, torch.float32),
    "methods_expect_builtin_promote": (None, torch.float32),
    "torch_fp16": (torch, LOW),
    "torch_fp32": (torch, torch.float32),
    "torch_need_autocast_promote": (torch, torch.float32),
    "nn_fp16": (torch._C._nn, LOW),
    "nn_fp32": (torch._C._nn, torch.float32),
    "linalg_fp16": (torch._C._linalg, LOW),
    "methods_fp16": (None, LOW),
    "methods_fp32": (None, torch.float32),
    "banned": (None, torch.float32),  # autocast raises; see DIFFERENCES
}


def _entries() -> list[Entry]:
    torch.manual_seed(0)
    lists = _autocast_test_lists_module().AutocastTestLists(torch.device("cpu"))
    out = []
    for list_name, (module, expected) in RUN_AS.items():
        for i, raw in enumerate(getattr(lists, list_name)):
            op, args, extra = raw[0], raw[1], raw[2:]
            kwargs = extra[0] if extra and isinstance(extra[0], dict) else {}
            if list_name == "banned":
                module = extra[0]  # banned entries name their module
            out.append(Entry(list_name, i, op, args, kwargs, module, expected))
    return out


ENTRIES = _entries()

# Entries torch's lists hold that no graph can run, with the reason. Each is still exercised.
NOT_A_GRAPH_OP = {
    # returns a Python bool: a host read, which a compiled step cannot return. graphamp raises a
    # CaptureError that says so (asserted in test_entries_that_are_not_graph_ops).
    "torch_expect_builtin_promote-10-equal",
    # torch's own test never runs this entry (its third element, the operand tuple, is read as
    # the skip flag) and the equation needs 4-d operands where the entry gives 8x8 matrices.
    "torch_fp16-17-einsum",
}

# cuDNN ops: no CPU kernel and no fake kernel, so without a GPU neither a Graph nor a fake-CUDA
# capture can run them. Without CUDA the test builds their one-node forward graph by hand (the
# output value from the convolution they compute, on fake CUDA tensors) and runs the AMP passes
# on it; with CUDA they run as one-op Graphs like every other entry.
CUDA_ONLY = {
    # cudnn_convolution(input, weight, padding, stride, dilation, groups, ...)
    "torch_fp16-10-cudnn_convolution": lambda x, w, padding, stride, dilation, groups, *_: (
        torch.convolution(x, w, None, stride, padding, dilation, False, [0] * len(padding), groups)
    ),
    # cudnn_convolution_transpose(input, weight, padding, output_padding, stride, dilation,
    # groups, ...)
    "torch_fp16-11-cudnn_convolution_transpose": lambda x, w, padding, output_padding, stride, dilation, groups, *_: (
        torch.convolution(x, w, None, stride, padding, dilation, True, output_padding, groups)
    ),
}

# Deliberate differences from autocast (passes/lists.py module docstring): entry -> the dtype
# graphamp computes in. A change of either side fails the test.
DIFFERENCES = {
    # autocast raises (binary_cross_entropy is banned as unsafe in fp16); graphamp runs it in
    # fp32, the remedy autocast's error offers (difference 8)
    "banned-0-binary_cross_entropy": torch.float32,
}
# Not a difference, but worth knowing: under bf16 autocast the promote list's mixed fp16/fp32
# entries raise in autocast itself ("Unexpected floating ScalarType in prioritize"; torch's
# test runs that list under fp16 only). graphamp promotes them to fp32, the list's dtype.


def _all_fp32(args: Any) -> Any:
    return pytree.tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args
    )


def _one_op_graph(entry: Entry, dtype: torch.dtype):
    fn, kwargs = entry.function(), entry.kwargs

    class OneOp(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend("aot_eager")

        def build(self, *args):
            return fn(*args, **kwargs)

    return OneOp()


def forward_graph(entry: Entry, dtype: torch.dtype, args: tuple) -> fx.GraphModule:
    """The AMP forward graph of ``entry`` as a one-op Graph (run once on CPU), or, for ops with
    no CPU kernel, captured on fake CUDA tensors and run through the AMP passes."""
    if entry.id in CUDA_ONLY and not torch.cuda.is_available():
        return run_amp_passes(
            _hand_built_graph(entry, args), AmpContext(lists=DEFAULT_LISTS, dtype=dtype)
        )
    device = "cuda" if entry.id in CUDA_ONLY else "cpu"
    args = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, args)
    g = _one_op_graph(entry, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation warnings of torch's old entry points
        g(*args)
    return g.compiled_steps[-1].forward_graph


def _hand_built_graph(entry: Entry, args: tuple) -> fx.GraphModule:
    """placeholders -> torch.ops.aten.<op> -> output, with fake CUDA values as capture makes."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [
        fake_copy(mode, t, torch.device("cuda")) if isinstance(t, torch.Tensor) else t for t in args
    ]
    graph = fx.Graph()
    nodes = []
    for i, value in enumerate(fakes):
        if isinstance(value, torch.Tensor):
            node = graph.placeholder(f"in_{i}")
            node.meta["val"] = value
            value = node
        nodes.append(value)
    op = graph.call_function(getattr(torch.ops.aten, entry.op).default, tuple(nodes))
    with mode:
        op.meta["val"] = CUDA_ONLY[entry.id](*fakes)
    graph.output((op,))
    return fx.GraphModule({}, graph)


def computed_dtypes(gm: fx.GraphModule) -> tuple:
    """For each tensor build() returns: the floating dtype it is computed in (graphamp's cast
    back to the captured dtype looked through); for a non-floating result, the dtype its op
    reads its floating inputs in (the comparison's dtype)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    out = []
    for value in pytree.tree_leaves(output.args):
        if not isinstance(value, fx.Node):
            continue
        if value.meta.get("amp_cast"):
            value = value.args[0]
        dtype = dtype_after_amp(value)
        if dtype is None:
            read = [dtype_after_amp(v) for v in value.all_input_nodes]
            read = [d for d in read if isinstance(d, torch.dtype)]
            dtype = _widest(read) if read else None
        out.append(dtype)
    return tuple(out)


def _widest(dtypes: list) -> torch.dtype:
    widest = dtypes[0]
    for d in dtypes[1:]:
        widest = torch.promote_types(widest, d)
    return widest


def expected_dtype(entry: Entry, dtype: torch.dtype) -> torch.dtype:
    if entry.id in DIFFERENCES:
        return DIFFERENCES[entry.id]
    return dtype if entry.expected is LOW else entry.expected


def check(entry: Entry, dtype: torch.dtype, inputs: str) -> str | None:
    """None if graphamp agrees with autocast's dtype on this entry, else what differs."""
    args = entry.args if inputs == "torch" else _all_fp32(entry.args)
    gm = forward_graph(entry, dtype, args)
    got = computed_dtypes(gm)
    want = expected_dtype(entry, dtype)
    if not got or any(d != want for d in got):
        return f"computes in {got}, autocast in {want}"
    if entry.id in CUDA_ONLY and not torch.cuda.is_available():
        return None  # no fake kernel to check the bookkeeping with
    mismatches = verify_dtypes(copy_graph_module(gm))
    return f"dtype bookkeeping: {mismatches}" if mismatches else None


DTYPES = [torch.float16, torch.bfloat16]
CASES = [e for e in ENTRIES if e.id not in NOT_A_GRAPH_OP]


@pytest.mark.parametrize("inputs", ["torch", "fp32"], ids=["torch_inputs", "fp32_inputs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("entry", CASES, ids=[e.id for e in CASES])
def test_entry_computes_in_autocasts_dtype(entry, dtype, inputs):
    problem = check(entry, dtype, inputs)
    assert problem is None, f"{entry.id} ({inputs} inputs, {dtype}): {problem}"


def test_entries_that_are_not_graph_ops():
    by_id = {e.id: e for e in ENTRIES}
    assert NOT_A_GRAPH_OP <= set(by_id), "torch's lists changed: update NOT_A_GRAPH_OP"
    equal = by_id["torch_expect_builtin_promote-10-equal"]
    with pytest.raises(CaptureError, match="uses the value of a tensor in Python"):
        forward_graph(equal, torch.float16, equal.args)
    einsum = by_id["torch_fp16-17-einsum"]
    assert isinstance(einsum.args, str)  # the equation where the operands belong


def test_the_lists_are_walked_whole():
    # every list torch's test_cuda.py checks, and nothing silently dropped
    lists = _autocast_test_lists_module().AutocastTestLists(torch.device("cpu"))
    assert set(RUN_AS) == set(vars(lists))
    assert len(ENTRIES) == sum(len(v) for v in vars(lists).values())
    assert set(DIFFERENCES) | set(CUDA_ONLY) <= {e.id for e in CASES}


def agreement() -> dict[tuple[str, str, str], tuple[int, int]]:
    """(dtype, list, inputs) -> (entries that agree with autocast, entries). An entry that
    raises, a deliberate difference and an entry no graph can run count as disagreeing."""
    counts: dict = collections.defaultdict(lambda: [0, 0])
    for dtype in DTYPES:
        for entry in ENTRIES:
            for inputs in ("torch", "fp32"):
                try:
                    ok = (
                        entry.id not in NOT_A_GRAPH_OP
                        and entry.id not in DIFFERENCES
                        and check(entry, dtype, inputs) is None
                    )
                except Exception:  # a capture or run failure is a disagreement
                    ok = False
                key = (str(dtype).removeprefix("torch."), entry.list_name, inputs)
                counts[key][0] += ok
                counts[key][1] += 1
    return {k: tuple(v) for k, v in counts.items()}


if __name__ == "__main__":
    table = agreement()
    for (dt, name, inputs), (n, total) in sorted(table.items()):
        print(f"{dt:9} {name:32} {inputs:6} {n:3}/{total}")
    for dt in ("float16", "bfloat16"):
        n = sum(v[0] for k, v in table.items() if k[0] == dt)
        total = sum(v[1] for k, v in table.items() if k[0] == dt)
        print(f"{dt}: {n}/{total}")
