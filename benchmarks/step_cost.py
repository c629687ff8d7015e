"""Steady-step time of graphamp on this machine, to compare two versions of graphamp in one run.

    python benchmarks/step_cost.py                       # this checkout: one JSON line
    python benchmarks/step_cost.py --trees OLD NEW       # two source trees, rounds interleaved

Workloads: the seed MLP (batch 128, SGD, LambdaLR) and a 6-layer GPT (n_embd 128, T 64, batch
8, AdamW, LambdaLR), fp16 AMP with a grad scaler, inductor. With ``--trees`` each round runs
every tree in a fresh process (``PYTHONPATH`` set to the tree), alternating the order, so both
see the same machine load; the report gives each tree's median over the rounds and NEW/OLD.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(steps: int, backend: str) -> dict:
    import torch
    import torch.nn.functional as F
    from workloads import GPT, lm_loss, seed_mlp

    import graphamp

    torch.manual_seed(0)
    mlp = seed_mlp("cpu")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 512, (8, 65), generator=gen)
    cases = {
        "seed_mlp": (mlp.make_model(), F.cross_entropy, mlp.batches[0], "sgd"),
        "gpt_6l": (
            GPT(vocab=512, seq=64, layers=6, heads=4, dim=128),
            lm_loss,
            (idx[:, :-1].contiguous(), idx[:, 1:].contiguous()),
            "adamw",
        ),
    }
    out = {}
    for name, (model, loss_fn, (x, y), kind) in cases.items():
        opt = (
            torch.optim.SGD(model.parameters(), lr=1e-3)
            if kind == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-4)
        )
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

        class Step(graphamp.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(opt, lr_sch=sch)
                self.config.enable_amp(True)
                self.config.set_backend(backend)
                self.set_grad_scaler(graphamp.GradScaler(init_scale=2.0**10))

            def build(self, x, y):
                loss = loss_fn(self.model(x), y)
                loss.backward()
                return loss

        g = Step()
        for _ in range(10):
            g(x, y)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            g(x, y)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e3
    return out


def compare(trees: list[str], rounds: int, steps: int, backend: str) -> dict:
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, HERE])}
            done = subprocess.run(
                [sys.executable, __file__, "--steps", str(steps), "--backend", backend],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    old, new = trees
    report = {"rounds": rounds, "steps": steps, "backend": backend}
    for name in runs[old][0]:
        a = statistics.median(run[name] for run in runs[old])
        b = statistics.median(run[name] for run in runs[new])
        report[name] = {"old_ms": round(a, 3), "new_ms": round(b, 3), "new/old": round(b / a, 3)}
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    if args.trees:
        result = compare(args.trees, args.rounds, args.steps, args.backend)
    else:
        sys.path.insert(0, HERE)
        result = {k: round(v, 3) for k, v in measure(args.steps, args.backend).items()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
