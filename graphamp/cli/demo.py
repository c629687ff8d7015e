"""``python -m graphamp demo``: the OneFlow AMP example, trained through graphamp.Graph.

The MLP of OneFlow's AMP tutorial (Linear 256→128, ReLU, Linear 128→10, batch 128, SGD lr 1e-3)
with ``enable_amp(True)`` and ``GradScaler(init_scale=3000, growth_factor=2.0, backoff_factor=0.5,
growth_interval=1000)``, on CUDA if present, else the CPU. The labels come from a fixed random
teacher network, so the loss has something to learn.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn as nn

import graphamp

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
    """Train the demo MLP for ``args.steps`` steps; print and return a summary."""
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    graph = make_graph(model, DTYPES[args.dtype], args.backend)
    if not args.quiet:
        graph.debug(1)
    losses, first_call, ms_per_step = train(graph, teacher_batches(device), args)
    summary = summarise(graph, args, device, losses, first_call, ms_per_step)
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k:14s} {v:.4f}" if isinstance(v, float) else f"  {k:14s} {v}")
    if args.dump:
        summary["dump"] = graph.dump(args.dump)
        print(f"  {'dump':14s} {summary['dump']} (open report.html in a browser)")
    logging.getLogger("graphamp").handlers.clear()
    return summary


def make_graph(model: nn.Module, dtype: torch.dtype, backend: str) -> graphamp.Graph:
    """OneFlow's AMP example as a Graph: SGD lr 1e-3, GradScaler(3000, 2.0, 0.5, 1000) in fp16."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    class TrainGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend(backend)
            if dtype == torch.float16:
                self.set_grad_scaler(
                    graphamp.GradScaler(
                        init_scale=3000, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000
                    )
                )

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return TrainGraph()


def teacher_batches(device: torch.device, n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches labelled by a fixed random linear teacher, so the loss has something to learn."""
    teacher = nn.Linear(256, 10).to(device)
    batches = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(128, 256, device=device)
            batches.append((x, teacher(x).argmax(dim=1)))
    return batches


def train(graph: graphamp.Graph, batches: list, args: argparse.Namespace):
    """(losses, first-call seconds, ms per step after the warm-up steps)."""
    from tqdm import tqdm

    warmup = min(20, args.steps // 4)  # kernels finish compiling and tuning in the first steps
    bar = tqdm(
        range(args.steps),
        desc=f"graphamp demo ({batches[0][0].device.type}, {args.dtype})",
        disable=args.quiet,
        unit="step",
    )
    losses, first_call, start_steady = [], None, None
    start = time.perf_counter()
    for step in bar:
        x, y = batches[step % len(batches)]
        losses.append(graph(x, y))
        if step == 0:
            first_call = time.perf_counter() - start
        if step == warmup:
            start_steady = time.perf_counter()
        if step % 50 == 0 and not args.quiet:
            bar.set_postfix(loss=f"{losses[-1].item():.4f}")
    if batches[0][0].is_cuda:
        torch.cuda.synchronize()
    steady = (time.perf_counter() - (start_steady or start)) / max(args.steps - warmup, 1)
    return losses, first_call, steady * 1e3


def summarise(
    graph: graphamp.Graph,
    args: argparse.Namespace,
    device: torch.device,
    losses: list,
    first_call: float,
    ms_per_step: float,
) -> dict:
    history = graph.history.fetch()
    return {
        "device": str(device),
        "dtype": args.dtype,
        "backend": args.backend,
        "steps": args.steps,
        "first_call_s": first_call,
        "ms_per_step": ms_per_step,  # after the warm-up steps
        "loss_first": losses[0].item(),
        "loss_last": sum(v.item() for v in losses[-16:]) / min(16, len(losses)),
        "skipped_steps": int(sum(history["skipped"])),
        "final_scale": graph.grad_scaler.get_scale() if graph.grad_scaler else None,
        "precision": graph.precision_report(with_autocast=False).summary(),
    }
