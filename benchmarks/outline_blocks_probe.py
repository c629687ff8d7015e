"""Research probe (issue 31, repeated blocks): outline N identical transformer blocks of an
assembled step graph into shared ``invoke_subgraph`` subgraphs and time inductor on it.

Not library code. It answers one question with a measurement: if graphamp built
``torch.ops.higher_order.invoke_subgraph`` nodes itself after assembly (one shared forward
subgraph and one shared backward subgraph for every block), would inductor compile each once, stay
bitwise equal to the inlined step, and make the first call flat in depth?

How, in short (each step is a stand-in for what a real pass would do):

- Assembly runs with torch's autograd stack-trace hooks and ``preserve_node_meta`` (patched in
  here), so every backward node carries the ``seq_nr`` of the forward op it differentiates.
- Forward nodes are assigned to block ``i`` by module path (``model.h.i``); backward nodes by
  the ``seq_nr`` of their forward op.
- Each block's forward region and backward region becomes a subgraph (inputs: values read from
  outside, in order of first use; outputs: values used outside). Regions whose subgraph code and
  input metadata are identical share one GraphModule and one identifier.
- Every region is replaced by one ``invoke_subgraph`` call placed before the first outside user
  of its outputs.

    python benchmarks/outline_blocks_probe.py --layers 6 --backend inductor --variant outlined
    python benchmarks/outline_blocks_probe.py --layers 6 --backend inductor --variant inlined

Each run is one fresh process with caches disabled; it prints one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import operator
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _patch_assembly_for_seq_nr():
    """Make assembly record which forward op each backward node differentiates (seq_nr)."""
    import torch
    import torch.fx.traceback as fx_traceback
    from torch._functorch._aot_autograd.logging_utils import (
        setup_stacktrace_preservation_hooks_from_tensors,
    )

    import graphamp.step.assemble as assemble

    real_trace, real_grad = assemble.trace_functional, torch.autograd.grad

    def grad(outputs, *args, **kwargs):
        setup_stacktrace_preservation_hooks_from_tensors(outputs)
        return real_grad(outputs, *args, **kwargs)

    def trace(*args, **kwargs):
        torch.autograd.grad = grad
        try:
            with fx_traceback.preserve_node_meta():
                return real_trace(*args, **kwargs)
        finally:
            torch.autograd.grad = real_grad

    assemble.trace_functional = trace


def block_regions(gm, prefix: str) -> dict[tuple[str, int], list]:
    """{("fw" | "bw", block index): nodes in graph order}."""
    from graphamp.records.fxutil import module_path

    seq_to_block = {}
    regions: dict[tuple[str, int], list] = {}
    for node in gm.graph.nodes:
        if node.meta.get("graphamp_subgraph") != "forward":
            continue
        path = module_path(node)
        if path.startswith(prefix):
            block = int(path[len(prefix) :].split(".")[0])
            seq_to_block.setdefault(node.meta.get("seq_nr"), block)
            regions.setdefault(("fw", block), []).append(node)
    block_of = {}
    for node in gm.graph.nodes:
        if node.meta.get("graphamp_subgraph") == "backward":
            block = seq_to_block.get(node.meta.get("seq_nr"))
            if block is not None:
                block_of[node] = block
    # Gradient accumulation (the sum of the two gradients of a residual stream) carries the
    # seq_nr of no block op: a backward node that both reads from and feeds one block's
    # backward belongs to it.
    for node in gm.graph.nodes:
        if node.meta.get("graphamp_subgraph") == "backward" and node not in block_of:
            before = {block_of.get(a) for a in node.all_input_nodes} - {None}
            after = {block_of.get(u) for u in node.users} - {None}
            if len(before) == 1 and before == after:
                block_of[node] = before.pop()
    for node in gm.graph.nodes:
        if node in block_of:
            regions.setdefault(("bw", block_of[node]), []).append(node)
    return regions


def _inductor_mishandles(node, inputs) -> bool:
    """An output inductor's invoke_subgraph lowering gets wrong (torch 2.14.1, CPU): an output
    that aliases an input of the subgraph (a transposed weight saved for the backward). With
    one, the step computed wrong gradients or corrupted the heap ("free(): invalid next size"),
    while aot_eager on the same graph was bitwise right. Such outputs are returned as copies.
    PROBE_CLONE selects: alias (default; enough), offset (views with a storage offset only:
    not enough), noncontig (offset or non-contiguous), all."""
    val = node.meta.get("val")
    policy = os.environ.get("PROBE_CLONE", "alias")
    if not hasattr(val, "storage_offset"):
        return False
    if policy == "all":
        return True
    if policy == "alias":  # outputs sharing storage with an input of the region
        from torch.multiprocessing.reductions import StorageWeakRef

        mine = StorageWeakRef(val.untyped_storage())
        return any(
            hasattr(a.meta.get("val"), "untyped_storage")
            and StorageWeakRef(a.meta["val"].untyped_storage()) == mine
            for a in inputs
        )
    if policy == "noncontig":
        return val.storage_offset() != 0 or not val.is_contiguous()
    return val.storage_offset() != 0


def extract(gm, nodes, for_autograd: bool = False):
    """(subgraph GraphModule with canonical names, inputs, outputs) of a node region."""
    import torch
    import torch.fx as fx

    inside = set(nodes)
    inputs, seen = [], set()
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in seen:
                seen.add(arg)
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env = {}
    for i, arg in enumerate(inputs):
        env[arg] = graph.placeholder(f"in{i}")
        env[arg].meta = dict(arg.meta)
    for i, node in enumerate(nodes):
        env[node] = graph.node_copy(node, lambda a: env[a])
        env[node]._rename(f"n{i}")  # noqa: SLF001 - canonical names make equal blocks equal code
    results = []
    for o in outputs:
        result = env[o]
        if not for_autograd and _inductor_mishandles(o, inputs):
            result = graph.call_function(torch.ops.aten.clone.default, (result,))
            result.meta["val"] = o.meta["val"].clone()
        results.append(result)
    graph.output(tuple(results))
    sub = fx.GraphModule(gm, graph)
    if for_autograd:
        sub = _pure_aten(sub, inputs)
    return sub, inputs, outputs


def _pure_aten(sub, inputs):
    """``sub`` traced again through assembly's forward interpreter: graphamp's own ops (its
    SDPA under an autocast policy, functional copies) become the aten ops autograd can
    differentiate inside the HOP; the outputs' metadata is dropped (see outline)."""
    from graphamp.records.fxutil import trace_functional
    from graphamp.step.gradients import _ForwardRunner

    def run(*args):
        return tuple(_ForwardRunner(sub, None).run(*args, enable_io_processing=False))

    pure = trace_functional(run, [a.meta["val"] for a in inputs], propagate_input_mutations=False)
    for result in next(reversed(pure.graph.find_nodes(op="output"))).args[0]:
        result.meta.pop("val", None)
    return pure


def signature(sub, inputs) -> str:
    metas = [
        (tuple(a.meta["val"].shape), str(a.meta["val"].dtype), tuple(a.meta["val"].stride()))
        if hasattr(a.meta.get("val"), "shape")
        else repr(a.meta.get("val"))
        for a in inputs
    ]
    return hashlib.sha1((sub.code + repr(metas)).encode()).hexdigest()[:16]


def forward_regions(fwd, prefix: str) -> dict[tuple[str, int], list]:
    """{("block", i): call nodes of block i} in the AMP forward graph (by module path)."""
    from graphamp.records.fxutil import module_path

    regions: dict[tuple[str, int], list] = {}
    for node in fwd.graph.nodes:
        path = module_path(node)
        if node.op == "call_function" and path.startswith(prefix):
            block = int(path[len(prefix) :].split(".")[0])
            regions.setdefault(("block", block), []).append(node)
    return regions


def outline(gm, regions, for_autograd: bool = False) -> dict:
    """Replace every repeated region by an invoke_subgraph call; returns counts.

    ``for_autograd``: the regions are forward code that autograd will differentiate through
    the HOP later (its outputs' metadata must not claim requires_grad=False: make_fx traced
    them below autograd, and the HOP would take them for non-differentiable)."""
    import torch

    extracted = {key: extract(gm, nodes, for_autograd) for key, nodes in regions.items()}
    groups: dict[str, list] = {}
    for key, (sub, inputs, _) in extracted.items():
        groups.setdefault(f"graphamp_{key[0]}_{signature(sub, inputs)}", []).append(key)
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    shared_of = {}
    for ident, keys in groups.items():
        if len(keys) < 2:
            continue
        attr = ident
        gm.register_module(attr, extracted[keys[0]][0])
        for key in keys:
            shared_of[key] = (attr, ident)
    outlined, skipped = 0, [(i, k) for i, k in groups.items() if len(k) < 2]
    replaced: dict = {}  # an outlined region's output -> the getitem that now stands for it
    for key in sorted(shared_of, key=lambda k: order[regions[k][0]]):
        attr, ident = shared_of[key]
        _, inputs, outputs = extracted[key]
        inputs = [replaced.get(a, a) for a in inputs]
        nodes = regions[key]
        inside = set(nodes)
        users = [u for o in outputs for u in o.users if u not in inside]
        first_user = min(users, key=order.__getitem__)
        if inputs and max(order[a] for a in inputs) >= order[first_user]:
            late = [a for a in inputs if order[a] >= order[first_user]]
            raise RuntimeError(
                f"region {key} is not contiguous: inputs {[(a.name, a.meta.get('seq_nr'), a.meta.get('graphamp_subgraph')) for a in late]} "
                f"come after {first_user.name} ({first_user.meta.get('seq_nr')}, {first_user.meta.get('graphamp_subgraph')}) which reads "
                f"{[a.name for a in first_user.all_input_nodes if a in inside]}"
            )
        with gm.graph.inserting_before(first_user):
            sub_ref = gm.graph.get_attr(attr)
            call = gm.graph.call_function(
                torch.ops.higher_order.invoke_subgraph, (sub_ref, ident, *inputs)
            )
            call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
            for i, out in enumerate(outputs):
                item = gm.graph.call_function(operator.getitem, (call, i))
                item.meta = dict(out.meta)
                order[item] = order[first_user] - 0.5
                replaced[out] = item
                out.replace_all_uses_with(item, delete_user_cb=lambda u, s=inside: u not in s)
        for node in reversed(nodes):
            gm.graph.erase_node(node)
        outlined += 1
    gm.graph.lint()
    gm.recompile()
    return {
        "regions": len(regions),
        "outlined": outlined,
        "distinct_subgraphs": sum(len(k) >= 2 for k in groups.values()),
        "left_inline": [f"{i}: {k}" for i, k in skipped],
    }


def assemble_with_block_hops(program, x, y):
    """The step assembled again from a forward whose blocks are invoke_subgraph calls, so that
    autograd itself makes the forward and backward HOPs (InvokeSubgraphAutogradOp) and
    AOTAutograd partitions each pair once (run_joint_graph_passes_on_hops)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import graphamp.step.assemble as assemble
    from graphamp.records.fxutil import copy_graph_module

    fwd = copy_graph_module(program.forward)
    info = outline(fwd, forward_regions(fwd, "model.h."), for_autograd=True)
    real_trace = assemble.trace_functional

    def trace_in_context(fn, example, *args, **kwargs):
        # one TracingContext for the whole trace: calls with one identifier share one subgraph
        mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [mode.from_tensor(t, static_shapes=True) for t in example]
        with tracing(TracingContext(mode)):
            return real_trace(fn, fakes, *args, **kwargs)

    assemble.trace_functional = trace_in_context
    try:
        example = [t.detach() for t in program.runner.gather([x, y])]
        gm = assemble.assemble_step(program.plan, fwd, example)
    finally:
        assemble.trace_functional = real_trace
    hops = [n for n in gm.graph.nodes if n.target is torch_hop()]
    info["step_hops"] = len(hops)
    info["step_subgraphs"] = len({n.args[0].target for n in hops})
    return gm, info


def torch_hop():
    import torch

    return torch.ops.higher_order.invoke_subgraph


def alias_repro() -> None:
    """The inductor bug in ten lines (torch 2.14.1, CPU): a shared subgraph that returns one of
    its inputs (or a view of it with the input's own layout, here ``w.t().t()``) gives wrong
    results in the calling graph; aot_eager, and inductor on the inlined graph, are right."""
    import torch
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphamp.records.fxutil import trace_functional
    from graphamp.runtime.compile import compile_step

    def sub(x, w):
        return (torch.tanh(x @ w.t()), w.t(), x, w.t().t())

    sub_gm = make_fx(sub)(torch.randn(4, 8), torch.randn(8, 8))

    def step(call, x, w1, w2):
        a, _, x1, w1tt = call(x, w1)
        b, _, a1, w2tt = call(a, w2)
        g = b @ w2tt + a1 @ w1tt.t() + x1.sum()
        w1.copy_(w1 - 0.1 * g.sum() * w1)
        return (b, g)

    def shared(*args):
        return invoke_subgraph(sub_gm, "s", *args)

    torch.manual_seed(0)
    example = [torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 8)]
    for backend in ("aot_eager", "inductor"):
        outs = []
        for call in (sub, shared):
            gm = trace_functional(
                lambda *a, call=call: step(call, *a), example, propagate_input_mutations=True
            )
            args = [t.clone() for t in example]
            outs.append([*compile_step(gm, [t.clone() for t in example], backend)(*args), *args])
        diff = max((a - b).abs().max().item() for a, b in zip(*outs))
        print(f"{backend}: max |inlined - invoke_subgraph| = {diff:.3g}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--variant", default="outlined", choices=["outlined", "inlined", "hop"])
    parser.add_argument("--profile", action="store_true", help="top ops of one steady step")
    parser.add_argument("--steady-steps", type=int, default=0, help="time this many more steps")
    parser.add_argument("--kinds", default="fw,bw", help="which regions to outline")
    parser.add_argument("--opt", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--save", help="torch.save the outputs and updated state here")
    parser.add_argument(
        "--emulate-precision-casts",
        action="store_true",
        help="inductor rounds every low-precision intermediate as eager does",
    )
    parser.add_argument("--alias-repro", action="store_true", help=alias_repro.__doc__)
    args = parser.parse_args()
    if args.alias_repro:
        return alias_repro()

    import torch

    sys.path.insert(0, HERE)
    from workloads import GPT, lm_loss

    import graphamp
    from graphamp.runtime.compile import compile_step

    _patch_assembly_for_seq_nr()
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, seq=64, layers=args.layers, heads=4, dim=args.dim)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        if args.opt == "adamw"
        else torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient
    )

    class Train(graphamp.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)
            self.config.set_backend("eager")  # the graph only; compiled below
            self.config.enable_amp(True, dtype=torch.bfloat16)

        def build(self, x, y):
            loss = lm_loss(self.model(x), y)
            loss.backward()
            return loss

    g = Train()
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (8, 65), generator=gen)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g(x, y)  # builds the program (eager backend: no compile); this step is undone below
    program = next(reversed(g._programs.values()))  # noqa: SLF001 - a probe reads internals
    model.load_state_dict(state)
    gm = program.step_gm
    nodes_before = len(gm.graph.nodes)
    info = {}
    if args.variant == "outlined":
        kinds = args.kinds.split(",")
        regions = block_regions(gm, "model.h.")
        info = outline(gm, {k: v for k, v in regions.items() if k[0] in kinds})
    elif args.variant == "hop":
        gm, info = assemble_with_block_hops(program, x, y)
    runner = program.runner
    flat = runner.gather([x, y])
    example = [t.detach() for t in flat]
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as inductor_metrics

    inductor_config.emulate_precision_casts = args.emulate_precision_casts
    start = time.perf_counter()
    compiled = compile_step(gm, example, args.backend)
    out = compiled(*flat)
    first_call = time.perf_counter() - start
    steady = []
    for _ in range(args.steady_steps):  # on copies: the saved state stays the first step's
        again = [t.clone() for t in flat]
        start = time.perf_counter()
        compiled(*again)
        steady.append(time.perf_counter() - start)
    if args.profile:
        from torch.profiler import profile

        again = [t.clone() for t in flat]
        with profile() as prof:
            compiled(*again)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.save:
        torch.save([t.detach().clone() for t in [*out, *flat]], args.save)
    digest = hashlib.sha1()
    for t in [*out, *flat]:
        t = t.detach()
        digest.update(
            (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()
        )
    print(
        json.dumps(
            {
                "layers": args.layers,
                "variant": args.variant,
                "backend": args.backend,
                "nodes_before": nodes_before,
                "nodes_after": len(gm.graph.nodes),
                **info,
                "compile_and_first_call_s": round(first_call, 2),
                "kernels": inductor_metrics.generated_kernel_count,
                "steady_step_ms": [round(t * 1e3) for t in steady],
                "loss": float(out[0]),
                "digest": digest.hexdigest()[:12],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
