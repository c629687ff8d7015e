"""fp32_where_faster: an op the lists put in low precision stays fp32 where, on this machine and
at this op's sizes, its fp32 kernel measured faster; attention is written as low-precision
matmuls around an fp32 softmax where that measured faster than both kernels.

The lists say which ops *may* run in low precision; they assume the low-precision kernel is
the fast one, which holds for matmuls on a GPU but not for every kernel on the CPU. torch's
scaled-dot-product attention for the CPU (``_scaled_dot_product_flash_attention_for_cpu``) is
the case measured: in bf16 its backward is several times slower than in fp32 at the sizes of
small language models (``python benchmarks/attention_precision.py``; torch 2.14.1, one thread,
an x86 CPU with AMX: forward and backward of causal (B, H, T, D) = (2, 4, 64, 32) took
1.9 ms in bf16 against 0.36 ms in fp32), while at long sequences and in forward-only graphs
bf16 is the faster one. Matrix products and convolutions are the other case: on a CPU without
bf16 or fp16 instructions every one of them is, tens of times (``dense_ops.py``). So the pass
times each such op, as it will run (forward, and backward
in a training graph), in both precisions, with random tensors of its sizes, and keeps it fp32
where fp32 took at most 1/``MARGIN`` of the low-precision time. fp32 is never the less
accurate choice, so the only thing this can cost is speed.

A third form is timed for attention without a mask: ``graphamp.sdpa_as_matmuls``, the two
products in low precision (fp32 accumulation, as the kernels' own) around an fp32 softmax,
which inductor compiles with the casts and the scale fused into the softmax; where the step
is compiled by inductor its time is its kernels' (``_matmul_kernels``: the products and the
softmax each way, the fused work left out, nothing compiled to time it), elsewhere its ops'
one by one, as it will run. At ViT-Ti's sizes ((4, 3, 197, 64), bf16, one thread, forward and
backward, on the machine above) the form compiled whole took 2.5-2.7 ms, its kernels as this
pass times them 3.8 ms, against 5.1 ms for the fp32 kernel and 7.1 ms for the bf16 one: the
kernels' time is the conservative one (fresh tensors each run). It rounds as the
low-precision kernel does (bf16 operands, the probabilities rounded to bf16 before the second
product), so it is what the lists allow; it is chosen where it took at most 1/``MARGIN`` of
both other forms' time. It keeps the attention matrix for the backward, which the kernels
do not; the size window below bounds that (at most ``MAX_TIMED_MACS`` / the head size
elements a call).

The margin keeps near-ties in low precision, ops too small to time reliably are not timed,
and the timings are recorded on
disk (``fp32_where_faster.json`` under graphamp's cache root, per torch version, CPU and thread
count): noise that flipped the choice between runs would give each run a different step (and
the step cache a different key), so a machine times each size once and every later run reads
its choice. Deleting the file times them again.

It is on by default for AMP on the CPU (``config.set_fp32_where_faster``), never on CUDA, where
the low-precision kernels (flash attention) are the fast ones, and off where the user names the
op in ``override_amp_lists`` (their choice stands), at opt level O3, and in a process group of
more than one rank (every rank must trace the same graph; timings differ between ranks). The
precision report says why each op kept fp32 here is, and its summary counts the attention
written as matmuls; the timings are in the AMP context (``kept_fp32_timings``,
``matmul_attention_timings``), not in the node's metadata, which the step cache's key reads.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
import functools
import json
import logging
import math
import operator
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import ops

from ..records.amp import SpeedCheck
from ..records.settings import ConfigSnapshot
from ..torchkit.cache_root import graphamp_cache_root, write_atomically
from ..torchkit.op_math import repeat_kv_heads, sdpa_as_matmuls, sdpa_reference
from ..torchkit.ops import SDPA, SDPA_AS_MATMULS
from ..torchkit.process_state import BoundedCache
from ..torchkit.shapes import inverse_permutation, memory_order, size_hint
from .base import AmpContext, CheckPaths, PassResult, packet_of
from .dense_ops import dense_timing, is_dense

log = logging.getLogger("graphamp")

# fp32 is chosen where it takes at most 1 / MARGIN of the low-precision time: a margin over
# what one best-of-5 timing can get wrong (the choice is then recorded: it does not drift)
MARGIN = 1.2
# Only calls between these sizes (multiply-adds) are timed. Below, either precision takes tens
# of microseconds, too little to matter and too little to time without noise flipping the
# choice. Above, timing would cost the build more than about a second a size, and the
# low-precision kernel measured the faster one (T 512 and longer at GPT-2's head sizes).
MIN_TIMED_MACS = 1e6
MAX_TIMED_MACS = 1e9
RUNS = 5  # timed runs of each precision, alternating, after one warm-up each; the best counts
DECISIVE = 4.0  # one form this many times faster than the others after a run each: no more runs


# The forms an attention op can run in: the kernel in the low-precision dtype (the lists'
# choice), the kernel in fp32, and sdpa_as_matmuls in the low-precision dtype.
LOW, FP32, MATMULS = "low", "fp32", "matmuls"


@dataclass(frozen=True)
class _Timed:
    """One op at its sizes: ``run(form, low dtype)`` runs it once in that form on fresh inputs
    (forward, and backward if training) and returns the seconds the op took, its inputs'
    making left out. ``forms``: the forms it may run in."""

    key: tuple
    run: Callable[[str, torch.dtype], float]
    forms: tuple[str, ...] = (LOW, FP32)
    what: str = ""  # the op and its sizes, in words, for the log line that it is being timed


def speed_settings(
    config: ConfigSnapshot,
    device: torch.device,
    name: str,  # noqa: ARG001 - SettingsOf's signature
    training: bool,
    check_paths: CheckPaths,  # noqa: ARG001 - SettingsOf's signature
) -> dict[str, Any]:
    """This pass's field of the AmpContext (``amp_pipeline.PASS_SETTINGS``): what to time, or
    nothing where the pass is off (module docstring)."""
    if not (config.amp_active and config.fp32_where_faster and device.type == "cpu"):
        return {}
    if config.amp_opt_level == "O3":
        return {}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return {}
    compiled = config.backend == "inductor"
    return {"speed_check": SpeedCheck(training=training, compiled=compiled)}


def keep_fp32_where_faster(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    """Pin (``ctx.pinned_nodes``) each timed op whose fp32 kernel measured faster; retarget
    to ``graphamp.sdpa_as_matmuls`` each attention op whose matmul form measured faster."""
    check = ctx.speed_check
    if check is None:
        return PassResult(gm, False)
    pins, kept_fp32, as_matmuls = {}, {}, {}
    for node in list(gm.graph.nodes):  # the matmul form may replace a node
        if node.name in ctx.pinned_nodes or packet_of(node) in ctx.lists.overridden:
            continue
        timed = _timed(node, check, ctx.rewritten_later)
        if timed is None:
            continue
        ms = _timings(timed, ctx.dtype)
        form = fastest_form(ms)
        if form == FP32:
            # no figures in the reason: it is node metadata, which the step cache's key reads
            pins[node.name] = (
                f"faster in fp32 than in {_short(ctx.dtype)} on this machine at these sizes "
                f"({'forward and backward' if check.training else 'forward'} timed "
                "once per size and recorded; config.set_fp32_where_faster)"
            )
            kept_fp32[node.name] = (ms[LOW], ms[FP32])
        elif form == MATMULS:
            written = _as_matmuls(node)
            written.meta["amp_form"] = (
                f"written as {_short(ctx.dtype)} matmuls around an fp32 softmax: faster than "
                "either attention kernel on this machine at these sizes (timed once per size "
                "and recorded; config.set_fp32_where_faster)"
            )
            as_matmuls[written.name] = (ms[LOW], ms[FP32], ms[MATMULS])
    if pins:
        ctx.pinned_nodes = {**ctx.pinned_nodes, **pins}
    # the timings of each op moved off the lists' kernel, for the precision report's summary
    ctx.kept_fp32_timings = dict(sorted(kept_fp32.items()))
    ctx.matmul_attention_timings = dict(sorted(as_matmuls.items()))
    return PassResult(gm, bool(as_matmuls))  # pins change no node: colouring reads them


def _timed(node: fx.Node, check: SpeedCheck, rewritten_later: frozenset) -> _Timed | None:
    """How to time ``node`` in the forms it may run in, or None where it is not timed: not an
    attention op, matrix product or convolution, part of a whole op (an RNN layer's pieces),
    an op a later pass rewrites (``AmpContext.rewritten_later``), or at sizes not timed."""
    if node.op != "call_function" or node.meta.get("part_of") is not None:
        return None
    if node.target in _ATTENTION_OPS:
        return _attention(node, check)
    if not is_dense(node) or node.target in rewritten_later:
        return None
    found = dense_timing(node, check)
    return None if found is None else _Timed(found.key, found.run, (LOW, FP32), found.what)


def _as_matmuls(node: fx.Node) -> fx.Node:
    """``node`` run as ``graphamp.sdpa_as_matmuls`` (the lists allow it as they do attention):
    graphamp's op retargeted (the same schema), or the CPU kernel's node, whose output alone is
    read (``_writable_as_matmuls``), replaced by one. The kernel's output has its query's
    layout ((T, B, H, D) memory under ``nn.MultiheadAttention``), and the captured code after
    it may view it as such without a copy, so the matmuls' output is copied into that layout:
    permuted to its memory order, made contiguous, permuted back."""
    if node.target is SDPA:
        node.target = SDPA_AS_MATMULS
        return node
    (output,) = node.users  # the kernel's (output, logsumexp)[0]
    val = output.meta["val"]
    order = memory_order(val.stride())
    back = inverse_permutation(order)
    written = val.contiguous()
    steps: list[tuple[Any, tuple, dict, torch.Tensor]] = [
        (SDPA_AS_MATMULS, _sdpa_arguments(node), {}, written)
    ]
    if not val.is_contiguous():
        turned = written.permute(order).contiguous()
        steps += [
            (ops.aten.permute.default, (order,), {}, written.permute(order)),
            (ops.aten.clone.default, (), {"memory_format": torch.contiguous_format}, turned),
            (ops.aten.permute.default, (back,), {}, turned.permute(back)),
        ]
    graph, meta = node.graph, {k: v for k, v in node.meta.items() if k != "val"}
    made: list[fx.Node] = []
    with graph.inserting_before(node):
        for target, args, kwargs, step_val in steps:
            made.append(graph.call_function(target, (*made[-1:], *args), kwargs))
            made[-1].meta = {**meta, "val": step_val}
    output.replace_all_uses_with(made[-1])
    graph.erase_node(output)
    graph.erase_node(node)
    return made[0]


def _writable_as_matmuls(node: fx.Node, mask: Any) -> bool:
    """Can ``node`` run as ``sdpa_as_matmuls``? Not with a mask (it takes none: a wholly masked
    row is the kernels' business), nor where a CPU kernel's logsumexp is read or its output's
    layout is symbolic or not a permutation of a contiguous one (``_as_matmuls`` copies into
    it)."""
    if mask is not None:
        return False
    if node.target is SDPA:
        return True
    users = list(node.users)
    if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
        return False
    val = users[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.stride()):
        return False  # symbolic strides: comparing them would add guards
    order = memory_order(val.stride())
    return val.contiguous().permute(order).contiguous().stride() == tuple(
        val.stride(d) for d in order
    )


def fastest_form(ms: dict[str, float]) -> str:
    """The form to run: the low-precision kernel unless another took at most 1 / MARGIN of
    its time; the matmul form only where it beats the fp32 kernel by that margin too (fp32 is
    the more accurate of the two)."""
    form = FP32 if ms[FP32] * MARGIN <= ms[LOW] else LOW
    if MATMULS in ms and ms[MATMULS] * MARGIN <= min(ms[LOW], ms[FP32]):
        form = MATMULS
    return form


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


# (what was timed, the low dtype, the forms) -> ms of each form: each size timed once a process
_TIMINGS: BoundedCache[tuple, dict[str, float]] = BoundedCache(1024)
RECORD_FILE = "fp32_where_faster.json"  # under graphamp's cache root: timings kept across runs
MAX_RECORDED = 4096  # sizes kept in the file, the oldest dropped


def _timings(timed: _Timed, low: torch.dtype) -> dict[str, float]:
    """The ms of each of ``timed``'s forms: from this process, else from the machine's record
    of earlier runs, else timed now and recorded. The record makes the choice once per
    machine: every later run gets the same step (and its step cache entry) whatever its
    timing noise."""
    key = (*timed.key, low, timed.forms)
    found = _TIMINGS.get(key)
    if found is not None:
        return found
    text = repr((_machine(), key))
    record = _read_record()
    if len(record.get(text, ())) == len(timed.forms):
        ms = dict(zip(timed.forms, record[text]))
    else:
        log.info(
            "timing %s in %s (once per size on this machine: recorded in %s)",
            timed.what, ", ".join(timed.forms), _record_path(),
        )  # fmt: skip
        ms = _time_forms(timed, low)
        _write_record({**record, text: [ms[form] for form in timed.forms]})
    _TIMINGS[key] = ms
    return ms


def _time_forms(timed: _Timed, low: torch.dtype) -> dict[str, float]:
    """The best of RUNS alternating runs of each form, after a warm-up run of each, in ms;
    after the first run of each, where one form was DECISIVE times faster than every other,
    that is the answer (a low-precision kernel on a CPU without its instructions takes tens
    of times fp32's: more runs would cost the build seconds and could not change the choice)."""
    best = dict.fromkeys(timed.forms, math.inf)
    for form in best:  # warm-up: first calls allocate and pick kernels
        timed.run(form, low)
    for _ in range(RUNS):
        for form in best:
            best[form] = min(best[form], timed.run(form, low))
        fastest = min(best.values())
        if all(t >= DECISIVE * fastest for t in best.values() if t != fastest):
            break
    return {form: seconds * 1e3 for form, seconds in best.items()}


def _machine() -> str:
    """What the timings depend on besides the op: torch, the CPU, the threads."""
    return f"torch {torch.__version__}, {_cpu_model()}, {torch.get_num_threads()} threads"


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (read once: it does not change under a running process)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), cpu)
    except OSError:
        return cpu


def _record_path() -> str:
    return os.path.join(graphamp_cache_root(), RECORD_FILE)


def _read_record() -> dict[str, list[float]]:
    """The machine's recorded timings; an unreadable or malformed file counts as none (the
    sizes are timed again and the file rewritten)."""
    try:
        with open(_record_path()) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {
        k: v
        for k, v in record.items()
        if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v)
    }


def _write_record(record: dict[str, list[float]]) -> None:
    """Written to a temporary file and renamed into place (a reader never sees half a file);
    a directory that cannot be written leaves the timings to this process."""
    while len(record) > MAX_RECORDED:
        del record[next(iter(record))]
    path = _record_path()
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        write_atomically(path, json.dumps(record).encode(), ".timings-")
    except OSError as e:
        log.debug("fp32_where_faster: timings not recorded (%s)", e)


def _sdpa_arguments(node: fx.Node) -> tuple:
    """(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa) of an attention
    node: graphamp's whole op, or the CPU kernel where capture recorded the kernel itself
    (``nn.MultiheadAttention`` calls it by a name capture does not see)."""
    if node.target is SDPA:
        return tuple(node.args)
    q, k, v, dropout_p, is_causal = (*node.args, 0.0, False)[:5]
    return (q, k, v, node.kwargs.get("attn_mask"), dropout_p, is_causal,
            node.kwargs.get("scale"), False)  # fmt: skip


# the attention ops timed: graphamp's, and the CPU kernel capture may record instead
_ATTENTION_OPS = (SDPA, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def _attention(node: fx.Node, check: SpeedCheck) -> _Timed | None:
    """How to run the attention of ``node`` at its sizes (None: not timed: an unknown or large
    size, or a mask that is not a plain tensor), in the forms it can take."""
    query, key, value, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(node)
    shapes = [_sizes(v) for v in (query, key, value)]
    mask_val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if any(s is None for s in shapes) or (mask is not None and mask_val is None):
        return None
    q, k, v = (tuple(s) for s in shapes)  # type: ignore[arg-type]
    macs = math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    if not MIN_TIMED_MACS <= macs <= MAX_TIMED_MACS:
        return None
    mask_sizes = _sizes(mask) if mask_val is not None else ()
    if mask_sizes is None:
        return None
    mask_spec = None if mask_val is None else (tuple(mask_sizes), mask_val.dtype)
    forms = (LOW, FP32, MATMULS) if _writable_as_matmuls(node, mask) else (LOW, FP32)
    arguments = (dropout_p, is_causal, scale, gqa)

    def run(form: str, low: torch.dtype) -> float:
        dtype = torch.float32 if form == FP32 else low
        gen = torch.Generator().manual_seed(0)
        qkv = [torch.randn(s, generator=gen).to(dtype) for s in (q, k, v)]
        m = None if mask_spec is None else _mask(mask_spec, dtype)
        grad = [torch.ones((*q[:-1], v[-1]), dtype=dtype)] if check.training else []
        if form == MATMULS and check.compiled:
            return _matmul_kernels(*qkv, *grad)
        attention = sdpa_as_matmuls if form == MATMULS else sdpa_reference
        call = _joint(attention, m, arguments)
        start = time.perf_counter()
        call(*qkv, *grad)
        return time.perf_counter() - start

    key = ("sdpa", q, k, v, mask_spec, *arguments, check.training, check.compiled)
    return _Timed(key, run, forms, f"attention at {'x'.join(map(str, q))}")


def _joint(attention: Callable, mask: torch.Tensor | None, arguments: tuple) -> Callable:
    """``f(q, k, v[, grad])``: the attention's output, or with ``grad`` its inputs'
    gradients (forward and backward)."""

    def joint(*tensors: torch.Tensor) -> Any:
        qkv, grad = tensors[:3], tensors[3:]
        if not grad:
            with torch.no_grad():
                return attention(*qkv, mask, *arguments)
        qkv = tuple(t.detach().requires_grad_(True) for t in qkv)
        with torch.enable_grad():
            out = attention(*qkv, mask, *arguments)
            return torch.autograd.grad(out, qkv, grad[0])

    return joint


def _matmul_kernels(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad: torch.Tensor | None = None
) -> float:
    """Seconds of what inductor runs for ``sdpa_as_matmuls`` on these (B, H, T, D) inputs
    (forward, and backward with ``grad``): its products as matmul kernels and its softmax as
    one loop each way. The casts, the scale, the causal mask and dropout, which inductor fuses
    into the softmax's loops, are left out of the time, and so is compiling the form (seconds
    a size on a machine with a cold inductor cache). At ViT-Ti's sizes the sum was 2.6 ms
    against 2.5-2.7 ms for the form compiled whole (bf16, one thread, forward and backward)."""
    key, value = repeat_kv_heads(query, key, value)  # grouped-query attention
    q, k, v = (t.flatten(0, -3) for t in (query, key, value))
    clock = _Clock()
    with torch.enable_grad():
        scores = clock(torch.bmm, q, k.transpose(1, 2)).float().requires_grad_(grad is not None)
        probs = clock(torch.softmax, scores, -1)
    low = probs.detach().to(v.dtype)
    clock(torch.bmm, low, v)
    if grad is not None:
        g = grad.flatten(0, -3)
        d_probs = clock(torch.bmm, g, v.transpose(1, 2)).float()
        clock(torch.bmm, low.transpose(1, 2), g)
        (d_scores,) = clock(torch.autograd.grad, probs, scores, d_probs)
        d_scores = d_scores.to(q.dtype)
        clock(torch.bmm, d_scores, k)
        clock(torch.bmm, d_scores.transpose(1, 2), q)
    return clock.seconds


class _Clock:
    """Calls a function and adds the seconds it took to ``seconds``."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, fn: Callable, *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - start
        return out


def _mask(spec: tuple, dtype: torch.dtype) -> torch.Tensor:
    sizes, mask_dtype = spec
    if mask_dtype == torch.bool:
        return torch.ones(sizes, dtype=torch.bool)
    return torch.zeros(sizes, dtype=dtype)  # an additive mask: in the attention's dtype


def _sizes(value: Any) -> list[int] | None:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    sizes = [size_hint(s) for s in val.shape]
    return sizes if all(sizes) else None
