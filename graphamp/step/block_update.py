"""The optimizer update of repeated blocks: one kernel per distinct block, compiled once (issue 40).

Inline, the multi-tensor update over every parameter becomes one loop per parameter in
inductor's generated code: on a 12-layer GPT-2 that is 2,300 more nodes for inductor to
schedule and generate, most of the gap between graphamp's cold first call and torch.compile's
(``benchmarks/results/first_call_cpu.md``). Where the step's blocks repeat and are outlined (by
default on the CPU, for blocks repeated at least 3 times; ``config.set_block_updates``), each
block's parameters are updated instead by one call of ``graphamp::update_block_``. Its kernel is
the same multi-tensor math (``update_math.write_masked``), compiled with the step's backend as the
step is compiled, once for each distinct block (the optimizer kind, its options, the tensors'
sizes, dtypes and strides), and reused by every block equal to it. The step's own compile sees one
opaque call per block. Each call costs the steady step about 0.2 ms on the CPU (dispatch,
inductor's wrapper, a kernel's fixed costs): 1.004-1.022x the inlined step on the GPT workloads
and ViT-Ti, whose 6 and 12 blocks are equal, but 1.021-1.026x on ResNet-18, whose only equal
blocks are a pair (it saves one block's update at compile). Hence the default's 3 repeats.

Why a custom op and not an outlined subgraph: the update writes its parameters and state. An op
that declares its writes is auto-functionalized in the step, and inductor turns it back into
the in-place call on the step's own inputs with no copy (as for the fused kernel,
``torchkit/fused_update.py``). A subgraph's writes came back outside it as one copy kernel per
tensor, which made the steady step 3-8% slower.

Gradients reach the op in the dtype the backward made them (``pass_gradients_uncast``): where a
gradient is only the upcast of a low-precision gradient (a bf16 compute copy's, cast back to
its fp32 parameter's dtype), the op gets the bf16 gradient and its kernel casts it inside its
own loop. That is what inductor does with the update inline: the fp32 gradient is never written
to memory. The upcast is exact, so the values are the same either way.

With any backend other than inductor the op runs the math eagerly, bitwise the inline update
(the same ops on a subset of the same lists).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._to_copy
import json
from typing import Callable

import torch
import torch.fx as fx
from torch import Tensor

from ..torchkit.backends import call_backend
from ..torchkit.fxutil import trace_functional
from ..torchkit.ops import provide_block_update
from ..torchkit.process_state import BoundedCache
from .outline import numbered_on
from .update_math import GroupTensors, write_masked


def _update_block(
    params: list[Tensor],
    grads: list[Tensor],
    states: list[Tensor],
    fresh: list[Tensor],
    hypers: list[Tensor],
    skip: Tensor | None,
    spec: str,
) -> None:
    """One block's masked update, in place. ``states``: the state tensors key by key (each key's
    ``len(params)`` tensors in a row); ``fresh``: the momentum-start flags, or none; ``spec``:
    the update and its tensors' sizes and dtypes (``_Spec``), as JSON."""
    flat = [*params, *grads, *states, *fresh, *hypers]
    if skip is not None:
        flat.append(skip)
    key = _kernel_key(spec, flat)
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _remember(key, _kernel(_Spec(spec), flat))
    with torch.no_grad():  # the parameters are leaves that require grad, written in place
        kernel(*flat)


# the op's schema, fake kernel and registration are torchkit/ops.py's (the package's one
# import-time registration, and why the op is defined on torch's dispatcher directly); the
# kernel it runs is this one
provide_block_update(_update_block)


class _Spec:
    """What a block's kernel computes, parsed from the op's ``spec`` string."""

    def __init__(self, text: str):
        self.text = text
        d = json.loads(text)
        self.kind: str = d["kind"]
        self.flags: dict = d["flags"]
        self.state_keys: list[str] = d["state_keys"]
        self.hyper_names: list[str] = d["hyper_names"]
        self.n: int = d["n"]
        self.fresh: bool = d["fresh"]
        self.backend: str = d["backend"]
        self.inputs: list = d["inputs"]  # [dtype, sizes, device] of each flat input

    def update(self, *flat: Tensor) -> tuple:
        """The masked update over the op's flat inputs (``update_block_``'s order)."""
        n, keys = self.n, self.state_keys
        params, given = list(flat[:n]), flat[n : 2 * n]
        at = 2 * n
        state = {k: list(flat[at + i * n : at + (i + 1) * n]) for i, k in enumerate(keys)}
        at += len(keys) * n
        fresh = list(flat[at : at + n]) if self.fresh else None
        at += n if self.fresh else 0
        hyper = dict(zip(self.hyper_names, flat[at : at + len(self.hyper_names)]))
        at += len(self.hyper_names)
        skip = flat[at] if at < len(flat) else None
        # the upcast the step left to the kernel (pass_gradients_uncast): exact, fused here
        grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(given, params)]
        write_masked(self.kind, self.flags, GroupTensors(params, grads, state, hyper), fresh, skip)
        return ()


def spec_text(
    kind: str, flags: dict, state_keys, hyper_names, n: int, fresh: bool, flat: list[Tensor]
) -> str:
    """The ``spec`` of a call on the op's ``flat`` inputs (``update_block_``'s order) for a
    block of ``n`` parameters."""
    return json.dumps(
        {
            "kind": kind,
            "flags": flags,
            "state_keys": list(state_keys),
            "hyper_names": list(hyper_names),
            "n": n,
            "fresh": fresh,
            "backend": "eager",  # the step's backend, set as it is compiled (set_kernel_backend)
            "inputs": [[str(t.dtype), [int(d) for d in t.shape], str(t.device)] for t in flat],
        },
        sort_keys=True,
    )


# (spec, strides) -> the kernel, made at the first call (the specs name sizes and dtypes).
# Process-wide (process_state.PROCESS_STATE), and bounded: a long process that builds many
# models (a sweep, a notebook) drops its oldest kernels, made again if a step still calls them.
MAX_KERNELS = 256
_KERNELS: BoundedCache[tuple[str, tuple], Callable[..., object]] = BoundedCache(MAX_KERNELS)


def _remember(key: tuple[str, tuple], kernel: Callable[..., object]) -> Callable[..., object]:
    _KERNELS[key] = kernel  # the oldest dropped where the cache is full
    return kernel


def _kernel_key(spec: str, flat: list[Tensor]) -> tuple[str, tuple]:
    """``_KERNELS``' key of the kernel of ``spec`` for tensors laid out as ``flat``."""
    return (spec, tuple(t.stride() for t in flat))


# how the step's compile makes a kernel: (spec, trace, example, cached) -> kernel, where
# ``trace()`` gives the kernel's graph (stages.py notes AOTAutograd's key of it for a restart)
KernelCompiler = Callable[[str, Callable[[], fx.GraphModule], list, bool], Callable[..., object]]


def _kernel(
    spec: _Spec, flat: list[Tensor], cached: bool = False, compiler: KernelCompiler | None = None
) -> Callable[..., object]:
    """The block's update for ``spec``: with inductor, compiled for tensors like ``flat`` (a
    restart finds it in inductor's caches; ``cached``: expected there, as ``compile_step``
    takes it) by ``compiler``, or directly; with any other backend, the eager math."""
    if spec.backend != "inductor":
        return spec.update
    example = [t.detach() for t in flat]

    def trace() -> fx.GraphModule:
        with torch.no_grad():
            gm = trace_functional(spec.update, example, propagate_input_mutations=True)
        gm._tracer_cls = gm.graph._tracer_cls = None  # as assembly does: AOTAutograd's key
        return gm

    with torch.no_grad():
        if compiler is not None:
            return compiler(spec.text, trace, example, cached)
        return call_backend(trace(), example, "inductor", cached=cached)


# -- in the step ------------------------------------------------------------------------------


def block_of(name: str) -> tuple[str, str] | None:
    """(block, name inside it) of a parameter's qualified name: the block is the path up to its
    outermost numbered module (``h.3`` of ``transformer.h.3.attn.c_attn.weight``); None outside
    any."""
    found = numbered_blocks(name)
    return found[0] if found else None


def numbered_blocks(name: str) -> list[tuple[str, str]]:
    """(block, name inside it) for each numbered module on a parameter's path, outermost first,
    numbered as outlining numbers blocks (``outline.numbered_on``: ``3``, ``encoder_layer_3``)."""
    parts = name.split(".")
    return [
        (".".join(parts[: k + 1]), ".".join(parts[k + 1 :])) for k, _ in numbered_on(parts[:-1])
    ]


def update_repeated_blocks(
    kind: str,
    flags: dict,
    state_keys,
    hyper_names,
    tensors: GroupTensors,
    fresh: list[Tensor] | None,
    skip: Tensor | None,
    names: list[str],
    repeats: int = 2,
) -> list[int]:
    """One ``update_block_`` call per block of the group (``names``: its parameters') that has
    at least ``repeats - 1`` equals in the group (the same parameter names inside it, sizes and
    dtypes). The blocks are the outermost numbered modules; where none repeats so, the next
    numbered ones inside them, as outlining chooses. Returns the positions left to the inline
    update."""
    found = [numbered_blocks(name) for name in names]
    p, done = tensors.params, set()
    for depth in range(max(map(len, found), default=0)):
        blocks: dict[str, list[int]] = {}
        for j, chain in enumerate(found):
            if depth < len(chain):
                blocks.setdefault(chain[depth][0], []).append(j)
        equal: dict[tuple, list[list[int]]] = {}
        for members in blocks.values():
            key = tuple(
                (found[j][depth][1], str(p[j].shape), p[j].dtype, p[j].device) for j in members
            )
            equal.setdefault(key, []).append(members)
        for instances in equal.values():
            for members in instances if len(instances) >= max(repeats, 2) else ():
                _call(kind, flags, state_keys, hyper_names, tensors, fresh, skip, members)
                done.update(members)
        if done:
            break
    return [j for j in range(len(names)) if j not in done]


def _call(kind, flags, state_keys, hyper_names, t: GroupTensors, fresh, skip, members) -> None:
    params = [t.params[j] for j in members]
    grads = [t.grads[j] for j in members]
    states = [t.state[k][j] for k in state_keys for j in members]
    flags_of = [fresh[j] for j in members] if fresh is not None else []
    hypers = [t.hyper[h] for h in hyper_names]
    flat = [*params, *grads, *states, *flags_of, *hypers] + ([skip] if skip is not None else [])
    spec = spec_text(kind, flags, state_keys, hyper_names, len(members), fresh is not None, flat)
    torch.ops.graphamp.update_block_(params, grads, states, flags_of, hypers, skip, spec)


# -- on the assembled step ----------------------------------------------------------------------


def _calls(gm: fx.GraphModule):
    """The step's ``update_block_`` nodes (auto-functionalized in a functional step)."""
    op = torch.ops.graphamp.update_block_.default
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target is op or (node.args and node.args[0] is op)):
            yield node


def count_block_updates(gm: fx.GraphModule) -> tuple[int, int]:
    """(calls, distinct kernels) of the step's block updates."""
    specs = [node.kwargs["spec"] for node in _calls(gm)]
    return len(specs), len(set(specs))


_UPCASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def pass_gradients_uncast(gm: fx.GraphModule) -> int:
    """Each gradient an ``update_block_`` call reads that is the exact upcast of a
    lower-precision float gradient is passed uncast (the kernel casts it in its loop); returns
    how many. The cast stays in the step while something else reads it."""
    passed = 0
    for node in _calls(gm):
        grads = list(node.kwargs["grads"])
        spec = json.loads(node.kwargs["spec"])
        n = spec["n"]
        for i, g in enumerate(grads):
            if not (isinstance(g, fx.Node) and g.target in _UPCASTS and _is_exact_upcast(g)):
                continue
            grads[i] = g.args[0]
            spec["inputs"][n + i][0] = str(grads[i].meta["val"].dtype)
            passed += 1
        node.update_kwarg("grads", grads)
        node.update_kwarg("spec", json.dumps(spec, sort_keys=True))
    return passed


def _is_exact_upcast(cast: fx.Node) -> bool:
    src, out = cast.args[0], cast.meta.get("val")
    if not isinstance(src, fx.Node) or not isinstance(out, torch.Tensor):
        return False
    into = src.meta.get("val")
    if not isinstance(into, torch.Tensor) or not (
        into.is_floating_point() and out.is_floating_point()
    ):
        return False
    if set(cast.kwargs) - {"dtype", "layout", "device"} or into.device != out.device:
        return False
    return torch.finfo(into.dtype).bits < torch.finfo(out.dtype).bits and into.shape == out.shape


def block_specs(gm: fx.GraphModule) -> list[str]:
    """The ``spec`` of each distinct kernel the step's ``update_block_`` calls run, in order."""
    return list(dict.fromkeys(node.kwargs["spec"] for node in _calls(gm)))


def _example(parsed: _Spec, on_meta: bool = False) -> list[Tensor]:
    """Contiguous tensors of the sizes, dtypes and devices ``parsed`` names (or on "meta")."""
    return [
        torch.empty(
            sizes,
            dtype=getattr(torch, dtype.removeprefix("torch.")),
            device="meta" if on_meta else device,
        )
        for dtype, sizes, device in parsed.inputs
    ]


def block_example(spec: str) -> list[Tensor]:
    """Meta tensors laid out as the kernel of ``spec`` made at compile time takes them."""
    return _example(_Spec(spec), on_meta=True)


def block_devices(spec: str) -> set[str]:
    """The devices of the tensors the kernel of ``spec`` takes."""
    return {device for _, _, device in _Spec(spec).inputs}


def unmade_specs(specs: list[str]) -> list[str]:
    """Those of ``specs`` whose kernel for contiguous tensors this process has not made."""
    return [spec for spec in specs if _kernel_key(spec, block_example(spec)) not in _KERNELS]


def compile_block_kernels(
    specs: list[str], cached: bool = False, compiler: KernelCompiler | None = None
) -> int:
    """Make the kernels of ``specs`` (``block_specs``) now, as the step is compiled, rather than
    at its first run (for contiguous tensors of each call's sizes: a call whose inputs are laid
    out otherwise gets a kernel of its own then). ``cached``: the step came from the step cache
    (``compile_step``'s); ``compiler``: how (``_kernel``). Returns how many were made."""
    made = 0
    for spec in specs:
        parsed = _Spec(spec)
        flat = _example(parsed)
        key = _kernel_key(spec, flat)
        if key not in _KERNELS:
            _remember(key, _kernel(parsed, flat, cached, compiler))
            made += 1
    return made


def set_kernel_backend(gm: fx.GraphModule, backend: str) -> None:
    """The step's ``update_block_`` calls compile their kernels with ``backend`` (called as the
    step is compiled: the assembled and cached step does not depend on the backend)."""
    for node in _calls(gm):
        spec = json.loads(node.kwargs["spec"])
        spec["backend"] = backend
        node.update_kwarg("spec", json.dumps(spec, sort_keys=True))
    gm.recompile()
