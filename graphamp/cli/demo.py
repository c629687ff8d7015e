"""``python -m graphamp demo``: what graphamp does, beside ``torch.autocast`` + ``GradScaler``.

The MLP and loss scaler of OneFlow's AMP tutorial (Linear 256→128, ReLU, Linear 128→10, batch
128, ``GradScaler(init_scale=3000, growth_factor=2.0, backoff_factor=0.5,
growth_interval=1000)``) learn labels given by a fixed random teacher network, with SGD at lr
0.05 and momentum 0.9 (the tutorial's lr 1e-3 barely moves the loss in 500 steps). The same
model, batches and scaler train twice in one process: through ``graphamp.Graph`` and through
eager ``torch.autocast`` + ``torch.amp.GradScaler``. In fp16 one batch, part way through,
overflows on purpose (its inputs are scaled past float16's range): both skip that step and
halve the scale. The summary sets the two runs side by side: losses, speed, casts and host
reads per step. Then it prints graphamp's precision decision for each op, with the reason.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._local_scalar_dense, torch.utils._python_dispatch
import argparse
import copy
import logging
import math
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import graphamp

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALER: dict[str, Any] = {
    "init_scale": 3000.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
}
LR, MOMENTUM = 0.05, 0.9
OVERFLOW = 1e6  # the overflowing batch's inputs are multiplied by this (float16's max: 65504)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=500, help="training steps (default 500)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--backend", choices=graphamp.config.BACKENDS, default="inductor")
    parser.add_argument(
        "--dump", default="amp-dump", help="where to write the graph dump (empty string: no dump)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict:
    """Train the demo MLP both ways for ``args.steps`` steps; print and return a summary."""
    # a CUDA build of torch on a machine without CUDA says so when inductor loads: not ours to say
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    twin = copy.deepcopy(model)
    graph = make_graph(model, dtype, args.backend)
    if not args.quiet:
        graph.debug(1)
    batches = teacher_batches(device)
    overflow_at = args.steps * 3 // 5 if dtype == torch.float16 and args.steps >= 10 else None
    ours = train(graph, batches, args, overflow_at, "graphamp")
    theirs = train(eager_step(twin, dtype), batches, args, overflow_at, "eager autocast")
    summary = summarise(graph, args, device, ours, theirs, overflow_at)
    print_summary(summary, graph)
    if args.dump:
        summary["dump"] = graph.dump(args.dump)
        print(f"\ngraph dump: {summary['dump']} (open report.html in a browser)")
    logging.getLogger("graphamp").handlers.clear()
    return summary


def make_graph(model: nn.Module, dtype: torch.dtype, backend: str) -> graphamp.Graph:
    """The training step as a Graph: SGD, and in fp16 the tutorial's GradScaler."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    class TrainGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend(backend)
            if dtype == torch.float16:
                self.set_grad_scaler(graphamp.GradScaler(**SCALER))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return TrainGraph()


def eager_step(model: nn.Module, dtype: torch.dtype) -> Callable:
    """The same step as PyTorch's AMP recipe writes it: autocast, GradScaler in fp16."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    device = next(model.parameters()).device.type
    scaler = torch.amp.GradScaler(device, **SCALER, enabled=dtype == torch.float16)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    step.scaler = scaler  # type: ignore[attr-defined]
    return step


def teacher_batches(device: torch.device, n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches labelled by a fixed random two-layer teacher, so the loss has something to learn."""
    teacher = nn.Sequential(nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 10)).to(device)
    batches = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(128, 256, device=device)
            batches.append((x, teacher(x).argmax(dim=1)))
    return batches


class HostReads(TorchDispatchMode):
    """Counts the tensor values a step reads back on the host (``.item()``: a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def train(step: Callable, batches: list, args: argparse.Namespace, overflow_at, name: str):
    """Losses, first-call seconds, ms per step after the warm-up, host reads of one step."""
    from tqdm import tqdm

    warmup = min(20, args.steps // 4)  # kernels finish compiling and tuning in the first steps
    bar = tqdm(range(args.steps), desc=f"{name} ({args.dtype})", disable=args.quiet, unit="step")
    losses, first_call, start_steady, reads, scales = [], 0.0, None, None, []
    scaler = getattr(step, "scaler", None)
    scaler = scaler if scaler is not None and scaler.is_enabled() else None
    start = time.perf_counter()
    for i in bar:
        x, y = batches[i % len(batches)]
        if i == overflow_at:
            x = x * OVERFLOW
        if i == warmup + 1:
            with HostReads() as counted:
                losses.append(step(x, y))
            reads = counted.count
        else:
            losses.append(step(x, y))
        if scaler is not None:  # the demo's bookkeeping (a host read), outside the step
            scales.append(scaler.get_scale())
        if i == 0:
            first_call = time.perf_counter() - start
        if i == warmup:
            _sync(x)
            start_steady = time.perf_counter()
    _sync(batches[0][0])
    steady = (time.perf_counter() - (start_steady or start)) / max(args.steps - warmup - 1, 1)
    skipped = [j for j in range(1, len(scales)) if scales[j] < scales[j - 1]]
    return [float(v) for v in losses], first_call, steady * 1e3, reads, skipped


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def summarise(graph, args, device, ours, theirs, overflow_at) -> dict:
    losses, first_call, ms, reads, _ = ours
    eager_losses, _, eager_ms, eager_reads, eager_skipped = theirs
    history = graph.history.fetch()
    report = graph.precision_report(with_autocast=True)
    finite = [
        abs(a - b) / abs(b)
        for a, b in zip(losses, eager_losses)
        if math.isfinite(a) and math.isfinite(b)
    ]
    return {
        "device": str(device),
        "dtype": args.dtype,
        "backend": args.backend,
        "steps": args.steps,
        "loss_first": losses[0],
        "loss_last": _finite_mean(losses[-16:]),
        "eager_loss_last": _finite_mean(eager_losses[-16:]),
        "max_rel_loss_difference": max(finite, default=0.0),
        "first_call_s": first_call,
        "ms_per_step": ms,
        "eager_ms_per_step": eager_ms,
        "host_reads_per_step": reads,
        "eager_host_reads_per_step": eager_reads,
        "casts": report.casts,
        "parameter_copies": report.parameter_copies,
        "autocast_casts": report.autocast["casts"] if report.autocast is not None else None,
        "overflow_step": overflow_at,
        "skipped_steps": [i for i, s in enumerate(history["skipped"]) if s],
        "final_scale": graph.grad_scaler.get_scale() if graph.grad_scaler else None,
        "eager_skipped_steps": eager_skipped,
        "precision": report.summary(),
    }


def _finite_mean(values: list[float]) -> float:
    """The mean of the finite losses (the step that overflowed on purpose has none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def print_summary(summary: dict, graph: graphamp.Graph) -> None:
    s = summary
    rows = [
        ("", "graphamp", "eager autocast + GradScaler"),
        ("loss, last 16 steps (finite)", f"{s['loss_last']:.4f}", f"{s['eager_loss_last']:.4f}"),
        ("ms per step", f"{s['ms_per_step']:.3f}", f"{s['eager_ms_per_step']:.3f}"),
        (
            "casts in the forward",
            f"{s['casts']} (+{s['parameter_copies']} parameter copies)",
            str(s["autocast_casts"]),
        ),
        (
            "host reads per step",
            str(s["host_reads_per_step"]),
            str(s["eager_host_reads_per_step"]),
        ),
    ]
    if s["final_scale"] is not None:
        rows.append(("skipped steps", str(s["skipped_steps"]), str(s["eager_skipped_steps"])))
    print(
        f"\n{s['steps']} steps, {s['dtype']}, {s['device']}, backend {s['backend']}: loss "
        f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}; first call {s['first_call_s']:.1f} s"
    )
    width = max(len(r[0]) for r in rows) + 2
    for label, a, b in rows:
        print(f"  {label:{width}s}{a:34s}{b}")
    print(f"  the two runs' losses differ by at most {100 * s['max_rel_loss_difference']:.2f}%")
    if s["overflow_step"] is not None:
        print(
            f"  step {s['overflow_step']} overflowed on purpose (inputs x {OVERFLOW:g}): both "
            f"skipped it and halved the scale (now {s['final_scale']:g}); graphamp decides "
            "inside the compiled step, eager GradScaler reads found_inf on the host every step"
        )
    print("\nwhy each op runs in its precision (graphamp's decision, overridable):")
    report = graph.precision_report(with_autocast=False)
    for row in report.rows:
        print(f"  {row['op']:24s} {row['module'] or '-':10s} {row['dtype']:9s} {row['why']}")
