"""use_fp8_matmuls: the bf16 matmuls of linear layers become fp8 (``config.enable_fp8``).

Runs last, on the coloured graph with its casts: a matmul the passes lowered to bf16 (``mm``, or
``addmm`` with its bias added after) becomes ``graphamp::fp8_mm(a, b, recipe)``
(``torchkit/fp8_numerics.py``: quantised by dynamic scales inside the step, forward and
backward), unless a rule keeps it in bf16. The rules are data, each with the reason the precision report prints:

- its sizes are not all multiples of 16 (``torch._scaled_mm``'s requirement), or are symbolic;
- it is the input projection (a linear layer reading the step's input) or the output layer
  (the last matmul), which torchao and Transformer Engine leave in higher precision: the first
  sees raw features, the last's logits feed the loss directly;
- it sits in a module the user kept out of fp8 (``enable_fp8(..., keep=[...])``).

Attention's matmuls (``bmm``, scaled dot-product attention) are not linear layers and stay bf16.
Every matmul gets ``meta["fp8"]``: ``"fp8"`` or the reason it stayed bf16.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._to_copy, torch.ops.aten._unsafe_view
from typing import Any, Callable, cast

import torch
import torch.fx as fx

from ..errors import ConfigError
from ..records.amp import Fp8Options
from ..records.layouts import PassState
from ..records.settings import ConfigSnapshot
from ..torchkit.fp8_numerics import HISTORY_ROWS
from ..torchkit.fxutil import module_path
from ..torchkit.ops import FP8_MM, FP8_MM_DELAYED
from .base import AmpContext, CheckPaths, PassResult, dtype_after_amp

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default)


def use_fp8_matmuls(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    if ctx.fp8 is None:
        return PassResult(gm, False)
    ctx.pass_state.clear()
    matmuls = [n for n in gm.graph.nodes if n.target in _MATMULS and _is_bf16(n)]
    ends = _first_and_last_layers(matmuls) if ctx.fp8.keep_first_last else set()
    changed = False
    for node in matmuls:
        kept = next((why for rule, why in _RULES if rule(node, ctx, ends)), None)
        node.meta["fp8"] = kept or "fp8"
        if kept is not None:
            node.meta["amp_reason"] = f"{node.meta.get('amp_reason', '')}; {kept}"
        else:
            _to_fp8(gm.graph, node, ctx)
            changed = True
    return PassResult(gm, changed)


def _history_input(graph: fx.Graph, node: fx.Node, ctx: AmpContext) -> fx.Node:
    """The delayed recipe's state for ``node``: a new last input, (3, 1 + history) fp32."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        state = graph.placeholder(f"fp8_history_{node.name}")
    shape = (HISTORY_ROWS, 1 + _options(ctx).history)
    state.meta["val"] = _operands(node)[0].meta["val"].new_zeros(shape, dtype=torch.float32)
    ctx.pass_state.append(PassState(state.name, shape))
    return state


def _options(ctx: AmpContext) -> Fp8Options:
    return cast(Fp8Options, ctx.fp8)  # the pass runs only with options (use_fp8_matmuls)


def fp8_settings(
    config: ConfigSnapshot,
    device: torch.device,
    name: str,
    training: bool,  # noqa: ARG001 - SettingsOf's signature
    check_paths: CheckPaths,
) -> dict[str, Any]:
    """This pass's field of the AmpContext (``amp_pipeline.PASS_SETTINGS``): the fp8 options
    when enable_fp8 is on, after checking what they need: bf16 AMP, on CUDA a GPU with fp8
    matmuls (compute capability 8.9, Ada and Hopper, or later), and registered modules for
    ``keep``."""
    if config.fp8_recipe is None:
        return {}
    if not config.amp_active or config.amp_dtype != torch.bfloat16:
        raise ConfigError(
            f"{name}: enable_fp8 runs on top of bf16 AMP: call "
            "config.enable_amp(True, dtype=torch.bfloat16) (fp16 with fp8 is not offered: fp8 "
            "keeps its own scales, and bf16's range needs no loss scaler beneath them)"
        )
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(
                f"{name}: enable_fp8 needs a GPU with fp8 matmuls (compute capability 8.9 or "
                f"later: Ada, Hopper); this one has {capability[0]}.{capability[1]}"
            )
    check_paths(config.fp8_keep, "enable_fp8(keep=...)")
    options = Fp8Options(
        config.fp8_recipe,
        frozenset(config.fp8_keep),
        config.fp8_keep_first_last,
        config.fp8_history,
        config.fp8_margin,
    )
    # the matmuls are this pass's to rewrite: fp32_where_faster does not time them
    return {"fp8": options, "rewritten_later": frozenset(_MATMULS)}


def _is_bf16(node: fx.Node) -> bool:
    return dtype_after_amp(node) == torch.bfloat16 and not node.kwargs


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    a, b = node.args[-2:]
    return cast(fx.Node, a), cast(fx.Node, b)  # aten.mm / addmm take tensors: graph values


def _sizes(node: fx.Node) -> list:
    a, b = _operands(node)
    return [*a.meta["val"].shape, b.meta["val"].shape[-1]]


def _not_multiples_of_16(node: fx.Node, _ctx: AmpContext, _ends: set) -> bool:
    return not all(_multiple_of_16(s) for s in _sizes(node))


def _multiple_of_16(size: Any) -> bool:
    """A symbolic size (a batch of changing length) is asked as a guard: the program then
    serves only sizes that answer alike, so no size it serves decides another precision
    (a batch of 40 after 32 and 48 builds a step of its own, logged)."""
    if isinstance(size, int):
        return size % 16 == 0
    if isinstance(size, torch.SymInt):
        return bool(size % 16 == 0)
    return False


def _first_and_last_layers(matmuls: list[fx.Node]) -> set[str]:
    """The modules of the input projection (a matmul reading a g(...) input directly, as an
    MLP's first layer or a ViT's patch embedding does) and of the output layer (the last
    matmul: a head or classifier). A transformer's first block reads an embedding, not an
    input, so its blocks stay alike (and outlined)."""
    ends = {module_path(n) for n in matmuls if _reads_an_input(n)}
    if matmuls:
        ends.add(module_path(matmuls[-1]))
    return {m for m in ends if m}


_PASS_THROUGH = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten._to_copy.default,
        aten.t.default,
        aten.expand.default,
        aten.clone.default,
    }
)


def _reads_an_input(node: fx.Node) -> bool:
    value = _operands(node)[0]
    while value.op == "call_function" and value.target in _PASS_THROUGH:
        first = value.args[0]
        if not isinstance(first, fx.Node):
            return False
        value = first
    return value.op == "placeholder" and value.name.startswith("in_")


def _first_or_last(node: fx.Node, _ctx: AmpContext, ends: set) -> bool:
    return module_path(node) in ends


def _kept_by_user(node: fx.Node, ctx: AmpContext, _ends: set) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(path in _options(ctx).keep for path in stack)


_RULES: tuple[tuple[Callable[[fx.Node, AmpContext, set], bool], str], ...] = (
    (_not_multiples_of_16, "bf16: sizes not all multiples of 16 (torch._scaled_mm needs them)"),
    (_kept_by_user, "bf16: in a module kept out of fp8 (enable_fp8(keep=...))"),
    (
        _first_or_last,
        "bf16: input projection or output layer (kept in higher precision, as torchao "
        "and Transformer Engine advise)",
    ),
)


def _to_fp8(graph: fx.Graph, node: fx.Node, ctx: AmpContext) -> None:
    """``mm(a, b)`` -> ``fp8_mm(a, b)``; ``addmm(bias, a, b)`` -> ``fp8_mm(a, b) + bias``
    (``fp8_mm_delayed(a, b, its history, margin)`` for the delayed recipe)."""
    a, b = _operands(node)
    recipe = _options(ctx).recipe
    meta: dict[str, object] = {
        k: node.meta[k] for k in ("val", "nn_module_stack", "user_frame") if k in node.meta
    }
    history = _history_input(graph, node, ctx) if recipe == "delayed" else None
    with graph.inserting_before(node):
        if history is not None:
            fp8 = graph.call_function(FP8_MM_DELAYED, (a, b, history, _options(ctx).margin))
        else:
            fp8 = graph.call_function(FP8_MM, (a, b, recipe))
        fp8.meta.update(meta, amp_dtype=torch.bfloat16, amp_colour="fp8", fp8="fp8")
        fp8.meta["amp_reason"] = f"fp8 matmul ({recipe} scales): a linear layer's matmul"
        out = fp8
        if node.target is aten.addmm.default:
            out = graph.call_function(aten.add.Tensor, (fp8, node.args[0]))
            out.meta.update(meta, amp_dtype=torch.bfloat16, amp_colour="allow")
            out.meta["amp_reason"] = "the bias of an fp8 matmul, added in bf16"
    node.replace_all_uses_with(out)
    graph.erase_node(node)
