"""Activation checkpointing on the CPU: counted peak of live intermediates, and step time.

    PYTHONPATH=. python benchmarks/checkpoint_memory.py [--layers 4 --dim 64 --batch 16 --seq 64]

Peak bytes are counted on the step graph (graphamp.inspect.memory.step_memory); the step time
is the median of timed calls after two warm-up calls, backend aot_eager.
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import Block, TinyGPT, lm_loss

import graphamp
from graphamp.inspect.memory import step_memory


def measure(base, args, ckpt: bool, amp):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("aot_eager")
            if amp is not None:
                self.config.enable_amp(True, dtype=amp)
            if ckpt:
                self.config.enable_activation_checkpointing(Block)

        def build(self, idx, targets):
            loss = lm_loss(self.model(idx), targets)
            loss.backward()
            return loss

    g = Train()
    idx = torch.randint(0, 64, (args.batch, args.seq))
    times = []
    for i in range(2 + args.steps):
        start = time.perf_counter()
        g(idx, torch.roll(idx, 1, 1))
        if i >= 2:
            times.append(time.perf_counter() - start)
    mem = step_memory(g.compiled_steps[-1].step_graph)
    return mem, statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    base = TinyGPT(vocab=64, dim=args.dim, heads=4, layers=args.layers, seq=args.seq)
    print(
        "| precision | checkpointing | peak intermediates (MiB, counted) | resident (MiB) "
        "| ms/step (CPU, aot_eager) |"
    )
    print("|---|---|---:|---:|---:|")
    for amp in (None, torch.bfloat16):
        for ckpt in (False, True):
            mem, ms = measure(base, args, ckpt, amp)
            print(
                f"| {'fp32' if amp is None else 'bf16'} | {'Block' if ckpt else 'off'} | "
                f"{mem.peak_intermediate_bytes / 2**20:.2f} | {mem.resident_bytes / 2**20:.2f} "
                f"| {ms:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
