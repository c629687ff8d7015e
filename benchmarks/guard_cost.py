"""What checking a compiled step's assumptions costs per call, against the step itself.

Every call of a Graph checks, before it runs the cached step: the ambient modes, the structure
key (modules, modes, optimizers, config, scaler, hooks), and the program's guards (the Python
attributes build() read, parameter and buffer sizes; ``records/guards.py``) through the program
cache's memo. This times those checks alone, in one process, against the median steady step of
the same Graph (CPU, bf16 AMP), for the seed MLP ("mlp") and the 6-layer GPT-2 of ``workloads.py``.

    python benchmarks/guard_cost.py                        # mlp and gpt2-6l, inductor
    python benchmarks/guard_cost.py --workloads mlp --backend aot_eager

Prints one JSON line per workload; the issue's target is checks under 5% of the seed MLP's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit

import torch
from bench import make_step
from workloads import WORKLOADS

from graphamp.records.inputs import flatten_inputs
from graphamp.runtime import ambient


def _best_us(fn, number: int, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _step_ms(g, batches, steps: int) -> float:
    times = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        g(x, y).item()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(name: str, backend: str, steps: int) -> dict:
    torch.manual_seed(0)
    workload = WORKLOADS[name](torch.device("cpu"))
    g = make_step("graphamp_bf16", workload, workload.make_model(), torch.device("cpu"), backend)
    x, y = workload.batches[0]
    g(x, y)  # compile
    step_ms = _step_ms(g, workload.batches, steps)
    run = g._run  # a benchmark of graphamp's internals
    (program,) = run.programs.values()
    inputs = flatten_inputs((x, y), {})

    def structure():
        return run.structure(
            run.modules, run.optimizers, run.config.snapshot(), run.scaler, ambient.mode_key()
        )

    key = (inputs.signature, structure())

    def all_checks():  # what _call does before it runs the step
        ambient.neutral_modes()
        run.programs.find((inputs.signature, structure()), inputs)

    guards = program.guards
    result = {
        "workload": name,
        "backend": backend,
        "step_ms": round(step_ms, 3),
        "attribute_guards": len(guards.attributes),
        "state_size_guards": len(guards.state_sizes),
        "guards_us": round(_best_us(guards.values_hold, 2000), 2),
        "lookup_with_guards_us": round(_best_us(lambda: run.programs.find(key, inputs), 2000), 2),
        "all_checks_us": round(_best_us(all_checks, 1000), 2),
    }
    result["guards_pct_of_step"] = round(result["lookup_with_guards_us"] / (step_ms * 10), 3)
    result["all_checks_pct_of_step"] = round(result["all_checks_us"] / (step_ms * 10), 3)
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["mlp", "gpt2-6l"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=50, help="steady steps timed (median)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.workloads:
        rows.append(measure(name, args.backend, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
