"""Bytes held per rank and collectives per step: graphamp's data parallel and ZeRO 1/2/3
against FSDP2 (fully_shard) + torch.autocast, on gloo CPU processes.

    python benchmarks/zero_memory.py [--ranks 1 2 4] [--width 256] [--depth 8] [--out FILE]

For each rank count W it starts ``torchrun --nproc-per-node W`` on this file (one process per
rank), which trains the same model (``--depth`` residual MLP blocks of ``--width``, AdamW, bf16
autocast, global batch 32) with each setting in turn and reports, from rank 0 (counted, not
sampled):

- parameters, optimizer state: bytes of the tensors the rank holds between steps (a DTensor
  counts its local shard);
- step inputs and peak intermediates: ``graphamp.inspect.memory.step_memory`` over graphamp's
  step graph (sizes of the traced values in the order the graph runs them; what a backend
  fuses away is still counted), and the peak before the optimizer update begins;
- collectives per step: graphamp's from its step graph (each all-gather counted by its
  gathered size, each reduce-scatter by its input, each all-reduce by its tensor), FSDP2's by
  wrapping ``torch.distributed``'s calls for one step;
- ms per step: the median of 6 steps after 2 warm-up steps, a sanity check only on gloo.

Writes a markdown table (``--out``, default stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

BATCH, STEPS, WARMUP = 32, 6, 2
SETTINGS = ("data parallel", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2 + autocast")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)), nn.Linear(width, 10))


def held_bytes(tensors) -> int:
    """Bytes of the tensors as this rank holds them (a DTensor: its local shard)."""
    total = 0
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        total += local.numel() * local.element_size()
    return total


def optimizer_bytes(opt) -> int:
    return held_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def batches(width: int, world: int, rank: int):
    gen = torch.Generator().manual_seed(rank)
    n = BATCH // world
    return [
        (torch.randn(n, width, generator=gen), torch.randint(0, 10, (n,), generator=gen))
        for _ in range(STEPS + WARMUP)
    ]


def graphamp_run(setting: str, width: int, depth: int, world: int, rank: int) -> dict:
    import graphamp
    from graphamp.inspect.memory import step_memory

    model = make_model(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stage = {"ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}.get(setting, 0)

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt, clip_grad_max_norm=1.0)
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_backend("aot_eager")
            if stage:
                self.config.enable_zero(stage=stage)
            else:
                self.config.enable_data_parallel()

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    g = Train()
    times = timed(lambda x, y: g(x, y), batches(width, world, rank))
    gm = g.compiled_steps[-1].step_graph
    memory = step_memory(gm)
    return {
        "params": held_bytes(model.parameters()),
        "optimizer": optimizer_bytes(opt),
        "inputs": memory.resident_bytes,
        "peak": memory.peak_intermediate_bytes,
        "peak_before_update": step_memory(gm, before="optimizer").peak_intermediate_bytes,
        "collectives": graph_collectives(gm),
        "ms": statistics.median(times) * 1e3,
    }


def fsdp2_run(width: int, depth: int, world: int, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = make_model(width, depth)
    for block in model[:-1]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    data = batches(width, world, rank)
    times = timed(step, data)
    with counting_collectives() as counted:
        step(*data[0])
    return {
        "params": held_bytes(model.parameters()),
        "optimizer": optimizer_bytes(opt),
        "collectives": counted,
        "ms": statistics.median(times) * 1e3,
    }


def timed(step, data) -> list[float]:
    times = []
    for i, (x, y) in enumerate(data):
        start = time.perf_counter()
        step(x, y)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


_COLLECTIVES = {
    "all_gather_into_tensor": "all-gather",
    "all_gather_single": "all-gather",  # FSDP2's, torch 2.14
    "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_single": "reduce-scatter",
    "all_reduce": "all-reduce",
    "all_reduce_coalesced": "all-reduce",
}
# the tensor each call is counted by: the gathered output, the reduced input
_COUNTED = {"all-gather": ("output_tensor", "output", 0), "reduce-scatter": ("input", 1)}


def graph_collectives(gm) -> dict[str, list[int]]:
    """{kind: [count, bytes]} of the functional collectives in the step graph."""
    from graphamp.inspect.memory import value_bytes

    out: dict[str, list[int]] = {}
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        kind = _COLLECTIVES.get(name)
        if kind is None:
            continue
        if kind == "all-gather":
            size = value_bytes(n.meta.get("val"))
        else:  # the tensor reduced (a list of them for the coalesced all-reduce)
            args = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
            size = sum(value_bytes(a.meta.get("val")) for a in args)
        entry = out.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += size
    return out


@contextlib.contextmanager
def counting_collectives():
    """{kind: [count, bytes]} of torch.distributed's collective calls inside the block."""
    counted: dict[str, list[int]] = {}
    originals = {}
    for name, kind in _COLLECTIVES.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def wrapper(*args, _fn=fn, _kind=kind, **kwargs):
            tensor = _counted_tensor(_kind, args, kwargs)
            entry = counted.setdefault(_kind, [0, 0])
            entry[0] += 1
            entry[1] += tensor.numel() * tensor.element_size()
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield counted
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _counted_tensor(kind: str, args: tuple, kwargs: dict) -> torch.Tensor:
    for where in _COUNTED.get(kind, (0,)):
        if isinstance(where, str) and where in kwargs:
            return kwargs[where]
        if isinstance(where, int) and len(args) > where:
            return args[where]
    raise ValueError(f"cannot find the tensor of a {kind} call")


def worker(width: int, depth: int, out: str) -> None:
    dist.init_process_group("gloo")
    warnings.simplefilter("ignore")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for setting in SETTINGS:
        if setting.startswith("FSDP2"):
            results[setting] = fsdp2_run(width, depth, world, rank)
        else:
            results[setting] = graphamp_run(setting, width, depth, world, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(runs: dict[int, dict], width: int, depth: int) -> str:
    params = sum(p.numel() for p in make_model(width, depth).parameters())
    lines = [
        f"Model: {depth} residual MLP blocks of width {width} and a head ({params:,} parameters, "
        f"{mib(4 * params)} MiB in fp32), AdamW, bf16, global batch {BATCH}, gloo on CPU "
        "processes. MiB per rank, counted; collectives per step as count x MiB.",
        "",
        "| ranks | setting | parameters | optimizer state | step inputs | peak intermediates "
        "| peak before the update | all-gather | reduce-scatter | all-reduce | ms/step |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for world, results in sorted(runs.items()):
        for setting, r in results.items():
            coll = r["collectives"]

            def c(kind: str, coll=coll) -> str:
                count, size = coll.get(kind, [0, 0])
                return f"{count} x {mib(size)}" if count else "-"

            lines.append(
                f"| {world} | {setting} | {mib(r['params'])} | {mib(r['optimizer'])} | "
                f"{mib(r['inputs']) if 'inputs' in r else '-'} | "
                f"{mib(r['peak']) if 'peak' in r else '-'} | "
                f"{mib(r['peak_before_update']) if 'peak_before_update' in r else '-'} | "
                f"{c('all-gather')} | {c('reduce-scatter')} | {c('all-reduce')} | {r['ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.width, args.depth, args.worker)
        return
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            out = os.path.join(tmp, f"w{world}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                   f"--master-port={free_port()}", __file__, "--width", str(args.width), "--depth",
                   str(args.depth), "--worker", out]  # fmt: skip
            print(f"{world} rank(s)...", file=sys.stderr, flush=True)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs[world] = json.load(f)
    text = table(runs, args.width, args.depth)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
