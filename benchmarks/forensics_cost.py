"""What overflow tracing costs per step: ms/step with it off and on, in the same run.

Two Graphs per (workload, backend), identical but for ``config.enable_overflow_tracing()``,
built on copies of one model; after warm-up their steps alternate (off, on, off, on, ...) so
both see the same machine load, and each side's median is reported.

    python benchmarks/forensics_cost.py                       # CPU: TinyGPT and a small ResNet,
                                                              # aot_eager and inductor
    python benchmarks/forensics_cost.py --workload gpt --backend aot_eager --steps 10
    python benchmarks/forensics_cost.py --device cuda --workload gpt2 resnet50 \
        --backend inductor                                    # GPU: GPT-2 124M (B8 T1024) and
                                                              # ResNet-50 (B128 224x224), fp16

On the CPU AMP runs in bf16: fp16 matrix products on the CPU run ~10x slower than fp32 ones (no
native kernels), which would hide the probes' cost behind slow GEMMs; the probes themselves do
not depend on the dtype. On CUDA it runs fp16 with graphamp.GradScaler (the case forensics is
for), CUDA graphs on (graphamp's default), and each step is timed with CUDA events around it.
Results: benchmarks/results/forensics_cost_<cpu|cuda>.{json,md}. ``benchmarks/bench.py
--variant graphamp_fp16 graphamp_fp16_traced`` gives the same comparison beside the other
variants of bench.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from models import TinyGPT, lm_loss  # noqa: E402

import graphamp  # noqa: E402

sys.path.insert(0, HERE)
from machine import cpu_words  # noqa: E402
from workloads import WORKLOADS  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            None
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    """ResNet-18's layout at a quarter of the width, one block per stage, for 32x32 images."""

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        widths = [width, 2 * width, 4 * width, 8 * width]
        self.stages = nn.Sequential(
            *(
                BasicBlock(widths[max(i - 1, 0)], w, 1 if i == 0 else 2)
                for i, w in enumerate(widths)
            )
        )
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))


def workload(name: str, device: torch.device):
    """(model, loss, batch, description); gpt2 and resnet50 are bench.py's full-size ones."""
    torch.manual_seed(0)
    if name in ("gpt2", "resnet50"):
        w = WORKLOADS[name](device, n_batches=1)
        return w.make_model(), w.loss, w.batches[0], w.description
    if name == "gpt":
        model = TinyGPT(vocab=256, dim=128, heads=4, layers=4, seq=64)
        batch = (torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64)))
        return (
            model,
            lm_loss,
            batch,
            "TinyGPT (tests/models.py): 4 layers, dim 128, 4 heads, "
            "vocab 256; batch 8 x 64 tokens; AdamW",
        )
    model = SmallResNet()
    batch = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    return (
        model,
        F.cross_entropy,
        batch,
        "SmallResNet (4 BasicBlocks, widths 16-128, BatchNorm); batch 16 x 3 x 32 x 32; AdamW",
    )


def make_graph(model: nn.Module, loss_fn, backend: str, traced: bool) -> graphamp.Graph:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cuda = next(model.parameters()).is_cuda

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.enable_amp(True, dtype=torch.float16 if cuda else torch.bfloat16)
            self.config.set_backend(backend)
            if cuda:
                self.set_grad_scaler(graphamp.GradScaler())
            if traced:
                self.config.enable_overflow_tracing()

        def build(self, x, y):
            loss = loss_fn(self.model(x), y)
            loss.backward()
            return loss

    return Train()


def _timed(fn, cuda: bool) -> float:
    """ms of one call of fn (CUDA: events around it, so the GPU time of the step)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def measure(name: str, backend: str, steps: int, warmup: int, device: torch.device) -> dict:
    model, loss_fn, batch, description = workload(name, device)
    model = model.to(device)
    batch = tuple(t.to(device) for t in batch)
    cuda = device.type == "cuda"
    graphs, first_call = {}, {}
    for traced in (False, True):
        graphs[traced] = make_graph(copy.deepcopy(model), loss_fn, backend, traced)
        start = time.perf_counter()
        graphs[traced](*batch)
        if cuda:
            torch.cuda.synchronize()
        first_call[traced] = time.perf_counter() - start
        for _ in range(warmup):
            graphs[traced](*batch)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(steps):
        for traced in (False, True):  # alternate: both sides see the same load
            times[traced].append(_timed(lambda g=graphs[traced]: g(*batch), cuda))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    step_graphs = {t: g.compiled_steps[-1].step_graph for t, g in graphs.items()}
    probes = sum(
        n.meta.get("graphamp_subgraph") == "forensics" for n in step_graphs[True].graph.nodes
    )
    return {
        "workload": name,
        "description": description,
        "backend": backend,
        "ms_off": off,
        "ms_on": on,
        "overhead_pct": (on / off - 1) * 100,
        "first_call_s_off": first_call[False],
        "first_call_s_on": first_call[True],
        "step_nodes_off": len(step_graphs[False].graph.nodes),
        "step_nodes_on": len(step_graphs[True].graph.nodes),
        "forensics_nodes": probes,
        "steps": steps,
        "device": str(device),
    }


def write(rows: list[dict], meta: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"forensics_cost_{meta['device_type']}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = [
        f"# Overflow tracing: cost per step ({meta['device_type']})",
        "",
        f"{meta['machine']}, {meta['threads']} thread(s), torch {meta['torch']}, "
        f"graphamp {meta['graphamp']}. Command: `{meta['command']}`",
        "",
        "Medians over the measured steps; the traced and untraced graphs' steps alternate "
        f"in one process. AMP {meta['amp']} (the script's docstring says why).",
        "",
        "| workload | backend | ms/step off | ms/step on | cost | forensics nodes | step nodes off → on | first call s off / on |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['backend']} | {r['ms_off']:.1f} | {r['ms_on']:.1f} | "
            f"{r['overhead_pct']:+.0f}% | {r['forensics_nodes']} | {r['step_nodes_off']} → "
            f"{r['step_nodes_on']} | {r['first_call_s_off']:.1f} / "
            f"{r['first_call_s_on']:.1f} |"
        )
    described = {r["workload"]: r["description"] for r in rows}
    lines += [""] + [f"- {name}: {text}" for name, text in described.items()]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        nargs="*",
        default=["gpt", "resnet"],
        choices=["gpt", "resnet", "gpt2", "resnet50"],
    )
    parser.add_argument(
        "--backend", nargs="*", default=["aot_eager", "inductor"], choices=["aot_eager", "inductor"]
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steadier figures on a shared machine)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_words()
    meta = {
        "machine": machine,
        "device_type": device.type,
        "amp": "fp16 + GradScaler" if device.type == "cuda" else "bf16",
        "threads": args.threads,
        "torch": torch.__version__,
        "graphamp": graphamp.__version__,
        "command": "python benchmarks/forensics_cost.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    rows = []
    for name in args.workload:
        for backend in args.backend:
            print(f"[forensics_cost] {name} {backend} ...", flush=True)
            rows.append(measure(name, backend, args.steps, args.warmup, device))
            print(
                f"  off {rows[-1]['ms_off']:.1f} ms, on {rows[-1]['ms_on']:.1f} ms "
                f"({rows[-1]['overhead_pct']:+.0f}%)",
                flush=True,
            )
            write(rows, meta, args.out)
    return rows


if __name__ == "__main__":
    main()
