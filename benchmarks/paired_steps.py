"""graphamp's step variants side by side in one process, interleaved in blocks of steps.

    python benchmarks/paired_steps.py --workload hf-gpt2-small --variants inlined default
    python benchmarks/paired_steps.py --smoke                   # tiny model, aot_eager: runs?

What it answers: is graphamp's default within 2% of the inlined step (issue 64 §2), and what
do outlining and block updates cost a steady step. On this shared 2-core machine the same
program's median step moved by up to 1.7x between processes started minutes apart (the core's
speed drifts: CPU time moves with wall time), so programs in separate processes, as
``outline_cost.py`` runs them, cannot resolve 2%. Here every variant is built in this process,
and the variants take turns: each runs ``--block`` timed steps after three untimed ones (so
each runs with its own tensors in cache), and a round is one block of each. A variant's ratio
is the median over rounds of its block's median over the first variant's block median in the
same round: drift slower than a round cancels. ``--variants inlined inlined`` measures the
method's own spread.

Only graphamp's variants are paired this way: they share the process, its allocator and
torch's state, which would bias a comparison with torch.compile (``outline_cost.py`` measures
the peers, each in its own process). Variants: ``default`` (as graphamp decides),
``inlined`` (no outlining, no block updates), ``outlined`` (outlined, no block updates),
``inlined-block-updates`` and ``outlined-block-updates``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from outline_cost import WORKLOADS, make_workload  # noqa: E402

# variant -> (set_outline_blocks, set_block_updates); None: graphamp's default
VARIANTS = {
    "default": (None, None),
    "inlined": (False, False),
    "outlined": (True, False),
    "inlined-block-updates": (False, True),
    "outlined-block-updates": (True, True),
}


def make_variant(variant: str, workload: str, smoke: bool):
    """A fresh model, optimizer and graphamp step of ``variant`` (the same initial weights for
    every variant); returns (step, batch)."""
    import torch

    import graphamp

    torch.manual_seed(0)
    model, batch, loss_fn, make_opt = make_workload(workload, smoke)
    opt = make_opt(model)
    outline, block_updates = VARIANTS[variant]

    class Step(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_backend("aot_eager" if smoke else "inductor")
            if outline is not None:
                self.config.set_outline_blocks(outline)
                self.config.set_block_updates(block_updates)

        def build(self, x, y):
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return Step(), batch


def measure(workload: str, variants: list[str], rounds: int, block: int, smoke: bool) -> dict:
    steps, first_call = [], {}
    for k, variant in enumerate(variants):  # one at a time: each compile has the cores
        step, batch = make_variant(variant, workload, smoke)
        start = time.perf_counter()
        step(*batch)
        first_call[f"{k}:{variant}"] = round(time.perf_counter() - start, 1)
        steps.append((step, batch))
    medians: list[list[float]] = [[] for _ in variants]
    for _ in range(rounds):
        for k, (step, batch) in enumerate(steps):
            for _ in range(3):  # its own tensors back in cache
                step(*batch)
            times = []
            for _ in range(block):
                start = time.perf_counter()
                step(*batch)
                times.append(time.perf_counter() - start)
            medians[k].append(statistics.median(times))
    ratios = {
        f"{k}:{variant}": round(statistics.median(m / b for m, b in zip(medians[k], medians[0])), 4)
        for k, variant in enumerate(variants)
    }
    return {
        "workload": workload,
        "variants": variants,
        "ms": {
            f"{k}:{v}": round(statistics.median(medians[k]) * 1e3, 3)
            for k, v in enumerate(variants)
        },
        "ratio_to_first": ratios,
        "rounds_ratio_range": {
            f"{k}:{v}": [
                round(min(m / b for m, b in zip(medians[k], medians[0])), 4),
                round(max(m / b for m, b in zip(medians[k], medians[0])), 4),
            ]
            for k, v in enumerate(variants)
        },
        "first_call_s": first_call,
        "rounds": rounds,
        "block": block,
    }


def _table(rows: list[dict], command: str) -> str:
    import torch

    lines = [
        "# graphamp's step variants paired in one process (issue 64 §2)",
        "",
        f"CPU, torch {torch.__version__}, {torch.get_num_threads()} thread(s), bf16. "
        f"Command: `{command}`",
        "",
        "Median ms per step of each variant's blocks; ratio: median over rounds of the block's "
        "median over the first variant's in the same round; rounds' range: the lowest and the "
        "highest round.",
        "",
        "| workload | variant | ms | ratio to the first | rounds' range | first call s |",
        "|---|---|---:|---:|---|---:|",
    ]
    for row in rows:
        for name in row["ms"]:
            low, high = row["rounds_ratio_range"][name]
            lines.append(
                f"| {row['workload']} | {name.split(':', 1)[1]} | {row['ms'][name]} | "
                f"{row['ratio_to_first'][name]} | {low}-{high} | {row['first_call_s'][name]} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", nargs="*", choices=WORKLOADS, default=["hf-gpt2-small"])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=20, help="timed steps a block")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    variants = args.variants or ["inlined", "default"]
    if len(variants) < 2:
        parser.error("--variants needs at least two (the first is what the others are paired with)")
    rounds, block = (2, 2) if args.smoke else (args.rounds, args.block)
    command = "python benchmarks/paired_steps.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    rows = []
    for workload in ["gpt"] if args.smoke else args.workload:
        rows.append(measure(workload, variants, rounds, block, args.smoke))
        print(json.dumps(rows[-1]), flush=True)
    name = "paired_steps_smoke" if args.smoke else "paired_steps_cpu"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(_table(rows, command))
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
