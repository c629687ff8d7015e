"""Shared by the examples: --tiny (CPU, a few steps, aot_eager) or full size on a GPU."""

from __future__ import annotations

import argparse

import torch


def parse(description: str, steps: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--tiny", action="store_true", help="a few small steps on the CPU (what the tests run)"
    )
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    args.device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    args.backend = "aot_eager" if args.tiny else "inductor"
    args.steps = args.steps or (4 if args.tiny else steps)
    return args
