"""What an outlined step executes that the inlined one does not (issue 64 §2): counted, not timed.

For one workload this builds graphamp's step twice, repeated blocks outlined and inlined (each in
its own process, inductor on the CPU), reads the Python wrapper inductor generated for each, and
counts what one step executes: C++ kernels, extern calls (matmuls, attention, fallbacks), buffer
allocations, runtime size/stride/alignment asserts and calls of outlined subgraphs (a subgraph's
counts times the number of its calls). Counts do not depend on the machine's load, so they say
where the outlined step's fixed cost per block comes from while timings on a shared machine
cannot. The steady step's time is printed beside them (median of ``--steps``; noisy under load).

    python benchmarks/outline_anatomy.py --workload hf-gpt2-small
    python benchmarks/outline_anatomy.py --workload gpt-small --out benchmarks/results
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = ("outlined", "inlined")
# what a call in inductor's Python wrapper is, by the name it calls
KINDS = {
    "kernels": lambda name: name.startswith("cpp_fused_") or name.startswith("triton_"),
    "extern": lambda name: name.startswith("extern_kernels.") or name.startswith("torch.ops."),
    "allocations": lambda name: name.startswith("empty_strided"),
    "asserts": lambda name: name.startswith("assert_"),
}


def _called_names(fn: ast.FunctionDef) -> list[str]:
    return [ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)]


def executed_counts(source: str) -> dict[str, int]:
    """Per step: each kind's calls in the wrapper's ``call``, a subgraph's counted at every
    call of it (module-level functions ``call`` invokes, recursively)."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    def count(name: str, seen: tuple[str, ...]) -> dict[str, int]:
        out = {k: 0 for k in (*KINDS, "subgraph_calls")}
        for called in _called_names(functions[name]):
            for kind, matches in KINDS.items():
                out[kind] += matches(called)
            if called in functions and called not in seen and called != name:
                out["subgraph_calls"] += 1
                for k, v in count(called, (*seen, called)).items():
                    out[k] += v
        return out

    return count("call", ("call",))


def _step_source(before: set[str]) -> str:
    """The largest generated wrapper module loaded since ``before`` (the step's)."""
    import torch._inductor.codecache as codecache

    paths = [m.__file__ for m in codecache.PyCodeCache.modules if m.__file__ not in before]
    sources = [open(p).read() for p in paths]
    return max((s for s in sources if "def call(" in s), key=len)


def child(program: str, workload: str, steps: int) -> dict:
    """One program in this process: its step's executed counts and steady milliseconds."""
    import statistics
    import time

    import torch
    import torch._inductor.codecache as codecache

    sys.path.insert(0, HERE)
    from outline_cost import make_step, make_workload

    torch.set_num_threads(1)
    model, (x, y), loss_fn, make_opt = make_workload(workload, False)
    before = {m.__file__ for m in codecache.PyCodeCache.modules}
    step = make_step(program, model, loss_fn, make_opt, "inductor")
    for _ in range(3):
        step(x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    counts = executed_counts(_step_source(before))
    return {"program": program, "ms": round(statistics.median(times) * 1e3, 2), **counts}


def write_table(path: str, workload: str, rows: list[dict]) -> None:
    keys = (*KINDS, "subgraph_calls")
    lines = [
        f"# Outlined against inlined: what one step executes ({workload}, CPU, inductor)",
        "",
        f"Command: `python benchmarks/outline_anatomy.py --workload {workload}`. Counts from "
        "inductor's generated wrapper (a subgraph's counted at each call); ms: median steady "
        "step of this run (each program in its own process, 1 thread).",
        "",
        f"| program | {' | '.join(keys)} | ms |",
        f"|---|{'---:|' * (len(keys) + 1)}",
    ]
    for r in rows:
        lines.append(f"| {r['program']} | {' | '.join(str(r[k]) for k in keys)} | {r['ms']} |")
    if len(rows) == 2:
        a, b = rows
        diff = ", ".join(f"{k} {a[k] - b[k]:+d}" for k in keys)
        lines += ["", f"outlined - inlined: {diff}; ms {a['ms'] - b['ms']:+.2f}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="hf-gpt2-small")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=None, help="a folder for outline_anatomy_<workload>.md")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.steps)))
        return []
    rows = []
    with tempfile.TemporaryDirectory() as cache:  # each program compiles afresh
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for program in PROGRAMS:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", program, args.workload]
                + ["--steps", str(args.steps)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if proc.returncode:
                raise RuntimeError(f"{program} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write_table(
            os.path.join(args.out, f"outline_anatomy_{args.workload}_cpu.md"), args.workload, rows
        )
    return rows


if __name__ == "__main__":
    main()
