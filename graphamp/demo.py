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
    parser.add_argument("--dump", default="amp-dump", help="where to write the graph dump "
                        "(empty string: no dump)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    teacher = nn.Linear(256, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = DTYPES[args.dtype]

    class TrainGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, dtype=dtype)
            self.config.set_backend(args.backend)
            if dtype == torch.float16:
                self.set_grad_scaler(graphamp.GradScaler(
                    init_scale=3000, growth_factor=2.0, backoff_factor=0.5, growth_interval=1000))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    graph = TrainGraph()
    log = logging.getLogger("graphamp")
    if not args.quiet:
        graph.debug(1)
    batches = []
    with torch.no_grad():
        for _ in range(16):
            x = torch.randn(128, 256, device=device)
            batches.append((x, teacher(x).argmax(dim=1)))

    start = time.perf_counter()
    warmup = min(20, args.steps // 4)  # kernels finish compiling and tuning in the first steps
    start_steady = None
    losses = []
    bar = tqdm(range(args.steps), desc=f"graphamp demo ({device.type}, {args.dtype})",
               disable=args.quiet, unit="step")
    first_call = None
    for step in bar:
        x, y = batches[step % len(batches)]
        loss = graph(x, y)
        losses.append(loss)
        if step == 0:
            first_call = time.perf_counter() - start
        if step == warmup:
            start_steady = time.perf_counter()
        if step % 50 == 0 and not args.quiet:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    steady = (time.perf_counter() - (start_steady or start)) / max(args.steps - warmup, 1)
    history = graph.history.fetch()
    report = graph.precision_report(with_autocast=False)
    summary = {
        "device": str(device),
        "dtype": args.dtype,
        "backend": args.backend,
        "steps": args.steps,
        "first_call_s": first_call,
        "ms_per_step": steady * 1e3,  # after the warm-up steps
        "loss_first": losses[0].item(),
        "loss_last": sum(l.item() for l in losses[-16:]) / min(16, len(losses)),
        "skipped_steps": int(sum(history["skipped"])),
        "final_scale": graph.grad_scaler.get_scale() if graph.grad_scaler else None,
        "precision": report.summary(),
    }
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k:14s} {v:.4f}" if isinstance(v, float) else f"  {k:14s} {v}")
    if args.dump:
        path = graph.dump(args.dump)
        summary["dump"] = path
        print(f"  {'dump':14s} {path} (open report.html in a browser)")
    log.handlers.clear()
    return summary
