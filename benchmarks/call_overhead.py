"""graphamp's own Python time per call: the seed MLP's step with the compiled program replaced
by a function that returns its last outputs, so only graphamp's bookkeeping is timed (input
flattening, the cache lookup, gathering state, counters, schedulers, output rebuilding).

    python benchmarks/call_overhead.py                 # best of 5 runs of 5,000 calls
    python benchmarks/call_overhead.py --runs 3 --calls 2000

Prints one JSON line: microseconds per call (best run, and the median of the runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn

import graphamp


def make_graph() -> graphamp.Graph:
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    class TrainGraph(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.add_optimizer(opt, lr_sch=sch)
            self.config.enable_amp(True)
            self.config.set_backend("aot_eager")
            self.set_grad_scaler(graphamp.GradScaler(init_scale=3000, growth_interval=1000))

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return TrainGraph()


def replace_compiled_step_with_noop(g: graphamp.Graph, x, y) -> None:
    """Run one real call, then swap the compiled program for one returning those outputs."""
    g(x, y)
    (program,) = g._programs.values()  # a benchmark of graphamp's internals
    runner = program.runner
    outputs = runner.compiled(*runner.gather([x, y]))
    runner.compiled = lambda *flat: outputs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    g = make_graph()
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    replace_compiled_step_with_noop(g, x, y)
    per_call = []
    for _ in range(args.runs):
        start = time.perf_counter()
        for _ in range(args.calls):
            g(x, y)
        per_call.append((time.perf_counter() - start) / args.calls * 1e6)
    result = {
        "us_per_call_best": round(min(per_call), 2),
        "us_per_call_median": round(statistics.median(per_call), 2),
        "runs": args.runs,
        "calls": args.calls,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
