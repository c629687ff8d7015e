"""Scaled-dot-product attention in low precision against fp32, on this machine: the facts behind
``config.set_fp32_where_faster`` (``graphamp/passes/fp32_where_faster.py``).

For each (batch, heads, length, head size, causal) the script times torch's
``F.scaled_dot_product_attention`` forward, and forward plus backward, on random tensors in
fp32 and in the low dtype, and keeps each one's best of ``--runs``. The last column is what
the pass chooses for a training graph, for calls it times (fp32 where it took at most
1/MARGIN of the time).

    python benchmarks/attention_precision.py                 # one thread, bf16
    python benchmarks/attention_precision.py --threads 2 --dtype fp16

Results: benchmarks/results/attention_precision_cpu.md (``--out`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# (batch, heads, length, head size, causal): the attention of the benchmarks' workloads
# (the small-block GPT-2 of issue 64, transformers' GPT-2 at B8 T64, ViT-Ti/16 at B8), then
# longer sequences
SHAPES = (
    (2, 4, 64, 32, True),
    (8, 4, 64, 32, True),
    (8, 3, 197, 64, False),
    (8, 12, 128, 64, True),
    (8, 12, 256, 64, True),
    (8, 12, 512, 64, True),
    (4, 16, 1024, 64, True),
)


def best_ms(run, runs: int) -> float:
    run()  # warm-up: the first call allocates and picks kernels
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_shape(shape, low, runs: int) -> dict:
    import torch
    import torch.nn.functional as F

    b, h, t, d, causal = shape
    out = {}
    for dtype in (torch.float32, low):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(3))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        grad = torch.ones(b, h, t, d, dtype=dtype)

        def forward(q=q, k=k, v=v):
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def training(q=q, k=k, v=v, grad=grad):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)

        name = "fp32" if dtype == torch.float32 else "low"
        out[f"{name} forward"] = best_ms(forward, runs)
        out[f"{name} training"] = best_ms(training, runs)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)

    import torch

    from graphamp.passes.fp32_where_faster import MARGIN

    torch.set_num_threads(args.threads)
    low = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    lines = [
        f"| (B, H, T, D), causal | fp32 fwd ms | {args.dtype} fwd ms | fp32 fwd+bwd ms | "
        f"{args.dtype} fwd+bwd ms | {args.dtype} / fp32, fwd+bwd | training graph runs |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for shape in SHAPES:
        r = time_shape(shape, low, args.runs)
        ratio = r["low training"] / r["fp32 training"]
        choice = "fp32" if r["fp32 training"] * MARGIN <= r["low training"] else args.dtype
        lines.append(
            f"| {shape[:4]}, {shape[4]} | {r['fp32 forward']:.3f} | {r['low forward']:.3f} | "
            f"{r['fp32 training']:.3f} | {r['low training']:.3f} | {ratio:.2f} | {choice} |"
        )
        print(lines[-1], flush=True)
    header = (
        f"# Attention in {args.dtype} against fp32 on the CPU\n\n"
        f"{platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} thread(s), best of {args.runs} runs. Command: `python "
        f"benchmarks/attention_precision.py --threads {args.threads} --dtype {args.dtype}`\n\n"
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_precision_cpu.md")
    with open(path, "w") as f:
        f.write(header + "\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
