"""What every AMP pass shares: the context, the result type, and how a node is classified."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from .lists import DEFAULT_LISTS, FIXED_DTYPE, PrecisionLists

__all__ = ["AmpContext", "PassResult", "classify", "float_dtype", "is_compute_node"]

LOW_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class AmpContext:
    """Everything the AMP passes read, and what they report back."""

    dtype: torch.dtype = torch.float16
    lists: PrecisionLists = DEFAULT_LISTS
    opt_level: str = "O1"
    pinned_paths: frozenset[str] = frozenset()  # module paths whose ops stay fp32
    # placeholder names of parameters (hoist_parameter_casts may give them shadows)
    parameters: frozenset[str] = frozenset()
    # filled by the passes
    stats: dict[str, Any] = field(default_factory=dict)
    unknown_ops: dict[str, int] = field(default_factory=dict)
    hoisted: list[tuple[str, torch.dtype]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.dtype not in LOW_DTYPES:
            raise ValueError(f"AMP dtype must be torch.float16 or torch.bfloat16, got {self.dtype}")
        if self.opt_level not in ("O0", "O1", "O2", "O3"):
            raise ValueError(f"unknown AMP opt level {self.opt_level!r}")


def float_dtype(value: Any) -> torch.dtype | None:
    """The floating dtype of a fake tensor, or None for anything else."""
    if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
        return value.dtype
    return None


def is_compute_node(node: fx.Node) -> bool:
    """A call that computes something (getitem only unpacks a tuple)."""
    return node.op == "call_function" and node.target is not operator.getitem


def packet_of(node: fx.Node) -> Any:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        return target.overloadpacket
    return target


def touches_float(node: fx.Node) -> bool:
    """Does the op read or produce a floating-point tensor? Only those take part in AMP."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    if any(float_dtype(v) for v in vals):
        return True
    return any(float_dtype(n.meta.get("val")) for n in node.all_input_nodes)


def classify(node: fx.Node, ctx: AmpContext) -> tuple[str, str]:
    """(category, why) for a compute node, after pins and the opt level are applied.

    Categories: allow, deny, infer, clear (list membership), unknown (fp32, reported), fixed
    (output dtype fixed by an argument: never coloured), n/a (no floating-point data).
    """
    packet = packet_of(node)
    explicit_dtype = node.kwargs.get("dtype") is not None
    if packet in FIXED_DTYPE or (explicit_dtype and packet not in ctx.lists.clear):
        return "fixed", "output dtype fixed by the op's arguments"
    if not touches_float(node):
        return "n/a", "no floating-point data"
    base = ctx.lists.category(packet)
    why = f"{base} list" + (" (user override)" if packet in ctx.lists.overridden else "")
    stack = node.meta.get("nn_module_stack") or {}
    pinned = next((p for p in stack if p in ctx.pinned_paths), None)
    if pinned is not None and ctx.opt_level != "O3":
        return "deny", f"inside fp32-pinned module {pinned}"
    if ctx.opt_level == "O3":
        return "allow", "opt level O3: everything in low precision"
    if ctx.opt_level == "O2" and base in ("infer", "clear"):
        return "allow", "opt level O2: all but deny ops and pinned modules"
    if base == "unknown":
        return "unknown", "not in any precision list: kept fp32"
    return base, why
