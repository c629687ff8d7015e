"""Training on padded batches of changing length: graphamp against torch.compile + autocast
(its default automatic dynamic shapes) and eager autocast, same run.

A loop as most language-model fine-tunes write it: a small text built here (synthetic words,
a word-level tokenizer made with ``tokenizers``, no download), batches padded to their own
longest sequence by transformers' ``DataCollatorWithPadding``, a GPT-2 from a ``GPT2Config``
(n_embd 128, 2 or 6 layers), bf16 AMP, AdamW, inductor, on the CPU. Each cell runs in a fresh
Python process on an empty inductor cache (cold): the total time of all its steps, compiles
included, and how many times it compiled.

Cells: 12 steps over 4 lengths, and 200 steps over 50 lengths. ``--steady``: the step time of
graphamp's dynamic program against a static program at the same length (same process,
interleaved).

    python benchmarks/variable_shapes.py                       # 2 and 6 layers, both cells
    python benchmarks/variable_shapes.py --layers 2 --cells 12x4 --steady
    python benchmarks/variable_shapes.py --layers 6 --cells 12x4 --variants graphamp compile --restart
    python benchmarks/variable_shapes.py --layers 6 --cells 12x4 --variants graphamp compile \
        --restart --repeat 3       # three runs of each, alternating; the tables give medians

Results: benchmarks/results/variable_shapes_cpu.{jsonl,md} (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# the peers: torch.compile(model) + autocast with AdamW eager (compile), fused=True
# (compile_fused, the strongest a user would pick on the CPU: the transformers Trainer's default
# adamw_torch_fused), or its step compiled too (compile_optstep, named only)
PEERS = ("compile", "compile_fused", "compile_optstep")
VARIANTS = ("graphamp", "compile", "compile_fused", "eager")
# graphamp_marked: the sequence dimension marked with torch._dynamo.mark_dynamic before the
# first call, so one compile serves every length (``--variants graphamp_marked``);
# graphamp_blocks: set_block_updates(True), which also takes blocks repeated only twice (the
# default "graphamp" updates blocks repeated 3 times or more by one kernel each on the CPU; the
# dynamic build reuses the kernels of the static one: a block's parameters do not change size)
BATCH = 8


def make_batches(steps: int, n_lengths: int, seed: int = 0) -> list[dict]:
    """``steps`` batches from DataCollatorWithPadding whose longest sequences take
    ``n_lengths`` distinct values (8..71), cycling; the other rows are shorter."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(250)]
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]")
    collator = DataCollatorWithPadding(tokenizer, return_tensors="pt")
    gen = torch.Generator().manual_seed(seed)
    longest = [8 + (i * 64) // n_lengths for i in range(n_lengths)]
    batches = []
    for step in range(steps):
        top = longest[step % n_lengths]
        sizes = [top] + torch.randint(4, top + 1, (BATCH - 1,), generator=gen).tolist()
        texts = [
            " ".join(words[j] for j in torch.randint(0, 250, (n,), generator=gen)) for n in sizes
        ]
        batches.append(collator([tokenizer(t) for t in texts]))
    return batches


def make_model(layers: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=layers, n_head=4)
    return GPT2LMHeadModel(config)


def _loss(model, batch):
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels
    ).loss


def make_step(variant: str, model, dynamic=None):
    """(batch -> loss) for one training step of ``variant``; bf16 AMP, AdamW."""
    import torch

    import graphamp

    # --fused: AdamW(fused=True) in every variant (torch's fused kernel; one op of graphamp's step)
    fused = os.environ.get(FUSED_ENV) == "1" or variant == "compile_fused" or None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if variant.startswith("graphamp"):

        class Padded(graphamp.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(opt)
                self.config.enable_amp(True, dtype=torch.bfloat16)
                self.config.set_backend("inductor")
                self.config.set_dynamic_shapes(dynamic)
                if variant == "graphamp_blocks":
                    self.config.set_block_updates(True)

            def build(self, input_ids, attention_mask):
                loss = _loss(self.model, {"input_ids": input_ids, "attention_mask": attention_mask})
                loss.backward()
                return loss

        g = Padded()

        def step(b):
            if variant == "graphamp_marked":
                for name in ("input_ids", "attention_mask"):
                    torch._dynamo.mark_dynamic(b[name], 1)
            return g(b["input_ids"], b["attention_mask"])

        return step, g
    net = torch.compile(model) if variant in PEERS else model
    if variant == "compile_optstep":
        opt.step = torch.compile(opt.step)  # type: ignore[method-assign]

    def step(batch):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(net, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, None


def _compiles(variant: str, graph) -> int | None:
    if variant.startswith("graphamp"):
        return len(graph.compiled_steps)
    if variant in PEERS:
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]
    return None


def child_total(variant: str, layers: int, steps: int, n_lengths: int) -> dict:
    import torch

    batches = make_batches(steps, n_lengths)
    model = make_model(layers)
    # timed from before the step is made: ``torch.compile(model)`` imports inductor as it is
    # called, graphamp at its first compile (first_call.py's note)
    losses, start = [], time.perf_counter()
    step, graph = make_step(variant, model)
    for batch in batches:
        losses.append(step(batch).item())
    total = time.perf_counter() - start
    row = {
        "variant": variant,
        "layers": layers,
        "steps": steps,
        "lengths": n_lengths,
        "total_s": round(total, 2),
        "compiles": _compiles(variant, graph),
        "last_loss": round(losses[-1], 4),
        "torch": torch.__version__,
    }
    if graph is not None:  # where graphamp's time went: seconds per stage of each build
        row["builds"] = [
            {stage: round(s, 2) for stage, s in step.timings.items()}
            for step in graph.compiled_steps
        ]
    return row


def child_steady(layers: int, length_index: int = 2, reps: int = 30) -> dict:
    """Median step of the dynamic program and of a static one at the same length."""
    batches = make_batches(4, 4)
    dyn_step, dyn_graph = make_step("graphamp", make_model(layers))
    static_step, _ = make_step("graphamp", make_model(layers), dynamic=False)
    for batch in batches[:2]:  # the second length makes the dynamic program
        dyn_step(batch).item()
    probe = batches[length_index]
    static_step(probe).item()
    times: dict[str, list[float]] = {"dynamic": [], "static": []}
    for _ in range(reps):
        for name, step in (("dynamic", dyn_step), ("static", static_step)):
            start = time.perf_counter()
            step(probe).item()
            times[name].append(time.perf_counter() - start)
    dyn_ms, static_ms = (statistics.median(times[k]) * 1e3 for k in ("dynamic", "static"))
    return {
        "variant": "steady",
        "layers": layers,
        "length": int(probe["input_ids"].shape[1]),
        "dynamic_program": dyn_graph.compiled_steps[-1].signature,
        "dynamic_ms": round(dyn_ms, 2),
        "static_ms": round(static_ms, 2),
        "ratio": round(dyn_ms / static_ms, 3),
    }


FUSED_ENV = "GRAPHAMP_BENCH_FUSED_ADAMW"  # set by --fused for the children


def run_child(args: list[str], restart: bool = False) -> dict:
    """The cell in a fresh process on an empty cache directory; ``restart``: then again in a
    second fresh process on the directory the first filled (its row, with the cold total)."""
    with tempfile.TemporaryDirectory(prefix="graphamp-varshape-") as cache:
        env = {
            **{k: v for k, v in os.environ.items() if k != "GRAPHAMP_CACHE_DIR"},
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), ROOT]),
        }
        row = _child(args, env)
        if restart:  # the cold run's total and, for graphamp, its builds' stage seconds
            cold = {"cold_total_s": row["total_s"]}
            if "builds" in row:
                cold["cold_builds"] = row["builds"]
            row = {**_child(args, env), **cold, "cache": "restart"}
    return row


def _child(args: list[str], env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def medians(rows: list[dict]) -> list[dict]:
    """One row per cell and variant: the first run's, with the medians of the repeated runs'
    totals (``runs``: how many; ``loads``: the load average before each)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["variant"], row["layers"], row.get("steps"), row.get("lengths"))
        groups.setdefault(key, []).append(row)
    merged = []
    for runs in groups.values():
        row = dict(runs[0])
        for name in ("total_s", "cold_total_s"):
            if name in row:
                row[name] = round(statistics.median(r[name] for r in runs), 2)
        row["runs"] = len(runs)
        row["loads"] = [r.get("load") for r in runs]
        merged.append(row)
    return merged


def write_table(path: str, rows: list[dict], meta: dict) -> None:
    out = [
        "# Changing shapes on the CPU (`benchmarks/variable_shapes.py`)",
        "",
        f"{meta['machine']}; torch {meta['torch']}; GPT-2 from a GPT2Config (n_embd 128), "
        f"bf16 AMP, {rows[0].get('optimizer', 'AdamW') if rows else 'AdamW'}, inductor, batch 8 "
        "padded by DataCollatorWithPadding; each cell a fresh "
        "process on an empty inductor cache. Total seconds of all steps, compiles included.",
        "",
        "| layers | steps | lengths | graphamp s (compiles) | graphamp, block updates s (compiles) "
        "| graphamp, marked s (compiles) | torch.compile s (graphs) | eager s "
        "| graphamp / torch.compile | block updates / torch.compile "
        "| best peer s (which) | graphamp / best peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    merged = medians(rows)
    cells: dict[tuple, dict] = {}
    for row in merged:
        if row["variant"] != "steady":
            cells.setdefault((row["layers"], row["steps"], row["lengths"]), {})[row["variant"]] = (
                row
            )
    for (layers, steps, lengths), got in sorted(cells.items()):
        names = ("graphamp", "graphamp_blocks", "graphamp_marked", "compile", "eager")
        g, b, m, c, e = (got.get(v, {}) for v in names)
        ratio = g["total_s"] / c["total_s"] if g and c else float("nan")
        blocks = b["total_s"] / c["total_s"] if b and c else float("nan")
        out.append(
            f"| {layers} | {steps} | {lengths} | {g.get('total_s')} ({g.get('compiles')}) "
            f"| {b.get('total_s')} ({b.get('compiles')}) "
            f"| {m.get('total_s')} ({m.get('compiles')}) "
            f"| {c.get('total_s')} ({c.get('compiles')}) | {e.get('total_s')} | {ratio:.2f} "
            f"| {blocks:.2f} | {_best_peer(got, g)} |"
        )
    restarts = [r for r in merged if r.get("cache") == "restart"]
    if restarts:
        out += [
            "",
            "Restart: the same cell in a second fresh process on the cache directory its "
            "cold run filled.",
            "",
        ]
        out += [
            "| layers | steps | lengths | variant | cold s | restart s (compiles) | runs "
            "| load before each |"
        ]
        out.append("|---|---|---|---|---|---|---|---|")
        for r in restarts:
            out.append(
                f"| {r['layers']} | {r['steps']} | {r['lengths']} | {r['variant']} "
                f"| {r['cold_total_s']} | {r['total_s']} ({r['compiles']}) | {r['runs']} "
                f"| {', '.join(str(x) for x in r['loads'])} |"
            )
    steady = [r for r in rows if r["variant"] == "steady"]
    if steady:
        out += ["", "| layers | length | dynamic program ms | static program ms | ratio |"]
        out.append("|---|---|---|---|---|")
        for r in steady:
            out.append(
                f"| {r['layers']} | {r['length']} | {r['dynamic_ms']} | {r['static_ms']} "
                f"| {r['ratio']} |"
            )
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def _best_peer(got: dict, graphamp_row: dict) -> str:
    """The fastest torch.compile peer measured in a cell, and graphamp's ratio to it."""
    peers = {v: got[v]["total_s"] for v in PEERS if got.get(v, {}).get("total_s")}
    if not peers:
        return "- | -"
    best = min(peers, key=peers.__getitem__)
    ratio = graphamp_row["total_s"] / peers[best] if graphamp_row else float("nan")
    return f"{peers[best]} ({best}) | **{ratio:.2f}**"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    parser.add_argument("--cells", nargs="+", default=["12x4", "200x50"], help="STEPSxLENGTHS")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--steady", action="store_true", help="also the steady-step comparison")
    parser.add_argument(
        "--restart", action="store_true", help="each cell again on the cache its cold run filled"
    )
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True) in every variant")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each cell (the table: medians)"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.fused:
        os.environ[FUSED_ENV] = "1"
    if args.child:
        kind, *rest = args.child
        row = child_steady(int(rest[0])) if kind == "steady" else child_total(kind, *map(int, rest))
        row["optimizer"] = "AdamW(fused=True)" if os.environ.get(FUSED_ENV) == "1" else "AdamW"
        print(json.dumps(row), flush=True)
        return [row]
    rows = []
    for layers in args.layers:
        for cell in args.cells:
            steps, lengths = cell.split("x")
            for rep in range(args.repeat):  # variants alternate, so a drift in load hits all
                for variant in args.variants:
                    load = os.getloadavg()[0]  # before the child starts: other work's load
                    row = run_child([variant, str(layers), steps, lengths], args.restart)
                    rows.append({**row, "repeat": rep, "load": round(load, 2)})
                    print(json.dumps(rows[-1]), flush=True)
        if args.steady:
            rows.append(run_child(["steady", str(layers)]))
            print(json.dumps(rows[-1]), flush=True)
    import torch

    meta = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "torch": torch.__version__,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "variable_shapes_cpu.jsonl"), "a") as f:
        for row in rows:
            f.write(json.dumps({**row, **meta}) + "\n")
    write_table(os.path.join(args.out, "variable_shapes_cpu.md"), rows, meta)
    return rows


if __name__ == "__main__":
    main()
