"""Convolution networks' steady step on the CPU: the traced layout against inductor's channels-last.

Inductor lays out every CPU graph that holds a convolution channels-last (a rule made for
inference graphs). A whole training step holds the backward too, where torch.compile's
backward graph holds no ``convolution`` and keeps the traced layout. graphamp's default
(``backend/compile.default_inductor_options``) keeps the traced layout for a step with a
convolution's backward; this measures that against inductor's rule
(``config.set_inductor_options(layout_optimization=True)``, graphamp's default until this
benchmark) and against the peer (``torch.compile(model)`` + ``torch.autocast`` + eager SGD).

All programs run in one process, interleaved, the order alternating each round; bf16, inductor,
SGD with momentum, one CPU thread unless ``--threads`` says otherwise, the step cache off. The
first call of each program is timed too, on a cache directory of this run (kernels whose source
two programs share are compiled once, for the first).

    python benchmarks/conv_layout.py                       # every workload
    python benchmarks/conv_layout.py --workload resnet18-64 --rounds 4
    python benchmarks/conv_layout.py --smoke               # a tiny net, aot_eager: runs?

Results: benchmarks/results/conv_layout_cpu.{json,md} (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from machine import cpu_words  # noqa: E402

# torchvision model, image side, batch
WORKLOADS = {
    "resnet18-64": ("resnet18", 64, 8),
    "resnet18-128": ("resnet18", 128, 8),
    "resnet18-224": ("resnet18", 224, 4),
    "resnet50-64": ("resnet50", 64, 8),
    "mobilenet_v3_small-128": ("mobilenet_v3_small", 128, 8),
}
PROGRAMS = ("default", "channels-last", "compile")


def make_workload(name: str, smoke: bool):
    import torch
    import torch.nn as nn
    import torchvision

    gen = torch.Generator().manual_seed(0)
    if smoke:
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )
        side, batch = 16, 2
    else:
        arch, side, batch = WORKLOADS[name]
        model = getattr(torchvision.models, arch)(num_classes=100)
    x = torch.randn(batch, 3, side, side, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return model, (x, y)


def make_step(program: str, model, backend: str):
    """outline_cost.py's programs (graphamp's step with its blocks outlined, as on the CPU by
    default, and the peer), with SGD momentum; "channels-last" is graphamp's step with
    inductor's own rule for CPU graphs."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    from outline_cost import make_step as outline_cost_step

    sgd = lambda m, fused=None: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)  # noqa: E731
    step = outline_cost_step(
        "compile" if program == "compile" else "outlined", model, F.cross_entropy, sgd, backend
    )
    if program == "channels-last":
        step.config.set_inductor_options(layout_optimization=True)
    return step


def measure(workload: str, rounds: int, steps: int, smoke: bool) -> dict:
    import torch

    torch.manual_seed(0)
    model, (x, y) = make_workload(workload, smoke)
    backend = "aot_eager" if smoke else "inductor"
    programs, first_call, losses = {}, {}, {}
    for program in PROGRAMS:
        step = make_step(program, copy.deepcopy(model), backend)
        start = time.perf_counter()
        losses[program] = [float(step(x, y))]
        first_call[program] = time.perf_counter() - start
        programs[program] = step
    times: dict[str, list[float]] = {p: [] for p in PROGRAMS}
    for r in range(rounds):
        for program in PROGRAMS if r % 2 == 0 else PROGRAMS[::-1]:
            step = programs[program]
            step(x, y)  # the other programs ran meanwhile: caches cold again
            for _ in range(steps):
                start = time.perf_counter()
                losses[program].append(float(step(x, y)))
                times[program].append(time.perf_counter() - start)
    ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
    return {
        "workload": workload,
        "ms": {p: round(v, 2) for p, v in ms.items()},
        "default/channels-last": round(ms["default"] / ms["channels-last"], 3),
        "default/compile": round(ms["default"] / ms["compile"], 3),
        "channels-last/compile": round(ms["channels-last"] / ms["compile"], 3),
        "first_call_s": {p: round(v, 1) for p, v in first_call.items()},
        # every program trains the same batch from the same weights: the losses of its first
        # call and its last step (each program took the same number of steps)
        "loss_first_last": {p: [round(v[0], 4), round(v[-1], 4)] for p, v in losses.items()},
        "rounds": rounds,
        "steps_per_round": steps,
    }


def write_table(path: str, rows: list[dict], meta: dict) -> None:
    lines = [
        "# Convolution networks' steady step: the traced layout against channels-last (CPU)",
        "",
        f"{meta['machine']}, torch {meta['torch']}, {meta['threads']} thread(s), bf16, "
        f"inductor, SGD with momentum. Command: `{meta['command']}`",
        "",
        "Median ms per step, the three programs in one process, interleaved (the order "
        "alternates each round). default: graphamp's default (the step keeps the layout it "
        "was traced in); channels-last: graphamp with inductor's CPU rule "
        "(`set_inductor_options(layout_optimization=True)`); compile: torch.compile + "
        "autocast + eager SGD. First calls on this run's cache directory.",
        "",
        "| workload | default ms | channels-last ms | torch.compile ms | default / channels-last "
        "| default / torch.compile | first call s (default, channels-last, compile) "
        "| loss first, last (default; channels-last; compile) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        ms, fc, lo = r["ms"], r["first_call_s"], r["loss_first_last"]
        lines.append(
            f"| {r['workload']} | {ms['default']:.1f} | {ms['channels-last']:.1f} | "
            f"{ms['compile']:.1f} | {r['default/channels-last']:.3f} | "
            f"{r['default/compile']:.3f} | "
            f"{fc['default']}, {fc['channels-last']}, {fc['compile']} | "
            + "; ".join(f"{lo[p][0]}, {lo[p][1]}" for p in PROGRAMS)
            + " |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per program a round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.smoke:
        args.rounds, args.steps, args.workload = 2, 2, ["smoke"]
    # first calls compile here, not from an earlier run's inductor cache
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="conv_layout_"))
    meta = {
        "machine": cpu_words(),
        "torch": torch.__version__,
        "threads": args.threads,
        "command": "python benchmarks/conv_layout.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    os.makedirs(args.out, exist_ok=True)
    name = "conv_layout_smoke" if args.smoke else "conv_layout_cpu"
    rows = []
    for workload in args.workload:
        row = measure(workload, args.rounds, args.steps, args.smoke)
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:  # as each one finishes
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        write_table(os.path.join(args.out, f"{name}.md"), rows, meta)
    return rows


if __name__ == "__main__":
    main()
