"""How ``fp32_where_faster`` times a matrix product or a convolution at its sizes.

The lists put these ops in low precision because on a GPU, and on a CPU with bf16 or fp16
instructions (AMX, AVX512-BF16), their low-precision kernels are the fast ones. A CPU without
them runs the low-precision kernels on a slow path: on an AMD EPYC (Zen 3, AVX2 only) with
torch 2.14.1 and one thread, a (788, 192) x (192, 768) product took 202 ms in bf16 against
3.2 ms in fp32, and timm-sized ViT-Ti's training step 7.7 s with its products in bf16
against 0.6 s in fp32. So where the pass is on, each such op is timed in both precisions at
its sizes, forward and backward in a training graph, as the attention ops are.

An op of more than ``MAX_MACS`` multiply-adds is timed on a slice of its batch (the rows of a
product, the images of a convolution) of about that size: the precisions' ratio depends on the
kernels, not on the batch, and timing the whole op would cost the build seconds a size where
the low-precision kernel is the slow one. The choice applies to the op at its own sizes, which
key the record.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple, cast

import torch
import torch.fx as fx

from ..records.amp import SpeedCheck
from ..torchkit.shapes import inverse_permutation, memory_order, size_hint

aten = torch.ops.aten

# Calls below this many multiply-adds are not timed (too little work to matter or to time
# without noise; the attention's bound, fp32_where_faster.MIN_TIMED_MACS, is the same);
# calls above ``MAX_MACS`` are timed on a slice of their batch.
MIN_MACS = 1e6
MAX_MACS = 1e8

# op -> (the index of its first matrix or input argument, the indices of the arguments whose
# first dimension may be the batch that a slice shortens: a bias is, where it is not broadcast)
_DENSE: dict[Any, tuple[int, tuple[int, ...]]] = {
    aten.mm.default: (0, (0,)),
    aten.addmm.default: (1, (1, 0)),
    aten.bmm.default: (0, (0, 1)),
    aten.baddbmm.default: (1, (1, 2, 0)),
    aten.convolution.default: (0, (0,)),
}


def is_dense(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _DENSE


class DenseTiming(NamedTuple):
    key: tuple  # the op at its sizes and layouts, as the record keys it
    run: Callable[[str, torch.dtype], float]  # (form, low dtype) -> seconds of one run
    what: str  # the op and its sizes in words, for the log line


def dense_timing(node: fx.Node, check: SpeedCheck) -> DenseTiming | None:
    """How to time ``node``'s op at its sizes, on fresh inputs in either form, or None where
    it is not timed: a size that is not known, too small, or too large to slice."""
    specs = [_spec(a) for a in node.args]
    out = node.meta.get("val")
    if any(s is _UNKNOWN for s in specs) or not isinstance(out, torch.Tensor):
        return None
    first, batched = _DENSE[node.target]
    macs = _macs(node, specs, first, out)
    if macs is None or macs < MIN_MACS:
        return None
    batch = specs[first][0][0]  # type: ignore[index]
    rows = max(1, min(batch, math.floor(batch * MAX_MACS / macs)))
    if macs * rows / batch > 4 * MAX_MACS:
        return None  # one item of the batch is too much to time
    sliced = _sliced(specs, batched, first, rows)
    op = cast(Callable[..., torch.Tensor], node.target)

    def run(form: str, low: torch.dtype) -> float:
        dtype = torch.float32 if form == "fp32" else low
        gen = torch.Generator().manual_seed(0)
        made = {i: _made(s, dtype, gen) for i, s in enumerate(sliced) if isinstance(s, tuple)}
        leaves = [t.requires_grad_(check.training) for t, _ in made.values()]
        start = time.perf_counter()
        with torch.enable_grad() if check.training else torch.no_grad():
            args = [
                made[i][0].permute(made[i][1]) if i in made else s for i, s in enumerate(sliced)
            ]
            result = op(*args, **node.kwargs)
            if check.training:
                torch.autograd.grad(result, leaves, torch.ones_like(result))
        return time.perf_counter() - start

    kwargs = tuple(sorted(node.kwargs.items()))
    key = (str(node.target), tuple(_key_part(s) for s in specs), kwargs, check.training)
    sizes = ", ".join("x".join(map(str, s[0])) for s in specs if isinstance(s, tuple))
    return DenseTiming(key, run, f"{node.target} at {sizes}")


# an argument: a tensor's (sizes, memory order) as a tuple, any other value as it is, or
# _UNKNOWN where the argument's sizes are not known
Spec = Any
_UNKNOWN = object()


def _spec(arg: Any) -> Spec:
    if not isinstance(arg, fx.Node):
        return arg
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
        return _UNKNOWN
    sizes = [size_hint(s) for s in val.shape]
    if not all(sizes):
        return _UNKNOWN
    return (tuple(sizes), tuple(memory_order([size_hint(s) for s in val.stride()])))


def _key_part(spec: Spec) -> Any:
    return spec if isinstance(spec, tuple) else repr(spec)


def _macs(node: fx.Node, specs: list[Spec], first: int, out: torch.Tensor) -> int | None:
    """Multiply-adds of the op: its output's elements times the length of each one's sum (a
    transposed convolution: its input's elements times the outputs each reaches)."""
    if not isinstance(specs[first], tuple):
        return None
    if node.target is not aten.convolution.default:
        return out.numel() * specs[first][0][-1]
    weight = specs[1][0]
    per_item = weight[1] * math.prod(weight[2:])
    transposed = node.args[6]
    counted = math.prod(specs[0][0]) if transposed else out.numel()
    return int(counted * per_item)


def _sliced(specs: list[Spec], batched: tuple[int, ...], first: int, rows: int) -> list[Spec]:
    """``specs`` with the batch of each batched argument (of as many dimensions as the first
    one, and the same batch) cut to ``rows``."""
    out, (sizes_first, _) = list(specs), specs[first]
    for i in batched:
        if not isinstance(specs[i], tuple):
            continue  # no bias
        sizes, order = specs[i]
        if len(sizes) == len(sizes_first) and sizes[0] == sizes_first[0]:
            out[i] = ((rows, *sizes[1:]), order)
    return out


def _made(spec: tuple, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, list]:
    """A random contiguous tensor, and the permutation that gives it these sizes laid out in
    this memory order (a transposed weight stays transposed: the kernels' speed depends on
    it)."""
    sizes, order = spec
    t = torch.randn([sizes[d] for d in order], generator=gen).to(dtype)
    return t, inverse_permutation(order)
