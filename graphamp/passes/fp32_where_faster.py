"""fp32_where_faster: an op the lists put in low precision stays fp32 where, on this machine and
at this op's sizes, its fp32 kernel measured faster.

The lists say which ops *may* run in low precision; they assume the low-precision kernel is
the fast one, which holds for matmuls on a GPU but not for every kernel on the CPU. torch's
scaled-dot-product attention for the CPU (``_scaled_dot_product_flash_attention_for_cpu``) is
the case measured: in bf16 its backward is several times slower than in fp32 at the sizes of
small language models (``python benchmarks/attention_precision.py``; torch 2.14.1, one thread,
an x86 CPU with AMX: forward and backward of causal (B, H, T, D) = (2, 4, 64, 32) took
1.9 ms in bf16 against 0.36 ms in fp32), while at long sequences and in forward-only graphs
bf16 is the faster one. So the pass times each such op, as it will run (forward, and backward
in a training graph), in both precisions, with random tensors of its sizes, and keeps it fp32
where fp32 took at most 1/``MARGIN`` of the low-precision time. fp32 is never the less
accurate choice, so the only thing this can cost is speed. The margin keeps near-ties in low
precision, ops too small to time reliably are not timed, and the timings are recorded on
disk (``fp32_where_faster.json`` under graphamp's cache root, per torch version, CPU and thread
count): noise that flipped the choice between runs would give each run a different step (and
the step cache a different key), so a machine times each size once and every later run reads
its choice. Deleting the file times them again.

It is on by default for AMP on the CPU (``config.set_fp32_where_faster``), never on CUDA, where
the low-precision kernels (flash attention) are the fast ones, and off where the user names the
op in ``override_amp_lists`` (their choice stands), at opt level O3, and in a process group of
more than one rank (every rank must trace the same graph; timings differ between ranks). The
precision report says why each op kept fp32 here is; the timings are in the AMP stats
(``fp32_where_faster``), not in the node's metadata, which the step cache's key reads.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
import functools
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from ..records.amp import SpeedCheck
from ..records.settings import ConfigSnapshot
from ..torchkit.cache_root import graphamp_cache_root, write_atomically
from ..torchkit.ops import SDPA, sdpa_reference
from ..torchkit.process_state import BoundedCache
from ..torchkit.shapes import size_hint
from .base import AmpContext, CheckPaths, PassResult, packet_of

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


@dataclass(frozen=True)
class _Timed:
    """One op at its sizes: ``run(dtype)`` runs it once on fresh inputs (forward, and backward
    if training) and returns the seconds the op took, its inputs' making left out."""

    key: tuple
    run: Callable[[torch.dtype], float]


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
    return {"speed_check": SpeedCheck(training=training)}


def keep_fp32_where_faster(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    """Pin (``ctx.pinned_nodes``) each timed op whose fp32 kernel measured faster."""
    if ctx.speed_check is None:
        return PassResult(gm, False)
    pins, timings = {}, {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _ATTENTION_OPS:
            continue
        if node.name in ctx.pinned_nodes or packet_of(node) in ctx.lists.overridden:
            continue
        timed = _attention(node, ctx.speed_check.training)
        if timed is None:
            continue
        low_ms, fp32_ms = timings[node.name] = _timings(timed, ctx.dtype)
        if fp32_ms * MARGIN <= low_ms:
            # no figures in the reason: it is node metadata, which the step cache's key reads
            pins[node.name] = (
                f"faster in fp32 than in {_short(ctx.dtype)} on this machine at these sizes "
                f"({'forward and backward' if ctx.speed_check.training else 'forward'} timed "
                "once per size and recorded; config.set_fp32_where_faster)"
            )
    if pins:
        ctx.pinned_nodes = {**ctx.pinned_nodes, **pins}
    # (low ms, fp32 ms) of each op kept fp32, for the precision report's summary
    ctx.kept_fp32_timings = {name: timings[name] for name in sorted(pins)}
    return PassResult(gm, False)  # the graph is unchanged: colouring reads the pins


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


# (what was timed, the low dtype) -> (low ms, fp32 ms): each size is timed once per process
_TIMINGS: BoundedCache[tuple, tuple[float, float]] = BoundedCache(1024)
RECORD_FILE = "fp32_where_faster.json"  # under graphamp's cache root: timings kept across runs
MAX_RECORDED = 4096  # sizes kept in the file, the oldest dropped


def _timings(timed: _Timed, low: torch.dtype) -> tuple[float, float]:
    """(low ms, fp32 ms) of ``timed``: from this process, else from the machine's record of
    earlier runs, else timed now and recorded. The record makes the choice once per machine:
    every later run gets the same step (and its step cache entry) whatever its timing noise."""
    key = (*timed.key, low)
    found = _TIMINGS.get(key)
    if found is not None:
        return found
    text = repr((_machine(), key))
    record = _read_record()
    if text in record:
        low_ms, fp32_ms = record[text]
    else:
        low_ms, fp32_ms = _time_both(timed, low)
        _write_record({**record, text: [low_ms, fp32_ms]})
    _TIMINGS[key] = (low_ms, fp32_ms)
    return low_ms, fp32_ms


def _time_both(timed: _Timed, low: torch.dtype) -> tuple[float, float]:
    best = {low: math.inf, torch.float32: math.inf}
    for dtype in best:  # warm-up: first calls allocate and pick kernels
        timed.run(dtype)
    for _ in range(RUNS):
        for dtype in best:
            best[dtype] = min(best[dtype], timed.run(dtype))
    return best[low] * 1e3, best[torch.float32] * 1e3


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
        if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v)
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


def _attention(node: fx.Node, training: bool) -> _Timed | None:
    """How to run the attention of ``node`` at its sizes (None: not timed: an unknown or large
    size, or a mask that is not a plain tensor)."""
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

    def run(dtype: torch.dtype) -> float:
        gen = torch.Generator().manual_seed(0)
        qt, kt, vt = (
            torch.randn(s, generator=gen).to(dtype).requires_grad_(training) for s in (q, k, v)
        )
        m = None if mask_spec is None else _mask(mask_spec, dtype)
        grad = torch.ones((*q[:-1], v[-1]), dtype=dtype) if training else None
        with torch.enable_grad() if training else torch.no_grad():
            start = time.perf_counter()
            out = sdpa_reference(qt, kt, vt, m, dropout_p, is_causal, scale, gqa)
            if grad is not None:
                out.backward(grad)
            return time.perf_counter() - start

    return _Timed(("sdpa", q, k, v, mask_spec, dropout_p, is_causal, scale, gqa, training), run)


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
