"""What every AMP pass shares: the context, the result type, and how a node is classified."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._ops
import math
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from ..records.amp import AmpContext
from ..records.settings import ConfigSnapshot
from ..torchkit.fxutil import captured_dtype, dtype_after_amp, float_dtype, is_compute_node
from .op_dtypes import FIXED_DTYPE, PROMOTE

# Checks that each module path a setting names (the second argument: the setter, for the
# error) is a registered module; the build's capture stage supplies it (passes do not read
# the modules).
CheckPaths = Callable[[tuple[str, ...], str], None]

# A pass's own settings (``amp_pipeline.PASS_SETTINGS``): (config, device, graph name, whether
# the graph trains, CheckPaths) -> the AmpContext fields the pass reads, ConfigError where they
# cannot run.
SettingsOf = Callable[[ConfigSnapshot, torch.device, str, bool, CheckPaths], dict[str, Any]]

__all__ = [
    "AmpContext",
    "CheckPaths",
    "Classifier",
    "PassResult",
    "SettingsOf",
    "captured_dtype",
    "dtype_after_amp",
    "float_dtype",
    "is_compute_node",
]


def packet_of(node: fx.Node) -> Any:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket
    return target


def carries_float(dtype: Any) -> bool:
    if isinstance(dtype, tuple):
        return any(d is not None for d in dtype)
    return dtype is not None


def touches_float(node: fx.Node) -> bool:
    """Does the op read or produce a floating-point tensor? Only those take part in AMP."""
    if carries_float(captured_dtype(node)):
        return True
    return any(carries_float(captured_dtype(n)) for n in node.all_input_nodes)


class Classifier:
    """(category, why) for compute nodes, after pins and the opt level; cached per op.

    Categories: allow, deny, infer, clear (list membership), unknown (fp32, reported), promote
    (autocast's promote list: the widest input dtype, never coloured), fixed (output dtype fixed
    by an argument: never coloured), n/a (no floating-point data). A piece of a composite op
    (``meta["part_of"]``, written at capture) is classified as that op.
    """

    def __init__(self, ctx: AmpContext):
        self.ctx = ctx
        self._by_target: dict[Any, tuple[str, str]] = {}

    def _base(self, target: Any) -> tuple[str, str]:
        hit = self._by_target.get(target)
        if hit is None:
            ctx = self.ctx
            packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
            base = ctx.lists.category(packet)
            if packet in FIXED_DTYPE:
                hit = ("fixed", "output dtype fixed by the op's arguments")
            elif ctx.opt_level == "O3":
                hit = ("allow", "opt level O3: everything in low precision")
            elif packet in PROMOTE and packet not in ctx.lists.overridden:
                hit = ("promote", "autocast's promote list: runs in the widest input dtype")
            elif ctx.opt_level == "O2" and base in ("infer", "clear"):
                hit = ("allow", "opt level O2: all but deny ops and pinned modules")
            elif base == "unknown":
                hit = ("unknown", "not in any precision list: kept fp32")
            else:
                hit = (
                    base,
                    f"{base} list" + (" (user override)" if packet in ctx.lists.overridden else ""),
                )
            self._by_target[target] = hit
        return hit

    def __call__(self, node: fx.Node) -> tuple[str, str]:
        # a custom autograd Function is one node; the lists name it by its class
        category, why = self._base(node.meta.get("autograd_function") or node.target)
        if category == "fixed":
            return category, why
        whole = node.meta.get("part_of")
        if whole is not None and whole != packet_of(node):
            whole_category, whole_why = self._base(whole)
            if whole_category not in ("unknown", "fixed"):
                category, why = whole_category, f"part of {whole} ({whole_why})"
        # an explicit dtype fixes the output, except for factories (clear ops get it rewritten)
        if node.kwargs.get("dtype") is not None and packet_of(node) not in self.ctx.lists.clear:
            return "fixed", "output dtype fixed by the op's arguments"
        if not touches_float(node):
            return "n/a", "no floating-point data"
        if node.name in self.ctx.pinned_nodes and self.ctx.opt_level != "O3":
            return "deny", self.ctx.pinned_nodes[node.name]
        if self.ctx.pinned_paths and self.ctx.opt_level != "O3":
            stack = node.meta.get("nn_module_stack") or {}
            pinned = next((p for p in stack if p in self.ctx.pinned_paths), None)
            if pinned is not None:
                return "deny", f"inside fp32-pinned module {pinned}" + (
                    f": {self.ctx.pin_reasons[pinned]}" if pinned in self.ctx.pin_reasons else ""
                )
        wide = scalar_beyond(node, self.ctx.dtype)
        if wide is not None and self.ctx.opt_level != "O3":
            return "deny", (
                f"its scalar {wide:.4g} is beyond {str(self.ctx.dtype)[6:]}'s range: kept fp32"
            )
        form = node.meta.get("amp_form")  # a pass chose how the op runs (fp32_where_faster)
        return category, f"{why}; {form}" if form else why


def scalar_beyond(node: fx.Node, dtype: torch.dtype) -> float | None:
    """A finite number argument of ``node`` that ``dtype`` cannot hold, if any.

    Capture runs build() in fp32, so a value it derived from a tensor's dtype was derived from
    fp32: ``scores.masked_fill(mask, torch.finfo(q.dtype).min)`` (DeBERTa's attention) holds
    -3.4e38, where eager autocast, whose ``q`` is bf16, computes bf16's smallest. Run in low
    precision, the op would raise (eager kernels refuse the conversion) or write -inf (a
    compiled one). Kept fp32, it computes the value build() wrote, whatever the precision of
    its neighbours. Only numbers given where the schema takes a number or a tensor count
    (``masked_fill``'s value, ``x * 1e5``'s operand): sizes and dims are ints in their own
    right."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    limit = torch.finfo(dtype).max
    schema = target._schema.arguments
    given = [
        *zip(schema, node.args),
        *((a, node.kwargs[a.name]) for a in schema if a.name in node.kwargs),
    ]
    for arg, value in given:
        kind = arg.type
        if isinstance(kind, torch.OptionalType):
            kind = kind.getElementType()
        if (
            isinstance(kind, (torch.NumberType, torch.TensorType))
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and abs(value) > limit
        ):
            return float(value)
    return None


def output_values(output: fx.Node) -> list[fx.Node]:
    """The nodes an output node returns, in order (its nested tuples flattened); a captured
    forward returns one flat tuple: ``CapturedForward.split_outputs`` order."""
    out: list[fx.Node] = []

    def walk(arg: Any) -> None:
        if isinstance(arg, fx.Node):
            out.append(arg)
        elif isinstance(arg, (list, tuple)):
            for a in arg:
                walk(a)

    walk(output.args)
    return out
