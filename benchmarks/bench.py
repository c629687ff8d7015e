"""graphamp against what PyTorch users run today, side by side in one process on the same data.

For each workload (seed MLP, GPT-2 124M, a 6-layer GPT-2, ResNet-50, a 1.1B Llama-style decoder)
and each variant, all variants of a workload one after the other in one process (same-run ratios):

    eager_fp32        eager fp32
    eager_amp_fp16    eager torch.autocast(fp16) + torch.amp.GradScaler
    eager_bf16        eager torch.autocast(bf16)
    compile_amp_fp16  torch.compile(model) + autocast fp16 + GradScaler, fused optimizer
    compile_bf16      torch.compile(model) + autocast bf16, fused optimizer (on the CPU too,
                      since round 10: torch's CPU fused AdamW, as the Trainer's default
                      adamw_torch_fused; the workloads whose fused kernel torch lacks stay
                      unfused)
    compile_amp_fp16_optstep, compile_bf16_optstep  the same with the optimizer's step compiled
                      too (torch.compile(opt.step), foreach, as torch's tutorial compiles it)
    compile_bf16_ro   mode="reduce-overhead" (CUDA graphs; CUDA only, not run unless named)
    compile_bf16_ma   mode="max-autotune-no-cudagraphs" (not run unless named)
    graphamp_fp16     graphamp.Graph, AMP fp16 + graphamp.GradScaler (CUDA graph on CUDA)
    graphamp_bf16     graphamp.Graph, AMP bf16
    graphamp_fp16_traced, graphamp_bf16_traced   the same with config.enable_overflow_tracing()
                      (not run unless named: the cost of overflow forensics, as a ratio to the
                      untraced variant of the same run)
    graphamp_fp16_inline, graphamp_bf16_inline   the same with repeated blocks inlined
    graphamp_fp16_outline, graphamp_bf16_outline the same with repeated blocks outlined
                      (config.set_outline_blocks(False) and (True); not run unless named. The
                      default outlines on the CPU and inlines on CUDA; the two named together
                      give what outlining costs or saves in the steady step and the first
                      call, as ratios of one process: issue 40 §0)
    graphamp_fp16_blocks, graphamp_bf16_blocks   outlined, and each repeated block's update by
                      one kernel call (set_block_updates(True); the CPU's default for blocks
                      repeated 3 times, off by default on CUDA; not run unless named)
    graphamp_fp16_fused, graphamp_bf16_fused     the optimizer built with fused=True (torch's
                      fused kernel as one op of the step, as the compile_* peers' optimizer;
                      not run unless named)
    graphamp_bf16_fp8, graphamp_bf16_fp8rw, graphamp_bf16_fp8dl
                      bf16 with fp8 matmuls (tensorwise, rowwise, delayed);
                      not run unless named

it reports ms/step (median of per-step CUDA-event times over the measured steps, launched back
to back with one sync at the end), achieved TFLOP/s where the FLOPs are known, peak memory,
first-call time (capture/trace + compile), the loss trajectory, whether a steady-state step
synchronises with the host (``torch.cuda.set_sync_debug_mode("error")``), and graphamp's ratio
to the best peer of its dtype.

    python benchmarks/bench.py --workload mlp gpt2 resnet50          # on a GPU
    python benchmarks/bench.py --workload llama1b --variant graphamp_bf16 compile_bf16
    python benchmarks/bench.py --smoke                               # tiny, CPU, aot_eager
    python benchmarks/bench.py --workload gpt2 resnet50 --variant graphamp_fp16 \
        graphamp_fp16_traced --tag forensics                         # overflow tracing's cost

Results: benchmarks/results/bench_<device>.jsonl (one JSON object per variant) and
bench_<device>.md (a table), stamped with the device name and torch version.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from workloads import WORKLOADS  # noqa: E402

import graphamp  # noqa: E402

VARIANTS = (
    "eager_fp32",
    "eager_amp_fp16",
    "eager_bf16",
    "compile_amp_fp16",
    "compile_bf16",
    "compile_amp_fp16_optstep",
    "compile_bf16_optstep",
    "graphamp_fp16",
    "graphamp_bf16",
)
# the peer with torch.compile's other modes, only when named
MODE_VARIANTS = ("compile_bf16_ro", "compile_bf16_ma")
_MODES = {"_ro": "reduce-overhead", "_ma": "max-autotune-no-cudagraphs"}
TRACED_VARIANTS = ("graphamp_fp16_traced", "graphamp_bf16_traced")  # only when named
# config.set_outline_blocks(False) and (True), only when named
INLINE_VARIANTS = ("graphamp_fp16_inline", "graphamp_bf16_inline")
OUTLINE_VARIANTS = ("graphamp_fp16_outline", "graphamp_bf16_outline")
# outlined with set_block_updates(True), only when named
BLOCK_VARIANTS = ("graphamp_fp16_blocks", "graphamp_bf16_blocks")
# the optimizer built with fused=True (torch's fused kernel, one op of the step): only when named
FUSED_VARIANTS = ("graphamp_fp16_fused", "graphamp_bf16_fused")
# enable_fp8, only when named: suffix -> recipe
FP8_RECIPES = {"_fp8": "tensorwise", "_fp8rw": "rowwise", "_fp8dl": "delayed"}
FP8_VARIANTS = tuple(f"graphamp_bf16{suffix}" for suffix in FP8_RECIPES)
SUFFIXES = ("_traced", "_inline", "_outline", "_blocks", "_fused", *FP8_RECIPES)


def _base_variant(variant: str) -> str:
    """graphamp_bf16 for graphamp_bf16_traced or graphamp_bf16_inline."""
    for suffix in SUFFIXES:
        variant = variant.removesuffix(suffix)
    return variant


FP16, BF16 = torch.float16, torch.bfloat16
# dense bf16/fp16 tensor-core peak (TFLOP/s) by device name, for MFU
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


def _dtype_name(variant: str) -> str:
    return "bf16" if "bf16" in variant else "fp16" if "fp16" in variant else "fp32"


def make_step(variant: str, workload, model, device, backend: str, inductor_options=None):
    """A function (x, y) -> loss tensor that runs one training step of ``variant``."""
    dtype = BF16 if _dtype_name(variant) == "bf16" else FP16
    if variant.startswith("graphamp"):
        opt = workload.make_optimizer(model, variant.endswith("_fused"))

        class TrainGraph(graphamp.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(opt)
                self.config.enable_amp(True, dtype=dtype)
                self.config.set_backend(backend)
                if inductor_options:
                    self.config.set_inductor_options(**inductor_options)
                if dtype == FP16:
                    self.set_grad_scaler(graphamp.GradScaler())
                if variant.endswith("_traced"):
                    self.config.enable_overflow_tracing()
                if variant.endswith(("_inline", "_outline")):
                    self.config.set_outline_blocks(variant.endswith("_outline"))
                if variant.endswith("_blocks"):
                    self.config.set_block_updates(True)  # outlines the step too
                recipe = next((r for s, r in FP8_RECIPES.items() if variant.endswith(s)), None)
                if recipe is not None:
                    self.config.enable_fp8(True, recipe=recipe)

            def build(self, x, y):
                loss = workload.loss(self.model(x), y)
                loss.backward()
                return loss

        return TrainGraph()

    # the strongest configuration a user would pick: the fused kernel where there is one, or
    # the optimizer's step compiled too (_optstep)
    compiled = variant.startswith("compile")
    opt = workload.make_optimizer(model, compiled and not variant.endswith("_optstep"))
    mode = next((m for suffix, m in _MODES.items() if variant.endswith(suffix)), None)
    net = torch.compile(model, backend=backend, mode=mode) if compiled else model
    if variant.endswith("_optstep"):
        opt.step = torch.compile(opt.step, backend=backend)  # type: ignore[method-assign]
    if variant == "eager_fp32":

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = workload.loss(net(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return step
    scaler = torch.amp.GradScaler(device.type) if dtype == FP16 else None

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = workload.loss(net(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def syncs_with_host(step, batch, device) -> str:
    """Run steady-state steps with CUDA's sync debug mode set to error."""
    if device.type != "cuda":
        return "n/a"
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(2):
            step(*batch)
        return "no"
    except RuntimeError as e:
        return "yes: " + str(e).splitlines()[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run_variant(variant, workload, base_model, device, args) -> dict:
    torch.manual_seed(0)
    model = copy.deepcopy(base_model).to(device)
    backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    batches = workload.batches
    losses = []
    if device.type == "cuda":  # before the first call: CUDA-graph pools are allocated there
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # timed from before the step is made: torch.compile(model) imports inductor as it is called
    start = time.perf_counter()
    step = make_step(variant, workload, model, device, backend, args.inductor_options)
    losses.append(step(*batches[0]))
    _sync(device)
    first_call = time.perf_counter() - start
    for i in range(args.warmup):
        losses.append(step(*batches[(i + 1) % len(batches)]))
    _sync(device)
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(args.steps)
        ]
    times = []
    wall = time.perf_counter()
    for i in range(args.steps):
        batch = batches[i % len(batches)]
        if device.type == "cuda":
            events[i][0].record()
            losses.append(step(*batch))
            events[i][1].record()
        else:
            t = time.perf_counter()
            losses.append(step(*batch))
            times.append((time.perf_counter() - t) * 1e3)
    _sync(device)
    wall = (time.perf_counter() - wall) / args.steps * 1e3
    if device.type == "cuda":
        times = [a.elapsed_time(b) for a, b in events]
    extra = max(0, args.loss_steps - len(losses))
    for i in range(extra):
        losses.append(step(*batches[i % len(batches)]))
    trajectory = torch.stack([ln.float().reshape(()) for ln in losses]).cpu().tolist()
    # last: an eager GradScaler interrupted by the sync error is left in a broken state
    sync_state = syncs_with_host(step, batches[0], device)
    ms = statistics.median(times)
    result = {
        "workload": workload.name,
        "variant": variant,
        "ms_per_step": ms,
        "ms_mean_wall": wall,
        "ms_p10": sorted(times)[len(times) // 10],
        "ms_p90": sorted(times)[len(times) * 9 // 10],
        "tflops": workload.flops_per_step / (ms * 1e-3) / 1e12 if workload.flops_per_step else None,
        "tokens_per_s": workload.tokens_per_step / (ms * 1e-3)
        if workload.tokens_per_step
        else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.type == "cuda"
        else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30
        if device.type == "cuda"
        else None,
        "first_call_s": first_call,
        "host_sync": sync_state,
        "loss_first": trajectory[0],
        "loss_last": trajectory[-1],
        "loss_min": min(trajectory),
        "loss_finite": all(map(_finite, trajectory)),
        "steps_total": len(trajectory),
        "loss_every_20": trajectory[::20],
    }
    if variant.startswith("graphamp"):
        report = step.precision_report(with_autocast=False)
        result["precision"] = report.summary()
        compiled = step.compiled_steps[-1]
        result["cuda_graph"] = compiled.cuda_graph
        result["timings"] = dict(compiled.timings)
        if args.profile and device.type == "cuda":
            result["profile"] = profile_steps(step, batches, device, args)
    del step, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def measure(variant, workload, base_model, device, args) -> dict:
    """run_variant's row, or a row naming the error: one failing variant (a compile error on
    another torch release) must not cost the variants after it their figures."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return run_variant(variant, workload, base_model, device, args)
    except Exception as e:  # reported in the row and the table, then go on
        traceback.print_exc()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        return {
            "workload": workload.name,
            "variant": variant,
            "error": f"{type(e).__name__}: {e}"[:300],
        }


def _summary(row: dict) -> str:
    if row.get("error"):
        return "FAILED: " + row["error"]
    return (
        f"{row['ms_per_step']:.3f} ms/step, first call {row['first_call_s']:.1f}s, "
        f"sync {row['host_sync'].split(':')[0]}, "
        f"loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}"
    )


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def profile_steps(step, batches, device, args) -> dict:
    """Top kernels of a few steady-state steps, and where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0
    ]
    rows = []
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((e.key, t / 5 / 1e3, e.count // 5))
            total += t / 5 / 1e3
    rows.sort(key=lambda r: -r[1])

    def share(pred):
        return sum(t for k, t, _ in rows if pred(k.lower()))

    del events
    return {
        "gpu_ms_per_step": total,
        "top": [{"kernel": k[:120], "ms": round(t, 4), "calls": c} for k, t, c in rows[:25]],
        "kernels_per_step": sum(c for _, _, c in rows),
        "ms_gemm": share(lambda k: "gemm" in k or "cutlass" in k or "sm90" in k or "xmma" in k),
        "ms_flash": share(lambda k: "flash" in k or "fmha" in k or "attention" in k),
        "ms_triton": share(lambda k: k.startswith("triton")),
    }


def write_table(path_md: str, rows: list[dict], meta: dict) -> None:
    peak = peak_tflops(meta["device"])
    lines = [
        "# graphamp benchmark",
        "",
        f"Device: **{meta['device']}**, torch {meta['torch']}, graphamp {meta['graphamp']}. "
        f"Command: `{meta['command']}`",
        "",
        "ms/step: median of per-step CUDA-event times over the measured steps, launched back "
        "to back with one sync at the end. Ratio: graphamp over the best peer of the same "
        "dtype in the same run (lower is better). MFU: TFLOP/s over the device's dense "
        f"bf16/fp16 peak ({peak or 'unknown'} TFLOP/s).",
        "",
    ]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == workload]
        lines += [
            f"## {workload}",
            "",
            "| variant | ms/step | TFLOP/s | MFU | tokens/s | peak GiB (reserved) | first call s | host sync | loss first → last (finite) | ratio to the best peer |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
        ]
        for r in rs:
            if r.get("error"):
                lines.append(f"| {r['variant']} | failed |" + " |" * 8)
                continue
            tf = f"{r['tflops']:.1f}" if r.get("tflops") else "-"
            mfu = f"{r['tflops'] / peak:.1%}" if r.get("tflops") and peak else "-"
            tokens = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
            mem = (
                f"{r['peak_mem_gib']:.2f} ({r['peak_reserved_gib']:.2f})"
                if r.get("peak_mem_gib") is not None
                else "-"
            )
            ratio = r.get("ratio_vs_best_peer")
            shown = f"{ratio:.2f} of {r['best_peer']}" if ratio else ""
            name = r["variant"] + (
                " " + ",".join(f"{k}={v}" for k, v in r["inductor_options"].items())
                if r.get("inductor_options")
                else ""
            )
            lines.append(
                f"| {name} | {r['ms_per_step']:.3f} | {tf} | {mfu} | {tokens} | {mem} | "
                f"{r['first_call_s']:.1f} | {r['host_sync'].split(':')[0]} | "
                f"{r['loss_first']:.3f} → {r['loss_last']:.3f} ({'yes' if r['loss_finite'] else 'NO'}) | "
                f"{shown} |"
            )
        lines.append("")
        for r in rs:
            if r.get("tracing_cost"):
                lines.append(
                    f"- {r['variant']}: overflow tracing costs "
                    f"{(r['tracing_cost'] - 1) * 100:+.1f}% ms/step against "
                    f"{r['variant'].removesuffix('_traced')} in the same run"
                )
            if r.get("outline_step_ratio"):
                lines.append(
                    f"- {_outlined_variant(r['variant'])} over "
                    f"{r['variant']} in the same run: steady step "
                    f"{r['outline_step_ratio']:.3f}x, first call "
                    f"{r['outline_first_call_ratio']:.2f}x"
                )
            if r.get("fp8_speedup"):
                lines.append(
                    f"- {r['variant']}: {r['fp8_speedup']:.3f}x the speed of "
                    f"{_base_variant(r['variant'])} (bf16) in the same run"
                )
            if r.get("error"):
                lines.append(f"- {r['variant']}: FAILED: {r['error']}")
            if r.get("precision"):
                lines.append(
                    f"- {r['variant']}: {r['precision']}; CUDA graph: "
                    f"{r.get('cuda_graph')}; first call "
                    + ", ".join(f"{k} {v:.1f}s" for k, v in r["timings"].items())
                )
        lines.append("")
    with open(path_md, "w") as f:
        f.write("\n".join(lines))


def _row(rows: list[dict], workload: str, variant: str) -> dict | None:
    """The row of ``variant`` on ``workload``, if it ran."""
    return next((p for p in rows if p["workload"] == workload and p["variant"] == variant), None)


def _outlined_variant(inlined: str) -> str:
    """graphamp_bf16_outline for graphamp_bf16_inline: the pair that gives outlining's cost."""
    return inlined.removesuffix("_inline") + "_outline"


def add_ratios(rows: list[dict]) -> None:
    rows = [r for r in rows if not r.get("error")]
    for r in rows:
        if not r["variant"].startswith("graphamp"):
            continue
        dtype = _dtype_name(r["variant"])
        base = _row(rows, r["workload"], _base_variant(r["variant"]))
        if base and r["variant"].endswith("_traced"):
            r["tracing_cost"] = r["ms_per_step"] / base["ms_per_step"]
        if base and r["variant"].endswith(tuple(FP8_RECIPES)):  # fp8 over bf16, same run
            r["fp8_speedup"] = base["ms_per_step"] / r["ms_per_step"]
        if r["variant"].endswith("_inline"):  # outlined over inlined, where both ran
            outlined = _row(rows, r["workload"], _outlined_variant(r["variant"]))
            if outlined:
                r["outline_step_ratio"] = outlined["ms_per_step"] / r["ms_per_step"]
                r["outline_first_call_ratio"] = outlined["first_call_s"] / r["first_call_s"]
        peers = [
            p
            for p in rows
            if p["workload"] == r["workload"]
            and not p["variant"].startswith("graphamp")
            and _dtype_name(p["variant"]) == dtype
        ]
        if peers:
            best = min(peers, key=lambda p: p["ms_per_step"])
            r["best_peer"] = best["variant"]
            r["ratio_vs_best_peer"] = r["ms_per_step"] / best["ms_per_step"]
        compiled = [p for p in peers if p["variant"].startswith("compile")]
        if compiled:
            r["first_call_ratio_vs_compile"] = r["first_call_s"] / compiled[0]["first_call_s"]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload", nargs="*", default=["mlp", "gpt2", "resnet50"], choices=sorted(WORKLOADS)
    )
    parser.add_argument(
        "--variant",
        nargs="*",
        default=list(VARIANTS),
        choices=VARIANTS
        + TRACED_VARIANTS
        + INLINE_VARIANTS
        + OUTLINE_VARIANTS
        + BLOCK_VARIANTS
        + FUSED_VARIANTS
        + FP8_VARIANTS
        + MODE_VARIANTS,
    )
    parser.add_argument("--steps", type=int, default=50, help="measured steps (default 50)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        help="train at least this many steps in all (loss trajectory)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models on the CPU with the aot_eager backend (for tests)",
    )
    parser.add_argument("--profile", action="store_true", help="profile graphamp's steps")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; aot_eager smoke)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--tag", default="", help="suffix for the result files")
    parser.add_argument(
        "--inductor-option",
        action="append",
        default=[],
        help="NAME=VALUE for graphamp's inductor compile (e.g. combo_kernels=True)",
    )
    args = parser.parse_args(argv)
    device = torch.device(
        args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    )
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    args.inductor_options = {
        k: json.loads(v.lower()) if v.lower() in ("true", "false") else json.loads(v)
        for k, v in (o.split("=", 1) for o in args.inductor_option)
    }
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    meta = {
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "graphamp": graphamp.__version__,
        "command": "python benchmarks/bench.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    rows = []
    os.makedirs(args.out, exist_ok=True)
    tag = ("smoke" if args.smoke else device.type) + (f"_{args.tag}" if args.tag else "")
    jsonl = os.path.join(args.out, f"bench_{tag}.jsonl")
    for name in args.workload:
        workload = WORKLOADS[name](device, smoke=args.smoke)
        torch.manual_seed(0)
        base = workload.make_model()
        for variant in args.variant:
            if device.type == "cpu" and _dtype_name(variant) == "fp16" and not args.smoke:
                continue
            print(f"[bench] {workload.name} {variant} ...", flush=True)
            row = measure(variant, workload, base, device, args)
            row.update(device=meta["device"], torch=meta["torch"])
            if args.inductor_options and variant.startswith("graphamp"):
                row["inductor_options"] = args.inductor_options
            rows.append(row)
            print(f"[bench]   {_summary(row)}", flush=True)
            with open(jsonl, "a") as f:  # as each variant finishes: a timeout loses nothing
                f.write(json.dumps({**row, "meta": meta}) + "\n")
            add_ratios(rows)
            write_table(os.path.join(args.out, f"bench_{tag}.md"), rows, meta)
        del base, workload
    print(open(os.path.join(args.out, f"bench_{tag}.md")).read())
    return rows


if __name__ == "__main__":
    main()
