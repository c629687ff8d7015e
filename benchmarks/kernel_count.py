"""Nodes and kernels of graphamp's compiled step, per workload, on a machine without a GPU.

graphamp captures and assembles the step on the CPU (fake tensors, full-size workload), then
hands the step graph to inductor twice:

- ``cuda``: inductor generates (does not run) the CUDA code for an H100-like device that is not
  there: torch's CUDA queries are answered with an H100's properties and the Triton compiler is
  never called. Counted: kernel launch sites in the generated wrapper (Triton kernels, extern
  GEMMs, ATen fallbacks). A fallback site may launch more than one kernel on a real GPU (cuDNN
  attention, the multi-tensor unscale), and SDPA is the CPU op the capture saw, so this is a
  structural count to compare versions, not a profiler count. An outlined block's kernels are
  counted at each call of its subgraph.
- ``cpu``: the real inductor compile for the CPU; counted: C++ kernels and extern calls.

    python benchmarks/kernel_count.py --workload mlp gpt2 resnet50 --target cuda
    python benchmarks/kernel_count.py --workload mlp --target cpu
    python benchmarks/kernel_count.py --workload gpt2-6l --variant graphamp_bf16_outline
    PYTHONPATH=OTHER_TREE python benchmarks/kernel_count.py ...   # another version of graphamp

The step's blocks are outlined or inlined as the target's device would build them by default
(CUDA: inlined); the ``_inline`` and ``_outline`` variants choose. Prints one JSON line per
workload and target.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
import types

import torch
import torch.fx as fx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench import FP8_VARIANTS, INLINE_VARIANTS, OUTLINE_VARIANTS, make_step  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

import graphamp  # noqa: E402
import graphamp.pipeline.stages as stages  # noqa: E402
from graphamp.torchkit.fxutil import graph_modules  # noqa: E402

_H100 = dict(
    name="NVIDIA H100 80GB HBM3 (not present)",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=80 * 2**30,
    warp_size=32,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232448,
    shared_memory_per_block=49152,
    shared_memory_per_multiprocessor=233472,
    L2_cache_size=50 * 2**20,
    gcnArchName="",
    clock_rate=1980000,
)


class _Generated(Exception):
    """Raised once inductor has written the step's code: nothing is loaded or run."""


class _Captured(BaseException):
    """Raised by the stand-in compile stage once it has the step (a BaseException: graphamp
    turns an Exception from its compile stage into a CompileError)."""


def pretend_h100(sink: list[str]) -> None:
    """Answer torch's CUDA queries as an H100 would and stop inductor after code generation."""
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch._inductor.scheduler as scheduler
    import torch._inductor.utils as inductor_utils
    import torch.utils._triton as triton_utils
    from torch._inductor.graph import GraphLowering

    props = types.SimpleNamespace(**_H100)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda._lazy_init = lambda: None
    torch.cuda._exchange_device = lambda idx: 0
    torch.cuda._maybe_exchange_device = lambda idx: 0
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(16, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    interface = device_interface.CudaInterface  # bound torch.cuda's functions at import
    for name in (
        "get_device_properties",
        "current_device",
        "device_count",
        "exchange_device",
        "maybe_exchange_device",
    ):
        attr = {
            "exchange_device": "_exchange_device",
            "maybe_exchange_device": "_maybe_exchange_device",
        }.get(name, name)
        setattr(interface, name, staticmethod(getattr(torch.cuda, attr)))
    interface.get_compute_capability = staticmethod(lambda *a, **k: 90)
    interface.is_available = staticmethod(lambda: True)
    scheduler.has_triton = inductor_utils.has_triton = lambda: True
    triton_utils.triton_hash_with_backend = lambda: "not-compiled"
    # pattern tables are built by running sample graphs on the device: skip them
    joint_graph.lazy_init = lambda *a, **k: None

    def save(code: str) -> None:
        sink.append(code)
        raise _Generated()

    GraphLowering.save_output_code = staticmethod(save)


def capture_step(workload, variant: str, target: str) -> tuple[fx.GraphModule, list, dict]:
    """graphamp's step graph for one batch, its example inputs and the first-call timings, on
    the CPU; the compile stage is replaced by a function that keeps what it was given. The
    step's blocks are outlined or inlined as ``target``'s device would have them by default
    (CUDA inlines them), unless ``variant`` says which."""
    got: dict = {}

    def keep(gm, example, backend, options=None, cached=False):  # compile_step's signature
        got.update(gm=gm, example=example)
        raise _Captured()

    real, real_default = stages.compile_step, stages.outlined_by_default
    stages.compile_step = keep
    stages.outlined_by_default = lambda device, grad_acc_steps: real_default(
        torch.device(target), grad_acc_steps
    )
    try:
        model = workload.make_model()
        g = make_step(variant, workload, model, torch.device("cpu"), "inductor")
        start = time.perf_counter()
        try:
            g(*workload.batches[0])
        except _Captured:
            pass
        got["capture_and_assemble_s"] = time.perf_counter() - start
    finally:
        stages.compile_step, stages.outlined_by_default = real, real_default
    return got["gm"], got["example"], got


def subgraph_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts = collections.Counter(n.meta.get("graphamp_subgraph", n.op) for n in gm.graph.nodes)
    return dict(sorted(counts.items()))


def cuda_code(gm: fx.GraphModule, example: list) -> str:
    """Inductor's CUDA code for ``gm``, moved to cuda:0 and decomposed on its fakes."""
    from torch._decomp import decomposition_table
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    sink: list[str] = []
    pretend_h100(sink)
    aten = torch.ops.aten
    table = dict(select_decomp_table())
    # decomposed here: inductor's fallback for them would run a real CUDA op
    for op in (aten._unsafe_masked_index_put_accumulate.default, aten._unsafe_masked_index.default):
        table[op] = decomposition_table[op]
    device = torch.device("cuda", 0)
    on_cuda = lambda a: device if isinstance(a, torch.device) and a.type == "cpu" else a  # noqa: E731
    for module in graph_modules(gm):  # an outlined step's subgraphs name the device too
        for n in module.graph.nodes:
            n.args, n.kwargs = (
                fx.node.map_aggregate(n.args, on_cuda),
                fx.node.map_aggregate(n.kwargs, on_cuda),
            )
        module.recompile()
    # one fake mode for the trace and the compile: an outlined step's subgraphs hold its fakes
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = [mode.from_tensor(t, static_shapes=True).to(device) for t in example]
        gm = make_fx(gm, decomposition_table=table)(*fakes)
        try:
            compile_fx_inner(gm, fakes)
        except Exception:  # _Generated, wrapped by inductor
            if not sink:
                raise
    return sink[-1]


def cpu_code(gm: fx.GraphModule, example: list) -> str:
    from torch._inductor.graph import GraphLowering

    sink: list[str] = []
    real = GraphLowering.save_output_code
    GraphLowering.save_output_code = staticmethod(sink.append)
    try:
        import torch._dynamo

        torch._dynamo.lookup_backend("inductor")(gm, example)
    finally:
        GraphLowering.save_output_code = real
    return sink[-1]


def _sites(text: str) -> collections.Counter:
    """Kernel launch sites written in ``text``: Triton/C++ kernels, extern GEMMs, ATen; and
    the wrapper's buffer allocations and runtime size/stride/alignment asserts (what a call of
    an outlined block's subgraph repeats that the inlined step does once or shares)."""
    asserts = len(re.findall(r"^\s*assert_\w+\(", text, flags=re.M))
    allocations = len(re.findall(r"\bempty_strided\w*\(", text))
    text = "\n".join(
        line for line in text.splitlines() if not line.strip().startswith(("assert_", "#"))
    )
    return collections.Counter(
        asserts=asserts,
        allocations=allocations,
        triton=len(re.findall(r"\btriton_\w+\.run\(", text)),
        cpp=len(re.findall(r"^\s*cpp_fused_\w+\(", text, flags=re.M)),
        extern=len(re.findall(r"\bextern_kernels\.\w+\(", text)),
        aten=len(re.findall(r"torch\.ops\.aten\.\w+\.\w+\(", text)),
        combo_kernels=len(re.findall(r"\btriton_for_\w+\.run\(", text)),
    )


def _subgraph_bodies(code: str) -> dict[str, str]:
    """The wrapper's top-level ``def NAME(args):`` functions (an outlined block's subgraph,
    one per call site), by name."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in code.splitlines():
        match = re.match(r"def (\w+)\(args\):$", line)
        if match:
            current = bodies.setdefault(match.group(1), [])
        elif current is not None and line and not line[0].isspace():
            current = None
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in bodies.items()}


def launches(code: str) -> dict[str, int]:
    """Kernel launches of one run of the wrapper's ``call``: its own sites and, for each call of
    a subgraph function (an outlined block), that function's."""
    bodies = _subgraph_bodies(code)

    def run(text: str) -> collections.Counter:
        counts = _sites(text)
        for name, body in bodies.items():
            for _ in re.findall(rf"\b{name}\(", text):
                counts += run(body)
        return counts

    counts = run(code[code.index("def call(") :])
    out = {kind: counts[kind] for kind in ("triton", "cpp", "extern", "aten")}
    out["total"] = sum(out.values())
    out["combo_kernels"] = counts["combo_kernels"]
    out["allocations"], out["asserts"] = counts["allocations"], counts["asserts"]
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", nargs="*", default=["mlp", "gpt2", "resnet50"], choices=sorted(WORKLOADS)
    )
    parser.add_argument(
        "--variant",
        default="graphamp_fp16",
        choices=[
            "graphamp_fp16",
            "graphamp_bf16",
            *INLINE_VARIANTS,
            *OUTLINE_VARIANTS,
            *FP8_VARIANTS,
        ],
    )
    parser.add_argument("--target", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--save-code", default=None, help="folder for the generated code")
    parser.add_argument("--smoke", action="store_true", help="the workloads' smoke sizes")
    args = parser.parse_args(argv)
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True  # a cache hit would skip code generation
    rows = []
    for name in args.workload:
        workload = WORKLOADS[name](torch.device("cpu"), smoke=args.smoke, n_batches=1)
        gm, example, got = capture_step(workload, args.variant, args.target)
        row = {
            "workload": workload.name,
            "variant": args.variant,
            "target": args.target,
            "step_nodes": len(gm.graph.nodes),
            "by_subgraph": subgraph_counts(gm),
            "outlined_calls": sum(
                n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes
            ),
            "capture_and_assemble_s": round(got["capture_and_assemble_s"], 2),
        }
        start = time.perf_counter()
        code = (cuda_code if args.target == "cuda" else cpu_code)(gm, example)
        row["codegen_s"] = round(time.perf_counter() - start, 2)
        row["launches"] = launches(code)
        row["torch"] = torch.__version__
        row["graphamp_tree"] = os.path.dirname(os.path.dirname(graphamp.__file__))
        if args.save_code:
            os.makedirs(args.save_code, exist_ok=True)
            with open(os.path.join(args.save_code, f"{name}_{args.target}.py"), "w") as f:
                f.write(code)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
