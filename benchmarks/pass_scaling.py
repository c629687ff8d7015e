"""How long the AMP passes take as graphs grow: colour + cast a synthetic graph of N nodes.

Each block of the synthetic graph mixes every list category the way a transformer layer does:
view (clear) -> mm (allow) -> add (infer) -> gelu (infer) -> mm (allow) -> residual add (infer)
-> softmax (deny) -> mul (infer) -> relu (clear), with two weight placeholders per block. Nodes
carry a shared fake value (the passes read metadata only).

    python benchmarks/pass_scaling.py                 # 10k, 30k, 100k nodes
    python benchmarks/pass_scaling.py --nodes 100000 --repeat 3

Writes benchmarks/results/pass_scaling.json and .md. The timed region is the AMP pipeline
(``run_amp_passes``: colour_by_lists, hoist_parameter_casts, insert_casts, remove_hints,
fold_cast_chains) without the final invariant check and without regenerating Python code, which
are reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphamp.passes import DEFAULT_LISTS, AmpContext, check_amp_invariants, run_amp_passes

aten = torch.ops.aten
HERE = os.path.dirname(os.path.abspath(__file__))


def synthetic_graph(n_nodes: int) -> tuple[fx.GraphModule, frozenset]:
    with FakeTensorMode():
        val = torch.empty(64, 64)
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = val
    params, blocks = [], max(1, -(-(n_nodes - 2) // 11))  # 11 nodes a block, >= n_nodes
    weights = []
    for i in range(blocks):
        for j in range(2):
            w = graph.placeholder(f"w{i}_{j}")
            w.meta["val"] = val
            weights.append(w)
    params = frozenset(w.name for w in weights)
    h = x
    for i in range(blocks):
        w1, w2 = weights[2 * i], weights[2 * i + 1]
        v = graph.call_function(aten.view.default, (h, [64, 64]))
        m = graph.call_function(aten.mm.default, (v, w1))
        a = graph.call_function(aten.add.Tensor, (m, w1))
        g = graph.call_function(aten.gelu.default, (a,))
        m2 = graph.call_function(aten.mm.default, (g, w2))
        r = graph.call_function(aten.add.Tensor, (h, m2))
        s = graph.call_function(aten._softmax.default, (r, -1, False))
        e = graph.call_function(aten.mul.Tensor, (s, 2.0))
        h = graph.call_function(aten.relu.default, (e,))
        for node in (v, m, a, g, m2, r, s, e, h):
            node.meta["val"] = val
    graph.output((h,))
    return fx.GraphModule(torch.nn.Module(), graph, class_name="Synthetic"), params


def measure(n_nodes: int, repeat: int) -> dict:
    best, lint_s, code_s = float("inf"), None, None
    nodes = casts = None
    for _ in range(repeat):
        gm, params = synthetic_graph(n_nodes)
        nodes = len(gm.graph.nodes)
        ctx = AmpContext(lists=DEFAULT_LISTS, dtype=torch.float16, parameters=params)
        start = time.perf_counter()
        gm = run_amp_passes(gm, ctx, check=False, recompile=False)
        best = min(best, time.perf_counter() - start)
        casts = sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
        start = time.perf_counter()
        check_amp_invariants(gm, ctx)
        lint_s = time.perf_counter() - start
        start = time.perf_counter()
        gm.recompile()
        code_s = time.perf_counter() - start
    return {
        "nodes": nodes,
        "passes_s": best,
        "us_per_node": best / nodes * 1e6,
        "lint_s": lint_s,
        "recompile_s": code_s,
        "casts": casts,
        "hoisted": ctx.stats.get("parameter_casts_hoisted"),
        "per_pass_s": ctx.stats.get("pass_seconds", {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="*", default=[10_000, 30_000, 100_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(n, args.repeat) for n in args.nodes]
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "threads": 1,
        "command": "python benchmarks/pass_scaling.py "
        + " ".join(f"--nodes {' '.join(map(str, args.nodes))} --repeat {args.repeat}".split()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "pass_scaling.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [
        "# AMP pass time against graph size",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, one thread; best of "
        f"{args.repeat}. Command: `{meta['command']}`",
        "",
        "| nodes | colour + cast (s) | µs/node | casts | param casts hoisted | invariant check (s) | recompile (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['passes_s']:.3f} | {r['us_per_node']:.2f} | "
            f"{r['casts']} | {r['hoisted']} | {r['lint_s']:.3f} | {r['recompile_s']:.3f} |"
        )
    with open(os.path.join(args.out, "pass_scaling.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
